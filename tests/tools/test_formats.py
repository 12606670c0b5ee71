"""Tool-call formats: each family picked from a chat template through mlx-lm's tokenizer
loader (the embedded model's tokenizer under that family's template), and each parser run
on reply text written as the family's documentation shows it, whole and streamed."""

from __future__ import annotations

import json
import shutil

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from agentkv.model.load import ensure_embedded_model
from agentkv.tools import ReplyParser, tool_format
from agentkv.tools.render import render_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["location"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]

# Trimmed chat templates: the lines of each family's template that name its tool syntax.
TEMPLATES = {
    "hermes": (
        "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
        "{%- endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n"
        "{{ message.content }}{%- for tool_call in message.tool_calls or [] %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
        '{%- endif %}<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
        "{{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    ),
    "llama3": (
        "{{- bos_token }}{%- if tools %}Environment: ipython\n{%- endif %}"
        "{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>"
        '\n\n{{ message.content }}{%- for tool_call in message.tool_calls or [] %}{"name": "'
        '{{ tool_call.function.name }}", "parameters": '
        "{{ tool_call.function.arguments | tojson }}}{%- endfor %}<|eot_id|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{%- endif %}"
    ),
    "mistral": (
        "{%- for message in messages %}{%- if message.role == 'user' %}"
        "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
        "[INST]{{ message.content }}[/INST]{%- elif message.tool_calls %}[TOOL_CALLS]"
        "{{ message.tool_calls | tojson }}</s>{%- else %}{{ message.content }}</s>{%- endif %}"
        "{%- endfor %}"
    ),
    "gpt_oss": (
        "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {"
        "{%- for tool in tools %}type {{ tool.function.name }} = () => any;{%- endfor %}"
        "}<|end|>{%- endif %}{%- for message in messages %}<|start|>{{ message.role }}"
        "{%- for tool_call in message.tool_calls or [] %}"
        " to=functions.{{ tool_call.function.name }}"
        "<|channel|>commentary json<|message|>{{ tool_call.function.arguments | tojson }}"
        "<|call|>{%- else %}<|message|>{{ message.content }}<|end|>{%- endfor %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    ),
}

# Replies as each family's documentation shows them.
REPLIES = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "c"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ),
    "llama3": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "San Francisco, CA",'
        ' "unit": "c"}}; {"name": "get_time", "parameters": {}}'
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "San Francisco, CA", '
        '"unit": "c"}}, {"name": "get_time", "arguments": {}}]'
    ),
    "gpt_oss": (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"San Francisco, CA","unit":"c"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        "<|message|>{}<|call|>"
    ),
}
EXPECTED = [("get_weather", {"location": "San Francisco, CA", "unit": "c"}), ("get_time", {})]


def _tokenizer(tmp_path, template: str | None):
    src = ensure_embedded_model()
    dst = tmp_path / "tok"
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    if template is None:
        shutil.copy(src / "chat_template.jinja", dst / "chat_template.jinja")
    else:
        (dst / "chat_template.jinja").write_text(template)
    return load_tokenizer(dst)


def _events(fmt, text, *, by_char: bool, **kw):
    parser = ReplyParser(fmt, tools=TOOLS, **kw)
    events = []
    for piece in text if by_char else [text]:
        events += parser.feed(piece)
    events += parser.finish()
    return parser, events


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_each_family_is_picked_from_its_template_and_its_calls_parse(tmp_path, family):
    fmt = tool_format(_tokenizer(tmp_path, TEMPLATES[family]))
    assert fmt.family == family and fmt.native
    for by_char in (False, True):
        parser, events = _events(fmt, REPLIES[family], by_char=by_char)
        assert [(c.name, c.arguments) for c in parser.calls] == EXPECTED
        assert [e.call for e in events if e.kind == "call"] == parser.calls
        assert len({c.id for c in parser.calls}) == 2
        assert "tool_call" not in parser.content and "TOOL_CALLS" not in parser.content
    if family == "hermes":
        assert parser.content == "Let me check."  # the blanks around calls are dropped
    if family == "gpt_oss":
        assert parser.reasoning == "Need to use function get_weather."


