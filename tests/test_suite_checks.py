"""The run's own checks can fail: a run whose test leaves a temporary directory behind, or
writes into the user's agentkv home, ends with a failure that names what it left."""

from __future__ import annotations

import subprocess
import sys

from helpers import TESTS

LEAKY = """\
import os
import tempfile
from pathlib import Path


def test_leaves_a_temporary_directory():
    tempfile.mkdtemp(prefix="left-by-a-test-")


def test_writes_into_the_users_home():
    (Path(os.environ["USER_HOME"]) / "written-by-a-test").write_text("x")
"""


def test_a_run_that_leaves_files_behind_fails_and_names_them(tmp_path, python_env):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    user_home = tmp_path / "user-home"
    user_home.mkdir()
    env = {**python_env, "AGENTKV_HOME": str(user_home), "USER_HOME": str(user_home)}
    env.pop("AGENTKV_MODELS")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider"]
        + [str(tmp_path / "test_leaky.py")],
        cwd=TESTS,  # where ``-p conftest`` finds the suite's own conftest
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "2 passed" in out and "the run left files behind" in out
    (left,) = [line for line in out.splitlines() if "left-by-a-test-" in line]
    assert left.endswith(": left in the temporary directory")
    assert f"{user_home / 'written-by-a-test'}: added during the run" in out
