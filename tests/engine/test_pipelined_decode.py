"""The pipelined decode loop (a GPU's: engine/scheduler.py), run here on the CPU: a step
started on the tokens the step before is still sampling gives the same tokens, the same
stored agents and the same next turns as steps one after another, whether turns end by a
stop string, ``max_tokens`` or a cancel, in a batch or alone, greedy or at a temperature."""

import mlx.core as mx
import pytest

PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    ",
    "A recipe for bread: first, mix",
]


def run(engine, pipeline, tag, prompts=PROMPTS, seed=None, **options):
    """Each prompt's turn as a batch on fresh agents, then a second turn of each; the
    tokens of both, and how many steps ran ahead."""
    engine.scheduler.pipeline = pipeline
    before = engine.scheduler.ahead_steps
    try:
        if seed is not None:  # the scheduler's thread draws (MLX's keys are per thread)
            engine.scheduler.call(lambda: mx.random.seed(seed))
        turns = [(f"{tag}-{i}", p) for i, p in enumerate(prompts)]
        first = engine.generate_many(turns, **options)
        again = engine.generate_many(
            [(a, p + r.text + " And then") for (a, p), r in zip(turns, first)], max_tokens=12
        )
    finally:
        engine.scheduler.pipeline = False
    ahead = engine.scheduler.ahead_steps - before
    logprobs = [[(t.token, round(t.logprob, 5)) for t in r.logprobs] for r in first if r.logprobs]
    return [(r.tokens, r.finish_reason) for r in first + again] + logprobs, ahead


@pytest.mark.parametrize(
    "options",
    [
        {"max_tokens": 90},  # across a channel group's end (64): unpipelined steps between
        {"max_tokens": 40, "stop": [".", "\n\n"]},
        {"max_tokens": 48, "temperature": 0.8, "top_p": 0.9},
        {"max_tokens": 30, "logprobs": 3},  # each token's log-prob, as the plain step's
    ],
    ids=["greedy", "stop", "sampled", "logprobs"],
)
def test_pipelined_steps_give_the_tokens_of_steps_one_after_another(fresh_engine, options):
    engine = fresh_engine(draft_tokens=0)
    # At a temperature, one agent: the draws then come in the same order either way (in a
    # batch, a step run ahead draws before the prefill of an agent joining later: the same
    # distribution, other draws)
    sampled = "temperature" in options
    seed, prompts = (7, PROMPTS[:1]) if sampled else (None, PROMPTS)
    plain, ahead = run(engine, False, "plain", prompts, seed, **options)
    assert ahead == 0
    piped, ahead = run(engine, True, "piped", prompts, seed, **options)
    assert ahead > 10  # most steps ran ahead
    if "logprobs" in options:  # the first turns' log-probs compared too
        assert len(piped) == 3 * len(prompts) and all(len(lp) > 10 for lp in piped[-3:])
    assert piped == plain


def test_a_pipelined_agent_alone_reloads_and_continues_as_one_decoded_step_by_step(
    fresh_engine, tmp_path
):
    """An agent decoded pipelined, saved and reloaded in a new engine (warm), then
    continued: the same tokens as the agent decoded plainly."""
    prompt = "Notes on the migration of birds in autumn:"
    results = {}
    for pipeline in (False, True):
        engine = fresh_engine(draft_tokens=0, cache_dir=tmp_path / f"kv-{pipeline}")
        engine.scheduler.pipeline = pipeline
        first = engine.generate("bird", prompt, max_tokens=70)
        engine.close()
        engine = fresh_engine(draft_tokens=0, cache_dir=tmp_path / f"kv-{pipeline}")
        second = engine.generate("bird", prompt + first.text + "\nMore:", max_tokens=20)
        assert second.stats.cache == "warm"
        results[pipeline] = (first.tokens, second.tokens, second.stats.reused_tokens)
    assert results[True] == results[False]


def test_a_cancelled_pipelined_turn_keeps_no_reply(fresh_engine):
    """Cancelled while its next step runs ahead: the agent keeps its prompt and nothing of
    the reply, and its next turn is a fresh agent's."""
    engine = fresh_engine(draft_tokens=0)
    engine.scheduler.pipeline = True
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    held, pieces = {}, []

    def listener(event, value):
        if event == "piece":
            pieces.append(value)
            if len(pieces) == 6:
                held["job"].cancel()

    held["job"] = engine.submit_chat("keeper", messages, listener=listener, max_tokens=200)
    cancelled = held["job"].wait(120)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) < 20
    assert engine.scheduler.ahead_steps > 0
    after = engine.chat("keeper", messages, max_tokens=24)
    assert after.stats.cache == "hot"
    engine.scheduler.pipeline = False
    fresh = engine.chat("keeper-fresh", messages, max_tokens=24)
    assert after.tokens == fresh.tokens
