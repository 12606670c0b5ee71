"""README's quick starts, run as written (each a process of its own, as a user runs it)
against the real server and engine: each answers its question on topic, briefly, and does
what its comments say. The server's snippet is pointed at the test's server (its port is
free, not 8080); nothing else is changed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import TESTS

from agentkv.benchmarks.server_process import ServerProcess

README = (TESTS.parent / "README.md").read_text(encoding="utf-8")
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def snippets(title: str) -> dict[str, str]:
    """The fenced blocks of README's section ``title``, by language."""
    section = README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = {lang: code for lang, code in FENCED.findall(section)}
    assert blocks, f"README has no code under {title!r}"
    return blocks


def run(code: str, env: dict, cwd) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def user_env(python_env, tmp_path):
    """A user's environment: an agentkv home of their own, the embedded model already here."""
    return {**python_env, "AGENTKV_HOME": str(tmp_path / "home")}


def test_the_server_quick_start_answers_paris(user_env, tmp_path):
    code = snippets("Quick start: the server, with the OpenAI SDK")
    command = code["bash"].split("#")[0].split()
    assert command == ["agentkv", "serve"]  # the server as README starts it, defaults and all
    server = ServerProcess(tmp_path / "kv", user_env).start()
    try:
        client = code["python"]
        assert client.count("http://127.0.0.1:8080") == 1
        out = run(client.replace("http://127.0.0.1:8080", server.url), user_env, tmp_path)
    finally:
        server.stop()
    assert out == "The capital of France is Paris.\n"


def test_the_python_quick_start_answers_and_resumes_hot(user_env, tmp_path):
    out = run(snippets("Quick start: Python")["python"], user_env, tmp_path).splitlines()
    first, streamed = out
    text, tier, reused, ttft = first.rsplit(" ", 3)
    assert (text, tier, reused) == ("The capital of France is Paris.", "cold", "0")
    assert float(ttft) > 0
    assert streamed == "The capital of Italy is Rome."


def test_the_mlx_lm_quick_start_answers_and_saves_a_file_mlx_lm_loads(user_env, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    out = run(snippets("Quick start: inside mlx-lm")["python"], user_env, tmp_path)
    assert out == "The capital of France is Paris.\n"
    caches = load_prompt_cache(str(tmp_path / "geography.safetensors"))
    assert len(caches) == 30 and caches[0].offset > 0  # one per layer, the turn's tokens


def test_the_store_quick_start_resumes_an_agent_warm_on_the_other_server(
    user_env, tmp_path, s3_server
):
    """The two servers as README starts them (their store pointed at the test's S3 server,
    ports free): a turn on one, the next turn of the same agent on the other, warm."""
    import httpx

    from agentkv.benchmarks.local_s3 import BUCKET

    code = snippets("Quick start: two servers, one store")["bash"]
    install, *serves = [line.split("#")[0].split() for line in code.strip().splitlines()]
    assert install == ["pip", "install", "'agentkv[s3]'"]
    store = f"s3://{BUCKET}/readme"
    env = {**user_env, **s3_server.env()}
    servers = []
    for args in serves:
        assert args[:2] == ["agentkv", "serve"] and args[-1] == "&"
        options = dict(zip(args[2:-1:2], args[3:-1:2]))
        assert set(options) == {"--port", "--cache-dir", "--store"}
        assert options["--store"].startswith("s3://")
        server = ServerProcess(tmp_path / options["--cache-dir"], env, "--store", store)
        servers.append(server.start())
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 16}
        headers = {"x-agent-id": "geography"}
        with httpx.Client(timeout=120) as http:
            first = http.post(f"{servers[0].url}/v1/chat/completions", json=body, headers=headers)
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And of Italy?"},
            ]
            second = http.post(f"{servers[1].url}/v1/chat/completions", json=body, headers=headers)
    finally:
        for server in servers:
            server.stop()
    assert first.status_code == 200 and first.headers["x-agentkv-cache"] == "cold"
    assert "Paris" in answer
    assert second.status_code == 200 and second.headers["x-agentkv-cache"] == "warm"
    assert int(second.headers["x-agentkv-reused-tokens"]) > 20
