"""A GPU's whole path through the engine, run on the CPU with the kernels' real bodies.

``emulated_gpu(monkeypatch)`` makes this process look like one with a CUDA device to
agentkv: ``mx.default_device()`` says GPU (MLX itself still computes on the CPU), the kernel
backend is "cuda", and every custom kernel ``kernels/gpu.py`` would hand MLX
(``gpu._kernel``) runs instead through the CPU build of the same body (``_ext.kernel_*``,
csrc/kernels_cpu.cpp: each threadgroup's lanes as a loop). So an engine made inside it takes
every GPU-only branch the engine has: the paged kernel and its merge pass at decode, the
dense prefill path with the gathering kernel, the store and group kernels, non-lazy arenas
read through staging copies, the pipelined decode loop, the GPU's chunk sizes and warm-up.

What it checks on the way, on every call: that the inputs ``gpu.py`` assembles are what
each body reads (the CPU builds check every index they follow, where a GPU would read
garbage), and that the launch covers what the body expects (the grid and threadgroup a GPU
would get). What it cannot check: the GPU's own compiler, timings, memory spaces.
"""

from __future__ import annotations

import collections
import math

import mlx.core as mx
import numpy as np

from agentkv import _ext
from agentkv.kernels import gpu
from agentkv.kernels.cpu import THREADS

CALLS: collections.Counter = collections.Counter()  # the kernels run, by name
PROLOGUES: collections.Counter = collections.Counter()  # store_rows calls that roped queries


def emulated_gpu(monkeypatch) -> None:
    """Patch this process into the emulated GPU (module docstring) until the test ends.
    Import what reads the device at import time (mlx-lm's generate module) before."""
    import mlx_lm.generate  # noqa: F401  (makes a stream for the default device on import)
    from mlx_lm.utils import dequantize_model

    from agentkv.model import load

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(gpu, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu, "metal_available", lambda: False)
    monkeypatch.setattr(gpu, "_kernel", _emulated_kernel)
    load_model = load.mlx_adapter.load

    def load_float32(target):
        # MLX's CPU quantized matmul runs on one thread and float16 matmuls crawl on a CPU:
        # the weights dequantized to float32 (a graph of matmuls as a GPU's, not its kernels)
        model, tokenizer = load_model(target)
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        return model, tokenizer

    monkeypatch.setattr(load.mlx_adapter, "load", load_float32)
    gpu.device_index.cache_clear()


def refusing_gpu(monkeypatch):
    """A ``gpu._kernel`` (to patch in after ``emulated_gpu``) whose kernels fail where a GPU's
    compiler refuses one: when MLX evaluates it, after the pool's arrays were written from
    it. An inverse that fails stands in, its words taken for a compiler's until the test
    ends (``gpu.COMPILE_FAILURES``; the real ones: tests/kernels/test_store_rows.py), as is
    the refusal ``gpu.refuse`` records."""
    monkeypatch.setattr(gpu, "_refused", None)
    monkeypatch.setattr(gpu, "COMPILE_FAILURES", ("LU factorization failed",))

    def refused(backend, name, sources=0):
        def run(*, output_shapes, output_dtypes, **_):
            fails = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)[0, 0]
            return [mx.zeros(s, d) + fails.astype(d) for s, d in zip(output_shapes, output_dtypes)]

        return run

    return refused


def neighbour_head(monkeypatch) -> list[int]:
    """Make the emulated paged kernel wrong until the test ends: it reads the next KV head's
    keys and values (its result rolled by a GQA group along the query heads). A list that
    grows by one at each call of it."""
    right, calls = RUNS["paged_attention"], []

    def wrong(inputs, template, grid, threadgroup):
        calls.append(1)
        B, q_heads, kv_heads, L, _, Dv = _ints(inputs[9])[:6]
        padded, stats = right(inputs, template, grid, threadgroup)
        out = padded[: B * q_heads * L * Dv].reshape(B, q_heads, L, Dv)
        out = mx.roll(out, q_heads // kv_heads, axis=1).reshape(-1)
        return [mx.concatenate([out, padded[out.size :]]), stats]

    monkeypatch.setitem(RUNS, "paged_attention", wrong)
    return calls


def _emulated_kernel(backend: str, name: str, sources: int = 0):
    assert backend == "cuda", backend
    if name not in RUNS:
        raise AssertionError(f"the engine launched {name!r}, which the emulation does not run")

    def run(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), **_):
        CALLS[name] += 1
        outputs = RUNS[name](list(inputs), dict(template), tuple(grid), tuple(threadgroup))
        assert [tuple(o.shape) for o in outputs] == [tuple(s) for s in output_shapes], name
        return [o.astype(d) for o, d in zip(outputs, output_dtypes)]

    return run


def _ints(a: mx.array) -> list[int]:
    return np.array(a).astype(np.int64).tolist()


