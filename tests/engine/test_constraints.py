"""Constrained decoding on the real embedded model: JSON schemas, JSON objects, forced tool
calls, per-row grammars in a batched decode, and clear errors for bad constraints."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from agentkv import Constraint, InvalidRequestError
from agentkv.engine.constraints import GrammarError

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days? Use JSON."}]


def test_a_json_schema_constraint_yields_json_that_validates(engine):
    r = engine.chat("c-schema", ASK, max_tokens=48, constraint=Constraint.json_schema(WEATHER))
    value = json.loads(r.text)
    jsonschema.validate(value, WEATHER)
    assert r.finish_reason == "stop"
    # the turn stopped when the grammar was complete: no EOS step was spent after it
    assert r.stats.generated_tokens == len(r.tokens)
    # written the way json.dumps writes it (so a re-rendered reply is the cached text)
    assert r.text == json.dumps(value)


@pytest.mark.slow
def test_a_forced_tool_call_names_the_tool_and_its_arguments_validate(engine):
    tools = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
    named = Constraint.tool_calls({"get_weather": WEATHER})
    r = engine.chat("c-tool", ASK, max_tokens=64, constraint=named)
    assert r.text.startswith("<tool_call>\n") and r.text.endswith("\n</tool_call>")
    call = json.loads(r.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], tools["get_weather"])
    assert r.finish_reason == "stop"


@pytest.mark.slow
def test_json_object_yields_an_object_and_parallel_calls_each_validate(engine):
    r = engine.chat(
        "c-object",
        [{"role": "user", "content": "Reply with a JSON object: the name and age of a person."}],
        max_tokens=40,
        constraint=Constraint.json_object(),
    )
    assert isinstance(json.loads(r.text), dict) and r.finish_reason == "stop"

    tools = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
    both = Constraint.tool_calls(tools, parallel=True)
    r = engine.chat("c-calls", ASK, max_tokens=96, constraint=both)
    blocks = r.text.split("\n</tool_call>")
    # Every complete call validates; a reply cut by max_tokens may end inside one more.
    assert len(blocks) >= 2 and (blocks[-1] == "" or r.finish_reason == "length")
    for block in blocks[:-1]:
        call = json.loads(block.strip().removeprefix("<tool_call>\n"))
        jsonschema.validate(call["arguments"], tools[call["name"]])


@pytest.mark.slow
def test_in_one_batch_a_free_agent_decodes_as_alone_and_the_constrained_one_validates(engine):
    free = [{"role": "user", "content": "Name three colours of the rainbow."}]
    alone = engine.chat("c-free-alone", free, max_tokens=24)

    def submit_both():  # on the scheduler's thread: both turns are pending at the same step
        return (
            engine.submit_chat("c-free-batch", free, max_tokens=24),
            engine.submit_chat(
                "c-bound-batch", ASK, max_tokens=48, constraint=Constraint.json_schema(WEATHER)
            ),
        )

    free_job, bound_job = engine.scheduler.call(submit_both)
    batched, bound = free_job.wait(timeout=600), bound_job.wait(timeout=600)
    assert batched.tokens == alone.tokens and batched.text == alone.text
    jsonschema.validate(json.loads(bound.text), WEATHER)
    # they did decode side by side: each was still generating when the other began
    assert free_job.first_at < bound_job.last_at and bound_job.first_at < free_job.last_at


def test_eos_is_allowed_exactly_when_the_grammar_accepts(engine):
    tok = engine.token_text.tokenizer
    eos = min(engine.eos_ids)
    grammar = engine.grammars.start(Constraint.regex("ab+"))
    logits = mx.zeros((1, len(tok)))
    masked = grammar.mask(logits)
    assert masked[0, eos].item() == float("-inf")  # nothing written yet: no EOS
    for token in tok.encode("ab", add_special_tokens=False):
        grammar.advance(token)
    masked = grammar.mask(logits)
    assert masked[0, eos].item() == 0.0 and not grammar.done  # "ab" accepts, "abb" may follow
    allowed = set(np.flatnonzero(np.array(masked[0]) == 0.0).tolist())
    assert all(tok.decode([t]).startswith("b") for t in allowed - set(engine.eos_ids))

    done = engine.grammars.start(Constraint.regex("yes"))
    for token in tok.encode("yes", add_special_tokens=False):
        done.advance(token)
    assert done.done


def test_greedy_argmax_is_the_masked_argmax_whether_or_not_the_best_token_is_allowed(engine):
    """A greedy turn's grammar skips the mask where the row's own best token is allowed; the
    token is always the argmax of the masked row: along a tool call (text, the call's
    opening, its JSON), with random rows whose best token the grammar allows or forbids,
    rows of ties, and EOS once the grammar accepts."""
    tok = engine.token_text.tokenizer
    vocab, eos = len(tok), min(engine.eos_ids)
    auto = Constraint.tool_calls({"get_weather": WEATHER}, required=False)
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    text += '"days": 2, "unit": "celsius"}}\n</tool_call>'
    rng = np.random.default_rng(7)
    grammar, twin = engine.grammars.start(auto), engine.grammars.start(auto)
    forbidden = allowed = 0
    for token in tok.encode(text, add_special_tokens=False) + [eos]:
        rows = [rng.normal(0, 3, vocab).astype(np.float32) for _ in range(3)]
        rows.append(np.zeros(vocab, np.float32))  # all tied: the first allowed index
        favoured = rows[0].copy()
        favoured[token] = 100.0  # the text's own next token, which the grammar allows
        rows.append(favoured)
        for row in rows:
            logits = mx.array(row[None])
            expected = int(mx.argmax(twin.mask(logits), axis=-1).item())
            best = int(np.argmax(row))
            ok = bool(np.array(twin.mask(logits))[0, best] == row[best])
            forbidden, allowed = forbidden + (not ok), allowed + ok
            assert int(grammar.argmax(logits).item()) == expected
        if token == eos:
            assert int(grammar.argmax(mx.array(favoured[None])).item()) == eos
            break
        grammar.advance(token)
        twin.advance(token)
    assert forbidden > 0 and allowed > 0  # both paths taken


def test_a_reply_prefix_already_in_the_prompt_is_where_the_grammar_starts(engine):
    calls = Constraint.tool_calls({"get_weather": WEATHER})
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    grammar = engine.grammars.start(calls, prefix=prefix)
    tok = engine.token_text.tokenizer
    rest = '{"city": "Oslo", "days": 2, "unit": "celsius"}}\n</tool_call>'
    for token in tok.encode(rest, add_special_tokens=False):
        grammar.advance(token)
    assert grammar.done
    with pytest.raises(GrammarError, match="reply prefix"):
        engine.grammars.start(calls, prefix='<tool_call>\n{"name": "get_time"')


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Constraint.json_schema({"type": "foo"}), "Invalid type: foo"),
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema([1, 2]), "must be a JSON object"),
        (lambda: Constraint.json_schema({"$ref": "#/defs/x"}), "does not exist"),
        (lambda: Constraint.json_schema({"type": "string", "format": "odd"}), "Unknown format"),
        (lambda: Constraint.regex("a(b"), "unclosed group"),
        (lambda: Constraint.regex(""), "non-empty pattern"),
        (lambda: Constraint.lark("start: nothing_here"), "unknown name"),
        (lambda: Constraint.tool_calls({}), "at least one tool"),
        (lambda: Constraint.tool_calls({"": {}}), "non-empty string name"),
        (lambda: Constraint.tool_calls({"f": [1]}), "parameters must be a JSON schema"),
    ],
)
def test_a_bad_constraint_is_refused_with_what_is_wrong(make, message):
    with pytest.raises(InvalidRequestError, match=message):
        make()


def test_a_lenient_schema_ignores_what_the_engine_does_not_implement(engine):
    schema = {"type": "string", "format": "odd", "maxLength": 5}
    assert Constraint.json_schema(schema, strict=False).kind == "json_schema"
    with pytest.raises(InvalidRequestError, match="constraint must be an agentkv Constraint"):
        engine.chat("c-bad", ASK, max_tokens=4, constraint={"type": "json_object"})


def test_turns_with_the_same_constraint_have_their_own_grammar_state(engine):
    tok = engine.token_text.tokenizer
    first = engine.grammars.start(Constraint.regex("yes|no"))
    second = engine.grammars.start(Constraint.regex("yes|no"))  # from the compiled copy
    for token in tok.encode("yes", add_special_tokens=False):
        first.advance(token)
    assert first.done and not second.done
    for token in tok.encode("no", add_special_tokens=False):
        second.advance(token)
    assert second.done


def test_calls_that_are_not_required_leave_text_free_but_must_be_valid_once_begun(engine):
    tok = engine.token_text.tokenizer
    auto = Constraint.tool_calls({"get_weather": WEATHER}, required=False)

    eos, logits = min(engine.eos_ids), mx.zeros((1, len(tok)))

    def consumed(text: str) -> tuple[int, int, bool]:
        """Tokens of ``text`` the grammar takes, of how many; whether EOS may come next."""
        grammar = engine.grammars.start(auto)
        ids = tok.encode(text, add_special_tokens=False)
        for taken, token in enumerate(ids):
            try:
                grammar.advance(token)
            except GrammarError:
                return taken, len(ids), False
        return len(ids), len(ids), grammar.mask(logits)[0, eos].item() == 0.0

    text = "Sure, let me look that up."
    assert consumed(text) == (len(tok.encode(text, add_special_tokens=False)),) * 2 + (True,)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, '
    call += '"unit": "celsius"}}\n</tool_call>'
    taken, total, accepting = consumed(f"Let me check. {call} Done.")
    assert taken == total and accepting
    bad = 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {}}'
    taken, total, _ = consumed(bad)
    assert taken < total  # once a call begins, only a declared tool's valid call goes on
    half = consumed(call[: call.index('"days"')])
    assert half[0] == half[1] and not half[2]  # no EOS inside an unfinished call


@pytest.mark.slow
def test_a_reply_without_a_call_is_untouched_by_the_auto_grammar(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    auto = Constraint.tool_calls({"get_weather": WEATHER}, required=False)
    hello = [{"role": "user", "content": "Say hello."}]
    free = engine.submit_chat("c-auto-free", hello, tools=tools, max_tokens=24).wait(timeout=600)
    bound = engine.submit_chat(
        "c-auto-bound", hello, tools=tools, max_tokens=24, constraint=auto
    ).wait(timeout=600)
    assert bound.tokens == free.tokens and bound.finish_reason == free.finish_reason
