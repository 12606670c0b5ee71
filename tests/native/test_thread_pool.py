"""The host kernels' thread pool when a task throws (``thread_pool_check.cpp``): the first
exception reaches run()'s caller from any thread, after every thread is done with the job,
and the pool goes on serving (before, a worker's exception ended the process and a caller's
left the workers holding a job that no longer existed)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_task_that_throws_reaches_the_caller_and_the_pool_goes_on(tmp_path):
    binary = tmp_path / "thread_pool_check"
    sources = [ROOT / "tests" / "native" / "thread_pool_check.cpp"]
    sources.append(ROOT / "csrc" / "core" / "thread_pool.cpp")
    built = subprocess.run(
        ["g++", "-std=c++20", "-O2", f"-I{ROOT / 'csrc'}", "-o", str(binary), *map(str, sources)]
        + ["-lpthread"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-3000:]
