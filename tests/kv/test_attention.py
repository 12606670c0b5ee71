"""The fused CPU attention (csrc/core/attention.h) against the mx.quantized_matmul reference."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import attention_atol
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentkv import _ext
from agentkv.format.quant import V1, KVQuant
from agentkv.kernels import attention, cpu, reference
from agentkv.kv.batch import BatchQuantizedKVCache
from agentkv.kv.cache import AgentKVCache

formats = st.sampled_from(
    [(4, 4, 64), (4, 4, 32), (8, 8, 64), (8, 4, 128), (2, 4, 64), (4, 16, 64), (16, 16, 64)]
)


def stored(x: mx.array, bits: int, group: int) -> tuple:
    """x [B, H, T, D] float32 in the cache's format (float16 or affine-quantized)."""
    x16 = x.astype(mx.float16)
    return (x16,) if bits == 16 else tuple(mx.quantize(x16, group_size=group, bits=bits))


def fused(q, keys, values, quant, *, window=0, left_padding=None, sinks=None):
    return cpu.fused_cache_attention(
        q, keys, values, scale=q.shape[-1] ** -0.5, quant=quant, window=window,
        left_padding=left_padding, sinks=sinks, tail=None,
    )  # fmt: skip


def explicit_mask(batch, queries, keys, window, left_padding):
    """Boolean [B, 1, L, T]: causal from the last L rows, minus padding and the window."""
    p = np.arange(keys - queries, keys)[:, None]
    j = np.arange(keys)[None]
    pad = np.zeros(batch, int) if left_padding is None else np.array(left_padding)
    m = (j <= p)[None] & (j[None] >= pad[:, None, None])
    if window:
        m &= (p - j < window)[None]
    return mx.array(m[:, None])


@settings(max_examples=40, deadline=None)
@given(
    fmt=formats,
    dim=st.sampled_from([64, 128]),
    kv_heads=st.integers(1, 2),
    repeats=st.integers(1, 3),
    batch=st.integers(1, 3),
    queries=st.integers(1, 70),
    extra=st.integers(0, 300),
    window=st.sampled_from([0, 0, 16, 100]),
    with_sinks=st.booleans(),
    data=st.data(),
)
def test_fused_matches_reference(
    fmt, dim, kv_heads, repeats, batch, queries, extra, window, with_sinks, data
):
    assume(dim % fmt[2] == 0)
    quant = KVQuant(*fmt, **V1)
    keys_len = queries + extra
    pads = data.draw(st.lists(st.integers(0, extra), min_size=batch, max_size=batch))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q = mx.array(rng.standard_normal((batch, kv_heads * repeats, queries, dim)), mx.float32)
    k = mx.array(rng.standard_normal((batch, kv_heads, keys_len, dim)), mx.float32)
    v = mx.array(rng.standard_normal((batch, kv_heads, keys_len, dim)), mx.float32)
    keys = stored(k, quant.key_bits, quant.group_size)
    values = stored(v, quant.value_bits, quant.group_size)
    sinks = mx.array(rng.standard_normal(kv_heads * repeats), mx.float32) if with_sinks else None
    padding = mx.array(pads, mx.int32)

    ours = fused(q, keys, values, quant, window=window, left_padding=padding, sinks=sinks)
    mask = explicit_mask(batch, queries, keys_len, window, pads)
    theirs = reference.quantized_attention(
        q, keys, values, scale=dim**-0.5, mask=mask, quant=quant, sinks=sinks
    )
    assert ours.shape == theirs.shape and ours.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(ours), np.array(theirs), rtol=2e-4, atol=attention_atol(quant)
    )


def test_a_row_in_a_padded_batch_equals_the_row_alone():
    rng = np.random.default_rng(7)
    quant = KVQuant(**V1)
    rows = []
    for length in (300, 41, 129):
        k = mx.array(rng.standard_normal((1, 2, length, 64)), mx.float32)
        v = mx.array(rng.standard_normal((1, 2, length, 64)), mx.float32)
        rows.append((length, k, v))
    longest = max(n for n, _, _ in rows)

    def padded(x, n):
        return mx.pad(x, [(0, 0), (0, 0), (longest - n, 0), (0, 0)])

    k = mx.concatenate([padded(k, n) for n, k, _ in rows])
    v = mx.concatenate([padded(v, n) for n, _, v in rows])
    q = mx.array(rng.standard_normal((3, 6, 5, 64)), mx.float32)
    padding = mx.array([longest - n for n, _, _ in rows], mx.int32)
    together = fused(q, stored(k, 4, 64), stored(v, 4, 64), quant, left_padding=padding)
    for i, (_, k1, v1) in enumerate(rows):
        alone = fused(q[i : i + 1], stored(k1, 4, 64), stored(v1, 4, 64), quant)
        assert mx.array_equal(together[i : i + 1], alone), f"row {i} changed in the batch"


