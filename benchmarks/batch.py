"""Batch: system decode tokens/s with N agents batched vs the same turns one after another.

Every agent resumes the same 1,024-token context (a saved state forked to N
agents, reloaded from the page cache) and generates 64 tokens (greedy, raw
text so no EOS cuts a turn short). Sequential: ``Engine.generate`` per agent.
Batched: ``Engine.generate_many`` for all N: each agent's prefill of the new
text runs on its own, then all decode in one batch. Both produce the same
tokens (checked); ``*_tps`` = generated tokens / wall time of all N turns. Drafts are on
(the default): ``plans`` counts the batched arm's decode steps by plan (engine/planner.py:
one, draft, batch, both), and ``step_costs_ms`` the planner's measured step costs after it:
a one-turn step's base and cost a token fed, and what a token costs beyond that in a jagged
batch step and in an even one (what bounds a batch's gain over drafted turns one after
another: docs/drafts.md).
``attention_calls`` says which attention path ran over the 4-bit caches
(``fused_cpu``: agentkv's kernel; ``quantized_matmul``: MLX's).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import emit, progress
from .ttft import context_text

CONTEXT_TOKENS = 1024
NEW_TOKENS = 64
TURN = "\\n\\nThe clerks then wrote down what they had found, line by line:"


def run(agent_counts=(1, 2, 4, 8), as_json: bool = False, model: str | None = None) -> list[dict]:
    from agentkv import Engine
    from agentkv.engine.planner import Plan

    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-batch-") as tmp:
        progress("batch: loading the model...")
        with Engine(model=model, cache_dir=Path(tmp) / "kv") as eng:
            context = context_text(eng, CONTEXT_TOKENS)
            progress(f"batch: prefilling the shared {CONTEXT_TOKENS}-token context...")
            eng.generate("base", context, max_tokens=1)
            eng.flush()
            prompt = context + TURN
            for n in agent_counts:
                seq_agents = [f"seq{n}-{i}" for i in range(n)]
                bat_agents = [f"bat{n}-{i}" for i in range(n)]
                for agent in seq_agents + bat_agents:
                    eng.fork_agent("base", agent)
                progress(f"batch: {n} agents one after another...")
                start = time.perf_counter()
                sequential = [eng.generate(a, prompt, max_tokens=NEW_TOKENS) for a in seq_agents]
                seq_s = time.perf_counter() - start
                progress(f"batch: {n} agents batched...")
                plans = eng.scheduler.plans.copy()
                start = time.perf_counter()
                batched = eng.generate_many(
                    [(a, prompt) for a in bat_agents], max_tokens=NEW_TOKENS
                )
                bat_s = time.perf_counter() - start
                assert [r.tokens for r in batched] == [r.tokens for r in sequential]
                tokens = sum(r.stats.generated_tokens for r in batched)
                row = {
                    "agents": n,
                    "batched_tps": round(tokens / bat_s, 2),
                    "sequential_tps": round(tokens / seq_s, 2),
                }
                row["speedup"] = round(row["batched_tps"] / row["sequential_tps"], 2)
                row["tokens"] = tokens
                ran = eng.scheduler.plans - plans
                row["plans"] = {plan.value: ran[plan] for plan in Plan}
                row["cache"] = batched[0].stats.cache
                row["step_costs_ms"] = _step_costs(eng.scheduler.planner)
                rows.append(row)
                progress(
                    f"batch: {n} agents: batched {row['batched_tps']} tok/s, sequential "
                    f"{row['sequential_tps']} tok/s ({row['speedup']}x)"
                )
                for agent in seq_agents + bat_agents:
                    eng.delete_agent(agent)
    from agentkv.kernels.attention import paths_used

    extra = {"context_tokens": CONTEXT_TOKENS, "new_tokens": NEW_TOKENS}
    emit("batch", rows, as_json, {**extra, "attention_calls": paths_used()})
    return rows


def _step_costs(planner) -> dict:
    return {
        "alone_base": round(planner.alone.base * 1000, 2),
        "alone_per_token": round(planner.alone.per_token * 1000, 3),
        "batch_extra_per_token": round(planner.batch.extra * 1000, 3),
        "even_extra_per_token": round(planner.even.extra * 1000, 3),
    }