def _floats(a: mx.array) -> list[float]:
    return np.array(a).astype(np.float64).tolist()


def _paged_attention(inputs, template, grid, threadgroup):
    """Pass 1 and pass 2 in one CPU call: the result goes out in pass 1's first output, in
    front, for ``_merge`` to take (or as it is, with one part)."""
    q, kw, ks, kb, vw, vs, vb, tables, lengths, dims, sinks, scales, tail, slots, done, first = (
        inputs
    )
    d = _ints(dims)
    B, q_heads, kv_heads, L, D, Dv = d[:6]
    has_sinks, channel_tokens, splits, rotate = d[12], d[13], d[14], d[16]
    nq, kl, tg, ku = template["NQ"], template["KL"], template["TG"], template["KU"]
    tiles = -(-L * (q_heads // kv_heads) // nq)
    assert grid == (splits * tiles * tg, kv_heads, B) and threadgroup == (tg, 1, 1), (grid, d)
    assert tuple(q.shape) == (B, q_heads, L, D) and sinks.size == q_heads
    assert template["T"] == (q.dtype if splits == 1 else mx.float32)
    scale, out_scale, softcap = _floats(scales)
    if rotate:  # the CPU build folds 1 / sqrt(D) in itself, and rotates out by 1 / sqrt(Dv)
        assert math.isclose(out_scale, 1 / math.sqrt(Dv), rel_tol=1e-6)
        scale *= math.sqrt(D)
    else:
        assert out_scale == 1.0
    out = _ext.kernel_paged_attention(
        q, [kw, ks, kb], [vw, vs, vb], tables, lengths, tuple(d),
        sinks if has_sinks else None, scale, THREADS,
        tail if channel_tokens else None, slots if channel_tokens else None,
        nq, kl, done, first, softcap, ku,
    )  # fmt: skip
    flat = out.reshape(-1)
    padded = mx.concatenate([flat, mx.zeros(flat.size * (splits - 1))])
    return [padded, mx.zeros(B * q_heads * L * splits * 2)]


def _merge(inputs, template, grid, threadgroup):
    parts, stats, sinks, dims = inputs
    B, q_heads, L, Dv, splits, has_sinks = _ints(dims)
    assert splits > 1 and parts.size == B * q_heads * L * splits * Dv
    assert grid == (Dv, q_heads * L, B) and threadgroup == (Dv, 1, 1)
    return [parts[: B * q_heads * L * Dv].reshape(B, q_heads, L, Dv)]


def _store_rows(inputs, template, grid, threadgroup):
    keys, values, queries, dims, scale, starts, rope, norm = inputs
    d = _ints(dims)
    n, dim, n_queries = d[0], d[1], d[4]
    assert template["KL"] == dim // 8
    scales = _floats(scale)
    assert math.isclose(scales[0], 1 / math.sqrt(dim), rel_tol=1e-6) and len(scales) == 2
    PROLOGUES["normed"] += d[18] == 1
    rows_a_group = template["TG"] // template["KL"]
    assert grid[0] * rows_a_group >= (n + n_queries) * template["TG"]
    assert grid[0] % threadgroup[0] == 0
    PROLOGUES["store_rows"] += n_queries > 0
    # what a GPU reads them as (the CPU build would convert any dtype)
    assert starts.dtype == mx.int32 and rope.dtype == mx.float32 and dims.dtype == mx.int32
    # the body's own bounds checks: every row it reads lies inside its array
    out = _ext.kernel_store_rows(keys, values, queries, d, starts, rope, norm, scales[1], THREADS)
    return [*out[:4], out[4].reshape(-1)]


def _dense_rows(inputs, template, grid, threadgroup):
    kw, ks, kb, vw, vs, vb, tail, done, src, dims, scale = inputs
    d = _ints(dims)
    count = _ints(src[:1])[0]
    assert grid[0] >= count * d[6] and grid[0] % threadgroup[0] == 0, (grid, count, d)
    assert grid[0] - count * d[6] < threadgroup[0]
    keys, values = _ext.kernel_dense_rows(
        [kw, ks, kb], [vw, vs, vb], tail, done, src, tuple(d), _floats(scale)[0], THREADS
    )
    return [keys, values]


def _quantize_groups(inputs, template, grid, threadgroup):
    x, dims = inputs
    dim, bits, ct = _ints(dims)
    row_words = dim * bits // 32
    count = x.size // (ct * dim)
    assert grid == (count * row_words, 1, 1) and threadgroup == (row_words, 1, 1)
    return list(_ext.kernel_quantize_groups(x.reshape(-1, dim), bits, ct))


RUNS = {
    "paged_attention": _paged_attention,
    "paged_attention_merge": _merge,
    "store_rows": _store_rows,
    "dense_rows": _dense_rows,
    "quantize_groups": _quantize_groups,
}
