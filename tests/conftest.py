"""Shared fixtures. Every test runs on real files in a temporary AGENTKV_HOME; integration
tests run the real embedded model from the user's model cache (``AGENTKV_MODELS``, else
``$AGENTKV_HOME/models`` as it was before the tests), fetched there once if missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_SESSION_HOME = None


def pytest_configure(config):
    global _SESSION_HOME
    import tempfile

    from agentkv.paths import MODELS_ENV, models_dir

    os.environ[MODELS_ENV] = str(models_dir())  # before AGENTKV_HOME moves

    if "AGENTKV_TEST_HOME" in os.environ:
        _SESSION_HOME = Path(os.environ["AGENTKV_TEST_HOME"])
    else:
        _SESSION_HOME = Path(tempfile.mkdtemp(prefix="agentkv-test-home-"))
    os.environ["AGENTKV_HOME"] = str(_SESSION_HOME)


import agentkv  # noqa: E402,F401  (BLAS preload before anything imports mlx)


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


@pytest.fixture
def python_env(agentkv_home):
    """Environment for subprocesses: same AGENTKV_HOME, same agentkv package."""
    env = dict(os.environ)
    env["AGENTKV_HOME"] = str(agentkv_home)
    package_root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env
