"""The candidate KV formats of ``bench kv-candidates``: each simulation stores what it claims."""

import mlx.core as mx
import numpy as np
import pytest
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
    elif cand.keys.bits == 4 and cand.values.bits == 4:
        # 4-bit with a float16 scale and bias per 64 values (or per 32 for g32 keys).
        assert per_token == (6840 if cand.keys.group == 32 else 6480)
    else:  # more bits somewhere: more bytes than the 4-bit default, fewer than fp16
        assert 6480 < per_token < 23040
