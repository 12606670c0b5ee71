"""Reload: agentkv load-to-ready vs mlx-lm's load_prompt_cache vs the page-cache limit.

For each size and KV format (1; 2 with 4-bit keys in every layer; and 2 as the engine
stores it, with 8-bit keys in the embedded model's wide layers 18 and 19; a format-2
manifest also carries the float16 keys of the channel group still filling), the same Q4
cache content (the
embedded model's geometry: 30 layers, 3 KV heads, head dim 64; synthetic values: load time
does not depend on them) is stored twice: as an agentkv agent (its complete blocks in shared block
files, its tail in a segment) and as an mlx-lm prompt-cache file of
QuantizedKVCache layers; ``agentkv_load_prompt_cache_ms`` is that mlx-lm file
read by ``agentkv.load_prompt_cache`` (same result as mlx-lm's loader).
agentkv's load is what a warm resume does: read the manifest and copy every
block into a pool slot (checked), ready for attention. Every format of a size is
loaded in one rotation, ``repeats`` times from the page cache, each until every array is
materialized (mlx-lm's loads are lazy until evaluated); agentkv's file mappings are dropped
before each of its loads (``_ext.clear_mappings``), so it maps its files again every time,
as mlx-lm opens its file every time and as a new process would. ``page_cache_read_ms``
is the time to read() the agentkv files into a reused buffer, measured in the
same rotation: their bytes over this machine's sequential page-cache read
bandwidth. Medians; ``*_first_*`` is the first load of each size (files not yet
mapped).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .common import emit, median_ms, progress, synthetic_table, timed


def _mlx_lm_caches(pool, table):
    """The table's KV as mlx-lm QuantizedKVCache layers (what mlx-lm would have saved; a
    wide layer's 8-bit keys sit beside 4-bit values under ``bits=8``: a file to time loads
    of the same bytes, not one to generate with)."""
    from mlx_lm.models.cache import QuantizedKVCache

    from agentkv.format.geometry import BLOCK_TOKENS

    heads, n = pool.spec.kv_heads, table.length
    t = np.arange(n)
    blocks = np.asarray(table.blocks, dtype=np.int64)[t // BLOCK_TOKENS]
    rows = (blocks[None, :] * heads + np.arange(heads)[:, None]) * BLOCK_TOKENS + t % BLOCK_TOKENS
    rows = mx.array(rows.reshape(-1))
    out = []
    for layer, quant in zip(pool.arena.arrays, pool.arena.layer_quants):
        parts = [mx.take(a, rows, axis=0).reshape(1, heads, n, -1) for a in layer]
        q = QuantizedKVCache(group_size=quant.group_size, bits=quant.key_bits)
        q.keys, q.values, q.offset = tuple(parts[:3]), tuple(parts[3:]), n
        out.append(q)
    return out


def run(token_counts: list[int], repeats: int = 10, as_json: bool = False) -> list[dict]:
    from agentkv import _ext
    from agentkv.engine import EngineConfig
    from agentkv.engine.engine import kv_format_for
    from agentkv.format.quant import V1, V2, KVQuant
    from agentkv.model.load import load_model

    progress("reload: loading the embedded model for its cache geometry...")
    loaded = load_model()
    spec = loaded.spec
    rows = []
    formats = [
        KVQuant(4, 4, 64, **V1),
        KVQuant(4, 4, 64, **V2),
        kv_format_for(EngineConfig(), loaded),  # the engine's: format 2 with its wide layers
    ]
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-reload-") as tmp:
        for tokens in token_counts:
            cases = []
            for i, quant in enumerate(formats):
                progress(f"reload: {tokens} tokens, {quant.label}: building the cache...")
                cases.append(_Case(Path(tmp) / f"{tokens}-{i}", spec, quant, tokens))
            timings = [{"ours": [], "theirs": [], "reads": [], "compat": []} for _ in cases]
            for _ in range(repeats):  # in rotation: each runs after every other's traffic
                for case, t in zip(cases, timings):
                    _ext.clear_mappings()  # every repeat maps its files again, as a restart does
                    t["ours"].append(timed(case.agentkv_load)[0])
                    t["theirs"].append(timed(case.mlx_lm_load)[0])
                    t["reads"].append(timed(case.read_files)[0])
                    t["compat"].append(timed(case.same_file_through_agentkv)[0])
            for case, t in zip(cases, timings):
                rows.append(case.row(t))
                row = rows[-1]
                progress(
                    f"reload: {case.quant.label}, {tokens} tokens: "
                    f"agentkv {row['agentkv_load_ms']} ms, "
                    f"mlx-lm {row['mlx_lm_load_ms']} ms, read limit {row['page_cache_read_ms']} ms"
                )
    emit("reload", rows, as_json, {"repeats": repeats})
    return rows


class _Case:
    """One cache (size, format) stored both ways under ``root``, and its timed loads."""

    def __init__(self, root: Path, spec, quant, tokens: int):
        from mlx_lm.models.cache import save_prompt_cache

        from agentkv.format.geometry import BLOCK_TOKENS
        from agentkv.pool import KVPool
        from agentkv.store.agent_store import AgentStore, DurableState, build_save_job

        self.quant, self.tokens = quant, tokens
        root.mkdir(parents=True)
        self.store = store = AgentStore(root / "kv", spec, "bench", quant)
        store.ensure_layout()
        block_count = -(-tokens // BLOCK_TOKENS)
        pool = KVPool(
            spec, quant, pool_bytes=(block_count + 1) * BLOCK_TOKENS * spec.bytes_per_token(quant)
        )
        table = synthetic_table(pool, tokens, seed=tokens)
        self.agent = agent = f"reload-{tokens}"
        ends = np.arange(1, tokens + 1)
        job = build_save_job(
            pool.arena,
            table,
            agent_id=agent,
            keep=0,
            tokens=table.token_ids(),
            spans=np.stack([ends - 1, ends], axis=1),
            text=b"x" * tokens,
            messages=None,
        )
        store.write(job, DurableState())
        self.mlx_file = root / f"mlx-lm-{tokens}.safetensors"
        save_prompt_cache(str(self.mlx_file), _mlx_lm_caches(pool, table))
        table.release()
        self.loader = KVPool(spec, quant, pool_bytes=pool.budget_bytes)  # the resuming process
        manifest, _ = store.read_manifest(agent)
        self.files = [store.file_path(agent, name) for name in sorted(manifest.segments)]
        self.files.append(store.agent_dir(agent) / "manifest.safetensors")
        for f in self.files + [self.mlx_file]:
            f.read_bytes()  # every file in the page cache before timing
        self.buffer = bytearray(max(f.stat().st_size for f in self.files))

    def agentkv_load(self):
        """What a warm resume does: the manifest, then every block into a pool slot."""
        from agentkv.format.geometry import BLOCK_TOKENS

        loader, store, agent = self.loader, self.store, self.agent
        manifest, _ = store.read_manifest(agent)
        count = -(-manifest.token_count // BLOCK_TOKENS)
        sources = store.block_sources(manifest, agent, count)
        slots = [loader.blocks.allocate() for _ in sources]
        store.read_into(loader.arena, agent, list(zip(sources, slots)))
        if manifest.tail is not None:  # format 2: the filling group's keys
            tail = loader.arena.take_tail()
            loader.arena.write_tail(tail, manifest.tail)
            loader.arena.give_tail(tail)
        loader.blocks.release_all(slots)
        return slots

    def mlx_lm_load(self):
        from mlx_lm.models.cache import load_prompt_cache

        loaded = load_prompt_cache(str(self.mlx_file))
        mx.eval([(c.keys, c.values) for c in loaded])
        return loaded

    def same_file_through_agentkv(self):
        from agentkv import load_prompt_cache

        loaded = load_prompt_cache(str(self.mlx_file))
        mx.eval([(c.keys, c.values) for c in loaded])
        return loaded

    def read_files(self):
        for f in self.files:
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(self.buffer)

    def row(self, t: dict) -> dict:
        cache_bytes = sum(f.stat().st_size for f in self.files)
        gbps = cache_bytes / median_ms(t["reads"]) / 1e6
        row = {
            "tokens": self.tokens,
            "kv_bits": 4,
            "kv_format": self.quant.version,
            "format": self.quant.label,
            "cache_bytes": cache_bytes,
            "agentkv_load_ms": median_ms(t["ours"]),
            "mlx_lm_load_ms": median_ms(t["theirs"]),
            "page_cache_read_ms": round(cache_bytes / gbps / 1e6, 3),
            "agentkv_first_load_ms": round(t["ours"][0] * 1000, 3),
            "mlx_lm_first_load_ms": round(t["theirs"][0] * 1000, 3),
            "mlx_lm_file_bytes": self.mlx_file.stat().st_size,
            "agentkv_load_prompt_cache_ms": median_ms(t["compat"]),
            "page_cache_gbps": round(gbps, 2),
        }
        row["speedup_vs_mlx_lm"] = round(row["mlx_lm_load_ms"] / row["agentkv_load_ms"], 2)
        row["vs_read_limit"] = round(row["agentkv_load_ms"] / row["page_cache_read_ms"], 2)
        return row
