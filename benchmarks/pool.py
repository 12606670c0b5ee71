"""Pool: shared prefixes, paged decode, an overloaded pool, and the pool's own operations.

* ``shared``: N agents whose prompts share a long system prompt (~``system_tokens``). With
  the pool, agents 2..N reference its blocks and prefill only their own part: prefill
  tokens vs their own suffix (the tokens after the prefix all prompts share), TTFT vs a
  *hot* turn of an agent that already holds the system prompt and prefills the same user
  message; resident KV and disk bytes vs the same N agents kept apart (a salt each, so
  nothing is shared); after a restart, what a new agent with the same system prompt reuses.
* ``decode``: the model's decode step over a 1,024-token context on the pool (paged,
  jagged) vs the contiguous agentkv caches of 0.1 (``AgentKVCache`` / a merged
  ``BatchQuantizedKVCache``), at batch 1 and batch 4, in one run, interleaved; the KV
  bytes copied when agents join and leave a running pool batch (arena buffer moves plus
  merge/extract kernel traffic, both counted).
* ``overload``: ``agents`` agents with distinct ``tokens``-token prompts submitted at once
  to an engine whose pool holds ``fit`` of them (prompt + reply): all must complete, with
  the TTFT percentiles and the peak RSS of the process against budget + model.
* ``ops``: allocate + release, seal (hash and index) and lookup of pool blocks, in
  microseconds per block.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from .common import emit, percentile, progress
from .ttft import context_text

USERS = [
    "Plan the parser's error messages.",
    "Write the CSV dialect sniffer.",
    "Review the streaming writer for bugs.",
    "List tests for quoted newlines.",
    "Draft the README's usage section.",
    "Plan the release checklist for 1.0.",
    "Check the memory use on 10 GB files.",
    "Summarise the open issues in one line.",
    "Propose a name for the --strict flag.",
]


def _system(eng, tokens: int) -> str:
    return "You are one agent of a team that builds csvjson. The shared brief follows.\n" + (
        context_text(eng, tokens)
    )


def shared(*, agents: int = 8, system_tokens: int = 1100, max_tokens: int = 8) -> dict:
    from agentkv import Engine

    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-pool-") as tmp:
        with Engine(cache_dir=Path(tmp) / "shared") as eng:
            system = _system(eng, system_tokens)
            prompts = [
                [{"role": "system", "content": system}, {"role": "user", "content": USERS[i]}]
                for i in range(agents)
            ]
            ids = [eng.token_text.encode(eng.render_chat(p)).ids for p in prompts]
            common = _common_prefix(ids)
            progress(f"pool: {agents} agents sharing a {common}-token prefix...")
            # The hot reference: an agent of its own (a salt: it shares nothing) that holds
            # the prompt up to where agent i's shared part ends, so its turn prefills as many
            # new tokens as agent i's; raw text, the chat template already applied.
            eng.generate(
                "hot-ref", eng.render_chat(prompts[0])[:200], max_tokens=1, cache_salt="bench-hot"
            )
            for i, prompt in enumerate(prompts):
                r = eng.chat(f"agent{i}", prompt, max_tokens=max_tokens)
                s = r.stats
                text = eng.render_chat(prompt)
                cut = int(eng.token_text.encode(text).spans[max(1, s.reused_tokens) - 1, 1])
                eng.generate("hot-ref", text[:cut], max_tokens=1, cache_salt="bench-hot")
                hot = eng.generate("hot-ref", text, max_tokens=max_tokens, cache_salt="bench-hot")
                h = hot.stats
                rows.append(
                    {
                        "agent": i + 1,
                        "prompt_tokens": s.prompt_tokens,
                        "own_suffix_tokens": len(ids[i]) - common,
                        "shared_tokens": s.shared_tokens,
                        "prefill_tokens": s.prefill_tokens,
                        "excess_prefill": s.prefill_tokens - (len(ids[i]) - common),
                        "ttft_ms": round(s.ttft_ms, 1),
                        "hot_prefill_tokens": h.prefill_tokens,
                        "hot_ttft_ms": round(h.ttft_ms, 1),
                        "vs_hot": round(s.ttft_ms / h.ttft_ms, 2),
                    }
                )
                progress(
                    f"pool: agent {i + 1}: shared {s.shared_tokens}, prefilled "
                    f"{s.prefill_tokens} (own suffix {rows[-1]['own_suffix_tokens']}), TTFT "
                    f"{s.ttft_ms:.0f} ms vs hot {h.ttft_ms:.0f} ms ({h.prefill_tokens} tokens)"
                )
            eng.delete_agent("hot-ref")
            eng.drop_cached_blocks()  # the reference's blocks: not one of the N agents'
            eng.flush()
            resident, disk = eng.resident_bytes(), eng.disk_bytes()
            stats = eng.pool_stats().to_dict()
        progress(f"pool: the same {agents} agents kept apart (a salt each)...")
        with Engine(cache_dir=Path(tmp) / "apart") as eng:
            for i, prompt in enumerate(prompts):
                eng.chat(f"agent{i}", prompt, max_tokens=max_tokens, cache_salt=f"apart-{i}")
            eng.flush()
            resident_apart, disk_apart = eng.resident_bytes(), eng.disk_bytes()
        progress("pool: a new agent after a restart...")
        with Engine(cache_dir=Path(tmp) / "shared") as eng:
            newcomer = eng.chat(
                "newcomer",
                prompts[0][:1] + [{"role": "user", "content": USERS[-1]}],
                max_tokens=max_tokens,
            )
    later = rows[1:]
    return {
        "agents": rows,
        "common_prefix_tokens": common,
        "max_excess_prefill": max((r["excess_prefill"] for r in later), default=0),
        "max_vs_hot": max((r["vs_hot"] for r in later), default=0),
        "resident_bytes": resident,
        "resident_bytes_apart": resident_apart,
        "resident_ratio": round(resident / resident_apart, 3),
        "disk_bytes": disk,
        "disk_bytes_apart": disk_apart,
        "disk_ratio": round(disk / disk_apart, 3),
        "after_restart_reused": newcomer.stats.reused_tokens,
        "after_restart_shared": newcomer.stats.shared_tokens,
        "after_restart_cache": newcomer.stats.cache,
        "pool_stats": stats,
    }


def _common_prefix(ids: list[list[int]]) -> int:
    n = min(len(x) for x in ids)
    for i in range(n):
        if len({x[i] for x in ids}) > 1:
            return i
    return n


def decode(*, context_tokens: int = 1024, steps: int = 24, repeats: int = 3) -> dict:
    """One decode step, pool vs contiguous caches, batch 1 and 4 (same model, same data)."""
    import mlx.core as mx

    from agentkv import kernels
    from agentkv.kv.cache import AgentKVCache
    from agentkv.model.load import load_model
    from agentkv.pool import KVPool
    from agentkv.pool.step import PagedStep

    lm = load_model(None)
    model, spec = lm.model, lm.spec
    from agentkv.format.quant import KVQuant

    quant = KVQuant()
    pool = KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * 256 * 40)
    tok = lm.tokenizer
    from agentkv import Engine

    with (
        tempfile.TemporaryDirectory(prefix="agentkv-bench-pool-") as tmp,
        Engine(cache_dir=tmp, warmup=False) as eng,
    ):
        texts = [context_text(eng, context_tokens + 8 * i) for i in range(4)]
    contexts = [tok.encode(t)[:context_tokens] for t in texts]

    def contiguous(ids):
        caches = [AgentKVCache(quant, window=layer.window) for layer in spec.layers]
        for at in range(0, len(ids), 512):
            model(mx.array([ids[at : at + 512]]), cache=caches)
            mx.eval([x for c in caches for x in c.components])
        return caches

    def paged(ids):
        table = pool.new_table(pool.seed())
        for at in range(0, len(ids), 512):
            chunk = ids[at : at + 512]
            table.grow(len(chunk), pool.arena.copy_rows)
            step = PagedStep(pool.arena, spec, [table], len(chunk))
            model(mx.array([chunk]), cache=step.caches)
            pool.arena.settle()
            table.written(chunk)
        return table

    progress(f"pool: prefilling 4 contexts of {context_tokens} tokens, both ways...")
    old = [contiguous(ids) for ids in contexts]
    new = [paged(ids) for ids in contexts]

    def old_steps(rows):
        caches = (
            old[0]
            if rows == 1
            else [
                AgentKVCache.merge([old[r][layer] for r in range(rows)])
                for layer in range(spec.num_layers)
            ]
        )
        token = mx.array([[42]] * rows)
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits)
        elapsed = (time.perf_counter() - start) / steps
        for c in caches:
            c.trim(steps)
        return elapsed

    def new_steps(rows):
        tables = new[:rows]
        start = time.perf_counter()
        for _ in range(steps):
            for t in tables:
                t.grow(1, pool.arena.copy_rows)
            step = PagedStep(pool.arena, spec, tables, 1)
            logits = model(mx.array([[42]] * rows), cache=step.caches)
            mx.eval(logits)
            pool.arena.settle()
            for t in tables:
                t.written([42])
        elapsed = (time.perf_counter() - start) / steps
        for t in tables:
            t.trim(context_tokens)
        return elapsed

    samples = {key: [] for key in ("old1", "new1", "old4", "new4")}
    for r in range(repeats):
        progress(f"pool: decode steps, round {r + 1} of {repeats}...")
        samples["old1"].append(old_steps(1))
        samples["new1"].append(new_steps(1))
        samples["old4"].append(old_steps(4))
        samples["new4"].append(new_steps(4))
    ms = {k: round(median(v) * 1000, 2) for k, v in samples.items()}
    # Join and leave: rows come and go between steps of a running pool batch.
    copies_before, moved_before = pool.arena.copies, kernels.bytes_moved()
    for rows in (1, 3, 2, 4, 1):
        tables = new[:rows]
        for t in tables:
            t.grow(1, pool.arena.copy_rows)
        step = PagedStep(pool.arena, spec, tables, 1)
        mx.eval(model(mx.array([[7]] * rows), cache=step.caches))
        pool.arena.settle()
        for t in tables:
            t.written([7])
    moved = pool.arena.copies - copies_before
    kernel_bytes = sum(kernels.bytes_moved().values()) - sum(moved_before.values())
    return {
        "context_tokens": context_tokens,
        "step_ms_batch1_contiguous": ms["old1"],
        "step_ms_batch1_pool": ms["new1"],
        "batch1_pool_vs_contiguous": round(ms["new1"] / ms["old1"], 3),
        "step_ms_batch4_contiguous": ms["old4"],
        "step_ms_batch4_pool": ms["new4"],
        "batch4_speedup_contiguous": round(4 * ms["old1"] / ms["old4"], 2),
        "batch4_speedup_pool": round(4 * ms["new1"] / ms["new4"], 2),
        "join_leave_kv_bytes_copied": moved * pool.arena.block_bytes * pool.capacity + kernel_bytes,
        "arena_buffers_moved": moved,
    }


def overload(*, agents: int = 32, tokens: int = 1024, fit: int = 8, max_tokens: int = 16) -> dict:
    """Run in a child process, so its peak RSS is its own."""
    args = {"agents": agents, "tokens": tokens, "fit": fit, "max_tokens": max_tokens}
    args["per_token"] = _engine_bytes_per_token()
    command = [sys.executable, "-m", "agentkv.benchmarks.pool", "overload-child", json.dumps(args)]
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"the overload run failed: {child.stderr[-2000:]}")
    return json.loads(child.stdout)


def _engine_bytes_per_token() -> int:
    """The KV bytes a token takes in the default engine (its format, wide layers included),
    asked of an engine in another process, so the measured child loads one model only."""
    code = (
        "import sys, tempfile; from agentkv import Engine\n"
        "with tempfile.TemporaryDirectory(prefix='agentkv-bench-pool-') as tmp, "
        "Engine(cache_dir=tmp, pool_bytes=64 << 20, warmup=False) as eng:\n"
        "    print(eng.bytes_per_token)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"asking the engine its bytes per token failed: {probe.stderr[-2000:]}")
    return int(probe.stdout.split()[-1])


def _overload_child(agents: int, tokens: int, fit: int, max_tokens: int, per_token: int) -> dict:
    # Sized from the engine's bytes per token (asked in another process) and the model's
    # tokenizer: no model is loaded before the one measured, so the peak RSS is the engine's.
    from transformers import AutoTokenizer

    import agentkv  # noqa: F401  (BLAS first)
    from agentkv import Engine
    from agentkv.format.geometry import BLOCK_TOKENS, blocks_for
    from agentkv.model.load import ensure_embedded_model
    from agentkv.text.tokens import TokenText

    path = ensure_embedded_model()
    token_text = TokenText.for_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    probe = type("Probe", (), {"token_text": token_text})()
    texts = [context_text(probe, tokens + 40 * i)[-(tokens * 4) :] for i in range(agents)]
    # What one agent's turn takes: its prompt and reply, plus a block for a copied tail.
    budget = fit * (blocks_for(tokens + 64 + max_tokens) + 1) * per_token * BLOCK_TOKENS
    rss_before = _rss_bytes()
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-pool-") as tmp:
        with Engine(cache_dir=Path(tmp), pool_bytes=budget, max_batch=fit, max_queue=agents) as eng:
            model_rss = _rss_bytes()
            start = time.perf_counter()
            jobs = [
                eng.submit_chat(
                    f"load{i}",
                    [{"role": "user", "content": f"Agent {i}. " + texts[i]}],
                    max_tokens=max_tokens,
                    cache_salt=f"overload-{i}",  # nothing shared: every agent is its own
                )
                for i in range(agents)
            ]
            results, errors = [], []
            for job in jobs:
                try:
                    results.append(job.wait())
                except Exception as exc:  # counted, reported
                    errors.append(str(exc))
            elapsed = time.perf_counter() - start
            stats = eng.pool_stats()
            if eng.bytes_per_token != per_token:
                raise RuntimeError(
                    f"the pool was sized at {per_token} bytes a token; the engine stores "
                    f"{eng.bytes_per_token}"
                )
    ttfts = sorted(r.stats.ttft_ms for r in results)
    peak = _peak_rss_bytes()
    return {
        "agents": agents,
        "prompt_tokens": round(median(r.stats.prompt_tokens for r in results)) if results else 0,
        "agents_the_pool_fits": fit,
        "pool_budget_bytes": budget,
        "kv_bytes_per_token": per_token,
        "completed": len(results),
        "errors": len(errors),
        "error_messages": errors[:3],
        "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99), 1) if ttfts else None,
        "seconds": round(elapsed, 1),
        "evictions": stats.evictions,
        "rss_before_engine_bytes": rss_before,
        "rss_with_model_bytes": model_rss,
        "peak_rss_bytes": peak,
        "peak_vs_budget_plus_model": round(peak / (budget + model_rss), 3),
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's peak RSS. Not ``getrusage``'s ``ru_maxrss``: Linux carries that across
    ``execve``, so a child spawned by a large parent reports the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes


def ops(*, blocks: int = 4096, repeats: int = 5) -> dict:
    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.pool import BlockPool, BlockTable
    from agentkv.pool.hashing import chain, chain_seed

    seed = chain_seed("bench", "q4")
    best = {"allocate_release_us": float("inf"), "seal_us": float("inf"), "lookup_us": float("inf")}
    for _ in range(repeats):
        pool = BlockPool(blocks)
        start = time.perf_counter()
        taken = [pool.allocate() for _ in range(blocks)]
        for block in taken:
            pool.release(block)
        best["allocate_release_us"] = min(
            best["allocate_release_us"], (time.perf_counter() - start) / blocks * 1e6
        )
        table = BlockTable(pool, seed)
        ids = list(range(BLOCK_TOKENS)) * (blocks // 2)
        table.grow(len(ids), lambda *a: None)
        start = time.perf_counter()
        table.written(ids)  # records tokens and seals (hashes, indexes) every block
        best["seal_us"] = min(best["seal_us"], (time.perf_counter() - start) / (blocks // 2) * 1e6)
        hashes = chain(seed, ids)
        start = time.perf_counter()
        found = sum(pool.lookup(h) is not None for h in hashes)
        best["lookup_us"] = min(
            best["lookup_us"], (time.perf_counter() - start) / len(hashes) * 1e6
        )
        assert found == len(hashes)
    return {key: round(value, 3) for key, value in best.items()} | {"blocks": blocks}


def run(
    *,
    agents: int = 8,
    system_tokens: int = 1100,
    overload_agents: int = 32,
    overload_tokens: int = 1024,
    overload_fit: int = 8,
    sections=("shared", "decode", "overload", "ops"),
    as_json: bool = False,
) -> dict:
    result = {}
    if "ops" in sections:
        progress("pool: block operations...")
        result["ops"] = ops()
    if "shared" in sections:
        result["shared"] = shared(agents=agents, system_tokens=system_tokens)
    if "decode" in sections:
        result["decode"] = decode()
    if "overload" in sections:
        progress(
            f"pool: overload: {overload_agents} agents x {overload_tokens} tokens through a pool "
            f"for {overload_fit}..."
        )
        result["overload"] = overload(
            agents=overload_agents, tokens=overload_tokens, fit=overload_fit
        )
    rows = [
        {"section": k, **{kk: vv for kk, vv in v.items() if not isinstance(vv, (list, dict))}}
        for k, v in result.items()
    ]
    if as_json:
        emit("pool", rows, True, result)
    else:
        for name, section in result.items():
            print(f"== {name}")
            for key, value in section.items():
                if not isinstance(value, (list, dict)):
                    print(f"  {key}: {value}")
    return result


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "overload-child":
    print(json.dumps(_overload_child(**json.loads(sys.argv[2]))))
