"""kernels/dense_rows.metal: a prefill chunk's keys and values gathered from the pool and
dequantized in one kernel (the dense path on a GPU), here through its CPU build, held to the
MLX operations it replaces (kernels/dense.py's ``_gathered``) bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    dense_rows_both_ways,
    fill_table,
    format_2_batch,
    jagged_batch,
    pool_for,
    synthetic_spec,
)

from agentkv import _ext
from agentkv.format.quant import V1, V2, KVQuant, hadamard
from agentkv.kernels import cpu, dense, gpu
from agentkv.kernels.types import PagedQuery
from agentkv.pool.step import PagedStep


def both_ways(paged: PagedQuery, L: int, dtype=mx.float32):
    """Each row's (keys, values) by the kernel's CPU build and by the operations."""
    return dense_rows_both_ways(paged, L, cpu.dense_rows, dtype)


def assert_same(pairs, heads):
    for (keys, values), (want_keys, want_values) in pairs:
        assert keys.dtype == want_keys.dtype and values.dtype == want_values.dtype
        np.testing.assert_array_equal(
            np.array(keys.astype(mx.float32)).reshape(want_keys.shape),
            np.array(want_keys.astype(mx.float32)),
        )
        np.testing.assert_array_equal(
            np.array(values.astype(mx.float32)).reshape(want_values.shape),
            np.array(want_values.astype(mx.float32)),
        )


@pytest.mark.parametrize(
    "fmt,dim", [((4, 4, 64), 64), ((8, 4, 32), 64), ((2, 8, 32), 32), ((16, 16, 64), 64),
                ((8, 8, 128), 128), ((4, 2, 32), 256)]
)  # fmt: skip
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_format_1_rows_are_the_operations_bits(fmt, dim, window, dtype):
    """Per-token keys and values of 2, 4, 8 and 16 bits, groups of 32 to 128, a window:
    exactly the values MLX's gathers, ``mx.dequantize`` and casts give, in each dtype."""
    queries = dense.DENSE_QUERIES + 3
    lengths = [900, queries, 300]
    _, _, _, paged = jagged_batch(KVQuant(*fmt, **V1), lengths, queries=queries, dim=dim)
    paged = paged._replace(window=window)
    assert gpu.gathers_rows(paged)
    assert_same(both_ways(paged, queries, dtype), paged.kv_heads)


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("new", [20, 70])
def test_format_2_rows_and_tails_are_the_operations_bits(window, new):
    """Per-channel keys (their scales spread over each group's rows), the float16 tails of
    rows whose last group is filling, 4-bit values."""
    _, q, paged = format_2_batch(window, new=new)
    assert gpu.gathers_rows(paged)
    assert_same(both_ways(paged, q.shape[2]), paged.kv_heads)


def test_a_chunk_completing_groups_reads_their_float16_copies():
    """A step of 70 tokens completes a group of each row: its output rows list the group's
    float16 copies from the step's ``done`` after the row's keys (and their values again),
    as the operations concatenate them; the whole dense path gives the same bits through
    the kernel as through the operations."""
    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec, KVQuant(**V2))
    count = 70
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 64, 100])]
    for t in tables:
        t.grow(count, pool.arena.copy_rows)
    rng = np.random.default_rng(5)
    kv = mx.array(rng.standard_normal((2, 3, 2, count, 64)).astype(np.float32))
    q = mx.array(rng.standard_normal((3, 4, count, 64)).astype(np.float32))
    step = PagedStep(pool.arena, spec, tables, count)
    keys, values = step.caches[0].update_and_fetch(kv[0], kv[1])
    paged = PagedQuery(
        tuple(keys), tuple(values), step.tables, step.lengths, 2, 256, 4, 4, 64, 0, None, 64,
        pool.arena.tails[0], step.plan.tail_slots, step.host, step.plan.done[0],
        step.plan.done_first,
    )  # fmt: skip
    pairs = both_ways(paged, count)
    assert all(dense._own_groups(paged, b, int(n), count) for b, n in enumerate(step.host.lengths))
    assert_same(pairs, 2)
    by_kernel = dense.paged_attention(q, paged, scale=0.125, rows_kernel=cpu.dense_rows)
    by_ops = dense.paged_attention(q, paged, scale=0.125)
    np.testing.assert_array_equal(np.array(by_kernel), np.array(by_ops))
    pool.arena.settle()


