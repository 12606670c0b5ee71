"""Where agentkv keeps its files, and the crash-safe way it writes them.

Directories are created 0700 and files 0600: KV caches hold the text of every
conversation. Writes that matter go to a temporary file in the same directory,
are fsynced, atomically renamed over the target, and the directory is fsynced.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._faults import crash_point

HOME_ENV = "AGENTKV_HOME"
MODELS_ENV = "AGENTKV_MODELS"
DIR_MODE = 0o700
FILE_MODE = 0o600


def agentkv_home() -> Path:
    """``$AGENTKV_HOME`` or ``~/.cache/agentkv``."""
    configured = os.environ.get(HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentkv"


def models_dir() -> Path:
    """``$AGENTKV_MODELS`` or ``$AGENTKV_HOME/models``: fetched and imported models."""
    configured = os.environ.get(MODELS_ENV)
    return Path(configured).expanduser() if configured else agentkv_home() / "models"


def kv_dir() -> Path:
    return agentkv_home() / "kv"


def secure_mkdir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700 for the directories created."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            pass
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    crash_point(f"before-replace:{path.name}")
    os.replace(tmp, path)
    crash_point(f"after-replace:{path.name}")
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
