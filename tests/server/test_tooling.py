"""Forced tool calls on a real engine, per family: the embedded model under its own ChatML
(the Hermes fallback) and under a Llama 3 style template (the same weights, another call
format). ``required`` and a named tool give a valid call of a declared tool; the call and
its result sent back continue the agent's cache (``extend``)."""

from __future__ import annotations

import json

import anyio
import pytest

from agentkv import Engine
from agentkv.model.load import ensure_embedded_model
from agentkv.server.tooling import ToolChoice, prepare

CITIES = ["Paris", "Oslo", "Lima"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
LLAMA3 = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: "
    'ipython\nCall a function as {"name": function name, "parameters": arguments}.\n'
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{- message.content }}{%- for tool_call in message.tool_calls or [] %}"
    '{"name": "{{ tool_call.function.name }}", "parameters": '
    "{{ tool_call.function.arguments | tojson }}}{%- endfor %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}"
)


@pytest.fixture(scope="module", params=["hermes", "llama3"])
def family_engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = ensure_embedded_model()
    if request.param == "llama3":  # the same files (linked), another chat template
        model_dir = root / "smollm2-llama3-template"
        model_dir.mkdir()
        for item in model.iterdir():
            if item.name != "chat_template.jinja":
                (model_dir / item.name).symlink_to(item)
        (model_dir / "chat_template.jinja").write_text(LLAMA3)
        model = model_dir
    eng = Engine(model=str(model), cache_dir=root / "kv", warmup=False)
    assert eng.tool_format.family == request.param
    yield eng
    eng.close()


def _turn(eng, agent, messages, choice, max_tokens=40):
    plan = anyio.run(prepare, eng, agent, messages, TOOLS, choice)
    job = eng.submit_chat(agent, plan.messages, max_tokens=max_tokens, **plan.options)
    result = job.wait(timeout=600)
    plan.parser.feed(result.text)
    plan.parser.finish()
    return result, plan.parser


@pytest.mark.slow
@pytest.mark.parametrize("choice", [ToolChoice("named", "get_weather"), ToolChoice("required")])
def test_forced_calls_are_valid_and_their_round_trip_stays_hot(family_engine, choice):
    eng = family_engine
    agent = f"{choice.mode}-agent"
    messages = [{"role": "user", "content": "Is it raining in Paris?"}]
    result, parser = _turn(eng, agent, messages, choice)
    (call,) = parser.calls
    if choice.mode == "named":
        assert call.name == "get_weather" and call.arguments["city"] in CITIES
    else:
        assert call.name in ("get_weather", "get_time")
    json.dumps(call.arguments)  # an object the client gets as JSON
    sent_back = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    messages += [sent_back, {"role": "tool", "tool_call_id": call.id, "content": "light rain"}]
    result, parser = _turn(eng, agent, messages, ToolChoice("none"), max_tokens=4)
    stats = result.stats
    assert (stats.cache, stats.match) == ("hot", "extend")
    assert stats.reused_tokens == stats.stored_tokens > 50 and parser.calls == []
