"""Tool calling through real clients against a live ``agentkv serve`` on the embedded model:
the OpenAI SDK, the Anthropic SDK and LangChain's ``ChatOpenAI.bind_tools``, streamed and
not. A named ``tool_choice`` makes every call deterministic whatever the 135M model would
write; the turn after a tool result must be hot and reuse the whole cache (``extend``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import anthropic
import openai
import pytest

import agentkv
from agentkv.benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a server of its own and ~40 s of turns (test_server.py has
# the tool-call round trip and the bad tool requests in the fast tier)

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a weather assistant. Call get_weather to learn the weather of a city. " * 3
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMS},
    },
]
CLAUDE_TOOLS = [
    {"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER_PARAMS},
    {"name": "get_time", "description": "The time", "input_schema": TIME_PARAMS},
]


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("tools") / "kv", _env()).start()
    yield proc
    proc.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _create(oai, agent: str, messages, **kw):
    kw.setdefault("max_tokens", 40)
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        temperature=0,
        extra_headers={"x-agent-id": agent},
        **kw,
    )
    return raw.headers, raw.parse()


def _assert_reused_all(headers, body):
    """The turn continued the agent's cache: hot, and every cached token reused."""
    stats = body.agentkv if hasattr(body, "agentkv") else body["agentkv"]
    assert headers["x-agentkv-cache"] == "hot", stats
    assert stats["match"] == "extend" and stats["reused_tokens"] == stats["stored_tokens"], stats
    assert int(headers["x-agentkv-reused-tokens"]) == stats["stored_tokens"] > 100


def test_openai_sdk_tool_round_trips_stay_hot(oai):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}]
    headers, first = _create(oai, "oa-tools", messages, tool_choice=_named("get_weather"))
    assert headers["x-agentkv-cache"] == "cold"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITY["enum"]

    # the SDK's own message goes back in, with the tool's result: the cache is reused whole
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'},
    ]
    headers, second = _create(oai, "oa-tools", messages, tool_choice=_named("get_time"))
    _assert_reused_all(headers, second)
    (call2,) = second.choices[0].message.tool_calls
    assert call2.function.name == "get_time"
    assert isinstance(json.loads(call2.function.arguments), dict)

    messages += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call2.id, "content": "09:30"},
    ]
    headers, third = _create(oai, "oa-tools", messages, tool_choice="none", max_tokens=8)
    _assert_reused_all(headers, third)
    assert third.choices[0].message.tool_calls is None
    assert third.choices[0].finish_reason in ("stop", "length")


def test_openai_sdk_streams_a_call_name_first_then_arguments(oai):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Oslo?"}]
    _, whole = _create(oai, "oa-whole", messages, tool_choice=_named("get_weather"))
    kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    chunks = list(
        oai.chat.completions.create(
            **kwargs,
            tool_choice=_named("get_weather"),
            stream=True,
            extra_headers={"x-agent-id": "oa-stream"},
        )
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    head = deltas[0][0]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert len(deltas) >= 2 and chunks[-1].choices[0].finish_reason == "tool_calls"
    # the SDK's stream helper assembles the same call as the one returned whole
    with oai.chat.completions.stream(
        **kwargs, tool_choice=_named("get_weather"), extra_headers={"x-agent-id": "oa-helper"}
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    (expected,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(expected.function.arguments)
    streamed = "".join(d[0].function.arguments for d in deltas)
    assert json.loads(streamed) == json.loads(expected.function.arguments)


def test_anthropic_sdk_tool_use_round_trip_and_stream(claude):
    kwargs = dict(
        model=MODEL,
        system=SYSTEM,
        tools=CLAUDE_TOOLS,
        max_tokens=40,
        extra_body={"temperature": 0.0},
    )
    messages = [{"role": "user", "content": "Lima?"}]
    raw = claude.messages.with_raw_response.create(
        messages=messages,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_headers={"x-agent-id": "an-tools"},
        **kwargs,
    )
    first = raw.parse()
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input["city"] in CITY["enum"]

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 14 C"}],
        },
    ]
    raw = claude.messages.with_raw_response.create(
        messages=messages,
        tool_choice={"type": "none"},
        extra_headers={"x-agent-id": "an-tools"},
        **{**kwargs, "max_tokens": 8},
    )
    second = raw.parse()
    _assert_reused_all(raw.headers, second.model_dump())
    assert [b.type for b in second.content] == ["text"] and second.stop_reason != "tool_use"

    with claude.messages.stream(
        messages=messages[:1],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_headers={"x-agent-id": "an-stream"},
        **kwargs,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert (streamed.name, streamed.input) == (use.name, use.input)


def test_langchain_bind_tools_round_trip(server):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key="none",
        temperature=0,
        max_tokens=40,
        max_retries=0,
        default_headers={"x-agent-id": "lc-tools"},
    )
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    history = [SystemMessage(SYSTEM), HumanMessage("Paris?")]
    reply = bound.invoke(history)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict)
    # LangChain sends the call back re-serialized; the agent's cache is still reused whole
    history += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    # (the same tools stay declared: they are part of the prompt the cache holds)
    tools_again = llm.bind_tools([get_weather], tool_choice="none", strict=True, max_tokens=8)
    answer = tools_again.invoke(history)
    assert isinstance(answer.content, str) and not answer.tool_calls
    usage = answer.response_metadata["token_usage"]
    first = reply.response_metadata["token_usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["prompt_tokens"] + first["completion_tokens"] - 1


def test_auto_returns_only_calls_of_declared_tools_with_object_arguments(oai):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}]
    _, reply = _create(oai, "oa-auto", messages, max_tokens=24)
    message = reply.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    assert (reply.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
    assert message.content is not None or message.tool_calls
