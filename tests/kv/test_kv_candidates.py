"""The candidate KV formats of ``bench kv-candidates``: each simulation stores what it claims."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import attention_atol

from agentkv.benchmarks.kv_candidates import (
    CANDIDATES,
    FP16,
    Candidate,
    Kind,
    SimulatedCache,
    fake_quantize,
)


def keys_with_outlier_channels(tokens=128, dim=64, seed=0):
    """Keys like a real model's: a few channels sit far from zero, with their usual spread."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, tokens, dim)).astype(np.float32)
    x[..., [3, 17]] = 2 * x[..., [3, 17]] + 60
    return mx.array(x)


def error(a, b) -> float:
    return float(mx.sqrt(((a - b) ** 2).mean()))


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    x = keys_with_outlier_channels()
    token = error(fake_quantize(x, Kind()), x)
    channel = error(fake_quantize(x, Kind(scheme="channel")), x)
    rotated = error(fake_quantize(x, Kind(rotate=True)), x)
    assert channel < token / 4
    assert rotated < token  # the rotation spreads the outliers over every channel


def test_rotation_is_undone_and_more_bits_mean_less_error():
    x = keys_with_outlier_channels(seed=1)
    exact = fake_quantize(x, Kind(bits=16, rotate=True))
    assert error(exact, x) < 0.05  # float16 storage only
    errors = [error(fake_quantize(x, Kind(bits=b, scheme="channel")), x) for b in (4, 5, 8)]
    assert errors[0] > errors[1] > errors[2]


def test_token_scales_keep_small_rows_next_to_large_ones_and_k8_layers_get_8_bits():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 64, 64)).astype(np.float32)
    x[:, :, ::8] *= 50  # one row in 8 is 50x larger
    x = mx.array(x)
    small = [i for i in range(64) if i % 8]
    plain = fake_quantize(x, Kind(scheme="channel"))[:, :, small]
    scaled = fake_quantize(x, Kind(scheme="channel", token_scales=True))[:, :, small]
    assert error(scaled, x[:, :, small]) < error(plain, x[:, :, small]) / 4
    cand = Candidate("c", Kind(scheme="channel"), Kind(), k8_layers=(1,))
    assert [cand.for_layer(i).keys.bits for i in range(3)] == [4, 8, 4]


def test_the_filling_block_stays_float16_and_sinks_stay_exact():
    cand = Candidate("t", Kind(scheme="channel"), Kind(), sinks=4)
    cache = SimulatedCache(cand)
    x = keys_with_outlier_channels(tokens=100, seed=2)
    v = keys_with_outlier_channels(tokens=100, seed=3)
    keys, values = cache.update_and_fetch(x[:, :, :40], v[:, :, :40])
    assert keys.shape[2] == 40 and cache.offset == 40
    assert error(keys, fake_quantize(x[:, :, :40], FP16)) == 0  # no block complete yet
    keys, values = cache.update_and_fetch(x[:, :, 40:], v[:, :, 40:])
    assert keys.shape == x.shape and values.shape == v.shape
    # The first block (64 tokens) is quantized, except its 4 sinks; the rest still fills.
    assert error(keys[:, :, :4], fake_quantize(x[:, :, :4], FP16)) == 0
    assert error(keys[:, :, 4:64], x[:, :, 4:64]) > 0.01
    assert error(keys[:, :, 64:], fake_quantize(x[:, :, 64:], FP16)) == 0
    assert error(values[:, :, :4], fake_quantize(v[:, :, :4], FP16)) == 0
    assert error(values[:, :, 4:], v[:, :, 4:]) > 0.01


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.name)
def test_bytes_per_token_of_each_candidate(cand):
    per_token = cand.bytes_per_token(30, 3, 64)
    if cand.name == "fp16":
        assert per_token == 23040
    elif cand.k8_layers:  # 32 more bytes of key words per head and token
        assert per_token == 6480 + len(cand.k8_layers) * 3 * 32
    elif cand.keys.token_scales:  # a float16 per key row
        assert per_token == 6480 + 30 * 3 * 2
    elif cand.keys.bits == 4 and cand.values.bits == 4:
        # 4-bit with a float16 scale and bias per 64 values (or per 32 for g32 keys).
        assert per_token == (6840 if cand.keys.group == 32 else 6480)
    else:  # more bits somewhere: more bytes than the 4-bit default, fewer than fp16
        assert 6480 < per_token < 23040


def test_the_simulation_stores_and_attends_like_the_real_cache():
    """Today's formats simulated == the same formats in agentkv's real cache (the same
    values read back, the same attention), so a candidate's figures are the format's."""
    from agentkv.format.quant import V1, KVQuant
    from agentkv.kernels.attention import cache_attention
    from agentkv.kv.cache import AgentKVCache

    by_name = {c.name: c for c in CANDIDATES}
    k = keys_with_outlier_channels(tokens=100, seed=4)
    v = keys_with_outlier_channels(tokens=100, seed=5) / 10
    q = mx.random.normal((1, 6, 100, 64), key=mx.random.key(6))
    for name, quant in (("q4 (today)", KVQuant(4, 4, **V1)), ("k8v4 (today)", KVQuant(8, 4, **V1))):
        sim_k, sim_v = SimulatedCache(by_name[name]).update_and_fetch(k, v)
        real = AgentKVCache(quant)
        real_k, real_v = real.update_and_fetch(k, v)
        for stored, simulated, bits in ((real_k, sim_k, quant.key_bits), (real_v, sim_v, 4)):
            w, scales, biases = stored
            read = mx.dequantize(
                w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=bits
            )[:, :, :100]
            assert mx.array_equal(read, simulated), name
        ours = cache_attention(q, real_k, real_v, scale=0.125, mask="causal", quant=quant)
        theirs = mx.fast.scaled_dot_product_attention(q, sim_k, sim_v, scale=0.125, mask="causal")
        assert mx.allclose(ours, theirs, atol=attention_atol(quant)), name


@pytest.mark.slow
def test_quality_measures_on_the_real_model(engine):
    """fp16 simulated == the real fp16 cache through the model; KL and top-1 of a format
    against itself are 0 and all. (Through 30 layers, 4-bit formats are chaotic: a 1e-6
    difference in summation order flips a rounding and moves logits by ~1, so only fp16 is
    compared end to end.)"""
    from agentkv.benchmarks.kv_candidates import _segment_logprobs
    from agentkv.benchmarks.quality import compare, window_logprobs
    from agentkv.format.quant import V1, KVQuant

    model = engine.loaded.model
    ids = engine.loaded.tokenizer.encode("def add(a, b):\n    return a + b\n" * 30)[:600]
    scored = 64
    targets = mx.array(ids[len(ids) - scored :])
    spec = engine.loaded.spec
    ref = window_logprobs(model, spec, ids, KVQuant(16, 16, **V1), len(ids) - scored)
    simulated = _segment_logprobs(model, ids, CANDIDATES[0], scored)
    assert simulated.shape == ref.shape == (scored, ref.shape[-1])
    assert float(mx.abs(ref - simulated).max()) < 0.05
    _, kl_same, top1_same = compare(ref, ref, targets)
    assert kl_same == 0 and top1_same == scored
    q4 = window_logprobs(model, spec, ids, KVQuant(4, 4, **V1), len(ids) - scored)
    nll, kl, top1 = compare(q4, ref, targets)
    assert kl > 0 and 0 < top1 <= scored and math.isfinite(nll)
