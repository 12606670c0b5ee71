"""Constrained: decode tokens/s with an output grammar vs without, side by side.

The same chat turn (a ~300-token context, then a request for JSON) runs free and under
each constraint: ``json_object``, ``json_schema`` (a list of weather records, long enough
that the grammar is still open at ``max_tokens``), ``tool_calls`` (one of three tools,
parallel calls allowed) and ``tool_calls_auto`` (``required=False``: free text unless the
model begins a call, as for ``tool_choice`` "auto"). Every turn starts hot from a fork of
one agent that holds the prompt, so it is nearly all decode; one unmeasured turn of each
kind runs first. Rounds alternate free and constrained turns, so a busy machine slows both
alike; ``decode_tps`` is the median over rounds of each turn's own decode rate (tokens
after the first / time between the first and the last), and ``ratio`` the median over
rounds of its rate over the same round's free turn's. ``agents`` > 1 runs that many turns
as one batch (all under the constraint; ``mixed``: half free, half ``json_schema``), the
rate each agent sees.

On a shared machine wall-clock rates swing with other processes, so each row also gives
the process's CPU time per generated token (``cpu_ms_per_token``, all threads) and
``cpu_ratio``, the free turn's CPU per token over this row's: what ``ratio`` would be on an
otherwise idle machine, where decode is CPU-bound. ``grammar_us`` is what the grammar adds
to a decode step, measured apart from the model: the constrained turn's own tokens replayed
through a fresh grammar, mask and advance per token; ``step_ratio`` is what that alone
predicts, the free step time over the step time plus ``grammar_us`` for each constrained
row. ``compile_ms`` is the first compile of the constraint (checked, compiled, its grammar
started) and ``start_ms`` a later turn's start from the engine's compiled copy (the
tokenizer's token table is built once before: ``tokenizer_ms``).

``--engines`` instead measures the grammar engines themselves on the model's tokenizer
(llguidance, and xgrammar / outlines-core where installed): token-table build, compile
time of a schema and of a generic JSON object, mask time per token along a fixed output.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .common import emit, progress
from .ttft import context_text

CONTEXT_TOKENS = 300
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = {
    "get_weather": WEATHER,
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
}
REQUEST = (
    "List the weather records of every port named in the archive above as JSON: city, "
    "days, unit and whether the forecast is hourly."
)


def constraints() -> dict:
    from agentkv import Constraint

    return {
        "json_object": lambda: Constraint.json_object(),
        "json_schema": lambda: Constraint.json_schema(
            {"type": "array", "items": WEATHER, "minItems": 64}
        ),
        "tool_calls": lambda: Constraint.tool_calls(TOOLS, parallel=True),
        "tool_calls_auto": lambda: Constraint.tool_calls(TOOLS, required=False),
    }


def run(
    agent_counts=(1, 4),
    max_tokens: int = 64,
    repeats: int = 3,
    as_json: bool = False,
    model: str | None = None,
) -> list[dict]:
    from agentkv import Engine

    makers = constraints()
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-constrained-") as tmp:
        progress("constrained: loading the model...")
        with Engine(model=model, cache_dir=Path(tmp) / "kv") as eng:
            messages = [
                {"role": "system", "content": context_text(eng, CONTEXT_TOKENS)},
                {"role": "user", "content": REQUEST},
            ]
            start = time.perf_counter()
            vocab = eng.grammars.tokenizer.vocab_size  # the token table: built once
            tokenizer_ms = (time.perf_counter() - start) * 1000
            compile_ms = {kind: _compile_ms(eng, make) for kind, make in makers.items()}
            progress("constrained: prefilling the prompt once...")
            eng.chat("base", messages, max_tokens=1)
            turn = _Turns(eng, messages, max_tokens)
            progress("constrained: one unmeasured turn of each kind (one-time costs)...")
            for kind in [None, *makers]:
                turn.run(1, kind, makers)
            for n in agent_counts:
                kinds = [None, *makers] + (["mixed"] if n > 1 else [])
                rates: dict = {k: [] for k in kinds}
                tokens: dict = {k: [] for k in kinds}
                cpu: dict = {k: [] for k in kinds}
                replay: dict = {}
                for r in range(repeats):
                    progress(f"constrained: {n} agent(s), round {r + 1} of {repeats}...")
                    for kind in kinds:
                        results, cpu_s = turn.run(n, kind, makers)
                        if kind in makers and kind not in replay:
                            replay[kind] = _grammar_us(eng, makers[kind], results[0].tokens)
                        rates[kind].append(statistics.median(x.stats.decode_tps for x in results))
                        count = sum(x.stats.generated_tokens for x in results)
                        tokens[kind].append(count)
                        cpu[kind].append(cpu_s * 1000 / count)
                for kind in kinds:
                    row = {"constraint": kind or "none", "agents": n}
                    row.update(_figures(kind, n, rates, cpu, tokens, replay.get(kind)))
                    row.update(compile_ms.get(kind, {"compile_ms": None, "start_ms": None}))
                    rows.append(row)
                    progress(
                        f"constrained: {n} agent(s), {row['constraint']}: {row['decode_tps']} "
                        f"tok/s ({row['ratio']}x free; CPU per token {row['cpu_ratio']}x)"
                    )
    extra = {
        "context_tokens": CONTEXT_TOKENS,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tokenizer_ms": round(tokenizer_ms, 1),
        "vocab": vocab,
    }
    emit("constrained", rows, as_json, extra)
    return rows


def _figures(kind, n: int, rates: dict, cpu: dict, tokens: dict, grammar_us) -> dict:
    """A row's rates; each ratio is the median over rounds of that round's pair (this kind
    vs the free turn of the same round), so a round slowed by other processes cancels out."""
    step_us = 1e6 / statistics.median(rates[None])
    pairs = list(zip(rates[kind], rates[None], cpu[kind], cpu[None]))
    return {
        "decode_tps": round(statistics.median(rates[kind]), 2),
        "ratio": round(statistics.median(r / free for r, free, _, _ in pairs), 3),
        "tokens": int(statistics.median(tokens[kind])),
        "cpu_ms_per_token": round(statistics.median(cpu[kind]), 2),
        "cpu_ratio": round(statistics.median(free / c for _, _, c, free in pairs), 3),
        "grammar_us": None if grammar_us is None else round(grammar_us, 1),
        "step_ratio": None
        if grammar_us is None
        else round(step_us / (step_us + n * grammar_us), 4),
    }


def _compile_ms(eng, make, repeats: int = 5) -> dict:
    """The first compile of a constraint (checked, compiled) and then a start from the
    engine's compiled copy (what a later turn with the same constraint pays)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        eng.grammars.start(make())
        times.append((time.perf_counter() - start) * 1000)
    return {"compile_ms": round(times[0], 2), "start_ms": round(statistics.median(times[1:]), 3)}


