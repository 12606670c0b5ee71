"""KVSwap: decoding with most of an agent's KV on disk, against the same KV all in memory.

The embedded model, KV format 2 as ``Engine()`` stores it (q4.v2 with its wide layers), one
block pool; docs/kvswap.md describes the mechanism.

* **decode and quality** (each ``bench quality`` text): the text's first
  ``context - decode`` tokens are prefilled once into a table; two forks of it are swapped
  (their complete blocks written as block files, all but the last evicted, ``budget``
  tokens of KV resident per layer: staging blocks plus the last block), one as the engine
  swaps by default, one reading ahead (``Engine(kv_swap_read_ahead=True)``: each layer's
  reads start during the layer before, while reads go to disk). Then all three decode the
  text's next ``decode`` tokens one step at a time (teacher-forced), in turn step by step,
  each block a swapped arm fills written as its block file and evicted (the budget kept, as
  the engine keeps it):
  tokens/s of each, perplexity of each, their ratio, top-1 agreement of the swapped
  next-token choice with the in-memory one, and what each swap held and read: resident KV
  bytes, bytes read and reuse hit rate per token, time reading (on either thread) and
  choosing, the share of the read time hidden behind compute (``read_hidden_pct``), the
  model thread's wait for reads as a share of the step (``read_share_pct``) and the share
  of layer steps that found reads ahead (``read_ahead_pct``), and the groups a token read
  that the page cache could not give (``disk_reads_per_token``, as ``RWF_NOWAIT`` judges:
  storage that serves a dropped page within the call counts it as cached). ``cold`` (first
  text): ``cold_steps`` more steps with the swapped agents' block files dropped from the
  page cache (flushed, then ``posix_fadvise(DONTNEED)``) before every step, so each miss
  reads the storage.
* **agents**: ``agents`` agents of ``context`` tokens (random KV written through the
  forward pass's scatters, as ``bench save``) in a pool that holds 2 of them in full.
  Swapped: all decode together in one batch, ``agent_decode`` steps. Evict and reload
  (today without a swap budget): two at a time, each pair's blocks read back from their
  block files into the pool, decoded together, given back. Aggregate tokens/s of each.
* **memory** (``--memory``, or ``--memory-only``): one turn of ``context`` tokens of the
  first text (``decode`` of them generated, drafts off) through ``Engine`` in a process of
  its own, all in memory (the default pool) against swapped (``kv_swap_budget=budget``, a
  pool of half the turn's blocks: it cannot hold the turn), the arms alternating
  ``MEMORY_REPEATS`` times: each process's peak RSS as the parent reads it
  (``os.wait4``'s rusage), prefill seconds and decode tokens/s, the saving against the
  context's KV bytes.
* ``--tune``: the first text at every rank of ``TUNE_RANKS``, the chosen rank demanding
  only ``TUNE_DEMANDS`` groups a step (the other slots keep what they held), reading ahead,
  and the predictor without low-rank keys (``bounds``: each group's per-channel key ranges), side
  by side with the in-memory arm: perplexity ratio, top-1 agreement, tokens/s, bytes read
  and resident bytes each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentkv.format.geometry import BLOCK_TOKENS

from .common import emit, progress

CONTEXT = 8192
DECODE = 128
COLD_STEPS = 16
AGENTS = 8
AGENT_DECODE = 16
TUNE_RANKS = (8, 16, 24, 32)
TUNE_DEMANDS = (4, 8)  # groups that must be resident each step (default: every slot)
MEMORY_REPEATS = 2


def run(
    *,
    context: int = CONTEXT,
    decode: int = DECODE,
    budget: int | None = None,
    rank: int | None = None,
    agents: int = AGENTS,
    agent_decode: int = AGENT_DECODE,
    tune: bool = False,
    memory: bool = False,
    texts_too: bool = True,
    as_json: bool = False,
) -> list[dict]:
    budget = budget or context // 8
    if not texts_too:
        rows = memory_rows(context, budget, decode)
        emit("kvswap", rows, as_json, {"context": context, "budget": budget})
        return rows
    import mlx.core as mx

    from agentkv.model.kvswap import DEFAULT_RANK

    from .kv_candidates import texts
    from .quality import quant_of

    if decode < 1 or context <= decode + 512:
        raise SystemExit("agentkv: error: --context must exceed --decode by more than 512")
    budget = budget or context // 8
    rank = rank or DEFAULT_RANK
    from agentkv.model.load import load_model

    progress("kvswap: loading the model...")
    loaded = load_model(weights="quantized")
    quant = quant_of("q4.v2", loaded)
    setup = _Setup(loaded, quant)
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-kvswap-") as tmp:
        for i, (name, text) in enumerate(texts().items()):
            ids = loaded.tokenizer.encode(text)[: context + 1]
            if len(ids) < context + 1:
                raise SystemExit(f"agentkv: error: {name} has fewer than {context + 1} tokens")
            # (label, rank, demand, reading ahead)
            arms = [("swap", rank, None, False), ("swap, reading ahead", rank, None, True)]
            if tune and i == 0:
                arms = [(f"rank {r}", r, None, False) for r in TUNE_RANKS]
                arms += [(f"rank {rank}, demand {d}", rank, d, False) for d in TUNE_DEMANDS]
                arms += [(f"rank {rank}, reading ahead", rank, None, True)]
                arms += [("bounds", 0, None, False)]
            progress(f"kvswap: {name}: prefilling {context - decode} tokens, then decoding...")
            rows += setup.text_rows(
                name, ids, Path(tmp) / f"t{i}", arms, budget, decode, cold=i == 0
            )
            mx.clear_cache()
        if agents:
            progress(f"kvswap: {agents} agents of {context} tokens...")
            rows.append(
                setup.agents_row(Path(tmp) / "agents", agents, context, budget, rank, agent_decode)
            )
    if memory:
        rows += memory_rows(context, budget, decode)
    emit(
        "kvswap",
        rows,
        as_json,
        {"context": context, "budget": budget, "rank": rank, "format": quant.label},
    )
    return rows


class _Setup:
    def __init__(self, loaded, quant):
        self.loaded = loaded
        self.quant = quant
        self.spec = loaded.spec

    def pool(self, blocks: int):
        from agentkv.format.geometry import BLOCK_TOKENS
        from agentkv.pool import KVPool

        per_block = self.spec.bytes_per_token(self.quant) * BLOCK_TOKENS
        return KVPool(self.spec, self.quant, pool_bytes=per_block * blocks)

    def projections(self, rank: int, predict: bool = False):
        from agentkv.model.kvswap import projections

        if not rank:
            return None
        loaded = self.loaded
        return projections(
            loaded.model, loaded.tokenizer, self.spec, self.quant, rank, read_ahead=predict
        )

    def swap(
        self, pool, table, directory: Path, budget: int, rank: int, demand=None, predict=False
    ):
        """Write ``table``'s complete blocks as block files and evict all but its last."""
        from agentkv.pool.swap import SwapState, plan_blocks
        from agentkv.store.block_files import SharedBlocks

        plan = plan_blocks(table.length, budget)
        if plan is None:
            raise SystemExit("agentkv: error: the budget holds the whole context; nothing to swap")
        evicted, staging = plan
        shared = SharedBlocks(directory, self.spec, self.quant)
        with shared.writing():
            files = shared.ensure_pool_blocks(pool, table.blocks[:evicted])
        return SwapState.evict(
            pool,
            table,
            files,
            self.projections(rank, predict),
            query_heads=self.loaded.query_heads,
            staging=staging,
            demand=demand,
        )

    def keep_to_budget(self, pool, swap, directory: Path) -> None:
        """Evict the blocks a swapped arm filled while decoding (their block files written
        first), as ``Swapper.keep_to_budget`` does: its resident KV stays at the budget."""
        from agentkv.store.block_files import SharedBlocks

        shared = SharedBlocks(directory, self.spec, self.quant)
        while (block := swap.next_evictable()) is not None:
            with shared.writing():
                (file,) = shared.ensure_pool_blocks(pool, [block])
            swap.evict_next(file)

    def step(self, pool, tables, swaps, tokens):
        """One decode step of these rows; float32 logits [B, vocab]."""
        import mlx.core as mx

        from agentkv import mlx_adapter
        from agentkv.pool.step import PagedStep

        for table in tables:
            table.grow(1, pool.arena.copy_rows)
        step = PagedStep(pool.arena, self.spec, tables, 1, swaps=swaps)
        out = mlx_adapter.last_logits(
            self.loaded.model, mx.array([[t] for t in tokens]), step.caches
        )
        mx.eval(out)
        pool.arena.settle()
        for table, t in zip(tables, tokens):
            table.written([t])
        for swap in swaps:
            if swap is not None and swap.error:
                raise RuntimeError(f"kvswap: {swap.error}")
        return out.reshape(len(tables), -1).astype(mx.float32)

    def text_rows(self, name, ids, directory, arms, budget, decode, *, cold: bool):
        import mlx.core as mx
        import numpy as np

        from agentkv.format.geometry import blocks_for

        extra = COLD_STEPS if cold else 0
        prefix = len(ids) - 1 - decode - extra
        need = blocks_for(len(ids)) * (1 + len(arms)) + len(arms) * budget // 256 + 4
        pool = self.pool(need)
        base = pool.new_table(pool.seed(f"kvswap-{name}"))
        _prefill(self.loaded.model, self.spec, pool, base, ids[:prefix])
        tables, swaps = [base], [None]
        for a, (_, rank, demand, predict) in enumerate(arms):
            fork = base.fork()
            tables.append(fork)
            swaps.append(
                self.swap(pool, fork, directory / f"arm{a}", budget, rank, demand, predict)
            )
        nll = np.zeros(len(tables))
        top1 = np.zeros(len(tables))
        seconds = np.zeros(len(tables))
        for i in range(decode):
            token, target = ids[prefix + i], ids[prefix + i + 1]
            best = None
            for a, (table, swap) in enumerate(zip(tables, swaps)):
                start = time.perf_counter()
                logits = self.step(pool, [table], [swap], [token])[0]
                if swap is not None:  # a block the decode filled goes to its file, as the engine's
                    self.keep_to_budget(pool, swap, directory / f"arm{a - 1}")
                seconds[a] += time.perf_counter() - start
                logp = logits - mx.logsumexp(logits)
                nll[a] -= float(logp[target])
                choice = int(mx.argmax(logits).item())
                best = choice if a == 0 else best
                top1[a] += choice == best
        rows = []
        for a in range(1, len(tables)):
            label, rank, _, _ = arms[a - 1]
            rows.append(
                self._row(
                    name,
                    label,
                    rank,
                    swaps[a],
                    decode,
                    seconds[0],
                    seconds[a],
                    float(np.exp(nll[0] / decode)),
                    float(np.exp(nll[a] / decode)),
                    top1[a] / decode,
                )
            )
        if cold:
            tokens = ids[prefix + decode : prefix + decode + extra]
            rows += self._cold_rows(name, pool, tables, swaps, arms, tokens)
        for swap in swaps[1:]:
            swap.release()
        base.release()
        return rows

    def _row(self, name, label, rank, swap, steps, ram_s, swap_s, ppl_ram, ppl_swap, agree):
        stats = swap.stats()
        demanded = stats["hits"] + stats["misses"]
        return {
            "test": name,
            "arm": label,
            "rank": rank,
            "ram_tps": round(steps / ram_s, 1),
            "swap_tps": round(steps / swap_s, 1),
            "speed_ratio": round(ram_s / swap_s, 3),
            "ppl_ram": round(ppl_ram, 3),
            "ppl_swap": round(ppl_swap, 3),
            "ppl_ratio": round(ppl_swap / ppl_ram, 4),
            "top1_pct": round(100 * agree, 1),
            "resident_kv_mb": round(self._resident_bytes(swap) / 1e6, 2),
            "all_kv_mb": round(self._all_bytes(swap) / 1e6, 2),
            "low_rank_mb": round(swap.swapset.resident_bytes / 1e6, 2),
            "read_kb_per_token": round(stats["bytes_read"] / steps / 1e3, 1),
            "hit_pct": round(100 * stats["hits"] / max(demanded, 1), 1),
            "select_ms_per_token": round(stats["select_ns"] / steps / 1e6, 2),
            **_read_figures(stats, steps, swap_s),
        }

    def _resident_bytes(self, swap) -> int:
        """KV held in memory for the swapped agent: its staging and resident blocks."""
        return swap.resident_tokens() * self.spec.bytes_per_token(self.quant)

    def _all_bytes(self, swap) -> int:
        return swap.table.length * self.spec.bytes_per_token(self.quant)

    def _cold_rows(self, name, pool, tables, swaps, arms, tokens):
        """Each swapped arm with its block files dropped from the page cache before every
        step, the arms and the in-memory table in turn."""
        before = [s.stats() if s is not None else None for s in swaps]
        seconds = [0.0] * len(tables)
        for token in tokens:
            for swap in swaps[1:]:
                drop_page_cache(swap.files)
            for a in range(len(tables)):
                begin = time.perf_counter()
                self.step(pool, [tables[a]], [swaps[a]], [token])
                seconds[a] += time.perf_counter() - begin
        n = max(len(tokens), 1)
        rows = []
        for a in range(1, len(tables)):
            after = swaps[a].stats()
            stats = {k: after[k] - before[a][k] for k in after}
            rows.append(
                {
                    "test": name,
                    "arm": f"{arms[a - 1][0]}, cold page cache",
                    "rank": arms[a - 1][1],
                    "ram_tps": round(n / max(seconds[0], 1e-9), 1),
                    "swap_tps": round(n / max(seconds[a], 1e-9), 1),
                    "speed_ratio": round(seconds[0] / max(seconds[a], 1e-9), 3),
                    "read_kb_per_token": round(stats["bytes_read"] / n / 1e3, 1),
                    **_read_figures(stats, n, seconds[a]),
                    "steps": len(tokens),
                }
            )
        return rows

    def agents_row(self, directory, count, context, budget, rank, steps):
        import mlx.core as mx

        from agentkv.format.geometry import blocks_for
        from agentkv.store.block_files import SharedBlocks

        from .common import synthetic_table

        full = blocks_for(context + steps)
        staging = budget // 256 - 1
        pool = self.pool(2 * full + count * (staging + 2))
        # Swapped: every agent built in turn, written to block files and evicted.
        swaps, stored = [], []
        for i in range(count):
            table = synthetic_table(pool, context, seed=i + 1)
            shared = SharedBlocks(directory / f"a{i}", self.spec, self.quant)
            with shared.writing():
                stored.append(shared.ensure_pool_blocks(pool, table.blocks[: context // 256]))
            swaps.append(self.swap(pool, table, directory / f"a{i}", budget, rank))
            pool.blocks.drop_cached()
        tables = [s.table for s in swaps]
        start = time.perf_counter()
        for i in range(steps):
            self.step(pool, tables, swaps, [100 + i] * count)
        swapped_s = time.perf_counter() - start
        resident = sum(self._resident_bytes(s) for s in swaps)
        for s in swaps:
            s.release()
        mx.clear_cache()
        # Evict and reload: two agents at a time read back in full from their block files.
        reload_s = 0.0
        for pair in range(0, count, 2):
            start = time.perf_counter()
            loaded = [_reload(pool, stored[i], i + 1) for i in range(pair, min(pair + 2, count))]
            for i in range(steps):
                self.step(pool, loaded, [None] * len(loaded), [100 + i] * len(loaded))
            reload_s += time.perf_counter() - start
            for table in loaded:
                table.release()
        return {
            "test": f"{count} agents x {context} tokens, pool holds 2",
            "arm": "swap, all batched",
            "rank": rank,
            "swap_tps": round(count * steps / swapped_s, 1),
            "ram_tps": round(count * steps / reload_s, 1),
            "speed_ratio": round(reload_s / swapped_s, 3),
            "resident_kv_mb": round(resident / 1e6, 2),
            "pool_mb": round(pool.capacity * pool.arena.block_bytes / 1e6, 1),
            "steps": steps,
            "whole_agent_evictions": 0,
        }


def _read_figures(stats: dict, steps: int, seconds: float) -> dict:
    """Reads per token: their time (on either thread), the share of it hidden behind
    compute (read ahead while the layer before computed), the model thread's wait as a
    share of the step, the share of layer steps whose groups were read ahead, and the
    groups the page cache could not give."""
    read, wait = stats["read_ns"], stats["wait_ns"]
    return {
        "read_ms_per_token": round(read / steps / 1e6, 2),
        "read_hidden_pct": round(max(0.0, 100 * (read - wait) / read), 1) if read else None,
        "read_share_pct": round(100 * wait / 1e9 / seconds, 1),
        "read_ahead_pct": round(100 * stats["predicted"] / max(stats["steps"], 1), 1),
        "disk_reads_per_token": round(stats["disk_reads"] / steps, 1),
    }


def _prefill(model, spec, pool, table, ids, chunk: int = 512) -> None:
    import mlx.core as mx

    from agentkv.pool.step import PagedStep

    for c0 in range(0, len(ids), chunk):
        part = ids[c0 : c0 + chunk]
        table.grow(len(part), pool.arena.copy_rows)
        step = PagedStep(pool.arena, spec, [table], len(part))
        model(mx.array([part]), cache=step.caches)
        pool.arena.settle()
        table.written(part)


def _reload(pool, files, seed: int):
    """A synthetic agent's table read back in full from its block files (today's reload of
    a dropped agent)."""
    table = pool.new_table(pool.seed(f"bench-{seed}"))
    refs, regions = [], []
    for i, f in enumerate(files):
        block = pool.blocks.allocate()
        table.attach(block, f.tokens)
        refs.append((f.path, f.size, f.header_crc, f.layout))
        regions.append((i, f.offset, f.length, f.checksum, len(f.tokens), block))
    pool.arena.read_regions(refs, regions)
    table.seal_full()
    return table


def drop_page_cache(files) -> None:
    """Drop each block file (``.path``) from the page cache, so its next reads go to disk.
    The kernel drops clean pages only, so each file is flushed first: a page still dirty or
    under writeback would stay and answer a "cold" read from memory."""
    for f in files:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memory_rows(context: int, budget: int, decode: int) -> list[dict]:
    """The memory arms (module docstring): all in memory and swapped, each turn in a
    process of its own, alternating; a row per arm (its median) and the comparison."""
    runs = {"in memory": [], "swapped": []}
    pool_bytes = None  # the swapped arm's: half the turn's blocks (it cannot hold the turn)
    for repeat in range(MEMORY_REPEATS):
        for arm in runs:
            progress(f"kvswap: memory, {arm} ({repeat + 1} of {MEMORY_REPEATS})...")
            swapped = arm == "swapped"
            result = _memory_process(context, budget, decode, pool_bytes if swapped else None)
            runs[arm].append(result)
            pool_bytes = pool_bytes or context // BLOCK_TOKENS // 2 * result["block_bytes"]
    rows = []
    for arm, results in runs.items():
        rss = sorted(r["peak_rss_mb"] for r in results)
        tps = sorted(r["decode_tps"] for r in results)
        prefill = sorted(r["prefill_s"] for r in results)
        rows.append(
            {
                "arm": f"memory: {arm}",
                "peak_rss_mb": rss[len(rss) // 2],
                "peak_rss_mb_each": [r["peak_rss_mb"] for r in results],
                "decode_tps": tps[len(tps) // 2],
                "decode_tps_each": [r["decode_tps"] for r in results],
                "prefill_s": prefill[len(prefill) // 2],
                "prompt_tokens": results[0]["prompt_tokens"],
                "generated": results[0]["generated"],
                "pool_blocks": results[0]["pool_blocks"],
                "kv_mb": results[0]["kv_mb"],
            }
        )
    mem, swap = rows
    saving = mem["peak_rss_mb"] - swap["peak_rss_mb"]
    rows.append(
        {
            "arm": "memory: swapped against in memory",
            "rss_saving_mb": round(saving, 1),
            "rss_saving_of_kv": round(saving / mem["kv_mb"], 3),
            "decode_ratio": round(swap["decode_tps"] / mem["decode_tps"], 3),
        }
    )
    return rows


def _memory_process(context: int, budget: int, decode: int, pool_bytes: int | None) -> dict:
    """One arm's turn in a child process (swapped where ``pool_bytes`` is given); its peak
    RSS from its rusage (``os.wait4``)."""
    swapped = pool_bytes is not None
    args = json.dumps([context, budget, decode, pool_bytes])
    code = (
        "import json; from agentkv.benchmarks.kvswap import memory_arm; "
        f"memory_arm(*json.loads({args!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        arm = "swapped" if swapped else "in-memory"
        raise SystemExit(f"agentkv: error: the {arm} arm failed")
    result = json.loads(out)
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    result["peak_rss_mb"] = round(usage.ru_maxrss * unit / 2**20, 1)
    return result


def memory_arm(context: int, budget: int, decode: int, pool_bytes: int | None) -> None:
    """The child of ``_memory_process``: one turn, its figures as JSON on stdout."""
    from agentkv import Engine

    from .kv_candidates import texts

    with tempfile.TemporaryDirectory(prefix="agentkv-bench-kvswap-memory-") as tmp:
        options = {"cache_dir": Path(tmp), "draft_tokens": 0}
        if pool_bytes is not None:
            options.update(kv_swap_budget=budget, pool_bytes=pool_bytes)
        eng = Engine(**options)
        block = eng.pool.block_bytes
        kv_mb = context * block / BLOCK_TOKENS / 2**20
        pool_blocks = eng.pool.capacity
        tok = eng.loaded.tokenizer
        ids = tok.encode(next(iter(texts().values())))[: context - decode]
        result = eng.generate("long", tok.decode(ids), max_tokens=decode)
        eng.close()
    print(
        json.dumps(
            {
                "prompt_tokens": result.stats.prompt_tokens,
                "generated": result.stats.generated_tokens,
                "prefill_s": round(result.stats.prefill_ms / 1000, 2),
                "decode_tps": round(result.stats.decode_tps, 1),
                "pool_blocks": pool_blocks,
                "kv_mb": round(kv_mb, 1),
                "block_bytes": block,
            }
        )
    )
