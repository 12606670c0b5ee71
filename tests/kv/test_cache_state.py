"""CacheState: both cache classes save one record, read by name; a saved cache rebuilt from
it runs the next step exactly as the original; a format that rotates token keys stores them
rotated (it used to rotate only the queries)."""

import mlx.core as mx
import numpy as np
import pytest

from agentkv.format.quant import V1, V2, KVQuant
from agentkv.kv.batch import BatchQuantizedKVCache
from agentkv.kv.cache import AgentKVCache
from agentkv.kv.state import CacheState

FORMATS = [
    KVQuant(4, 4, **V1),
    KVQuant(4, 8, 32, **V1),
    KVQuant(4, 4, **V2),
    KVQuant(8, 4, key_scheme="token", rotate=True),
    KVQuant(8, 8, **V2, channel_tokens=32),
]


def _kv(tokens: int, seed: int, heads: int = 2, dim: int = 64):
    rng = np.random.default_rng(seed)
    k, v = rng.standard_normal((2, 1, heads, tokens, dim)).astype(np.float32)
    return mx.array(k), mx.array(v)


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(mx.array_equal(a, b)) if isinstance(a, mx.array) else a == b


@pytest.mark.parametrize("quant", FORMATS, ids=lambda q: q.identity)
def test_an_agent_cache_rebuilt_from_its_state_runs_the_next_step_identically(quant):
    cache = AgentKVCache(quant, window=None)
    cache.update_and_fetch(*_kv(77, seed=1))
    state = cache.state
    assert isinstance(state, CacheState) and state.offset == 77 and state.idx == 0
    assert (state.key_bits, state.key_scheme, bool(state.rotate)) == (
        quant.key_bits,
        quant.key_scheme,
        quant.rotate,
    )
    again = AgentKVCache.from_state(list(state))  # what mlx-lm reads back is a list
    assert again.quant == quant and again.offset == 77
    step = _kv(3, seed=2)
    assert _equal(cache.update_and_fetch(*step), again.update_and_fetch(*step))
    assert _equal(cache.tail, again.tail)


@pytest.mark.parametrize("quant", FORMATS, ids=lambda q: q.identity)
def test_a_batch_rebuilt_from_its_state_runs_the_next_step_identically(quant):
    caches = []
    for i, n in enumerate((40, 70)):
        c = AgentKVCache(quant)
        c.update_and_fetch(*_kv(n, seed=10 + i))
        caches.append(c)
    batch = BatchQuantizedKVCache.merge(caches)
    state = batch.state
    assert isinstance(state, CacheState) and state.start == 0
    assert state.idx == 70 and state.left_padding.tolist() == [30, 0]
    again = BatchQuantizedKVCache.from_state(list(state))
    assert again.quant == quant
    k = mx.concatenate([_kv(1, seed=20)[0]] * 2)
    v = mx.concatenate([_kv(1, seed=21)[0]] * 2)
    assert _equal(batch.update_and_fetch(k, v), again.update_and_fetch(k, v))
    assert _equal(batch.tails, again.tails)


def test_agent_states_of_the_old_layouts_still_load():
    for quant in (KVQuant(4, 4, 32, **V1), KVQuant(8, 4, **V2)):
        c = AgentKVCache(quant)
        c.update_and_fetch(*_kv(40, seed=7))
        fields = 8 if quant.version == 1 else 12  # what states held before CacheState
        again = AgentKVCache.from_state(list(c.state)[:fields])
        assert again.quant == quant
        assert _equal(again.keys_and_values(), c.keys_and_values())


def test_a_batch_state_of_the_old_layout_still_loads():
    c = AgentKVCache(KVQuant(4, 4, **V1))
    c.update_and_fetch(*_kv(20, seed=3))
    batch = BatchQuantizedKVCache.merge([c])
    s = batch.state
    old = [s.keys, s.values, s.offset, s.left_padding, s.idx, 0, 4, 4, 64]
    again = BatchQuantizedKVCache.from_state(old)
    assert again.quant == KVQuant(4, 4, **V1) and again._idx == 20
    assert _equal(again.keys_and_values(), batch.keys_and_values())


def test_a_state_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="8 to 14 fields"):
        AgentKVCache.from_state([None] * 5)
    with pytest.raises(ValueError, match="14 fields"):
        BatchQuantizedKVCache.from_state([None] * 10)


def test_rotated_token_keys_are_stored_rotated_so_attention_is_right():
    """KVQuant(key_scheme="token", rotate=True) rotates the queries in attention, so the keys
    and values it stores must be rotated too; 8 bits keep the result near exact attention."""
    quant = KVQuant(8, 8, key_scheme="token", rotate=True)
    k, v = _kv(50, seed=5)
    cache = AgentKVCache(quant)
    keys, values = cache.update_and_fetch(k, v)
    q = mx.array(np.random.default_rng(6).standard_normal((1, 2, 1, 64)).astype(np.float32))
    ours = cache.agentkv_attention(q, keys, values, scale=0.125, mask=None)
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    np.testing.assert_allclose(np.array(ours), np.array(exact), atol=2e-2)
    dk, dv = cache.dequantized()
    assert float(mx.abs(dk - k).max()) < 0.05 and float(mx.abs(dv - v).max()) < 0.05
