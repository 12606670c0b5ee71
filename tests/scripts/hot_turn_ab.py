"""A/B of a hot turn's prefill (benchmarks/RESULTS.md, 2026-11-26 @ 4836d21): an Engine, a
~1.7K-token system prompt, turns alternating two user messages (each prefills ~80-110 new
tokens over ~1.77K reused), group-completing steps fused (as the engine runs them) or sent to
the separate operations (as before 4836d21), alternating every two turns. Prints the median and
least engine TTFT of each. argv[1]: turns (default 64)."""

import statistics
import sys
import tempfile

from agentkv.benchmarks import peers
from agentkv.engine import Engine
from agentkv.pool import step

fusable = step.PagedStep._fusable
separate = {"on": False}


def _fusable(self) -> bool:
    return fusable(self) and not (separate["on"] and self.plan.key_plan is not None)


step.PagedStep._fusable = _fusable
turns = int(sys.argv[1]) if len(sys.argv) > 1 else 64
system = peers._system_prompt(1700)
said = (
    "The coder said: I will write the parser for quoted fields first, then the tests for "
    "embedded commas, newlines inside quotes and the header row; after that the JSON writer. "
)


def messages(k: int) -> list[dict]:
    ask = f"As the tester ({k}), what is your next step for csvjson? Answer in two sentences."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Round {k}. " + said * 2 + ask},
    ]


ttft: dict[bool, list[float]] = {False: [], True: []}
with tempfile.TemporaryDirectory() as tmp:
    engine = Engine(cache_dir=tmp)
    for i in range(turns):
        separate["on"] = bool(i // 2 % 2)
        stats = engine.chat("a", messages(i % 2), max_tokens=1, temperature=0).stats
        if i >= 4:  # after the first prefill and a warm-up of each arm
            ttft[separate["on"]].append(stats.ttft_ms)
    engine.close()
for arm, label in ((False, "fused (now)"), (True, "separate operations (before)")):
    v = ttft[arm]
    print(f"{label}: median {statistics.median(v):.1f} ms, min {min(v):.1f} ms, {len(v)} turns")
