"""Drafts from the context (engine/drafts.py): a greedy turn decoding alone checks several
tokens a step, and gives the tokens, the text and the KV of decoding one token a step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import held_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import Constraint, Engine, InvalidRequestError
from agentkv.cli.parser import build_parser
from agentkv.engine.drafts import ACCEPT_PRIOR, FIRST_DRAFT, ContextDrafter, room
from agentkv.engine.generation import SamplingParams
from agentkv.engine.planner import Plan, StepCosts
from agentkv.format.geometry import BLOCK_TOKENS

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
NAMES = {  # a JSON schema of a list of names
    "type": "object",
    "properties": {
        "names": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4}
    },
    "required": ["names"],
    "additionalProperties": False,
}
CODE = "def parse(text):\n    return [line.split(',') for line in text.splitlines()]\n"
# (agent, messages, options): free text, code that quotes its prompt, a reply under a tool
# grammar (auto: free text until a call starts) and a call it requires, a stop string, a reply
# cut by max_tokens.
TURNS = [
    ("poem", [{"role": "user", "content": "Write a short poem about the sea."}], {}),
    ("code", [{"role": "user", "content": CODE + "\nAdd a docstring and type hints."}], {}),
    (
        "tool",
        [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        {"constraint": Constraint.tool_calls({"get_weather": WEATHER}, required=False)},
    ),
    (
        "call",
        [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        {"constraint": Constraint.tool_calls({"get_weather": WEATHER})},
    ),
    ("stop", [{"role": "user", "content": "List five sea birds."}], {"stop": ["5."]}),
    ("short", [{"role": "user", "content": CODE + "\nRepeat the code."}], {"max_tokens": 9}),
]


def test_drafted_turns_give_the_tokens_text_and_kv_of_one_token_a_step(engine, tmp_path):
    plain = Engine(cache_dir=tmp_path / "kv", draft_tokens=0)
    drafted = kept = 0
    try:
        for agent, messages, options in TURNS:
            options = {"max_tokens": 64, **options}
            ours = engine.chat(f"draft-{agent}", messages, **options)
            step = plain.chat(f"draft-{agent}", messages, **options)
            assert ours.tokens == step.tokens, agent
            assert (ours.text, ours.finish_reason, ours.stop_sequence) == (
                step.text,
                step.finish_reason,
                step.stop_sequence,
            )
            assert step.stats.draft_tokens == 0
            assert 0 <= ours.stats.accepted_draft_tokens <= ours.stats.draft_tokens
            drafted += ours.stats.draft_tokens
            kept += ours.stats.accepted_draft_tokens
            size = engine.residency.get(f"draft-{agent}").size
            assert size == plain.residency.get(f"draft-{agent}").size
            for a, b in zip(
                held_kv(engine, f"draft-{agent}", size)[0],
                held_kv(plain, f"draft-{agent}", size)[0],
            ):
                np.testing.assert_array_equal(a, b)
        # and the next turn on the drafted KV is the next turn on the stepped one
        follow = [*TURNS[1][1], {"role": "assistant", "content": step.text}]
        follow.append({"role": "user", "content": "Now add a test."})
        assert (
            engine.chat("draft-code", follow, max_tokens=48).tokens
            == plain.chat("draft-code", follow, max_tokens=48).tokens
        )
    finally:
        plain.close()
    assert kept > 0 and drafted > kept  # drafts were kept, and some were cut


def test_drafts_in_a_batch_give_each_row_the_tokens_text_and_kv_it_gets_alone(engine, tmp_path):
    """Several turns decoding together, each drafting from its own context: rows feed
    1 + k_i tokens in one step (k_i the planner's, engine/planner.py), and each row gets the
    tokens, text and KV of its turn decoded alone one token a step; then under one tool
    grammar."""
    plain = Engine(cache_dir=tmp_path / "kv", draft_tokens=0)
    before = engine.scheduler.plans.copy()
    planner = engine.scheduler.planner
    one_turn = planner.alone
    planner.alone = StepCosts(base=1.0, per_token=1.0)  # every step a batch: jagged rows
    lyon = [{"role": "user", "content": "Weather in Lyon and in Paris, in fahrenheit?"}]
    try:
        batches = [
            ([t for t in TURNS if not t[2]] + [TURNS[5][:2]], {"max_tokens": 48}),
            (
                [TURNS[2][:2], ("lyon", lyon)],
                {**TURNS[2][2], "max_tokens": 40},
            ),
        ]
        for turns, options in batches:
            turns = [(f"batch-{agent}", messages) for agent, messages, *_ in turns]
            ours = engine.chat_many(turns, **options)
            for (agent, messages), row in zip(turns, ours):
                alone = plain.chat(agent, messages, **options)
                assert row.tokens == alone.tokens, agent
                assert (row.text, row.finish_reason) == (alone.text, alone.finish_reason)
                size = engine.residency.get(agent).size
                assert size == plain.residency.get(agent).size
                for a, b in zip(held_kv(engine, agent, size)[0], held_kv(plain, agent, size)[0]):
                    np.testing.assert_array_equal(a, b)
            assert sum(r.stats.accepted_draft_tokens for r in ours) > 0, options
    finally:
        planner.alone = one_turn
        plain.close()
    ran = engine.scheduler.plans - before
    assert ran[Plan.BOTH] > 0  # drafts were checked inside a batch


def test_sampled_rows_draft_in_a_batch_and_keep_their_tables_whole(engine):
    """At a temperature each row's draws are its own (docs/drafts.md); what holds per row is
    its table: after drafts kept and cut in a batch, it holds exactly the agent's tokens."""
    engine.scheduler.call(lambda: mx.random.seed(11))  # its thread draws
    turns = [
        (f"batch-sampled-{i}", [{"role": "user", "content": CODE * (i + 1) + "\nRepeat it."}])
        for i in range(3)
    ]
    results = engine.chat_many(turns, max_tokens=64, temperature=0.6)
    assert sum(r.stats.accepted_draft_tokens for r in results) > 0
    for (agent, _), result in zip(turns, results):
        state = engine.residency.get(agent)
        assert state.table.length == state.size
        fed = state.size - result.stats.prompt_tokens
        assert fed in (len(result.tokens) - 1, len(result.tokens))


def test_a_drafted_token_s_logprob_is_the_verifying_step_s(engine, tmp_path):
    """Log-probs asked of a turn (``logprobs=n``): each token's is the model's at the step
    that chose it; with drafts (alone, and in a batch) a kept draft token's comes from the
    verifying step, the same values as one token a step."""
    plain = Engine(cache_dir=tmp_path / "kv", draft_tokens=0)
    turns = [(f"lp-{agent}", messages) for agent, messages, options in TURNS[:2]]
    try:
        alone = [plain.chat(a, m, max_tokens=40, logprobs=4) for a, m in turns]
        drafted = [engine.chat(a, m, max_tokens=40, logprobs=4) for a, m in turns]
        for agent, _ in turns:
            engine.delete_agent(agent)
        batched = engine.chat_many(turns, max_tokens=40, logprobs=4)
    finally:
        plain.close()
    assert sum(r.stats.accepted_draft_tokens for r in drafted + batched) > 0
    for one, two, three in zip(alone, drafted, batched):
        assert one.logprobs == two.logprobs == three.logprobs
        assert [t.token for t in one.logprobs] == one.tokens
        assert b"".join(t.text for t in one.logprobs).decode() == one.text
        for t in one.logprobs:
            assert len(t.top) == 4 and t.top[0].token == t.token  # greedy: the likeliest
            assert t.top[0].logprob == t.logprob <= 0
            assert [o.logprob for o in t.top] == sorted((o.logprob for o in t.top), reverse=True)
            assert sum(np.exp([o.logprob for o in t.top])) <= 1 + 1e-5
    assert engine.chat("lp-none", TURNS[0][1], max_tokens=4).logprobs is None
    with pytest.raises(InvalidRequestError, match="logprobs"):
        engine.chat("lp-bad", TURNS[0][1], max_tokens=4, logprobs=21)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("grammar", [False, True], ids=["free", "under a grammar"])
def test_a_drafted_position_draws_what_mlx_lm_s_sampler_draws(engine, temperature, top_p, grammar):
    """A drafted position is drawn by mlx-lm's own sampler (``mlx_lm.sample_utils.
    make_sampler`` over the logprobs, as mlx-lm's generation calls it): from the same random
    state, the same tokens, whichever token was drafted (the likeliest, a middling one, one
    top-p or the grammar removes), so the same distribution; the draft is kept while the
    draws equal it, which for one fixed token a position is speculative sampling's rule
    (``SamplingParams.draft_sampler``). Under a grammar both draw from the logits a real
    JSON-schema grammar's first state masks, as a constrained turn does: a token the grammar
    removes is never drawn. Greedy: the argmax."""
    from mlx_lm.sample_utils import make_sampler

    vocab = engine.loaded.tokenizer.vocab_size if grammar else 6
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(0.0, 1.0, (1, vocab)).astype(np.float32))
    if grammar:
        logits = engine.grammars.start(Constraint.json_schema(WEATHER)).mask(logits)
    allowed = np.flatnonzero(np.isfinite(np.array(logits[0])))
    order = allowed[np.argsort(-np.array(logits[0])[allowed])]
    banned = int(np.flatnonzero(~np.isfinite(np.array(logits[0])))[0]) if grammar else 4
    theirs_sample = make_sampler(temp=temperature, top_p=top_p)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draw = SamplingParams.create(temperature=temperature, top_p=top_p).draft_sampler()
    n = 200
    mx.random.seed(11)
    theirs = [theirs_sample(logprobs).item() for _ in range(n)]
    if grammar:  # (the grammar's first state leaves one token: `{`)
        assert banned not in theirs and set(theirs) <= set(allowed.tolist())
    else:
        assert len(set(theirs)) > 1  # a real distribution, not one token
    for wanted in (int(order[0]), int(order[min(2, len(order) - 1)]), banned):
        mx.random.seed(11)
        assert [draw(logits, wanted).item() for _ in range(n)] == theirs, wanted
    greedy = SamplingParams.create().draft_sampler()
    assert greedy(logits, banned).item() == int(order[0])


