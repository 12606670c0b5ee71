"""``agentkv serve`` as a real process on 127.0.0.1, driven by the official OpenAI and
Anthropic SDKs and by raw HTTP: chats, streaming, multi-turn reuse, restarts, concurrency,
cancellation and every kind of bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import agentkv
from agentkv.benchmarks.server_process import ServerProcess

MODEL = "smollm2-135m-instruct"
# After draining on SIGTERM, uvicorn re-raises the signal: the exit status says how it ended.
GRACEFUL = (0, -signal.SIGTERM)
KEY = "sk-test-agentkv"
SYSTEM = (
    "You are the reviewer of a small software team. You read every change to a command line "
    "tool that converts CSV files to JSON and answer in one short sentence. "
) * 2


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(
        tmp_path_factory.mktemp("serve") / "kv", _env(), "--max-body-mb", "1", api_key=KEY
    ).start()
    yield proc
    assert proc.stop() in GRACEFUL


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _chat(oai, agent, messages, **kw):
    kw.setdefault("max_tokens", 12)
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, extra_headers={"x-agent-id": agent}, **kw
    )
    return raw.headers, raw.parse()


def test_openai_sdk_multi_turn_stream_and_usage(oai, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any bugs?"}]
    headers, first = _chat(oai, "oa-planner", messages)
    assert headers["x-agentkv-cache"] == "cold" and headers["x-agentkv-agent"] == "oa-planner"
    reply = first.choices[0].message.content
    assert reply and first.choices[0].finish_reason in ("stop", "length")
    usage = first.usage
    assert usage.prompt_tokens == int(headers["x-agentkv-prefill-tokens"]) > 50
    assert usage.completion_tokens == first.agentkv["generated_tokens"] > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0

    # Turn 2 streams; the whole of turn 1 (prompt and reply) is reused from memory.
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    with oai.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-agent-id": "oa-planner"},
    ) as response:
        assert response.headers["x-agentkv-cache"] == "hot"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and finish in (["stop"], ["length"]) and not chunks[-1].choices
    assert usage.prompt_tokens_details.cached_tokens == first.agentkv["prompt_tokens"] + (
        first.usage.completion_tokens - 1
    )  # turn 1's prompt and every reply token fed back (all but the last)
    assert usage.prompt_tokens > usage.prompt_tokens_details.cached_tokens

    # The same two turns without streaming, on another agent, give the same text.
    _, copy = _chat(oai, "oa-planner-copy", messages[:2])
    assert copy.choices[0].message.content == reply
    headers, again = _chat(oai, "oa-planner-copy", messages)
    assert headers["x-agentkv-cache"] == "hot" and again.choices[0].message.content == text


def _a_stop_inside(text: str) -> tuple[str, str]:
    """A stop string that occurs in the middle of ``text``, and what comes before it."""
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    return stop, text[: text.index(stop)]


def test_openai_tool_call_then_its_result_continues_the_cache(oai):
    """A named tool_choice forces a valid call even from the 135M model; the SDK's message
    and the tool's result go back in, and the next turn reuses the whole cache."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    headers, first = _chat(
        oai, "oa-tool", messages, tools=[WEATHER], tool_choice=named, max_tokens=30
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    headers, second = _chat(oai, "oa-tool", messages, tools=[WEATHER], tool_choice="none")
    stats = second.agentkv
    assert headers["x-agentkv-cache"] == "hot" and stats["match"] == "extend", stats
    assert stats["reused_tokens"] == stats["stored_tokens"] > 0
    assert second.choices[0].message.tool_calls is None


def test_openai_stop_sequences_are_enforced(oai):
    messages = [{"role": "user", "content": "Count from one to ten."}]
    _, free = _chat(oai, "oa-stop-ref", messages, max_tokens=30)
    stop, before = _a_stop_inside(free.choices[0].message.content)
    _, stopped = _chat(oai, "oa-stop", messages, max_tokens=30, stop=[stop, "never seen"])
    assert stopped.choices[0].message.content == before
    assert stopped.choices[0].finish_reason == "stop"


