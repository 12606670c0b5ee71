"""The OpenAI Responses API (``/v1/responses``) against a live ``agentkv serve`` on the
embedded model, through the OpenAI SDK and the OpenAI Agents SDK (Responses and Chat
Completions models): text, streaming events, function calls and their outputs chained with
``previous_response_id`` (the chain's agent continues its cache: hot, everything reused),
JSON output, stored responses across a restart, GET / DELETE, bad input. A named
``tool_choice`` makes every call deterministic whatever the 135M model would write."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import agents
import httpx
import jsonschema
import openai
import pytest

import agentkv
from agentkv.benchmarks.server_process import ServerProcess

MODEL = "smollm2-135m-instruct"
INSTRUCTIONS = "You are the weather desk of a small newspaper. Answer in one sentence. " * 3
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time now",
    "parameters": {"type": "object", "properties": {}},
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("responses") / "kv", _env()).start()
    yield proc
    proc.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _create(oai, agent: str | None = None, **kw):
    """``responses.create`` (greedy, short): (headers, response)."""
    kw.setdefault("max_output_tokens", 8)
    kw.setdefault("instructions", INSTRUCTIONS)
    headers = {"x-agent-id": agent} if agent else {}
    raw = oai.responses.with_raw_response.create(
        model=MODEL, temperature=0, extra_headers=headers, **kw
    )
    return raw.headers, raw.parse()


def _stats(response) -> dict:
    return response.model_extra["agentkv"]


def _assert_reused_all(headers, response, tier: str = "hot"):
    """The turn continued the chain's cache: nothing of the history prefilled again."""
    stats = _stats(response)
    assert headers["x-agentkv-cache"] == tier, stats
    assert stats["match"] == "extend" and stats["reused_tokens"] == stats["stored_tokens"], stats
    assert response.usage.input_tokens_details.cached_tokens == stats["stored_tokens"] > 50
    assert stats["prefill_tokens"] < 40, stats  # only the new input item


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_include_output_text_logprobs(oai):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the message's
    text part lists each token's log-prob; without it the list is empty; streamed, a 400."""
    include = ["message.output_text.logprobs"]
    _, response = _create(
        oai, "rs-logprobs", input="Name a colour.", include=include, top_logprobs=2
    )
    part = response.output[0].content[0]
    eos = response.status == "completed"  # an EOS: generated, not in the reply
    assert len(part.logprobs) == response.usage.output_tokens - eos > 0
    assert bytes(b for t in part.logprobs for b in t.bytes).decode() == part.text
    assert all(t.top_logprobs[0].logprob == t.logprob for t in part.logprobs)
    _, plain = _create(oai, "rs-logprobs-off", input="Name a colour.")
    assert plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="stream"):
        oai.responses.create(model=MODEL, input="Hi.", include=include, stream=True)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.responses.create(model=MODEL, input="Hi.", top_logprobs=2)


def test_text_response_then_a_streamed_turn_on_previous_response_id(oai):
    headers, first = _create(oai, "rs-text", input="What is the weather like in Paris?")
    assert headers["x-agentkv-cache"] == "cold" and headers["x-agentkv-agent"] == "rs-text"
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status in ("completed", "incomplete") and first.model == MODEL
    (message,) = first.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and first.output_text
    usage = first.usage
    assert usage.input_tokens == _stats(first)["prompt_tokens"] > 50
    assert usage.output_tokens == _stats(first)["generated_tokens"] <= 8
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"
    assert first.instructions == INSTRUCTIONS and first.previous_response_id is None

    # only the new item is sent: the chain's agent holds the rest, and it is not prefilled
    raw = oai.responses.with_raw_response.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And Oslo?"}]}],
        previous_response_id=first.id,
        instructions=INSTRUCTIONS,
        temperature=0,
        max_output_tokens=6,
        stream=True,
    )
    assert raw.headers["x-agentkv-agent"] == "rs-text"
    assert raw.headers["x-agentkv-cache"] == "hot"
    events = _events(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text and deltas
    assert final.previous_response_id == first.id
    _assert_reused_all(raw.headers, final)


@pytest.mark.slow
def test_function_call_then_its_output_on_previous_response_id_is_hot(oai):
    tools = [WEATHER, TIME]
    _, call = _create(
        oai,
        "rs-tools",
        input="Is it raining in Lima?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    assert call.status == "completed"
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert json.loads(item.arguments)["city"] in CITY["enum"]
    assert call.tool_choice.name == "get_weather" and [t.name for t in call.tools] == [
        "get_weather",
        "get_time",
    ]

    headers, answer = _create(
        oai,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "rain, 14 C"}],
        previous_response_id=call.id,
        tools=tools,
        tool_choice="none",
    )
    assert headers["x-agentkv-agent"] == "rs-tools"
    _assert_reused_all(headers, answer)
    assert [o.type for o in answer.output] == ["message"]

    # streamed: the call's arguments in pieces, then the whole call
    raw = oai.responses.with_raw_response.create(
        model=MODEL,
        input="And the time?",
        previous_response_id=answer.id,
        instructions=INSTRUCTIONS,
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
        stream=True,
    )
    events = _events(raw.parse())
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[2] == "response.output_item.added" and events[2].item.arguments == ""
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (streamed,) = events[-1].response.output
    assert streamed.type == "function_call" and streamed.name in ("get_weather", "get_time")
    assert pieces == streamed.arguments == events[-3].arguments
    assert json.loads(pieces) == json.loads(events[-2].item.arguments)
    _assert_reused_all(raw.headers, events[-1].response)