def test_a_sampled_turn_drafts_and_gives_the_tokens_of_one_token_a_step(engine, tmp_path):
    """At a temperature a drafted position is drawn as a one-token step draws it, one draw a
    token, over the same logits bit for bit: so from the same random state a sampled turn
    gives the very tokens it gives one token a step, drafts kept and cut; after it the table
    holds exactly the agent's tokens. (Free text and under a grammar, at two temperatures.)"""
    from agentkv import Engine

    messages = [{"role": "user", "content": CODE + "\nRepeat the code, then explain it."}]
    plain = Engine(cache_dir=tmp_path / "kv", draft_tokens=0)
    try:
        for seed, options in (
            (2, {"temperature": 0.6}),
            (5, {"temperature": 1.0, "top_p": 0.9}),
            (7, {"temperature": 0.8, "constraint": Constraint.json_schema(NAMES)}),
        ):
            agent = f"draft-sampled-{seed}"
            runs = []
            for eng in (engine, plain):
                eng.scheduler.call(lambda s=seed: mx.random.seed(s))  # its thread draws
                runs.append(eng.chat(agent, messages, max_tokens=96, **options))
            drafted, alone = runs
            assert drafted.tokens == alone.tokens and drafted.text == alone.text
            assert drafted.stats.draft_tokens > 0 and alone.stats.draft_tokens == 0
            if "constraint" not in options:  # (the grammar's reply quotes too little)
                assert drafted.stats.accepted_draft_tokens > 0
            state = engine.residency.get(agent)
            assert state.table.length == state.size
            fed = state.size - drafted.stats.prompt_tokens  # all but the last token (and EOS)
            assert fed in (len(drafted.tokens) - 1, len(drafted.tokens))
    finally:
        plain.close()