def test_a_prefill_chunk_equals_one_query_at_a_time():
    rng = np.random.default_rng(3)
    quant = KVQuant(**V1)
    k = mx.array(rng.standard_normal((1, 1, 200, 64)), mx.float32)
    v = mx.array(rng.standard_normal((1, 1, 200, 64)), mx.float32)
    q = mx.array(rng.standard_normal((1, 3, 8, 64)), mx.float32)
    keys, values = stored(k, 4, 64), stored(v, 4, 64)
    chunk = fused(q, keys, values, quant, window=50)
    for i in range(8):
        upto = 200 - 8 + i + 1
        one = fused(
            q[:, :, i : i + 1],
            tuple(x[:, :, :upto] for x in keys),
            tuple(x[:, :, :upto] for x in values),
            quant,
            window=50,
        )
        assert mx.array_equal(chunk[:, :, i : i + 1], one)


@pytest.mark.parametrize("window", [0, 700])
def test_long_ranges_merge_their_chunks_like_the_reference(window):
    """Past 512 keys a query's range is cut into chunks whose softmaxes merge; one agent
    alone (too few tasks for the threads) runs its chunks in parallel."""
    rng = np.random.default_rng(11)
    quant = KVQuant(**V1)
    length, queries = 1300, 3
    q = mx.array(rng.standard_normal((1, 4, queries, 64)), mx.float32)
    k = mx.array(rng.standard_normal((1, 2, length, 64)), mx.float32)
    v = mx.array(rng.standard_normal((1, 2, length, 64)), mx.float32)
    keys, values = stored(k, 4, 64), stored(v, 4, 64)
    sinks = mx.array(rng.standard_normal(4), mx.float32)
    ours = fused(q, keys, values, quant, window=window, sinks=sinks)
    mask = explicit_mask(1, queries, length, window, [0])
    theirs = reference.quantized_attention(
        q, keys, values, scale=64**-0.5, mask=mask, quant=quant, sinks=sinks
    )
    np.testing.assert_allclose(
        np.array(ours), np.array(theirs), rtol=2e-4, atol=attention_atol(quant)
    )


def test_a_long_row_gives_the_same_bits_alone_and_in_a_batch():
    """Alone, a 1,300-key row's chunks run on different threads and merge afterwards; in a
    batch of three (enough tasks) one thread runs them in turn: the same bits."""
    rng = np.random.default_rng(5)
    quant = KVQuant(**V1)
    lengths = (1300, 600, 90)
    rows = [
        tuple(mx.array(rng.standard_normal((1, 2, n, 64)), mx.float32) for _ in range(2))
        for n in lengths
    ]
    longest = max(lengths)

    def padded(x, n):
        return mx.pad(x, [(0, 0), (0, 0), (longest - n, 0), (0, 0)])

    k = mx.concatenate([padded(k, n) for n, (k, _) in zip(lengths, rows)])
    v = mx.concatenate([padded(v, n) for n, (_, v) in zip(lengths, rows)])
    q = mx.array(rng.standard_normal((3, 4, 1, 64)), mx.float32)
    padding = mx.array([longest - n for n in lengths], mx.int32)
    together = fused(q, stored(k, 4, 64), stored(v, 4, 64), quant, left_padding=padding)
    for i, (k1, v1) in enumerate(rows):
        alone = fused(q[i : i + 1], stored(k1, 4, 64), stored(v1, 4, 64), quant)
        assert mx.array_equal(together[i : i + 1], alone), f"row {i} changed in the batch"


