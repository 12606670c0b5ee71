"""Chat Completions ``response_format`` through the OpenAI SDK against a live ``agentkv serve``
on the embedded model: structured output that validates, JSON objects, clear 400s."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import agentkv
from agentkv.benchmarks.server_process import ServerProcess

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Describe Paris as JSON: its name, country and population."}]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    # bounded: under greedy decoding the 135M model may repeat a digit until max_tokens,
    # and an unbounded integer lets it (seen: "population_millions": 314222...)
    population_millions: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    env = dict(os.environ)
    root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    server = ServerProcess(tmp_path_factory.mktemp("response-format") / "kv", env).start()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


@pytest.mark.slow
def test_the_sdk_parses_structured_output_and_json_objects(oai):
    done = oai.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=City, max_tokens=60, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    streamed = oai.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, max_tokens=40, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), schema)

    ask = "Reply with a JSON object: the name and age of a person."
    person = [{"role": "user", "content": ask}]
    obj = oai.chat.completions.create(
        model=MODEL,
        messages=person,
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, param",
    [
        ({"type": "yaml"}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(oai, fmt, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=4)
    assert caught.value.body["param"] == param
