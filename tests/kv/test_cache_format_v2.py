"""KV format 2 in the contiguous AgentKVCache (mlx-lm's drop-in): the same bits as the block
pool stores, the same attention, trims, its state, and mlx-lm's files."""

import mlx.core as mx
import numpy as np
from helpers import _kv_for, fill_table, synthetic_spec, table_arrays

from agentkv.format.quant import V1, V2, KVQuant
from agentkv.kv.cache import AgentKVCache
from agentkv.pool import KVPool
from agentkv.pool.step import PagedStep

V2Q = KVQuant(**V2)
CHUNKS = [197, 61, 42]  # fill_table's chunks for 300 tokens


def contiguous(spec, tokens: int) -> AgentKVCache:
    cache = AgentKVCache(V2Q)
    at = 0
    for n in CHUNKS:
        n = min(n, tokens - at)
        if n <= 0:
            break
        k, v = _kv_for(spec, 0, at, n, rng=None, positional=True)
        cache.update_and_fetch(k, v)
        at += n
    mx.eval(cache.components, cache.tail)
    return cache


def test_the_contiguous_cache_stores_the_pool_s_bits_and_attends_alike():
    spec = synthetic_spec(layers=1, heads=2)
    pool = KVPool(spec, V2Q, pool_bytes=spec.bytes_per_token(V2Q) * 256 * 8)
    table = fill_table(pool, 300, positional=True)
    cache = contiguous(spec, 300)
    for ours, pooled in zip(cache.components, table_arrays(pool, table)):
        np.testing.assert_array_equal(np.array(ours[0, :, :256]), pooled[:, :256])
    np.testing.assert_array_equal(
        np.array(cache.tail[0, :, :44]), pool.arena.read_tail(table.tail, 44)[0]
    )
    # One more token through each, then the same query: the same output, bit for bit.
    k, v = _kv_for(spec, 0, 300, 1, rng=None, positional=True)
    q = mx.array(np.random.default_rng(1).standard_normal((1, 4, 1, 64)).astype(np.float32))
    keys, values = cache.update_and_fetch(k, v)
    ours = cache.agentkv_attention(q, keys, values, scale=0.125, mask=None)
    table.grow(1, pool.arena.copy_rows)
    step = PagedStep(pool.arena, spec, [table], 1)
    layer = step.caches[0]
    pk, pv = layer.update_and_fetch(k, v)
    pooled = layer.agentkv_attention(q, pk, pv, scale=0.125, mask=None)
    np.testing.assert_array_equal(np.array(ours), np.array(pooled))


def test_a_trim_into_a_group_and_more_tokens_read_back_close_to_the_keys():
    spec = synthetic_spec(layers=1, heads=2)
    cache = contiguous(spec, 300)
    assert cache.trim(150) == 150  # to 150: inside the group [128, 192)
    k, v = _kv_for(spec, 0, 150, 100, rng=None, positional=True)
    cache.update_and_fetch(k, v)
    keys, values = cache.dequantized()
    want_k, want_v = _kv_for(spec, 0, 0, 250, rng=None, positional=True)
    assert keys.shape == (1, 2, 250, 64)
    assert float(mx.abs(keys - want_k).max()) < 0.15
    assert float(mx.abs(values - want_v).max()) < 0.35  # rotated values, 4 bits per token


def test_state_round_trips_and_format_1_states_still_load():
    spec = synthetic_spec(layers=1, heads=2)
    cache = contiguous(spec, 300)
    again = AgentKVCache.from_state(cache.state)
    assert again.quant == V2Q and again.offset == 300
    for a, b in zip(cache.dequantized(), again.dequantized()):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    v1 = AgentKVCache(KVQuant(**V1))
    v1.update_and_fetch(*_kv_for(spec, 0, 0, 10, rng=None, positional=True))
    assert AgentKVCache.from_state(v1.state).quant == KVQuant(**V1)
    old = tuple(v1.state)[:8]  # the 8-field state files held before CacheState
    assert AgentKVCache.from_state(list(old)).quant == KVQuant(**V1)
    assert AgentKVCache().quant == KVQuant(4, 4) == V2Q  # mlx-lm's drop-in: format 2


def test_mlx_lm_reads_what_save_prompt_cache_writes_for_format_2(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load

    from agentkv.prompt_cache import save_prompt_cache

    spec = synthetic_spec(layers=1, heads=2)
    cache = contiguous(spec, 300)
    save_prompt_cache(tmp_path / "p.safetensors", [cache])
    (theirs,) = mlx_lm_load(str(tmp_path / "p.safetensors"))
    assert type(theirs).__name__ == "QuantizedKVCache" and theirs.offset == 300
    k = mx.dequantize(*theirs.keys, group_size=64, bits=4)[..., :300, :]
    want, _ = _kv_for(spec, 0, 0, 300, rng=None, positional=True)
    assert float(mx.abs(k - want).max()) < 0.25  # requantized per token: format 1's error


def test_a_wide_layer_is_written_for_mlx_lm_as_an_8_bit_layer(tmp_path):
    """mlx-lm's QuantizedKVCache has one bit width: a layer with 8-bit keys (a wide layer,
    or keys 8 / values 4) is requantized at 8 bits, keys and values; the others at 4."""
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load

    from agentkv.prompt_cache import save_prompt_cache

    spec = synthetic_spec(layers=2, heads=2)
    wide = KVQuant(wide_layers=(1,))
    caches = [AgentKVCache(wide.layer(i)) for i in range(2)]
    for layer, cache in enumerate(caches):
        cache.update_and_fetch(*_kv_for(spec, layer, 0, 300, rng=None, positional=True))
    save_prompt_cache(tmp_path / "p.safetensors", caches)
    loaded = mlx_lm_load(str(tmp_path / "p.safetensors"))
    assert [c.bits for c in loaded] == [4, 8] and all(c.offset == 300 for c in loaded)
    for layer, (theirs, bound) in enumerate(zip(loaded, (0.25, 0.02))):
        k = mx.dequantize(*theirs.keys, group_size=64, bits=theirs.bits)[..., :300, :]
        want, _ = _kv_for(spec, layer, 0, 300, rng=None, positional=True)
        assert float(mx.abs(k - want).max()) < bound, layer
