"""TTFT: time to first token of the same turn, cold / warm / hot, per context size.

For each size N, one agent's context is N tokens of English text (prefilled
from scratch: that turn's TTFT is ``cold_ms``). Its saved state is then forked
on disk into copies. The measured turn appends the same short question to the
context:

* ``hot_ms``: on a copy already in memory (loaded by an earlier turn).
* ``warm_ms``: on a copy only on disk, with no block of it left in the pool
  (none held, none cached): the turn reads them all (page cache).

Both run the identical prefill of the question over the identical cached
state, so ``warm_ms - hot_ms`` is the price of the reload. Medians of
``repeats`` copies; the engine runs on the embedded model.

* after a real restart: new processes open an engine on the same store (``restart_startup_s``:
  from spawn to the engine ready) and run the same turn on more copies: ``restart_first_ms``
  as a process's very first turn (first-call costs and the reload together),
  ``restart_warm_ms`` in another process after a turn on an unrelated agent (no block shared:
  the reload alone, in a process that has run a turn): the figure to hold to ``hot_ms`` +
  20 ms.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import emit, progress

PARAGRAPH = (
    "Section {i}. The archive keeps every record of the harbour town: ships that arrived, "
    "cargo they carried, the names of their captains and the weather on the day they left. "
    "Clerks copied each entry twice, once for the mayor and once for the guild, and in "
    "winter they compared the two books line by line to find mistakes.\n"
)
QUESTION = "\n\nQuestion: in one sentence, what does the archive keep?\nAnswer:"


def context_text(engine, tokens: int) -> str:
    text, i = "", 0
    while True:
        encoded = engine.token_text.encode(text)
        if len(encoded.ids) >= tokens:
            end = int(encoded.spans[tokens - 1, 1])
            data = text.encode()[:end]
            while True:
                try:
                    return data.decode()
                except UnicodeDecodeError:
                    data = data[:-1]
        text += "".join(PARAGRAPH.format(i=i + j) for j in range(20))
        i += 20


def run(
    token_counts: list[int], repeats: int = 3, as_json: bool = False, model: str | None = None
) -> list[dict]:
    from statistics import median

    from agentkv import Engine

    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-ttft-") as tmp:
        progress("ttft: loading the model...")
        with Engine(model=model, cache_dir=Path(tmp) / "kv") as eng:
            for n in token_counts:
                context = context_text(eng, n)
                base = f"ttft-{n}"
                progress(f"ttft: {n} tokens: cold prefill...")
                cold = eng.generate(base, context, max_tokens=1)
                assert cold.stats.cache == "cold"
                eng.flush()
                eng.evict(base)
                hot, warm = [], []
                for r in range(repeats):
                    eng.fork_agent(base, f"{base}-hot{r}")
                    eng.fork_agent(base, f"{base}-warm{r}")
                    preload = eng.generate(f"{base}-hot{r}", context, max_tokens=1)
                    assert preload.stats.cache == "warm"
                    h = eng.generate(f"{base}-hot{r}", context + QUESTION, max_tokens=1)
                    # The warm copy must read its blocks from disk: nothing in memory holds
                    # them (the hot copy shares them, and freed blocks stay cached).
                    eng.evict(f"{base}-hot{r}")
                    eng.drop_cached_blocks()
                    w = eng.generate(f"{base}-warm{r}", context + QUESTION, max_tokens=1)
                    eng.evict(f"{base}-warm{r}")
                    eng.drop_cached_blocks()
                    assert (h.stats.cache, w.stats.cache) == ("hot", "warm")
                    assert h.stats.prefill_tokens == w.stats.prefill_tokens
                    assert h.tokens == w.tokens
                    hot.append(h.stats)
                    warm.append(w.stats)
                row = {
                    "tokens": cold.stats.prompt_tokens,
                    "cold_ms": round(cold.stats.ttft_ms, 1),
                    "warm_ms": round(median(s.ttft_ms for s in warm), 1),
                    "hot_ms": round(median(s.ttft_ms for s in hot), 1),
                    "warm_load_ms": round(median(s.load_ms for s in warm), 2),
                    "turn_prefill_tokens": warm[0].prefill_tokens,
                }
                row.update(_after_restart(eng, base, context + QUESTION, Path(tmp) / "kv", model))
                row["restart_warm_minus_hot_ms"] = round(row["restart_warm_ms"] - row["hot_ms"], 1)
                row["warm_minus_hot_ms"] = round(row["warm_ms"] - row["hot_ms"], 1)
                row["cold_over_warm"] = round(row["cold_ms"] / row["warm_ms"], 1)
                rows.append(row)
                progress(
                    f"ttft: {n} tokens: cold {row['cold_ms']} ms, warm {row['warm_ms']} ms, "
                    f"hot {row['hot_ms']} ms; new process: first {row['restart_first_ms']} ms, "
                    f"warm {row['restart_warm_ms']} ms"
                )
                restarted = [f"{base}-restart-{k}" for k in ("first", "warm", "other")]
                for agent in [base, *restarted] + [
                    f"{base}-{k}{r}" for k in ("hot", "warm") for r in range(repeats)
                ]:
                    eng.delete_agent(agent)
    emit("ttft", rows, as_json, {"repeats": repeats})
    return rows


def _after_restart(eng, base: str, text: str, cache_dir: Path, model: str | None) -> dict:
    """``base``'s turn run by new processes on the same store: once as a process's very first
    turn, once after a turn on another agent (its own blocks: nothing shared with ``base``)."""
    first, warm, other = (f"{base}-restart-{k}" for k in ("first", "warm", "other"))
    eng.fork_agent(base, first)
    eng.fork_agent(base, warm)
    other_text = "Another agent's notes.\n" + "".join(PARAGRAPH.format(i=100 + i) for i in range(8))
    eng.generate(other, other_text, max_tokens=1)
    eng.flush()
    eng.evict(other)
    eng.drop_cached_blocks()
    one = _child(cache_dir, model, [(first, text)])
    two = _child(cache_dir, model, [(other, other_text + QUESTION), (warm, text)])
    if one["caches"] + two["caches"] != ["warm"] * 3:
        raise RuntimeError(f"the new processes did not resume from disk: {one}, {two}")
    return {
        "restart_startup_s": one["startup_s"],
        "restart_process_s": one["process_s"],
        "restart_first_ms": one["ttft_ms"][0],
        "restart_warm_ms": two["ttft_ms"][1],
        "restart_load_ms": [one["load_ms"][0], two["load_ms"][1]],
    }


def _child(cache_dir: Path, model: str | None, turns: list[tuple[str, str]]) -> dict:
    job = {"cache_dir": str(cache_dir), "model": model, "turns": turns}
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-m", "agentkv.benchmarks.ttft", "restart-child", json.dumps(job)],
        capture_output=True, text=True,
    )  # fmt: skip
    if child.returncode != 0:
        raise RuntimeError(f"the new process failed: {child.stderr[-2000:]}")
    out = json.loads(child.stdout.strip().splitlines()[-1])
    return {**out, "process_s": round(time.perf_counter() - started, 2)}


def _restart_child(cache_dir: str, model: str | None, turns: list[list[str]]) -> dict:
    started = time.perf_counter()
    from agentkv import Engine

    with Engine(model=model, cache_dir=Path(cache_dir)) as eng:
        ready = time.perf_counter() - started
        turns = [eng.generate(agent, text, max_tokens=1) for agent, text in turns]
    return {
        "startup_s": round(ready, 2),
        "ttft_ms": [round(t.stats.ttft_ms, 1) for t in turns],
        "load_ms": [round(t.stats.load_ms, 2) for t in turns],
        "caches": [t.stats.cache for t in turns],
    }


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "restart-child":
    print(json.dumps(_restart_child(**json.loads(sys.argv[2]))))