def test_the_sdk_stream_helper_assembles_a_call(oai):
    with oai.responses.stream(
        model=MODEL,
        input="Weather in Oslo?",
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
        extra_headers={"x-agent-id": "rs-helper"},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    (call,) = final.output
    assert call.name == "get_weather" and call.parsed_arguments["city"] in CITY["enum"]


@pytest.mark.slow
def test_text_format_json_schema_and_json_object(oai):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    _, person = _create(
        oai, "rs-json", input="Invent a person.", text={"format": fmt}, max_output_tokens=40
    )
    assert person.status == "completed" and person.text.format.type == "json_schema"
    jsonschema.validate(json.loads(person.output_text), PERSON)

    _, obj = _create(
        oai,
        "rs-json-object",
        input="Describe Paris in JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
    )
    if obj.status == "completed":  # else max_output_tokens cut the object
        assert isinstance(json.loads(obj.output_text), dict)
    else:
        assert obj.output_text.startswith("{")


def test_get_and_delete_stored_responses(oai, server):
    _, kept = _create(oai, "rs-store", input="Hello.", metadata={"ticket": "42"})
    fetched = oai.responses.retrieve(kept.id)
    assert fetched.id == kept.id and fetched.output_text == kept.output_text
    assert fetched.metadata == {"ticket": "42"} and fetched.usage == kept.usage

    _, unstored = _create(oai, "rs-store", input="Hello again.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        _create(oai, input="Next.", previous_response_id=unstored.id)

    oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(kept.id)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for bad in ("resp_nothex", "resp_" + "A" * 32, "resp_..", "x" * 300):
            r = http.get(f"/v1/responses/{bad}")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert http.delete(f"/v1/responses/{bad}").status_code == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": 3}, "input"),
        ({"model": "gpt-nothing", "input": "hi"}, "model"),
        ({"model": MODEL, "input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"model": MODEL, "input": [{"role": "critic", "content": "hi"}]}, "input[0].role"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        (
            {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c1"}]},
            "input[0].output",
        ),
        (
            {
                "model": MODEL,
                "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}],
            },
            "input",
        ),
        (
            {
                "model": MODEL,
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1"}
                ],
            },
            "input[0].arguments",
        ),
        ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"model": MODEL, "input": "hi", "tools": [WEATHER, WEATHER]}, "tools"),
        ({"model": MODEL, "input": "hi", "tool_choice": "required"}, "tool_choice"),
        (
            {"model": MODEL, "input": "hi", "tools": [WEATHER], "tool_choice": {"type": "x"}},
            "tool_choice",
        ),
        (
            {
                "model": MODEL,
                "input": "hi",
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "nope"},
            },
            "tool_choice",
        ),
        ({"model": MODEL, "input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        (
            {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema"}}},
            "text.format",
        ),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "temperature": 5.0}, "temperature"),
        ({"model": MODEL, "input": "hi", "metadata": {"k": 1}}, "metadata"),
        ({"model": MODEL, "input": "hi", "background": True}, "background"),
        ({"model": MODEL, "input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
        ({"model": MODEL, "input": "hi", "stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_are_400s_in_the_openai_shape(server, body, param):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/responses", json=body)
        expected = 404 if param == "model" else 400
        assert r.status_code == expected, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, error
        assert http.get("/health").status_code == 200


@pytest.mark.slow
def test_previous_response_id_after_a_restart_is_warm(oai, server):
    _, first = _create(
        oai,
        "rs-restart",
        input="Lima?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    (call,) = first.output
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL  # nothing saved on the way out
    server.start()
    assert oai.responses.retrieve(first.id).output[0].call_id == call.call_id
    headers, second = _create(
        oai,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
    )
    assert headers["x-agentkv-agent"] == "rs-restart"
    _assert_reused_all(headers, second, tier="warm")


# -- the OpenAI Agents SDK ----------------------------------------------------------------------


def _agents_models(server) -> dict:
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    return {
        "responses": agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        "chat": agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    }


def _weather_tool(seen: list):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    return get_weather


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_function_tool(server, api):
    models = _agents_models(server)
    seen: list[str] = []
    agent = agents.Agent(
        name="weather",
        instructions=f"You answer weather questions ({api}).",
        tools=[_weather_tool(seen)],
        model=models[api],
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", temperature=0.0, max_tokens=40
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?"))
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_handoff(server, api):
    models = _agents_models(server)
    seen: list[str] = []
    forced = dict(temperature=0.0, max_tokens=40)
    billing = agents.Agent(
        name="billing",
        handoff_description="Answers billing and weather questions",
        instructions=f"You handle billing ({api}).",
        tools=[_weather_tool(seen)],
        model=models[api],
        model_settings=agents.ModelSettings(tool_choice="get_weather", **forced),
        tool_use_behavior="stop_on_first_tool",
    )
    triage = agents.Agent(
        name="triage",
        instructions=f"Route the user to the right agent ({api}).",
        handoffs=[billing],
        model=models[api],
        model_settings=agents.ModelSettings(tool_choice="transfer_to_billing", **forced),
    )
    result = asyncio.run(agents.Runner.run(triage, "A billing question: is Oslo sunny?"))
    assert result.last_agent.name == "billing"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["HandoffCallItem", "HandoffOutputItem", "ToolCallItem", "ToolCallOutputItem"]
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}"


def test_response_store_keeps_whole_records_and_rejects_bad_ones(tmp_path, caplog):
    from agentkv.server.response_store import ResponseStore

    store = ResponseStore(tmp_path / "responses")
    rid = "resp_" + "0123456789abcdef" * 2
    assert store.get(rid) is None and not store.delete(rid)
    record = {"id": rid, "agent_id": "a", "model": MODEL, "conversation": [], "response": {}}
    store.put(record)
    assert store.get(rid) == {"format": 1, **record}
    assert [p.name for p in store.dir.iterdir()] == [f"{rid}.json"]  # no temporary left
    (store.dir / f"{rid}.json").write_text('{"format": 1, "id": "resp_')  # torn by hand
    assert store.get(rid) is None and "unreadable" in caplog.text
    other = "resp_" + "f" * 32
    (store.dir / f"{other}.json").write_text(json.dumps({**record, "format": 1}))
    assert store.get(other) is None  # a record under another id's name
    assert store.delete(rid) and store.get(rid) is None
    for bad in ("resp_../../x", "../x", "resp_" + "A" * 32, 7):
        with pytest.raises(ValueError):
            store.get(bad)


def test_streamed_reasoning_text_and_calls_are_events_the_sdk_validates():
    """The events of a reply with reasoning (thinking models: none runs here), text and a
    call, each checked against the OpenAI SDK's own event types."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from agentkv.server.openai_responses import _Events
    from agentkv.tools import ToolCall

    base = {"id": "resp_" + "a" * 32, "object": "response", "created_at": 1, "model": MODEL}
    base |= {"status": "in_progress", "parallel_tool_calls": True, "tool_choice": "auto"}
    events = _Events({**base, "output": [], "tools": []})
    sse = [events.emit("response.created", response=events.snapshot())]
    sse += events.text("reasoning", "The user ") + events.text("reasoning", "wants Oslo.")
    sse += events.text("content", "Checking.")
    sse += events.call(ToolCall("call_1", "get_weather", {"city": "Oslo"}))
    sse += events.close(empty_message=False, status="completed")
    sse.append(events.emit("response.completed", response=events.snapshot(status="completed")))
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(s.split("data: ", 1)[1])) for s in sse]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [e.type for e in parsed]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    final = parsed[-1].response
    reasoning, message, call = final.output
    assert reasoning.content[0].text == "The user wants Oslo." and message.status == "completed"
    assert final.output_text == "Checking." and call.arguments == '{"city": "Oslo"}'
    assert {e.output_index for e in parsed if e.type == "response.output_item.done"} == {0, 1, 2}