@pytest.mark.parametrize("window", [0, 100])
def test_format_2_rows_rotated_back_by_the_kernel(window):
    """With ``rotate`` the kernel rotates every row it writes back from H (a butterfly across
    a row's lanes by shuffles, as the store rotates): within float rounding of MLX's transform
    on the operations' rows; so the dense path takes the queries and gives the output as
    they are, where the operations rotate both around the attention."""
    _, q, paged = format_2_batch(window, new=70)
    rotated = paged._replace(rotate=True)
    assert rotated.rotates_inside(q)
    for (keys, values), (want_keys, want_values) in both_ways(rotated, q.shape[2]):
        for got, want in ((keys, want_keys), (values, want_values)):
            got = np.array(got).reshape(want.shape)
            np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=2e-6)
    plain = np.array(hadamard(dense.paged_attention(hadamard(q), paged, scale=0.125)))
    inside = dense.paged_attention(q, rotated, scale=0.125, rows_kernel=cpu.dense_rows)
    np.testing.assert_allclose(np.array(inside), plain, rtol=1e-4, atol=2e-6)
    unrotated = np.array(dense.paged_attention(q, paged, scale=0.125, rows_kernel=cpu.dense_rows))
    assert np.abs(unrotated - plain).max() > 1e-2  # the rotation matters
    bad = rotated.dense_rows_dims()
    src, count = dense._sources(rotated, 0, 0, int(rotated.host.lengths[0]), None)
    with pytest.raises(ValueError, match="bad dims"):  # rotate is 0 or 1
        _ext.kernel_dense_rows(list(rotated.keys), list(rotated.values), rotated.tail,
                               rotated.tail, src, (*bad[:7], 2), 0.1)  # fmt: skip


@pytest.mark.parametrize("rotate", [False, True])
def test_the_gpu_launch_covers_every_row_and_channel(monkeypatch, rotate):
    """``gpu.dense_rows`` launches a thread for each output row's 8 channels, in whole
    threadgroups (the body's bounds check drops the rest), with the dims the CPU build
    takes: what the GPU gets, recorded from the call MLX would receive."""
    _, q, paged = format_2_batch(0, new=70)
    paged = paged._replace(rotate=rotate)
    src, count = dense._sources(paged, 0, 0, int(paged.host.lengths[0]), None)
    launches = []

    def kernel(backend, name, sources=0):
        def run(*, inputs, grid, threadgroup, output_shapes, output_dtypes, **_):
            launches.append((name, grid, threadgroup, np.array(inputs[-2]).tolist()))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return run

    monkeypatch.setattr(gpu, "_kernel", kernel)
    keys, values = gpu.dense_rows("cuda", paged, src, count, mx.float16)
    ((name, grid, threadgroup, dims),) = launches
    units = 64 // 8
    assert name == "dense_rows" and dims == list(paged.dense_rows_dims()) and dims[7] == rotate
    assert grid[0] >= count * units and grid[0] % threadgroup[0] == 0
    assert grid[0] - count * units < threadgroup[0]
    assert keys.shape == values.shape == (count, 64)


def test_the_kernel_reads_no_row_outside_its_arrays_and_can_be_switched_off(monkeypatch):
    """The CPU build checks every row an output row names lies in its array (a GPU would read
    past it); ``AGENTKV_GPU_GATHER=0`` hands the chunk back to the operations; formats the
    kernel does not unpack (3-bit) go there too."""
    queries = dense.DENSE_QUERIES
    _, _, _, paged = jagged_batch(KVQuant(4, 4, 64, **V1), [300], queries=queries)
    src, count = dense._sources(paged, 0, 0, 300, None)
    rows = paged.keys[0].shape[0]
    for column, bad in ((1, rows), (2, -1), (0, 3)):
        broken = np.array(src).reshape(-1, 3)
        broken[8, column] = bad
        with pytest.raises(ValueError, match="outside its array"):
            cpu.dense_rows(paged, mx.array(broken.reshape(-1)), count, mx.float32)
    with pytest.raises(ValueError, match="its count"):
        cpu.dense_rows(paged, src[:-3], count, mx.float32)
    monkeypatch.setenv(gpu.GATHER_ENV, "0")
    assert not gpu.gathers_rows(paged)
    monkeypatch.delenv(gpu.GATHER_ENV)
    _, _, _, three = jagged_batch(KVQuant(3, 4, 64, **V1), [300], queries=queries)
    assert gpu.gathers_rows(paged) and not gpu.gathers_rows(three)