def test_bad_arguments_are_refused():
    quant = KVQuant(**V1)
    q = mx.zeros((1, 2, 1, 64))
    keys = stored(mx.zeros((1, 1, 10, 64)), 4, 64)
    with pytest.raises(ValueError, match="bits"):
        _ext.quantized_attention(q, list(keys), list(keys), 1.0, 3, 4, 64, 0, None, None)
    with pytest.raises(ValueError, match="float32"):
        fused(q.astype(mx.float16), keys, keys, quant)
    with pytest.raises(ValueError, match="T >= L"):
        fused(mx.zeros((1, 2, 11, 64)), keys, keys, quant)
    with pytest.raises(ValueError, match="T >= L"):
        fused(mx.zeros((2, 2, 1, 64)), keys, keys, quant)
    with pytest.raises(ValueError, match="left_padding"):
        fused(q, keys, keys, quant, left_padding=mx.array([0, 0], mx.int32))
    with pytest.raises(ValueError, match="scales"):
        fused(q, (keys[0], keys[1].astype(mx.float32), keys[2]), keys, quant)
    with pytest.raises(ValueError, match="wrong number"):
        fused(q, keys[:2], keys, quant)


def _delta(before: dict) -> dict:
    now = attention.paths_used()
    return {path: now[path] - before[path] for path in now}


def test_caches_take_the_fused_path_only_for_masks_they_understand(monkeypatch):
    rng = np.random.default_rng(5)
    cache = AgentKVCache(KVQuant(**V1), window=32)
    k = mx.array(rng.standard_normal((1, 1, 90, 64)), mx.float32)
    ours = cache.make_mask(90)
    keys, values = cache.update_and_fetch(k, k)
    q = mx.array(rng.standard_normal((1, 2, 90, 64)), mx.float32)
    assert attention.fused_available(cache.quant, q, ours)
    assert not attention.fused_available(cache.quant, q, mx.array(np.array(ours)))
    assert not attention.fused_available(cache.quant, q, None)  # several queries, no mask
    assert not attention.fused_available(cache.quant, q.astype(mx.float16), ours)

    before = attention.paths_used()
    fast = cache.agentkv_attention(q, keys, values, scale=0.125, mask=ours)
    assert _delta(before) == {
        attention.FUSED: 1,
        attention.KERNEL: 0,
        attention.DENSE: 0,
        attention.REFERENCE: 0,
    }
    monkeypatch.setenv(attention.ENV, "reference")
    assert not attention.fused_available(cache.quant, q, ours)
    before = attention.paths_used()
    slow = cache.agentkv_attention(q, keys, values, scale=0.125, mask=ours)
    assert _delta(before) == {
        attention.FUSED: 0,
        attention.KERNEL: 0,
        attention.DENSE: 0,
        attention.REFERENCE: 1,
    }
    np.testing.assert_allclose(
        np.array(fast), np.array(slow), rtol=2e-4, atol=attention_atol(cache.quant)
    )


def test_batch_cache_attention_matches_reference(monkeypatch):
    rng = np.random.default_rng(9)
    batch = BatchQuantizedKVCache(KVQuant(**V1), [3, 0], window=12)
    k = mx.array(rng.standard_normal((2, 1, 20, 64)), mx.float32)
    mask = batch.make_mask(20)
    keys, values = batch.update_and_fetch(k, k)
    q = mx.array(rng.standard_normal((2, 3, 20, 64)), mx.float32)
    before = attention.paths_used()
    fast = batch.agentkv_attention(q, keys, values, scale=0.125, mask=mask)
    assert _delta(before) == {
        attention.FUSED: 1,
        attention.KERNEL: 0,
        attention.DENSE: 0,
        attention.REFERENCE: 0,
    }
    monkeypatch.setenv(attention.ENV, "reference")
    slow = batch.agentkv_attention(q, keys, values, scale=0.125, mask=mask)
    assert _delta(before) == {
        attention.FUSED: 1,
        attention.KERNEL: 0,
        attention.DENSE: 0,
        attention.REFERENCE: 1,
    }
    # Row 0's first 3 queries are padding: they see no key, and what comes out is unused.
    np.testing.assert_allclose(
        np.array(fast[0, :, 3:]),
        np.array(slow[0, :, 3:]),
        rtol=2e-4,
        atol=attention_atol(batch.quant),
    )
    np.testing.assert_allclose(
        np.array(fast[1]), np.array(slow[1]), rtol=2e-4, atol=attention_atol(batch.quant)
    )
