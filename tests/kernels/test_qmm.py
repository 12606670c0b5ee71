"""agentkv's CPU quantized matmul (csrc/core/qmm.h) for MLX's affine weights, against
``mx.dequantize`` + matmul: every bit width, group and scale dtype it takes, odd sizes, few and
many rows; a row gives the same bits alone or batched; AVX2 and the portable path agree bit
for bit; NaN/Inf propagate; bad input is refused with a message."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from agentkv import _ext

SCALES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def weights(n, k, bits, group, scale_dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(SCALES[scale_dtype]), b.astype(SCALES[scale_dtype])


def reference(x, q, s, b, group, bits):
    w = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
    return np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T


def rows(m, k, seed=1, outliers=True):
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    if outliers:  # a few large channels, as real activations have
        x[:, 3] *= 40
        x[:, k // 2] *= -25
    return mx.array(x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
def test_it_matches_dequantize_and_matmul(bits, group, scale_dtype):
    n, k = 77, group * 3
    q, s, b = weights(n, k, bits, group, scale_dtype)
    for m in (1, 3, 17):
        x = rows(m, k, seed=m)
        ours = np.array(_ext.quantized_matmul(x, q, s, b, group, bits))
        want = reference(x, q, s, b, group, bits)
        assert ours.shape == (m, n) and ours.dtype == np.float32
        # int16 codes per 32 values: ~1e-5 of the output's scale
        np.testing.assert_allclose(ours, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_many_rows_and_leading_dimensions():
    q, s, b = weights(130, 576, 4, 32, "float16", seed=3)
    x = mx.reshape(rows(2 * 157, 576, seed=4), (2, 157, 576))
    ours = np.array(_ext.quantized_matmul(x, q, s, b, 32, 4))
    want = reference(x.reshape(-1, 576), q, s, b, 32, 4).reshape(2, 157, 130)
    np.testing.assert_allclose(ours, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_float16_inputs_come_back_float16():
    q, s, b = weights(40, 64, 4, 64, "float16")
    x = rows(2, 64).astype(mx.float16)
    out = _ext.quantized_matmul(x, q, s, b, 64, 4)
    assert out.dtype == mx.float16
    want = reference(x.astype(mx.float32), q, s, b, 64, 4)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gives_the_same_bits_alone_or_batched(bits):
    q, s, b = weights(300, 256, bits, 64, "float16", seed=5)
    x = rows(37, 256, seed=6)
    together = _ext.quantized_matmul(x, q, s, b, 64, bits)
    for i in (0, 5, 36):
        alone = _ext.quantized_matmul(x[i : i + 1], q, s, b, 64, bits)
        assert mx.array_equal(alone, together[i : i + 1])
    pair = _ext.quantized_matmul(x[3:5], q, s, b, 64, bits)
    assert mx.array_equal(pair, together[3:5])


PORTABLE_CHECK = """
import sys, numpy as np, mlx.core as mx
import agentkv
from agentkv import _ext
rng = np.random.default_rng(9)
out = []
for bits, group, dt in ((4, 32, mx.float16), (8, 64, mx.bfloat16), (4, 128, mx.float32)):
    w = mx.array(rng.standard_normal((45, 640)).astype(np.float32))  # 20 groups of 32: 16 + 4
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    for m in (1, 2, 3, 6, 13):  # every tile: 1 x 4 weight rows, 2 x 2, 4 x 1 (VNNI: 2, 3, 4, 8 x 4)
        x = mx.array(rng.standard_normal((m, 640)).astype(np.float32))
        out.append(np.array(_ext.quantized_matmul(x, q, s.astype(dt), b.astype(dt), group, bits)))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print(_ext.build_info()["qmm"])
"""


def test_the_portable_path_gives_the_same_bits_as_the_vector_path(tmp_path):
    """Every implementation this CPU has (AVX-512 VNNI, AVX2, portable): the same bits."""
    results = {}
    envs = {"default": {}, "avx2": {"AGENTKV_QMM": "avx2"}, "portable": {"AGENTKV_QMM": "portable"}}
    for name, env in envs.items():
        path = tmp_path / f"{name}.npy"
        run = subprocess.run(
            [sys.executable, "-c", PORTABLE_CHECK, str(path)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        results[name] = (run.stdout.strip(), np.load(path))
    assert results["portable"][0] == "portable"
    assert results["default"][0] in ("avx512-vnni", "avx2", "portable")
    assert results["avx2"][0] in ("avx2", "portable")
    for name in ("default", "avx2"):
        np.testing.assert_array_equal(results[name][1], results["portable"][1])


def test_nan_and_inf_propagate_to_their_row_only():
    q, s, b = weights(20, 64, 4, 32, "float16")
    x = np.array(rows(3, 64, outliers=False))
    x[0, 10] = np.nan
    x[1, 40] = np.inf
    out = np.array(_ext.quantized_matmul(mx.array(x), q, s, b, 32, 4))
    assert np.isnan(out[0]).all() and not np.isfinite(out[1]).any()
    clean = np.array(_ext.quantized_matmul(mx.array(x[2:]), q, s, b, 32, 4))
    np.testing.assert_array_equal(out[2:], clean)
    assert np.isfinite(clean).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "4- or 8-bit"),
        ({"group": 16}, "groups of 32, 64 or 128"),
        ({"x": mx.zeros((2, 63))}, "does not match"),
        ({"x": mx.zeros((2, 64), mx.int32)}, "floating point"),
        ({"scales": mx.zeros((20, 3), mx.float16)}, "scales and biases"),
        ({"w": mx.zeros((20, 8), mx.float32)}, "uint32"),
    ],
)
def test_bad_input_is_refused_with_a_message(change, message):
    q, s, b = weights(20, 64, 4, 32, "float16")
    args = {"x": rows(2, 64), "w": q, "scales": s, "biases": b, "group": 32, "bits": 4}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _ext.quantized_matmul(
            args["x"], args["w"], args["scales"], args["biases"], args["group"], args["bits"]
        )
