"""Shared fixtures. Every test runs on real files in a temporary home of its own
(``AGENTKV_HOME``, its models, pytest's temporary directories and ``TMPDIR`` all inside it);
integration tests run the real embedded model. Its source (the GGUF file, or a hub copy) is
linked read-only from the user's model cache (``AGENTKV_MODELS``, else
``$AGENTKV_HOME/models``, else ``~/.cache/agentkv/models``) where the user has one, and
fetched into the run's home otherwise; it is imported there, so nothing is written to the
user's cache. At its end the run checks that: the user's agentkv directories hold what they
held before it, and nothing the run made is left in its temporary directory (a failure
lists what was left)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from suite_checks import Snapshot, leftovers, link_embedded_source

_SESSION_HOME = None
_OWN_HOME = False  # made by this run (removed at its end), not given by AGENTKV_TEST_HOME
_USER_DIRS: list[Snapshot] = []  # the user's agentkv directories as the run found them
# The user's llama.cpp (``agentkv bench compute --peer install``: llama-cpp-python in its
# own venv under the agentkv home): where it is, found before AGENTKV_HOME moves.
LLAMA_CPP_PYTHON: Path | None = None


def pytest_configure(config):
    global _SESSION_HOME, _OWN_HOME, LLAMA_CPP_PYTHON
    import tempfile

    from agentkv.paths import MODELS_ENV, agentkv_home, models_dir, secure_mkdir

    user_models = models_dir()  # before AGENTKV_HOME moves
    LLAMA_CPP_PYTHON = agentkv_home() / "peers" / "llama-cpp" / "bin" / "python"
    user_dirs = {Path.home() / ".cache" / "agentkv", agentkv_home(), user_models}
    if "AGENTKV_TEST_HOME" in os.environ:
        _SESSION_HOME = Path(os.environ["AGENTKV_TEST_HOME"]).resolve()
    else:
        _SESSION_HOME = Path(tempfile.mkdtemp(prefix="agentkv-test-home-")).resolve()
        _OWN_HOME = True
    outermost = [d for d in user_dirs if not any(o in d.parents for o in user_dirs)]
    _USER_DIRS[:] = [Snapshot.of(d, skip=_SESSION_HOME) for d in sorted(outermost)]
    os.environ["AGENTKV_HOME"] = str(_SESSION_HOME)
    models = secure_mkdir(_SESSION_HOME / "models")
    os.environ[MODELS_ENV] = str(models)
    link_embedded_source(user_models, models)
    # Everything the run (and every process it starts) makes through tempfile lands here.
    scratch = secure_mkdir(_SESSION_HOME / "tmp")
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    if config.option.basetemp is None:
        config.option.basetemp = str(_SESSION_HOME / "pytest")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After every fixture's teardown: what the run left behind fails it; then its own
    home goes (its stores and saved caches are gigabytes)."""
    import shutil

    problems = leftovers(_SESSION_HOME / "tmp")
    problems += [change for snap in _USER_DIRS for change in snap.changes()]
    if _OWN_HOME:
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)
        if _SESSION_HOME.exists():
            problems.append(f"{_SESSION_HOME}: the run's own home could not be removed")
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_sep("=", "the run left files behind", red=True)
        for line in problems:
            reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(scope="session")
def llama_cpp_python() -> Path:
    """The user's llama-cpp-python venv's python (``agentkv bench compute --peer install``);
    tests that compare with llama.cpp skip without one."""
    import subprocess

    try:
        found = subprocess.run(
            [str(LLAMA_CPP_PYTHON), "-c", "import llama_cpp"], capture_output=True, timeout=60
        )
    except OSError:
        found = None
    if found is None or found.returncode != 0:
        pytest.skip(
            f"no llama-cpp-python at {LLAMA_CPP_PYTHON} (agentkv bench compute --peer install)"
        )
    return LLAMA_CPP_PYTHON


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, for the session; the
    tests that stop it start it again (``s3_store``)."""
    pytest.importorskip("moto.server", reason="the s3 tests need moto[server] (the test extra)")
    from agentkv.benchmarks.local_s3 import S3Server, free_port

    server = S3Server(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def s3_store(s3_server, monkeypatch, request):
    """``s3://bucket/<test name>``, the AWS variables pointing at the test's S3 server."""
    from agentkv.benchmarks.local_s3 import BUCKET

    if s3_server.process is None:  # a test before stopped it
        s3_server.start()
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    yield f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"
