"""Where agentkv keeps its files, and the crash-safe way it writes them.

Directories are created 0700 and files 0600: KV caches hold the text of every
conversation. Writes that matter go to a temporary file in the same directory,
are fsynced, atomically renamed over the target, and the directory is fsynced:
``atomic_target`` is the one place that does it (``atomic_write_bytes`` /
``atomic_write_text`` for bytes in hand).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def atomic_target(
    path: Path, *, label: str | None = None, suffix: str = ".tmp", sync_dir: bool = True
) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; what the ``with`` block writes there becomes
    ``path`` so that a crash leaves the old file or the new one, never a mix: the file is
    fsynced, renamed over ``path`` (``os.replace``) and the directory fsynced (unless
    ``sync_dir`` is false: the caller syncs it, once for many files). If the block raises,
    the temporary file is removed and ``path`` is untouched.

    Fault points (``_faults``), named by ``label`` (default: the file name):
    ``<label>-written`` (fsynced, not renamed) and ``<label>-renamed`` (renamed, the
    directory not synced)."""
    path = Path(path)
    label = label or path.name
    tmp = path.with_name(f".{path.name}.{os.getpid()}{suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point(f"{label}-written")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    crash_point(f"{label}-renamed")
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_bytes(
    path: Path, *parts: bytes | memoryview, label: str | None = None, sync_dir: bool = True
) -> None:
    """Write ``parts`` back to back as ``path`` through ``atomic_target`` (mode 0600); the
    fault point ``<label>-part-written`` follows each part."""
    path = Path(path)
    label = label or path.name
    with atomic_target(path, label=label, sync_dir=sync_dir) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
                crash_point(f"{label}-part-written")
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