def test_mistral_name_args_syntax(tmp_path):
    template = TEMPLATES["mistral"].replace("[TOOL_CALLS]", "[TOOL_CALLS]{{ x }}[ARGS]")
    fmt = tool_format(_tokenizer(tmp_path, template))
    assert fmt.family == "mistral" and fmt.mistral_args
    parser, _ = _events(fmt, '[TOOL_CALLS]get_weather[ARGS]{"location": "Oslo"}', by_char=True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", {"location": "Oslo"})]
    assert fmt.forced_prefix("get_time") == "[TOOL_CALLS]get_time[ARGS]"


def test_the_embedded_chatml_gets_the_hermes_fallback(tmp_path):
    tokenizer = _tokenizer(tmp_path, None)
    fmt = tool_format(tokenizer)
    assert (fmt.family, fmt.native) == ("hermes", False)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",  # null content, as clients send it with tool_calls
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "09:00"},
    ]
    prompt = render_prompt(tokenizer, fmt, messages, TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert json.dumps(WEATHER) in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"location": "Oslo"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        "-3 C\n</tool_response>\n<tool_response>\n09:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt
    # what the fallback writes parses back to the same call
    parser, _ = _events(fmt, fmt.render_call("get_weather", {"location": "Oslo"}), by_char=True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", {"location": "Oslo"})]


def test_reasoning_is_split_from_the_answer_and_calls():
    from agentkv.tools.formats import ToolFormat

    fmt = ToolFormat("hermes", True, "<tool_call>", "</tool_call>")
    text = (
        "<think>\nThe user wants the weather; call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Oslo"}}\n</tool_call>'
    )
    for by_char in (False, True):
        parser, events = _events(fmt, text, by_char=by_char, think=("<think>", "</think>"))
        assert parser.reasoning == "\nThe user wants the weather; call get_weather.\n"
        assert parser.content == "" and [c.name for c in parser.calls] == ["get_weather"]
    # a prompt that opened the think block: the reply starts inside it
    parser, _ = _events(
        fmt,
        "hmm</think>\n\nIt is cold.",
        by_char=True,
        think=("<think>", "</think>"),
        in_reasoning=True,
    )
    assert (parser.reasoning, parser.content) == ("hmm", "It is cold.")


def test_text_that_is_not_a_call_of_a_declared_tool_stays_text():
    from agentkv.tools.formats import ToolFormat

    fmt = ToolFormat("hermes", False, "<tool_call>", "</tool_call>")
    for text in (
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        "<tool_call>\n{not json\n</tool_call>",
        "a < b and <tool_ca",
    ):
        parser, _ = _events(fmt, text, by_char=True)
        assert parser.calls == [] and parser.content == text


def test_forced_calls_always_give_one_call_with_object_arguments():
    from agentkv.tools.formats import ToolFormat

    fmt = ToolFormat("hermes", False, "<tool_call>", "</tool_call>")
    named = fmt.forced_prefix("get_weather")
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    cases = [
        (named, '{"location": "Oslo"}}\n</tool_call>', "get_weather", {"location": "Oslo"}),
        (named, '{"location": "Oslo"} and then some', "get_weather", {"location": "Oslo"}),
        (named, '\n{"type": "function", "description": "unterminated', "get_weather", {}),
        (fmt.forced_prefix(None), 'get_time", "arguments": {}}\n</tool_call>', "get_time", {}),
        (
            fmt.forced_prefix(None),
            'get_wether", "arguments": {"location": "x"}}',
            "get_weather",
            {"location": "x"},
        ),
    ]
    for prefix, generated, name, args in cases:
        forced_name = "get_weather" if prefix == named else None
        parser = ReplyParser(fmt, tools=TOOLS, forced=prefix, forced_name=forced_name)
        for ch in generated:
            parser.feed(ch)
        parser.finish()
        assert [(c.name, c.arguments) for c in parser.calls] == [(name, args)], generated
