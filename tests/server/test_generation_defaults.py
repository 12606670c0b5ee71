"""A request that names no temperature, top_p or reply length is sampled as its model asks
(its generation_config.json, with Hugging Face's meaning), else greedily with a chat-sized
reply limit: read from real model directories, served by the real app."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from agentkv import Engine
from agentkv.model.generation_config import (
    DEFAULT_MAX_TOKENS,
    GENERATION_CONFIG,
    GenerationDefaults,
    read_generation_defaults,
)
from agentkv.model.load import ensure_embedded_model
from agentkv.server import create_app

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "sampling-model"  # the directory's name, as the server serves it


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"bos_token_id": 1, "eos_token_id": 2}, (0.0, 1.0, DEFAULT_MAX_TOKENS, "agentkv")),
        ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, (0.6, 0.9, 512, "config")),
        ({"temperature": 0.6, "top_p": 0.9}, (0.0, 1.0, 512, "config")),  # no do_sample: greedy
        ({"do_sample": True}, (1.0, 1.0, 512, "config")),  # Hugging Face's own defaults
        ({"max_new_tokens": 64}, (0.0, 1.0, 64, "config")),
        ({"do_sample": True, "temperature": 7, "top_p": 0}, (1.0, 1.0, 512, "config")),
        ({"max_new_tokens": 0}, (0.0, 1.0, 512, "config")),
    ],
    ids=["ids", "sampling", "no do_sample", "do_sample", "max_new_tokens", "bad", "bad length"],
)  # fmt: skip
def test_a_model_directory_s_generation_config_gives_the_defaults(config, expected, tmp_path):
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps(config))
    got = read_generation_defaults(tmp_path)
    source = GENERATION_CONFIG if expected[3] == "config" else expected[3]
    assert got == GenerationDefaults(*expected[:3], source)


def test_no_generation_config_or_an_unreadable_one_is_greedy(tmp_path):
    assert read_generation_defaults(tmp_path) == GenerationDefaults(0.0, 1.0, 512, "agentkv")
    (tmp_path / GENERATION_CONFIG).write_text("{not json")
    assert read_generation_defaults(tmp_path) == GenerationDefaults()


@pytest.fixture
def sampling_model(tmp_path):
    """The embedded model's directory (its files linked) with a generation config that
    samples at 0.7, top_p 0.9, and bounds a reply at 3 tokens."""
    model = tmp_path / "sampling-model"
    model.mkdir()
    for source in ensure_embedded_model().iterdir():
        (model / source.name).symlink_to(source)
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3}
    (model / GENERATION_CONFIG).write_text(json.dumps(config))
    return model


def _serve(engine, tmp_path):
    return TestClient(create_app(engine, responses_dir=tmp_path / "responses"))


def test_the_served_model_s_generation_config_is_the_default(sampling_model, tmp_path):
    with Engine(model=str(sampling_model), cache_dir=tmp_path / "kv", warmup=False) as eng:
        assert eng.loaded.generation == GenerationDefaults(0.7, 0.9, 3, GENERATION_CONFIG)
        with _serve(eng, tmp_path) as client:
            chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CAPITAL})
            body = chat.json()
            assert chat.status_code == 200, body
            assert body["usage"]["completion_tokens"] == 3  # its max_new_tokens
            assert body["choices"][0]["finish_reason"] == "length"
            asked = {"model": MODEL, "messages": CAPITAL, "max_tokens": 5}
            longer = client.post("/v1/chat/completions", json=asked).json()
            assert longer["usage"]["completion_tokens"] > 3  # what the request names wins
            responses = client.post("/v1/responses", json={"input": "Hi."}).json()
            assert (responses["temperature"], responses["top_p"]) == (0.7, 0.9)
            named = client.post("/v1/responses", json={"input": "Hi.", "temperature": 0}).json()
            assert (named["temperature"], named["top_p"]) == (0.0, 0.9)


def test_a_model_that_says_nothing_answers_greedily_and_briefly(engine, tmp_path):
    """The embedded model ships no sampling: greedy, so the README's question gets the same
    short answer every time, well within the chat-sized default reply limit."""
    assert engine.loaded.generation == GenerationDefaults()
    with _serve(engine, tmp_path) as client:
        body = {"model": "smollm2-135m-instruct", "messages": CAPITAL}
        answers = [
            client.post("/v1/chat/completions", json=body, headers={"x-agent-id": agent}).json()
            for agent in ("defaults-1", "defaults-2")
        ]
        texts = {a["choices"][0]["message"]["content"] for a in answers}
        assert len(texts) == 1 and "Paris" in texts.pop()
        assert all(a["choices"][0]["finish_reason"] == "stop" for a in answers)
        assert answers[0]["usage"]["completion_tokens"] < 32
        responses = client.post("/v1/responses", json={"input": "Hi."}).json()
        assert (responses["temperature"], responses["top_p"]) == (0.0, 1.0)
