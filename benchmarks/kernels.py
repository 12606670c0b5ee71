"""Kernels: merge / extract of Q4 caches vs the pure-MLX reference vs mlx-lm fp16.

All 30 layers of the embedded model's geometry (3 KV heads, head dim 64), 4-bit
group 64, random bits. For B agents with lengths spread over 512-4096 tokens:

* merge: the agents' caches -> one left-padded batch (agentkv kernels on CPU vs
  the same operation in MLX ops vs mlx-lm's ``BatchKVCache.merge`` on float16
  caches of the same lengths, the format mlx-lm can batch);
* extract: every row of that batch back to its agent (vs ``BatchKVCache.extract``);

``bytes`` counts bytes read plus bytes written (``mlx_lm_fp16_bytes`` mlx-lm's, 3.6x as
many: ``vs_mlx_lm_fp16`` compares times, ``vs_mlx_lm_fp16_per_byte`` bytes per second);
``memcpy_gbps`` is this machine's copy bandwidth measured in the same run. Medians of
``repeats``.

* attention: one decode step of one layer (9 query heads over 3 KV heads, as the embedded
  model) over the block pool, B agents of ``context`` tokens each, KV format 1 and 2 at 4 bits:
  the fused CPU kernel production runs (csrc/core/attention*) vs the shared body
  kernels/paged_attention.metal compiled for CPU (what Metal and CUDA run) vs the pure-MLX
  reference; ``kv_gbps`` is KV bytes read per second by the fused kernel.
"""

from __future__ import annotations

import numpy as np

from .common import emit, median_ms, memcpy_gbps, progress, timed

LAYERS, HEADS, DIM = 30, 3, 64


def _agent(comps, tokens: int, seed: int):
    from agentkv.format.geometry import BLOCK_TOKENS as STEP

    rng = np.random.default_rng(seed)
    capacity = (tokens + STEP - 1) // STEP * STEP + STEP
    import mlx.core as mx

    layers = []
    for _ in range(LAYERS):
        arrays = []
        for c in comps:
            width = c.width
            if c.dtype == "uint32":
                a = mx.array(rng.integers(0, 2**32, (1, c.heads, capacity, width), dtype=np.uint32))
            else:
                bits = rng.integers(0, 2**16, (1, c.heads, capacity, width), dtype=np.uint16)
                a = mx.view(mx.array(bits), mx.float16)
            arrays.append(a)
        layers.append(tuple(arrays))
    return layers


def _fp16(tokens: int, seed: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    out = []
    for _ in range(LAYERS):
        c = KVCache()
        x = mx.random.normal((1, HEADS, tokens, DIM)).astype(mx.float16)
        c.update_and_fetch(x, x)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def run(batches=(2, 4, 8), repeats: int = 5, as_json: bool = False) -> list[dict]:
    from agentkv.format.quant import KVQuant

    comps = KVQuant(4, 4, 64).components(HEADS, DIM, DIM)
    copy_bw = memcpy_gbps()
    rows = []
    cases = [(b, [int(x) for x in np.linspace(512, 4096, b)]) for b in batches]
    cases.append((4, [4096] * 4))
    for batch, lengths in cases:
        progress(f"kernels: {batch} agents, {lengths[0]}-{lengths[-1]} tokens")
        rows += _case(comps, batch, lengths, repeats, copy_bw)
    for version in (1, 2):
        for batch, context in ((1, 1024), (1, 4096), (4, 4096)):
            progress(f"kernels: attention, format {version}, {batch} x {context} tokens")
            rows.append(_attention_case(version, batch, context, repeats, copy_bw))
    emit("kernels", rows, as_json)
    return rows


def _attention_case(version: int, batch: int, context: int, repeats: int, copy_bw: float):
    import mlx.core as mx

    from agentkv import kernels
    from agentkv.format.geometry import BLOCK_TOKENS, blocks_for
    from agentkv.format.quant import V1, V2, KVQuant
    from agentkv.kernels import cpu, reference

    quant = KVQuant(4, 4, 64, **(V1 if version == 1 else V2))
    rng = np.random.default_rng(version * 100 + batch)
    per_row = blocks_for(context)
    rows_total = batch * per_row * HEADS * BLOCK_TOKENS

    def component(c):
        shape = (rows_total, c.width)
        if c.dtype == "uint32":
            return mx.array(rng.integers(0, 2**32, shape, dtype=np.uint32))
        return mx.array(rng.uniform(-0.05, 0.05, shape).astype(np.float16))

    comps = quant.components(HEADS, DIM, DIM)
    arrays = tuple(component(c) for c in comps)
    keys, values = arrays[: quant.key_parts], arrays[quant.key_parts :]
    tables = mx.array(np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row))
    ct = quant.channel_tokens if quant.channel_keys else 0
    tail = tail_slots = None
    if ct:
        tail = mx.array(rng.standard_normal((batch * HEADS * ct, DIM)).astype(np.float16))
        tail_slots = mx.arange(batch, dtype=mx.int32)
    paged = kernels.PagedQuery(
        keys, values, tables, mx.full((batch,), context, mx.int32), HEADS, BLOCK_TOKENS,
        4, 4, 64, 0, None, ct, tail, tail_slots,
    )  # fmt: skip
    q = mx.array(rng.standard_normal((batch, 3 * HEADS, 1, DIM)).astype(np.float32))
    mx.eval(arrays, q)

    def run(fn):
        return lambda: mx.eval(fn(q, paged, scale=0.125))

    arms = {
        "fused": run(cpu.fused_paged_attention),
        "body": run(cpu.paged_attention),
        "reference": run(reference.paged_attention),
    }
    times = {name: [] for name in arms}
    for _ in range(repeats):  # in rotation
        for name, fn in arms.items():
            times[name].append(timed(fn)[0])
    kv_bytes = batch * context * HEADS * sum(c.row_bytes for c in comps)
    fused_s = float(np.median(times["fused"]))
    return {
        "op": "attention",
        "kv_format": quant.label,
        "agents": batch,
        "context": context,
        "fused_ms": median_ms(times["fused"]),
        "shared_body_ms": median_ms(times["body"]),
        "reference_ms": median_ms(times["reference"]),
        "body_over_fused": round(float(np.median(times["body"])) / fused_s, 2),
        "kv_gbps": round(kv_bytes / fused_s / 1e9, 2),
        "memcpy_gbps": round(copy_bw, 2),
    }


