"""Paged attention over the pool — the fused CPU kernel, the kernel body of
kernels/paged_attention.metal compiled for CPU, and the pure-MLX reference — on jagged
batches of block tables: they agree, the fused kernel gives the same bits as over a
contiguous cache, and a row gives the same bits alone or batched."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import fill_table, pool_for, synthetic_spec, table_arrays
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import _ext, kernels
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.format.quant import V1, KVQuant
from agentkv.kernels import PagedQuery, attention, cpu

formats = st.sampled_from([(4, 4, 64), (4, 4, 32), (8, 4, 64), (8, 8, 64), (2, 2, 32)])


def jagged_batch(quant, lengths, *, heads=2, q_heads=4, queries=1, seed=0, dim=64):
    spec = synthetic_spec(layers=1, heads=heads, dim=dim)
    pool = pool_for(spec, quant, blocks=sum(-(-n // BLOCK_TOKENS) for n in lengths) + 2)
    tables = [fill_table(pool, n, seed=seed + i) for i, n in enumerate(lengths)]
    width = max(len(t.blocks) for t in tables)
    table = np.full((len(tables), width), -1, dtype=np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t.blocks)] = t.blocks
    rng = np.random.default_rng(seed + 100)
    q = mx.array(rng.standard_normal((len(lengths), q_heads, queries, dim)).astype(np.float32))
    paged = PagedQuery(
        pool.arena.keys(0),
        pool.arena.values(0),
        mx.array(table),
        mx.array(lengths, dtype=mx.int32),
        heads,
        BLOCK_TOKENS,
        quant.key_bits,
        quant.value_bits,
        quant.group_size,
        0,
        None,
    )
    return pool, tables, q, paged


def fused(q, paged, scale=0.125):
    return cpu.fused_paged_attention(q, paged, scale=scale)


def close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=3e-4, atol=3e-5)


@settings(max_examples=15, deadline=None)
@given(
    fmt=formats,
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=4),
    queries=st.sampled_from([1, 3, 17]),
    rep=st.sampled_from([1, 2, 3]),  # query heads per KV head: the kernel folds 1-4 at once
    window=st.sampled_from([0, 100]),
    sinks=st.booleans(),
)
def test_fused_kernel_body_and_reference_agree(fmt, lengths, queries, rep, window, sinks):
    lengths = [max(n, queries) for n in lengths]
    pool, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), lengths, queries=queries, q_heads=2 * rep)
    sink_values = mx.array(np.linspace(-1, 1, 2 * rep).astype(np.float32)) if sinks else None
    paged = paged._replace(window=window, sinks=sink_values)
    ours = fused(q, paged)
    reference = kernels.reference.paged_attention(q, paged, scale=0.125)
    with kernels.use_backend("cpu"):
        body = kernels.paged_attention_body(q, paged, scale=0.125)
    close(ours, reference)
    close(body, reference)


def test_fused_paged_equals_fused_contiguous_bit_for_bit():
    quant = KVQuant(**V1)
    lengths = [300, 17, 600]
    pool, tables, q, paged = jagged_batch(quant, lengths, queries=5)
    ours = fused(q, paged)
    for b, table in enumerate(tables):
        arrays = [mx.array(a[None]) for a in table_arrays(pool, table)]
        contiguous = _ext.quantized_attention(
            q[b : b + 1], arrays[:3], arrays[3:], 0.125, 4, 4, 64, 0, None, None
        )
        assert mx.array_equal(ours[b : b + 1], contiguous)


def test_a_row_gives_the_same_bits_alone_or_batched():
    quant = KVQuant(8, 4, **V1)
    lengths = [513, 40, 256, 1]
    pool, tables, q, paged = jagged_batch(quant, lengths)
    together = fused(q, paged)
    for b in range(len(lengths)):
        alone = paged._replace(tables=paged.tables[b : b + 1], lengths=paged.lengths[b : b + 1])
        assert mx.array_equal(together[b : b + 1], fused(q[b : b + 1], alone))


def test_float16_caches_take_the_reference_beside_the_fused_kernel():
    quant = KVQuant(16, 16, **V1)
    pool, _, q, paged = jagged_batch(quant, [300, 70], queries=2)
    close(fused(q, paged), kernels.reference.paged_attention(q, paged, scale=0.125))
    with pytest.raises(Exception, match="quantized"):
        kernels.paged_attention_body(q, paged, scale=0.125)


def test_the_dispatch_takes_the_fused_path_on_cpu_and_the_reference_when_asked(monkeypatch):
    pool, _, q, paged = jagged_batch(KVQuant(**V1), [300, 9])
    before = attention.paths_used()
    fast = attention.paged_attention(q, paged, scale=0.125)
    monkeypatch.setenv(attention.ENV, "reference")
    slow = attention.paged_attention(q, paged, scale=0.125)
    now = attention.paths_used()
    assert {k: now[k] - before[k] for k in now} == {
        attention.FUSED: 1,
        attention.KERNEL: 0,
        attention.REFERENCE: 1,
    }
    close(fast, slow)


def test_a_table_naming_a_block_outside_the_arenas_never_reads_it():
    pool, _, q, paged = jagged_batch(KVQuant(**V1), [300])
    bad = mx.array(np.array([[0, pool.capacity + 5]], dtype=np.int32))
    out = fused(q, paged._replace(tables=bad))
    assert bool(mx.all(mx.isnan(out)).item())  # refused, not read out of bounds
    with kernels.use_backend("cpu"), pytest.raises(ValueError, match="outside the arenas"):
        kernels.paged_attention_body(q, paged._replace(tables=bad), scale=0.125)