def test_a_constrained_turn_at_a_temperature_drafts_within_its_grammar(engine):
    """A JSON-schema reply at a temperature, drafts on: every drafted token is sampled under
    the grammar (a draft the grammar forbids is cut), so the reply is valid JSON of the
    schema, drafts were tried, and the table holds exactly the agent's tokens."""
    import json

    import jsonschema

    schema = NAMES
    engine.scheduler.call(lambda: mx.random.seed(9))  # its thread draws
    ask = CODE + CODE.replace("parse", "parse_all") + "\nList every function name, as JSON."
    result = engine.chat(
        "draft-grammar",
        [{"role": "user", "content": ask}],
        max_tokens=160,
        temperature=0.7,
        constraint=Constraint.json_schema(schema),
    )
    jsonschema.validate(json.loads(result.text), schema)
    assert result.stats.draft_tokens > 0
    state = engine.residency.get("draft-grammar")
    assert state.table.length == state.size


def test_a_draft_is_what_followed_the_latest_match_of_the_longest_suffix():
    def draft(reply, limit=4):  # a turn's drafter, its reply so far
        return ContextDrafter([1, 2, 3, 9, 1, 2, 3, 7, 8], most=8).propose(reply, limit)

    assert draft([1, 2, 3]) == [7, 8, 1, 2]  # [1 2 3] last seen at 4
    assert draft([1, 2, 3], limit=1) == [7]
    assert draft([5, 9]) == [1, 2, 3, 7]  # [5 9] never; [9] at 3
    assert draft([6]) == []  # nowhere before
    assert draft([]) == [] and draft([1], limit=0) == []
    assert ContextDrafter([], most=8).propose([4], limit=4) == []


