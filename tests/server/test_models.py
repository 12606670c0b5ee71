"""``agentkv serve`` with two models: a request's `model` routes it; a swap saves every
agent of the model going out; agents of A resume warm when A comes back, also after the
idle model was unloaded."""

import time

import httpx
import pytest
from helpers import tiny_llama_dir
from test_server import _env

from agentkv.benchmarks.server_process import ServerProcess

MODEL = "smollm2-135m-instruct"


def _chat(url, agent, content, model=None, history=()):
    body = {"messages": [*history, {"role": "user", "content": content}], "max_tokens": 4}
    if model:
        body["model"] = model
    r = httpx.post(f"{url}/v1/agents/{agent}/chat", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.slow
def test_two_models_swap_and_agents_resume_warm(tmp_path):
    tiny = tiny_llama_dir(tmp_path / "tiny")
    proc = ServerProcess(
        tmp_path / "kv", _env(), "--model", "embedded", "--model", str(tiny),
        "--model-idle-ttl", "2",
    ).start()  # fmt: skip
    try:
        url = proc.url
        names = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert names == [MODEL, "tiny"]
        first = _chat(url, "alpha", "Name a colour.")
        assert first.headers["x-agentkv-cache"] == "cold"
        history = [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.json()["text"]},
        ]
        other = _chat(url, "beta", "Hello.", model="tiny")
        assert other.headers["x-agentkv-cache"] == "cold" and other.json()["model"] == "tiny"
        assert httpx.get(f"{url}/health").json()["model"] == "tiny"
        back = _chat(url, "alpha", "Another one?", history=history)
        assert back.headers["x-agentkv-cache"] == "warm"  # saved when tiny came in
        assert int(back.headers["x-agentkv-reused-tokens"]) > 10
        # The idle model is unloaded after its TTL; the next request loads it again.
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["model"] is not None:
            assert time.monotonic() < deadline, "the idle model was not unloaded"
            time.sleep(0.5)
        again = _chat(url, "beta", "Hello again.", model="tiny", history=[
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": other.json()["text"]},
        ])  # fmt: skip
        assert again.headers["x-agentkv-cache"] == "warm"
        unknown = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        )
        assert unknown.status_code == 404 and "tiny" in unknown.json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics").text
        swaps = [line for line in metrics.splitlines() if line.startswith("agentkv_model_swaps")]
        assert swaps and float(swaps[0].split()[-1]) >= 4
    finally:
        proc.stop()