def test_openai_logprobs_and_top_logprobs_whole_and_streamed(oai):
    """``logprobs`` / ``top_logprobs`` as the OpenAI SDK reads them: one entry a generated
    token (its bytes make the reply), the greedy token the likeliest of its top ones; a
    stream carries the same entries (with its last chunk); ``top_logprobs`` alone is a 400."""
    messages = [{"role": "user", "content": "Name three colours."}]
    _, whole = _chat(oai, "oa-logprobs", messages, max_tokens=10, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    eos = whole.choices[0].finish_reason == "stop"  # an EOS: generated, not in the reply
    assert len(content) == whole.usage.completion_tokens - eos > 0
    assert bytes(b for t in content for b in t.bytes).decode() == whole.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob <= 0
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_headers={"x-agent-id": "oa-logprobs-streamed"},
    )
    streamed = [t for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    _, plain = _chat(oai, "oa-logprobs", messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _chat(oai, "oa-logprobs", messages, top_logprobs=2)


def test_anthropic_sdk_messages_and_stream_events(claude, server):
    kwargs = dict(
        model=MODEL,
        max_tokens=16,
        extra_body={"temperature": 0.0},  # (this SDK no longer takes temperature itself)
        system=[{"type": "text", "text": SYSTEM}],
        metadata={"user_id": "an-reviewer"},
    )
    first = claude.messages.with_raw_response.create(
        messages=[{"role": "user", "content": "Is the change safe?"}], **kwargs
    )
    assert first.headers["x-agentkv-agent"] == "an-reviewer"
    message = first.parse()
    # nothing of its own: cold, or hot with the blocks of another agent's same system prompt
    shared = message.agentkv["shared_tokens"]
    assert first.headers["x-agentkv-cache"] == ("hot" if shared else "cold")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    # The system prompt's first 64 tokens may come from another agent's blocks (shared).
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 50
    assert usage.cache_read_input_tokens == message.agentkv["shared_tokens"]
    assert message.usage.output_tokens == message.agentkv["generated_tokens"]

    history = [
        {"role": "user", "content": "Is the change safe?"},
        {"role": "assistant", "content": [{"type": "text", "text": message.content[0].text}]},
        {"role": "user", "content": "Explain."},
    ]
    with claude.messages.stream(messages=history, **kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text and pieces
    assert final.usage.cache_read_input_tokens > message.usage.input_tokens

    # The documented event sequence, on the wire.
    body = {**kwargs, "messages": history, "stream": True, "metadata": {"user_id": "an-raw"}}
    body["temperature"] = body.pop("extra_body")["temperature"]
    with server.client() as http, http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) <= {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequence_is_reported(claude):
    kwargs = dict(model=MODEL, max_tokens=30, extra_body={"temperature": 0.0})
    messages = [{"role": "user", "content": "Count from one to ten."}]
    free = claude.messages.create(messages=messages, metadata={"user_id": "an-stop-ref"}, **kwargs)
    stop, before = _a_stop_inside(free.content[0].text)
    m = claude.messages.create(
        messages=messages, stop_sequences=[stop], metadata={"user_id": "an-stop"}, **kwargs
    )
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, before)


def test_direct_api_lists_shows_and_deletes_agents(server):
    with server.client() as http:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello."}]
        body = {"messages": messages, "max_tokens": 8}
        r = http.post("/v1/agents/direct-1/chat", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        stats = data["stats"]
        assert data["agent_id"] == "direct-1" and stats["match"] == "none"  # nothing of its own
        # cold, or hot with the blocks of other agents' same system prompt
        assert r.headers["x-agentkv-cache"] == stats["cache"]
        assert stats["cache"] == ("hot" if stats["shared_tokens"] else "cold")
        listed = {a["id"]: a for a in http.get("/v1/agents").json()["data"]}
        me = listed["direct-1"]
        assert me["tier"] == "hot" and me["tokens"] > 0 and me["memory_bytes"] > 0
        assert me["last_used"] is not None
        shown = http.get("/v1/agents/direct-1").json()
        assert shown["tokens"] == me["tokens"] and shown["disk_bytes"] > 0  # saved before 200

        messages += [
            {"role": "assistant", "content": data["text"]},
            {"role": "user", "content": "Bye."},
        ]
        body = {"messages": messages, "max_tokens": 8, "stream": True}
        with http.stream("POST", "/v1/agents/direct-1/chat", json=body) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
        assert events[0]["cache"] == "hot" and events[0]["reused_tokens"] > 0
        assert "".join(e.get("text", "") for e in events[1:-1]) == events[-1]["text"]

        assert http.delete("/v1/agents/direct-1").json() == {"id": "direct-1", "deleted": True}
        assert http.get("/v1/agents/direct-1").status_code == 404
        assert http.delete("/v1/agents/direct-1").status_code == 404


def test_agent_identity_header_user_field_and_derived(oai, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Status?"}]
    one = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    derived = one.headers["x-agentkv-agent"]
    assert derived.startswith("auto-")
    # An unmodified client resends its growing history: same agent, whole history reused.
    reply = one.parse().choices[0].message.content
    more = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Ok."}]
    two = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=more, max_tokens=6, temperature=0
    )
    assert two.headers["x-agentkv-agent"] == derived
    assert two.headers["x-agentkv-cache"] == "hot"
    assert int(two.headers["x-agentkv-reused-tokens"]) == two.parse().agentkv["stored_tokens"]

    by_user = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, user="alice@example.com"
    )
    assert by_user.headers["x-agentkv-agent"].startswith("user-")
    plain_user = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, user="alice"
    )
    assert plain_user.headers["x-agentkv-agent"] == "alice"


@pytest.mark.slow
def test_concurrent_agents_equal_serial_runs_and_one_agent_serializes(server):
    prompts = [
        "Name one risk of this change.",
        "Which test is missing?",
        "Is the error message clear?",
        "Should the flag have a default?",
    ]

    def turn(agent, prompt, system="You are terse."):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        body = {"messages": messages, "max_tokens": 16}
        with server.client() as http:
            r = http.post(f"/v1/agents/{agent}/chat", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    serial = [turn(f"serial-{i}", p) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(turn, [f"together-{i}" for i in range(4)], prompts))
    assert [r["text"] for r in together] == [r["text"] for r in serial]
    assert [r["tokens"] for r in together] == [r["tokens"] for r in serial]

    # Two requests for one agent: the second runs after the first and sees its whole turn
    # (and reuses its prompt: the system prompt is over one 256-token block).
    long = SYSTEM * 6
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(turn, ["same", "same"], [prompts[0]] * 2, [long] * 2)
    first, second = sorted((a, b), key=lambda r: r["stats"]["stored_tokens"])
    assert first["stats"]["match"] == "none" and second["stats"]["cache"] == "hot"
    assert second["stats"]["stored_tokens"] > first["stats"]["prompt_tokens"]
    assert second["stats"]["reused_tokens"] == first["stats"]["prompt_tokens"] - 1
    assert first["text"] == second["text"]


def test_a_client_that_disconnects_cancels_its_turn(server):
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 400,
        "stream": True,
    }
    with server.client() as http:
        with http.stream("POST", "/v1/agents/leaver/chat", json=body) as r:
            lines = r.iter_lines()
            start = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
            next(x for x in lines if x.startswith("data: "))  # one piece of text
        prompt_tokens = start["reused_tokens"] + start["prefill_tokens"]
        deadline = time.monotonic() + 60
        while http.get("/health").json()["running"]:
            assert time.monotonic() < deadline, "the cancelled turn is still running"
            time.sleep(0.05)
        info = http.get("/v1/agents/leaver").json()
        # The reply was not saved: the agent holds exactly the prompt.
        assert info["tokens"] == prompt_tokens
        again = http.post("/v1/agents/leaver/chat", json={**body, "stream": False, "max_tokens": 6})
        assert again.status_code == 200 and again.json()["stats"]["match"] == "exact"
        assert again.json()["stats"]["reused_tokens"] == prompt_tokens - 1
        assert 'status="500"' not in http.get("/metrics").text


def test_metrics_count_turns_tokens_and_bytes(server):
    with server.client() as http:
        text = http.get("/metrics").text
    assert 'agentkv_turns_total{cache="cold"}' in text
    assert 'agentkv_turns_total{cache="hot"}' in text
    assert 'agentkv_tokens_total{kind="reused"}' in text
    assert "agentkv_ttft_seconds_bucket" in text
    fused = [ln for ln in text.splitlines() if ln.startswith('agentkv_attention_calls{path="fused')]
    assert float(fused[0].split()[1]) > 0  # the 4-bit cache ran agentkv's CPU kernel
    resident = [ln for ln in text.splitlines() if ln.startswith("agentkv_kv_resident_bytes ")]
    disk = [ln for ln in text.splitlines() if ln.startswith("agentkv_kv_disk_bytes ")]
    assert float(resident[0].split()[1]) > 0 and float(disk[0].split()[1]) > 0


def _requests_answered(http, api: str, status: str) -> float:
    """``agentkv_requests_total`` of ``api`` and ``status``, as ``/metrics`` reads now."""
    wanted = f'agentkv_requests_total{{api="{api}",status="{status}"}} '
    lines = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith(wanted)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_health_probes_are_not_counted_as_requests(server):
    with server.client() as http:
        before = _requests_answered(http, "direct", "200")
        for _ in range(3):
            assert http.get("/health").status_code == 200
        after = _requests_answered(http, "direct", "200")
    assert after == before + 1  # the /metrics call that read ``before``, no /health


def _user(text="Hi."):
    return [{"role": "user", "content": text}]


BAD = [
    # (name, method, path, body (dict, or bytes sent raw), extra headers, status, error type)
    (
        "malformed json",
        "POST",
        "/v1/chat/completions",
        b'{"model": ',
        {},
        400,
        "invalid_request_error",
    ),
    ("not an object", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_request_error"),
    (
        "top_logprobs out of range",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "logprobs": True, "top_logprobs": 21},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "missing messages",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "empty messages",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": []},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "wrong type",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "max_tokens": "9"},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "stream not a bool",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "stream": "yes"},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "image content",
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        {},
        400,
        "invalid_request_error",
    ),
    (
        "tool role",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "max_tokens zero",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "max_tokens": 0},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "max_tokens huge",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "max_tokens": 10**9},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "temperature",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "temperature": 7},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "unknown model",
        "POST",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": _user()},
        {},
        404,
        "invalid_request_error",
    ),
    (
        "bad agent header",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user()},
        {"x-agent-id": "../../etc"},
        400,
        "invalid_request_error",
    ),
    (
        "oversized body",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user("x" * (2 << 20))},
        {},
        413,
        "invalid_request_error",
    ),
    (
        "n > 1",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _user(), "n": 2},
        {},
        400,
        "invalid_request_error",
    ),
    ("a: malformed json", "POST", "/v1/messages", b"{nope", {}, 400, "invalid_request_error"),
    (
        "a: missing max_tokens",
        "POST",
        "/v1/messages",
        {"model": MODEL, "messages": _user()},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "a: wrong role",
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "a: image block",
        "POST",
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        {},
        400,
        "invalid_request_error",
    ),
    (
        "a: system not text",
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "system": [{"type": "image"}], "messages": _user()},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "a: max_tokens negative",
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": -1, "messages": _user()},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "a: unknown model",
        "POST",
        "/v1/messages",
        {"model": "claude-9", "max_tokens": 5, "messages": _user()},
        {},
        404,
        "not_found_error",
    ),
    (
        "a: oversized",
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "messages": _user("y" * (2 << 20))},
        {},
        413,
        "request_too_large",
    ),
    (
        "a: bad agent header",
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "messages": _user()},
        {"x-agent-id": "a b"},
        400,
        "invalid_request_error",
    ),
    (
        "direct: bad agent id",
        "POST",
        "/v1/agents/bad%20id/chat",
        {"messages": _user()},
        {},
        400,
        "invalid_request_error",
    ),
    ("direct: dot agent", "GET", "/v1/agents/%2E%2E", None, {}, 400, "invalid_request_error"),
    (
        "direct: unknown field",
        "POST",
        "/v1/agents/ok/chat",
        {"messages": _user(), "max_tokenz": 5},
        {},
        400,
        "invalid_request_error",
    ),
    (
        "direct: content not text",
        "POST",
        "/v1/agents/ok/chat",
        {"messages": [{"role": "user", "content": 5}]},
        {},
        400,
        "invalid_request_error",
    ),
    ("no such route", "GET", "/v1/nothing", None, {}, 404, "invalid_request_error"),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, "invalid_request_error"),
    (
        "lone surrogate",
        "POST",
        "/v1/chat/completions",
        b'{"model": "x", "messages": [{"role": "user", "content": "\\ud800"}]}',
        {},
        400,
        "invalid_request_error",
    ),
    (
        "deep nesting",
        "POST",
        "/v1/chat/completions",
        b"[" * 100_000 + b"]" * 100_000,
        {},
        400,
        "invalid_request_error",
    ),
]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
A_TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}


