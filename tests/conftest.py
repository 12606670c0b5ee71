"""Shared fixtures. Every test runs on real files in a temporary AGENTKV_HOME; integration
tests run the real embedded model from the user's model cache (``AGENTKV_MODELS``, else
``$AGENTKV_HOME/models`` as it was before the tests), fetched there once if missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_SESSION_HOME = None
_OWN_HOME = False  # made by this run (removed at its end), not given by AGENTKV_TEST_HOME


def pytest_configure(config):
    global _SESSION_HOME, _OWN_HOME
    import tempfile

    from agentkv.paths import MODELS_ENV, models_dir

    os.environ[MODELS_ENV] = str(models_dir())  # before AGENTKV_HOME moves

    if "AGENTKV_TEST_HOME" in os.environ:
        _SESSION_HOME = Path(os.environ["AGENTKV_TEST_HOME"])
    else:
        _SESSION_HOME = Path(tempfile.mkdtemp(prefix="agentkv-test-home-"))
        _OWN_HOME = True
    os.environ["AGENTKV_HOME"] = str(_SESSION_HOME)


def pytest_unconfigure(config):
    """The run's own home goes with it (its stores and saved caches are gigabytes)."""
    if _OWN_HOME:
        import shutil

        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """Peak resident memory of this run, so CI reports it: the test process, and the largest
    of its finished child processes (a forked child starts with its parent's pages)."""
    import resource

    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit
    terminalreporter.write_sep("-", "peak memory")
    terminalreporter.write_line(
        f"peak RSS: test process {own / 2**20:.0f} MiB, largest child process "
        f"{child / 2**20:.0f} MiB"
    )


import agentkv  # noqa: E402,F401  (BLAS preload before anything imports mlx)

_ACTIVE_BYTES = 0  # MLX memory in use after the last collection
_COLLECT = False  # the last test left memory behind: collect before the next one


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Free what the tests before this one left behind, once pytest has dropped their
    fixture values: a closed Engine sits in a reference cycle, which keeps its model and pool
    alive until the cycle collector runs (seldom), so engine tests piled up gigabytes. The
    collection (~40 ms) runs only after a test that left MLX memory in use, or at a module's
    end (its module-scoped fixtures)."""
    global _ACTIVE_BYTES, _COLLECT
    if _COLLECT:
        import gc

        import mlx.core as mx

        gc.collect()
        mx.clear_cache()
        _trim_malloc()
        _ACTIVE_BYTES, _COLLECT = mx.get_active_memory(), False


def _trim_malloc() -> None:
    """Hand glibc's freed heap back to the system: a freed model's weights otherwise stay
    resident (~500 MiB each) and the next engine's land beside them."""
    if sys.platform == "linux":
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _COLLECT
    import mlx.core as mx

    try:
        return (yield)
    finally:
        mx.clear_cache()  # MLX's buffer cache back to the system
        module = getattr(item, "module", None)
        module_ends = nextitem is None or getattr(nextitem, "module", None) is not module
        _COLLECT = module_ends or mx.get_active_memory() > _ACTIVE_BYTES + (64 << 20)


@pytest.fixture(scope="session")
def agentkv_home() -> Path:
    return _SESSION_HOME


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """One Engine on the embedded model for the whole session (its own cache dir)."""
    from agentkv import Engine

    eng = Engine(cache_dir=tmp_path_factory.mktemp("kv-shared"))
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(tmp_path):
    """An Engine with an empty cache dir of its own (model loads are ~2 s)."""
    from agentkv import Engine

    engines = []

    def make(**options):
        options.setdefault("cache_dir", tmp_path / "kv")
        eng = Engine(**options)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
    engines.clear()  # pytest keeps ``make`` until after teardown


@pytest.fixture
def python_env(agentkv_home):
    """Environment for subprocesses: same AGENTKV_HOME, same agentkv package."""
    env = dict(os.environ)
    env["AGENTKV_HOME"] = str(agentkv_home)
    package_root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env
