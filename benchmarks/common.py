"""Timing, machine description and bandwidth probes shared by the benchmarks."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def machine() -> dict:
    import mlx.core as mx

    import agentkv

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": agentkv.BLAS_STATUS.description,
        "agentkv": agentkv.__version__,
        "threads": agentkv._ext.build_info()["threads"],  # agentkv's CPU kernels' pool
    }


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def percentile(sorted_values: list[float], pct: float) -> float:
    """The nearest-rank percentile of ascending ``sorted_values``: the smallest value with
    at least ``pct`` percent of the values at or below it."""
    rank = math.ceil(pct / 100 * len(sorted_values))
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def page_cache_read_gbps(paths: list[Path], repeats: int = 5) -> float:
    """Sequential read bandwidth of files already in the page cache (best of repeats)."""
    total = sum(p.stat().st_size for p in paths)
    buffer = bytearray(max(p.stat().st_size for p in paths))
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(buffer)
        best = min(best, time.perf_counter() - start)
    return total / best / 1e9


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(timed(lambda: np.copyto(dst, src))[0] for _ in range(repeats))
    return nbytes / best / 1e9


def emit(name: str, rows: list[dict], as_json: bool, extra: dict | None = None) -> None:
    result = {"bench": name, "machine": machine(), **(extra or {}), "rows": rows}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from agentkv.cli.output import table

    headers = list(rows[0]) if rows else []
    table([h.upper() for h in headers], [[row[h] for h in headers] for row in rows])


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synthetic_table(pool, tokens: int, *, seed: int = 0, ids=None):
    """An agent's block table of ``tokens`` tokens of random KV written into ``pool`` through
    the forward pass's scatters (load and save times do not depend on the values)."""
    table = pool.new_table(pool.seed(f"bench-{seed}"))
    ids = list(ids) if ids is not None else [int(t) for t in np.arange(tokens) % 1000 + 7]
    return extend_table(pool, table, ids, seed=seed)


def extend_table(pool, table, ids, *, seed: int = 0):
    """Append ``ids`` to ``table`` with random KV (as ``synthetic_table``)."""
    import mlx.core as mx

    from agentkv.pool.arena import WritePlan

    spec, arena = pool.spec, pool.arena
    mx.random.seed(seed)
    for at in range(0, len(ids), 2048):
        n = min(2048, len(ids) - at)
        start = table.length
        table.grow(n, arena.copy_rows)
        plan = WritePlan(arena, [table], [start], n)  # the pool's format, as a forward pass
        for layer in range(spec.num_layers):
            k = mx.random.normal((1, spec.kv_heads, n, spec.key_head_dim))
            v = mx.random.normal((1, spec.kv_heads, n, spec.value_head_dim))
            arena.append(layer, k, v, plan)
        arena.settle()
        table.written(ids[at : at + n])
    return table