def _case(comps, batch: int, lengths: list[int], repeats: int, copy_bw: float) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from agentkv import kernels
    from agentkv.format.geometry import BLOCK_TOKENS as STEP
    from agentkv.kernels import ExtractRow, RowSource

    per_token = sum(c.heads * c.row_bytes for c in comps) * LAYERS
    fp16_per_token = LAYERS * HEADS * DIM * 2 * 2  # keys and values, 2 bytes each
    agents = [_agent(comps, n, seed=i) for i, n in enumerate(lengths)]
    fp16 = [_fp16(n, seed=i) for i, n in enumerate(lengths)]
    mx.eval(agents)
    used = max(lengths)
    capacity = (used + STEP - 1) // STEP * STEP + STEP
    tokens_total = sum(lengths)

    def measure(fn, backend=None):
        if backend is None:
            fn()
            return [timed(fn)[0] for _ in range(repeats)]
        with kernels.use_backend(backend):
            return measure(fn)

    def merge_all():
        out = [
            kernels.merge(
                [RowSource(a[layer], 0, 0, n) for a, n in zip(agents, lengths)],
                used=used,
                capacity=capacity,
            )
            for layer in range(LAYERS)
        ]
        mx.eval(out)
        return out

    def mlx_lm_merge():
        out = [BatchKVCache.merge([f[layer] for f in fp16]) for layer in range(LAYERS)]
        mx.eval([c.state for c in out])
        return out

    rows = [
        _row(
            "merge",
            batch,
            tokens_total,
            tokens_total * per_token + batch * capacity * per_token,
            measure(merge_all, "cpu"),
            measure(merge_all, "reference"),
            measure(mlx_lm_merge),
            copy_bw,
            (tokens_total + batch * used) * fp16_per_token,  # mlx-lm pads to the longest
        )
    ]

    with kernels.use_backend("cpu"):
        merged = merge_all()
    batched_fp16 = mlx_lm_merge()
    specs = [
        ExtractRow(i, used - n, n, (n + STEP - 1) // STEP * STEP + STEP)
        for i, n in enumerate(lengths)
    ]

    def extract_all():
        out = [kernels.extract_rows(merged[layer], specs) for layer in range(LAYERS)]
        mx.eval(out)
        return out

    def mlx_lm_extract():
        out = [c.extract(i) for c in batched_fp16 for i in range(batch)]
        mx.eval([c.state for c in out])
        return out

    rows.append(
        _row(
            "extract",
            batch,
            tokens_total,
            2 * tokens_total * per_token,
            measure(extract_all, "cpu"),
            measure(extract_all, "reference"),
            measure(mlx_lm_extract),
            copy_bw,
            2 * tokens_total * fp16_per_token,
        )
    )

    return rows


def _row(op, batch, tokens_total, nbytes, ours, ref, theirs, copy_bw, their_bytes=None) -> dict:
    """``their_bytes``: what mlx-lm's float16 caches move for the same operation (3.6x the
    bytes of 4-bit): ``vs_mlx_lm_fp16`` compares times, ``vs_mlx_lm_fp16_per_byte`` bytes
    moved per second."""
    row = {
        "op": op,
        "batch": batch,
        "tokens_total": tokens_total,
        "bytes": nbytes,
        "agentkv_ms": median_ms(ours),
        "reference_ms": median_ms(ref),
        "mlx_lm_fp16_ms": median_ms(theirs) if theirs else None,
        "memcpy_gbps": round(copy_bw, 2),
    }
    row["agentkv_gbps"] = round(nbytes / row["agentkv_ms"] / 1e6, 2)
    row["vs_reference"] = round(row["reference_ms"] / row["agentkv_ms"], 2)
    if theirs:
        row["vs_mlx_lm_fp16"] = round(row["mlx_lm_fp16_ms"] / row["agentkv_ms"], 2)
        row["mlx_lm_fp16_bytes"] = their_bytes
        row["mlx_lm_fp16_gbps"] = round(their_bytes / row["mlx_lm_fp16_ms"] / 1e6, 2)
        row["vs_mlx_lm_fp16_per_byte"] = round(row["agentkv_gbps"] / row["mlx_lm_fp16_gbps"], 2)
    row["memcpy_fraction"] = round(row["agentkv_gbps"] / copy_bw, 2)
    progress(
        f"kernels: {op} x{batch}: agentkv {row['agentkv_ms']} ms ({row['agentkv_gbps']} GB/s), "
        f"reference {row['reference_ms']} ms, mlx-lm fp16 {row['mlx_lm_fp16_ms']} ms"
    )
    return row
