"""Reload: agentkv load-to-ready vs mlx-lm's load_prompt_cache vs the page-cache limit.

For each size, the same Q4 cache content (the embedded model's geometry: 30
layers, 3 KV heads, head dim 64; synthetic values: load time does not depend on
them) is stored twice: as an agentkv agent and as an mlx-lm prompt-cache file
of QuantizedKVCache layers; ``agentkv_load_prompt_cache_ms`` is that mlx-lm
file read by ``agentkv.load_prompt_cache`` (same result as mlx-lm's loader).
Both are loaded alternately ``repeats`` times from the page cache, each until
every array is materialized (mlx-lm's loads are lazy until evaluated).
``page_cache_read_ms`` is the time to read() the agentkv files into a reused
buffer, measured in the same rotation: their bytes over this machine's
sequential page-cache read bandwidth. Medians; ``*_first_*`` is the first load
of each size (fresh buffers, files not yet mapped).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .common import emit, median_ms, progress, timed


def _synthetic_caches(spec, quant, tokens: int, seed: int):
    from agentkv.kv.cache import AgentKVCache

    mx.random.seed(seed)
    caches = []
    for layer in spec.layers:
        cache = AgentKVCache(quant, window=layer.window)
        for start in range(0, tokens, 2048):
            n = min(2048, tokens - start)
            k = mx.random.normal((1, spec.kv_heads, n, spec.key_head_dim))
            v = mx.random.normal((1, spec.kv_heads, n, spec.value_head_dim))
            cache.update_and_fetch(k, v)
            mx.eval(cache.components)
        caches.append(cache)
    return caches


def _mlx_lm_caches(caches):
    from mlx_lm.models.cache import QuantizedKVCache

    out = []
    for c in caches:
        q = QuantizedKVCache(group_size=c.quant.group_size, bits=c.quant.key_bits)
        keys, values = c.keys_and_values()
        q.keys, q.values, q.offset = tuple(keys), tuple(values), c.offset
        out.append(q)
    return out


def run(token_counts: list[int], repeats: int = 10, as_json: bool = False) -> list[dict]:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from agentkv import load_prompt_cache as agentkv_load_prompt_cache
    from agentkv.kv.quant import KVQuant
    from agentkv.model.load import load_model
    from agentkv.store.agent_store import AgentStore, DurableState, build_save_job

    progress("reload: loading the embedded model for its cache geometry...")
    spec = load_model().spec
    quant = KVQuant(4, 4, 64)
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-reload-") as tmp:
        store = AgentStore(Path(tmp) / "kv", spec, "bench")
        store.ensure_layout()
        for tokens in token_counts:
            progress(f"reload: {tokens} tokens: building the cache...")
            caches = _synthetic_caches(spec, quant, tokens, seed=tokens)
            agent = f"reload-{tokens}"
            ids = np.zeros(tokens, dtype=np.int32)
            ends = np.arange(1, tokens + 1)
            spans = np.stack([ends - 1, ends], axis=1)
            job = build_save_job(
                spec,
                agent,
                caches,
                tokens=ids,
                spans=spans,
                text=b"x" * tokens,
                messages=None,
                first_block=0,
            )
            store.write(job, DurableState())
            mlx_file = Path(tmp) / f"mlx-lm-{tokens}.safetensors"
            save_prompt_cache(str(mlx_file), _mlx_lm_caches(caches))
            del caches, job

            def agentkv_load(agent=agent):
                manifest, _ = store.read_manifest(agent)
                loaded = store.load_caches(manifest, agent, manifest.token_count)
                mx.eval([x for c in loaded for x in c.components])
                return loaded

            def mlx_lm_load(mlx_file=mlx_file):
                loaded = load_prompt_cache(str(mlx_file))
                mx.eval([(c.keys, c.values) for c in loaded])
                return loaded

            def same_file_through_agentkv(mlx_file=mlx_file):
                loaded = agentkv_load_prompt_cache(str(mlx_file))
                mx.eval([(c.keys, c.values) for c in loaded])
                return loaded

            files = sorted(store.agent_dir(agent).glob("seg-*.safetensors"))
            files.append(store.agent_dir(agent) / "manifest.safetensors")
            for f in files + [mlx_file]:
                f.read_bytes()  # both files in the page cache before timing
            buffer = bytearray(max(f.stat().st_size for f in files))

            def read_files(files=files, buffer=buffer):
                for f in files:
                    with open(f, "rb", buffering=0) as fh:
                        fh.readinto(buffer)

            ours, theirs, reads, compat = [], [], [], []
            for _ in range(repeats):  # in rotation, so each runs after the others' traffic
                ours.append(timed(agentkv_load)[0])
                theirs.append(timed(mlx_lm_load)[0])
                reads.append(timed(read_files)[0])
                compat.append(timed(same_file_through_agentkv)[0])
            cache_bytes = sum(f.stat().st_size for f in files)
            gbps = cache_bytes / median_ms(reads) / 1e6
            row = {
                "tokens": tokens,
                "kv_bits": 4,
                "cache_bytes": cache_bytes,
                "agentkv_load_ms": median_ms(ours),
                "mlx_lm_load_ms": median_ms(theirs),
                "page_cache_read_ms": round(cache_bytes / gbps / 1e6, 3),
                "agentkv_first_load_ms": round(ours[0] * 1000, 3),
                "mlx_lm_first_load_ms": round(theirs[0] * 1000, 3),
                "mlx_lm_file_bytes": mlx_file.stat().st_size,
                "agentkv_load_prompt_cache_ms": median_ms(compat),
                "page_cache_gbps": round(gbps, 2),
            }
            row["speedup_vs_mlx_lm"] = round(row["mlx_lm_load_ms"] / row["agentkv_load_ms"], 2)
            row["vs_read_limit"] = round(row["agentkv_load_ms"] / row["page_cache_read_ms"], 2)
            rows.append(row)
            progress(
                f"reload: {tokens} tokens: agentkv {row['agentkv_load_ms']} ms, "
                f"mlx-lm {row['mlx_lm_load_ms']} ms, read limit {row['page_cache_read_ms']} ms"
            )
    emit("reload", rows, as_json, {"repeats": repeats})
    return rows