def _latest_match(context: list[int], limit: int) -> list[int]:
    """The draft by its definition: the tokens after the latest earlier occurrence of the
    context's last 3 tokens, else 2, else 1 (an occurrence ends before the last token)."""
    for n in range(min(3, len(context) - 1), 0, -1):
        for end in range(len(context) - 2, n - 2, -1):
            if context[end - n + 1 : end + 1] == context[-n:]:
                return context[end + 1 : end + 1 + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), max_size=40),
    replies=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), min_size=1, max_size=8),
)
def test_drafts_follow_the_latest_match_step_after_step(prompt, replies):
    drafter, generated = ContextDrafter(prompt, most=8), []
    for tokens in replies:  # the reply grows between steps, as a turn's does
        generated += tokens
        drafter.size, drafter._pause = 8, 0
        assert drafter.propose(generated, 5) == _latest_match(prompt + generated, 5)


def test_drafts_grow_while_kept_shrink_when_cut_and_pause_when_nothing_is_kept():
    drafter = ContextDrafter(list(range(50)) * 2, most=8)
    assert drafter.size == FIRST_DRAFT
    drafter.observe(FIRST_DRAFT, FIRST_DRAFT)
    assert drafter.size == 8
    drafter.observe(8, 8)
    assert drafter.size == 8  # never past the engine's most
    drafter.observe(8, 2)
    assert drafter.size == 3
    assert len(drafter.propose([10], limit=30)) == 3
    pauses = []
    for _ in range(3):
        drafter.observe(3, 0)
        steps = 0
        while drafter.propose([10], limit=30) == []:
            steps += 1
        pauses.append(steps)
    assert pauses == [1, 3, 7] and drafter.size == 1
    drafter.observe(1, 1)
    drafter.observe(2, 0)
    assert drafter.propose([10], limit=30) == []  # one miss after a kept draft: one step


def test_acceptance_starts_hopeful_and_follows_how_recent_drafts_fared():
    drafter = ContextDrafter([1, 2, 3], most=8)
    assert drafter.acceptance == ACCEPT_PRIOR[0] / ACCEPT_PRIOR[1]
    for _ in range(10):
        drafter.observe(8, 8)  # every draft token kept
    assert drafter.acceptance > 0.95
    for _ in range(15):
        drafter.observe(4, 0)  # the first token cut, each time
    assert drafter.acceptance < 0.35
    drafter.observe(4, 2)  # two kept, the third tried and cut: 2 of 3
    assert 0.35 < drafter.acceptance < 0.6


class _Table:
    def __init__(self, length, ct):
        self.length = length
        self.tails = None if ct is None else type("Arena", (), {"ct": ct})()


@pytest.mark.parametrize(
    "length,ct,expected",
    [(0, 32, 30), (30, 32, 0), (31, 32, -1), (32, 64, 30), (63, 64, -1), (100, None, 154)],
)
def test_a_draft_never_completes_a_channel_group_or_a_block(length, ct, expected):
    # the step feeds the last token and the draft: length + 1 + draft stays inside the group
    assert room(_Table(length, ct)) == expected
    unit = ct or BLOCK_TOKENS
    if expected >= 0:
        assert (length + 1 + expected) // unit == length // unit


def test_draft_tokens_are_checked():
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        Engine(draft_tokens=31)
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        Engine(draft_tokens=-1)
    parser = build_parser()
    assert parser.parse_args(["serve", "--draft-tokens", "0"]).draft_tokens == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--draft-tokens", "31"])