def _grammar_us(eng, make, tokens: list[int]) -> float:
    """Median microseconds of mask + advance per token, replaying ``tokens``."""
    import mlx.core as mx

    grammar = eng.grammars.start(make())
    logits = mx.zeros((1, eng.grammars.tokenizer.vocab_size))
    times = []
    for token in tokens:
        start = time.perf_counter()
        mx.eval(grammar.mask(logits))
        grammar.advance(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class _Turns:
    """Runs one measured turn (or batch of turns) on fresh forks of the agent ``base``."""

    def __init__(self, eng, messages, max_tokens: int):
        self.eng = eng
        self.messages = messages
        self.max_tokens = max_tokens
        self.count = 0

    def run(self, n: int, kind, makers) -> tuple[list, float]:
        """The turns' results and the process's CPU seconds while they ran."""
        eng = self.eng
        plan = []
        for i in range(n):
            bound = kind if kind != "mixed" else ("json_schema" if i % 2 else None)
            plan.append(makers[bound]() if bound else None)
        self.count += 1
        agents = [f"t{self.count}-{i}" for i in range(n)]
        for agent in agents:
            eng.fork_agent("base", agent)

        def submit():  # on the scheduler's thread: the turns start together, one batch
            return [
                eng.submit_chat(a, self.messages, max_tokens=self.max_tokens, constraint=c)
                for a, c in zip(agents, plan)
            ]

        start = time.process_time()
        results = [job.wait() for job in eng.scheduler.call(submit)]
        cpu_s = time.process_time() - start
        for agent in agents:
            eng.delete_agent(agent)
        return results, cpu_s


# -- --engines: the grammar engines themselves ------------------------------------------------

WALK_SCHEMA = '{"city": "Paris, France", "days": 3, "unit": "celsius", "hourly": false}'
WALK_OBJECT = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3], "x": {"a": null}}}'
)