def _tool_case(name: str, path: str, extra: dict):
    body = {"model": MODEL, "messages": _user(), "max_tokens": 4, **extra}
    return (name, "POST", path, body, {}, 400, "invalid_request_error")


BAD += [
    _tool_case(
        "tools: undeclared named tool",
        "/v1/chat/completions",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    ),
    _tool_case("tools: required, none given", "/v1/chat/completions", {"tool_choice": "required"}),
    _tool_case(
        "tools: bad tool_choice",
        "/v1/chat/completions",
        {"tools": [WEATHER], "tool_choice": "often"},
    ),
    _tool_case(
        "tools: bad name",
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
    ),
    _tool_case("tools: duplicates", "/v1/chat/completions", {"tools": [WEATHER, WEATHER]}),
    _tool_case("tools: not a function", "/v1/chat/completions", {"tools": [{"type": "code"}]}),
    _tool_case(
        "tools: arguments not an object",
        "/v1/chat/completions",
        {
            "messages": [
                *_user(),
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
            ]
        },
    ),
    _tool_case(
        "tools: result of no call",
        "/v1/chat/completions",
        {"messages": [*_user(), {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
    ),
    _tool_case(
        "a: tool_result from the assistant",
        "/v1/messages",
        {
            "messages": [
                *_user(),
                {
                    "role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                },
                *_user(),
            ]
        },
    ),
    _tool_case("a: tool without schema", "/v1/messages", {"tools": [{"name": "get_weather"}]}),
    _tool_case(
        "a: bad tool_choice", "/v1/messages", {"tools": [A_TOOL], "tool_choice": {"type": "x"}}
    ),
    _tool_case(
        "a: server tool", "/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "w"}]}
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_the_apis_error_shape_and_the_server_keeps_serving(server, case):
    name, method, path, body, headers, status, kind = case
    with server.client() as http:
        if isinstance(body, bytes):
            content = body
        else:
            content = None if body is None else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **headers}
        r = http.request(method, path, content=content, headers=hdrs)
        assert r.status_code == status, r.text
        error = r.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["type"] == kind
        else:
            assert error["error"]["type"] == kind and error["error"]["message"]
        assert http.get("/health").json()["status"] == "ok"


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "town"}}}
SCHEMA_CASES = [
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
        "tools[0].function.parameters",
    ),
    (
        "/v1/responses",
        {"tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]},
        "tools[0].parameters",
    ),
    (
        "/v1/messages",
        {"tools": [{"name": "f", "input_schema": BAD_SCHEMA}]},
        "tools[0].input_schema",
    ),
]


@pytest.mark.parametrize(("path", "extra", "field"), SCHEMA_CASES, ids=lambda c: str(c)[:20])
def test_a_tool_schema_that_cannot_be_followed_is_named_in_the_request_s_terms(
    server, path, extra, field
):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"input": "Hi."} if path == "/v1/responses" else {"messages": _user()}
    with server.client() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message == f"{field} is not a JSON schema calls can follow: Invalid type: town"


def test_the_cache_headers_say_what_was_reused_and_why_not_more(oai):
    """The same short request twice: the first reuses nothing (a new agent, and says so),
    the second reuses its whole prompt but the last token (hot), says that the cached reply
    was dropped, and answers the same."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    first, a = _chat(oai, "oa-twice", ask)
    second, b = _chat(oai, "oa-twice", ask)
    assert (first["x-agentkv-cache"], first["x-agentkv-reused-tokens"]) == ("cold", "0")
    assert first["x-agentkv-reuse-note"] == "a new agent: nothing stored for it yet"
    assert second["x-agentkv-cache"] == "hot"
    assert int(second["x-agentkv-reused-tokens"]) == a.usage.prompt_tokens - 1
    assert "diverged at byte" in second["x-agentkv-reuse-note"]  # the old reply: dropped
    assert b.choices[0].message.content == a.choices[0].message.content


def _raw_http(server, head: str, body_parts=()) -> tuple[int, dict, bytes]:
    """Send a request exactly as given, the whole body before reading anything (as urllib
    and many SDKs do); then read the answer until the server closes or it is complete."""
    deadline = time.monotonic() + 120
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            assert time.monotonic() < deadline, f"no whole answer head in 120 s: {data!r}"
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        status_line, *lines = head_bytes.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", 0))
        while len(rest) < length:
            assert time.monotonic() < deadline, f"no whole answer body in 120 s: {rest!r}"
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(status_line.split()[1]), headers, rest


def test_an_invalid_content_length_is_a_400(server):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: abc\r\n\r\n"
    )
    status, _, body = _raw_http(server, head, [b"{}"])
    assert status == 400
    with server.client() as http:
        assert http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_sent_before_reading_gets_the_413(server, framing):
    """64 MB through a 1 MB limit, written whole before the client reads: the client gets
    the 413 JSON error, not a connection reset."""
    piece = b"x" * (1 << 20)
    pieces = [b'{"model": "m", "messages": [{"role": "user", "content": "']
    pieces += [piece] * 64 + [b'"}]}']
    size = sum(len(p) for p in pieces)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    )
    if framing == "chunked":
        head += "Transfer-Encoding: chunked\r\n\r\n"
        pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    else:
        head += f"Content-Length: {size}\r\n\r\n"
    status, headers, body = _raw_http(server, head, pieces)
    assert status == 413, body[:200]
    error = json.loads(body)["error"]
    assert "request body over 1048576 bytes" in error["message"]
    assert headers.get("connection") == "close"


def test_urllib_posting_too_much_reads_the_413(server):
    body = json.dumps({"model": MODEL, "messages": _user("z" * (64 << 20))}).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 413
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_api_key_is_required_except_for_health(server):
    body = {"model": MODEL, "messages": _user(), "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/messages", json={**body, "max_tokens": 2}, headers={"x-api-key": "no"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/agents").status_code == 401
        assert http.get("/metrics").status_code == 401
        ok = http.get("/v1/models", headers={"x-api-key": KEY})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


def _wait_for(proc, key: str, timeout: float = 60) -> None:
    """Until /health reports a turn ``running`` or ``waiting``."""
    deadline = time.monotonic() + timeout
    while not httpx.get(f"{proc.url}/health").json()[key]:
        assert time.monotonic() < deadline, f"no turn {key} after {timeout} s"
        time.sleep(0.02)


def _turn(url, agent, messages, max_tokens=8):
    body = {"messages": messages, "max_tokens": max_tokens}
    r = httpx.post(f"{url}/v1/agents/{agent}/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_agents_resume_warm_after_a_restart(tmp_path, sig):
    proc = ServerProcess(tmp_path / "kv", _env()).start()
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Ready?"}]
        first = _turn(proc.url, "restart-me", messages)
        assert _turn(proc.url, "never-stopped", messages)["text"] == first["text"]
        messages += [
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "Go on."},
        ]
        hot = _turn(proc.url, "never-stopped", messages)  # the same turn, before the restart
        assert hot["stats"]["cache"] == "hot"
        assert proc.stop(sig) in (GRACEFUL if sig == signal.SIGTERM else (-signal.SIGKILL,))
        proc.start()
        second = _turn(proc.url, "restart-me", messages)
        stats = second["stats"]
        assert stats["cache"] == "warm" and stats["match"] == "extend"
        assert stats["reused_tokens"] == stats["stored_tokens"] > first["stats"]["prompt_tokens"]
        assert second["tokens"] == hot["tokens"]  # resumed from disk == never stopped
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_drains_requests_in_flight(tmp_path):
    proc = ServerProcess(tmp_path / "kv", _env()).start()
    results = {}

    def long_turn():
        results["r"] = _turn(proc.url, "drained", _user("Tell me about rivers."), max_tokens=48)

    thread = threading.Thread(target=long_turn)
    thread.start()
    _wait_for(proc, "running")
    assert proc.stop(signal.SIGTERM) in GRACEFUL
    thread.join()
    r = results["r"]
    assert r["finish_reason"] in ("stop", "length")  # answered in full before the exit
    proc.start()
    try:
        info = httpx.get(f"{proc.url}/v1/agents/drained").json()
        stats = r["stats"]
        # On disk: the prompt and every generated token but the last.
        assert info["tier"] == "warm"
        assert info["tokens"] == stats["prompt_tokens"] + stats["generated_tokens"] - 1
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after(tmp_path):
    proc = ServerProcess(tmp_path / "kv", _env(), "--max-batch", "1", "--max-queue", "1").start()
    try:
        with ThreadPoolExecutor(2) as pool:
            body = {"messages": _user("Describe a forest in detail."), "max_tokens": 64}
            running = pool.submit(
                httpx.post, f"{proc.url}/v1/agents/q-a/chat", json=body, timeout=120
            )
            _wait_for(proc, "running")
            waiting = pool.submit(
                httpx.post, f"{proc.url}/v1/agents/q-b/chat", json=body, timeout=120
            )
            _wait_for(proc, "waiting")
            r = httpx.post(
                f"{proc.url}/v1/chat/completions", json={"model": MODEL, "messages": _user()}
            )
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert running.result().status_code == 200 and waiting.result().status_code == 200
    finally:
        proc.stop(signal.SIGKILL)


def test_a_turn_that_failed_is_a_500_and_a_closing_engine_a_503():
    """A turn that failed on the engine's side (a KVSwap read: TurnFailedError, whose message
    names no file) is a server error of that turn, not "unavailable", which means the server
    is shutting down; each API's error shape says so."""
    from agentkv.server.endpoint import as_api_error
    from agentkv.server.errors import ANTHROPIC, OPENAI

    failed = agentkv.TurnFailedError("this turn of agent 'a' failed: part of its context ...")
    error = as_api_error(failed, None)
    assert (error.status, error.kind, error.message) == (500, "server", str(failed))
    assert OPENAI.error_body(error)["error"]["type"] == "server_error"
    assert ANTHROPIC.error_body(error)["error"]["type"] == "api_error"
    closing = as_api_error(agentkv.AgentKVError("the engine is closed"), None)
    assert (closing.status, closing.kind) == (503, "unavailable")