def run_engines(as_json: bool = False, model: str | None = None) -> list[dict]:
    """Token-table build, compile and per-token mask times of each installed engine."""
    import numpy as np

    from agentkv.model.load import load_model

    progress("constrained --engines: loading the tokenizer...")
    hf = load_model(model).tokenizer._tokenizer
    words = (len(hf) + 31) // 32
    rows = []
    for name, setup in (
        ("llguidance", _llguidance),
        ("xgrammar", _xgrammar),
        ("outlines-core", _outlines),
    ):
        try:
            start = time.perf_counter()
            compile_one, version = setup(hf)
            row = {"engine": f"{name} {version}", "tokenizer_ms": _since(start)}
        except ImportError:
            progress(f"constrained --engines: {name} is not installed (pip install {name})")
            continue
        for label, schema, walk in (
            ("schema", WEATHER, WALK_SCHEMA),
            ("json_object", None, WALK_OBJECT),
        ):
            progress(f"constrained --engines: {name}, {label}...")
            start = time.perf_counter()
            fill, consume, reset = compile_one(schema)
            bits = np.zeros(words, dtype=np.int32)
            fill(bits)
            row[f"{label}_compile_ms"] = _since(start)
            ids = hf.encode(walk, add_special_tokens=False)
            times = []
            for _ in range(3):
                reset()
                for token in ids:
                    start = time.perf_counter()
                    fill(bits)
                    times.append(time.perf_counter() - start)
                    if not consume(token):
                        raise RuntimeError(f"{name} refused {hf.decode([token])!r} in {walk}")
            row[f"{label}_mask_us"] = round(statistics.median(times) * 1e6, 1)
        rows.append(row)
    emit("constrained-engines", rows, as_json, {"vocab": len(hf)})
    return rows


def _since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)


def _llguidance(hf):
    import llguidance
    import llguidance.hf

    from agentkv.engine.constraints import JSON_STYLE

    tokenizer = llguidance.hf.from_tokenizer(hf)

    def compile_one(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema or {"type": "object"}, overrides=JSON_STYLE
        )
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return (
            lambda bits: m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes),
            m.consume_token,
            m.reset,
        )

    return compile_one, llguidance.__version__


def _xgrammar(hf):
    import json
    from importlib.metadata import version

    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_one(schema):
        grammar = (
            compiler.compile_json_schema(json.dumps(schema))
            if schema
            else compiler.compile_builtin_json_grammar()
        )
        m = xgrammar.GrammarMatcher(grammar)
        mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        return lambda bits: m.fill_next_token_bitmask(mask), m.accept_token, m.reset

    return compile_one, version("xgrammar")


def _outlines(hf):
    import json
    from importlib.metadata import version

    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf.eos_token_id
    vocab: dict = {}
    for token, i in hf.get_vocab().items():
        if i != eos:
            vocab.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, vocab)

    def compile_one(schema):
        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))

        def consume(token):
            guide.advance(token)
            return True

        return (
            lambda bits: guide.write_mask_into(bits.ctypes.data, bits.size, 4),
            consume,
            guide.reset,
        )

    return compile_one, version("outlines-core")
