"""agentkv's CPU quantized matmul (csrc/core/qmm.h) for MLX's affine weights packed for it
(``mlx_adapter.pack_quantized``), against ``mx.dequantize`` + matmul: every bit width, group and
scale dtype it takes, odd sizes (padded to 16 columns), few and many rows; a row gives the same
bits alone or batched; AVX-512 VNNI, AVX2 and the portable path agree bit for bit; NaN/Inf
propagate; bad input is refused with a message. The packing is lossless, and packed rows
dequantize as MLX does. K-quant scales in two levels give the float32 scales' bits."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from agentkv import _ext, mlx_adapter

SCALES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def mlx_weights(n, k, bits, group, scale_dtype, seed=0):
    """MLX's affine layout, as nn.QuantizedLinear stores it."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(SCALES[scale_dtype]), b.astype(SCALES[scale_dtype])


def weights(n, k, bits, group, scale_dtype, seed=0):
    """Packed for agentkv's kernel."""
    q, s, b = mlx_weights(n, k, bits, group, scale_dtype, seed)
    return mlx_adapter.pack_quantized(q, s, b, bits=bits, group_size=group)


def reference(x, n, k, bits, group, scale_dtype, seed=0):
    q, s, b = mlx_weights(n, k, bits, group, scale_dtype, seed)
    w = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
    return np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T


def matmul(x, packed, group, bits, n):
    """The kernel's output, its padded columns checked (zeros) and cut."""
    out = np.array(_ext.quantized_matmul(x, *packed, group, bits))
    assert out.shape[-1] == -(-n // 16) * 16
    assert not out[..., n:].any()
    return out[..., :n]


def rows(m, k, seed=1, outliers=True):
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    if outliers:  # a few large channels, as real activations have
        x[:, 3] *= 40
        x[:, k // 2] *= -25
    return mx.array(x)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
def test_it_matches_dequantize_and_matmul(bits, group, scale_dtype):
    n, k = 77, group * 3
    packed = weights(n, k, bits, group, scale_dtype)
    for m in (1, 3, 8, 9, 17):
        x = rows(m, k, seed=m)
        ours = matmul(x, packed, group, bits, n)
        want = reference(x, n, k, bits, group, scale_dtype)
        assert ours.shape == (m, n) and ours.dtype == np.float32
        # int16 codes per 32 values: ~1e-5 of the output's scale
        np.testing.assert_allclose(ours, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_many_rows_and_leading_dimensions():
    packed = weights(130, 576, 4, 32, "float16", seed=3)
    x = mx.reshape(rows(2 * 157, 576, seed=4), (2, 157, 576))
    ours = matmul(x, packed, 32, 4, 130)
    want = reference(x.reshape(-1, 576), 130, 576, 4, 32, "float16", seed=3).reshape(2, 157, 130)
    np.testing.assert_allclose(ours, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_float16_inputs_come_back_float16():
    packed = weights(48, 64, 4, 64, "float16")
    x = rows(2, 64).astype(mx.float16)
    out = _ext.quantized_matmul(x, *packed, 64, 4)
    assert out.dtype == mx.float16
    want = reference(x.astype(mx.float32), 48, 64, 4, 64, "float16")
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_a_row_gives_the_same_bits_alone_or_batched(bits):
    packed = weights(300, 256, bits, 64, "float16", seed=5)
    x = rows(37, 256, seed=6)
    together = _ext.quantized_matmul(x, *packed, 64, bits)
    for i in (0, 5, 36):
        alone = _ext.quantized_matmul(x[i : i + 1], *packed, 64, bits)
        assert mx.array_equal(alone, together[i : i + 1])
    for start, count in ((3, 2), (8, 4), (16, 9)):  # tiles of 2, 4, and 8 + 1 rows
        part = _ext.quantized_matmul(x[start : start + count], *packed, 64, bits)
        assert mx.array_equal(part, together[start : start + count])


def k_quant_weights(n, k, bits, seed=0):
    """MLX-layout codes with K-quant scales and biases (float32 d * sc and -dmin * m, d and
    dmin float16 of either sign a row and 256 K, sc and m 6-bit), and the factors d, -dmin."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    q, _, _ = mx.quantize(w, group_size=32, bits=bits)  # any codes
    signs = rng.choice([-1, 1], (n, k // 256))
    d, dmin = ((rng.uniform(1e-4, 2e-3, (n, k // 256)) * signs).astype(np.float16) for _ in "ab")
    sc, m = (rng.integers(0, 64, (n, k // 32)).astype(np.float32) for _ in "ab")
    scales = np.repeat(d.astype(np.float32), 8, axis=1) * sc
    biases = -(np.repeat(dmin.astype(np.float32), 8, axis=1) * m)
    return q, mx.array(scales), mx.array(biases), mx.array(d), mx.array(-dmin)


def two_level(q, s, b, fd, fb, bits):
    codes, ps, pb = mlx_adapter.pack_quantized(q, s, b, bits=bits, group_size=32)
    return (codes, ps, pb), (codes, _ext.pack_super_scales(ps, fd), _ext.pack_super_scales(pb, fb))


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_two_level_scales_give_the_bits_of_the_float32_ones(bits):
    """K-quant scales held as a float16 factor a row and 256 K and one byte a group
    (``_ext.pack_super_scales``): 1.25 bytes a group and column instead of 4, and every
    output and every dequantized row bit for bit what the float32 scales give."""
    n, k = 77, 768
    q, s, b, fd, fb = k_quant_weights(n, k, bits, seed=bits)
    f32, ours = two_level(q, s, b, fd, fb, bits)
    assert ours[1].dtype == ours[2].dtype == mx.uint8
    assert ours[1].shape == ours[2].shape == (5, k // 256, 160)
    assert ours[1].nbytes * 4 == f32[1].nbytes * 1.25
    x = rows(37, k, seed=3)
    want = np.array(_ext.quantized_matmul(x, *f32, 32, bits))
    for m in (1, 2, 3, 8, 9, 37):  # every tile size, alone and batched
        got = np.array(_ext.quantized_matmul(x[:m], *ours, 32, bits))
        np.testing.assert_array_equal(got, want[:m])
    ids = mx.array([[0, 15, 16], [76, 31, 40]])
    np.testing.assert_array_equal(
        np.array(mlx_adapter.packed_rows(ours, ids, bits=bits, group_size=32)),
        np.array(mlx_adapter.packed_rows(f32, ids, bits=bits, group_size=32)),
    )


def test_two_level_scales_are_refused_where_the_factors_do_not_give_the_floats():
    q, s, b, fd, fb = k_quant_weights(40, 512, 4, seed=2)
    codes, ps, pb = mlx_adapter.pack_quantized(q, s, b, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"not float\(d\) \* m"):
        _ext.pack_super_scales(ps, fd * 3)  # m = sc / 3: not an integer
    with pytest.raises(ValueError, match=r"not float\(d\) \* m"):
        _ext.pack_super_scales(pb, fd)  # the scales' factors for the biases
    with pytest.raises(ValueError, match="super float16"):
        _ext.pack_super_scales(ps, fd.astype(mx.float32))
    with pytest.raises(ValueError, match="super float16"):
        _ext.pack_super_scales(ps, fd[:20])
    with pytest.raises(ValueError, match="or two-level uint8"):
        _ext.quantized_matmul(rows(2, 512), codes, _ext.pack_super_scales(ps, fd), pb, 32, 4)


PORTABLE_CHECK = """
import sys, numpy as np, mlx.core as mx
import agentkv
from agentkv import _ext, mlx_adapter
rng = np.random.default_rng(9)
out = []
for bits, group, dt in (
    (4, 32, mx.float16), (8, 32, mx.float16), (8, 64, mx.bfloat16), (4, 128, mx.float32),
    (5, 32, mx.float32), (5, 64, mx.float16), (5, 128, mx.bfloat16),
):
    w = mx.array(rng.standard_normal((45, 640)).astype(np.float32))  # 3 blocks of 16 columns
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    packed = mlx_adapter.pack_quantized(q, s.astype(dt), b.astype(dt), bits=bits, group_size=group)
    for m in (1, 2, 3, 5, 8, 13):  # tiles of 1-8 rows (AVX2: up to 4)
        x = rng.standard_normal((m, 640)).astype(np.float32)
        x[:, 7] *= 50  # an outlier channel
        out.append(np.array(_ext.quantized_matmul(mx.array(x), *packed, group, bits)))
for bits in (4, 5):  # two-level (K-quant) scales: 1 and 3 super-blocks
    for k in (256, 768):
        w = mx.array(rng.standard_normal((45, k)).astype(np.float32))
        q, _, _ = mx.quantize(w, group_size=32, bits=bits)
        d = [mx.array(rng.uniform(-2e-3, 2e-3, (45, k // 256)).astype(np.float16)) for _ in "ab"]
        f = [np.repeat(np.array(v.astype(mx.float32)), 8, 1) for v in d]
        s, b = (mx.array(v * rng.integers(0, 64, v.shape).astype(np.float32)) for v in f)
        codes, ps, pb = mlx_adapter.pack_quantized(q, s, b, bits=bits, group_size=32)
        packed = (codes, _ext.pack_super_scales(ps, d[0]), _ext.pack_super_scales(pb, d[1]))
        for m in (1, 3, 8, 13):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            out.append(np.array(_ext.quantized_matmul(x, *packed, 32, bits)))
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
    packed = weights(32, 64, 4, 32, "float16")
    x = np.array(rows(3, 64, outliers=False))
    x[0, 10] = np.nan
    x[1, 40] = np.inf
    out = np.array(_ext.quantized_matmul(mx.array(x), *packed, 32, 4))
    assert np.isnan(out[0]).all() and not np.isfinite(out[1]).any()
    clean = np.array(_ext.quantized_matmul(mx.array(x[2:]), *packed, 32, 4))
    np.testing.assert_array_equal(out[2:], clean)
    assert np.isfinite(clean).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "4-, 5- or 8-bit"),
        ({"group": 16}, "groups of 32, 64 or 128"),
        ({"x": mx.zeros((2, 63))}, "does not match"),
        ({"x": mx.zeros((2, 64), mx.int32)}, "floating point"),
        ({"scales": mx.zeros((2, 3, 16), mx.float16)}, "scales and biases"),
        ({"scales": mx.zeros((2, 2, 16), mx.float32)}, "scales and biases"),
        ({"w": mx.zeros((2, 512), mx.float32)}, "packed codes"),
        ({"w": mx.zeros((32, 8), mx.uint32)}, "packed codes"),  # MLX's own layout
    ],
)
def test_bad_input_is_refused_with_a_message(change, message):
    q, s, b = weights(32, 64, 4, 32, "float16")
    args = {"x": rows(2, 64), "w": q, "scales": s, "biases": b, "group": 32, "bits": 4}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _ext.quantized_matmul(
            args["x"], args["w"], args["scales"], args["biases"], args["group"], args["bits"]
        )


def pack_in_array_ops(weight, scales, biases, bits, group):
    """The packed layout (csrc/core/qmm.h) as a move of MLX arrays: the definition the
    extension's packer is held to."""
    n, k = weight.shape[0], weight.shape[1] * 32 // bits
    blocks, pad = -(-n // 16), -n % 16
    raw = mx.view(weight, mx.uint8)  # little-endian words: codes in K order
    if bits == 4:
        codes = mx.stack([raw & 15, raw >> 4], axis=-1).reshape(n, k)
    elif bits == 5:  # a bit stream: k at bits 5k .. 5k + 4
        stream = mx.stack([(raw >> i) & 1 for i in range(8)], axis=-1).reshape(n, k, 5)
        codes = sum(stream[..., i] << i for i in range(5)).astype(mx.uint8)
    else:
        codes = raw
    codes = mx.pad(codes, [(0, pad), (0, 0)])
    quads = codes.reshape(blocks, 16, k // 32, 8, 4)  # [block, column, 32-block, quad, t]
    fifth = None
    if bits == 5:  # per quad, the 64 codes' fifth bits as a little-endian 64-bit mask
        high = (quads >> 4).transpose(0, 2, 3, 1, 4).reshape(blocks, k // 32, 8, 8, 8)
        fifth = sum(high[..., i] << i for i in range(8)).astype(mx.uint8)
        quads = quads & 15
    if bits != 8:  # quad 2p in the low nibbles, 2p + 1 in the high ones
        halves = quads.reshape(blocks, 16, k // 32, 4, 2, 4)
        quads = halves[..., 0, :] | (halves[..., 1, :] << 4)
    packed = quads.transpose(0, 2, 3, 1, 4).reshape(blocks, k // 32, -1)
    if fifth is not None:
        packed = mx.concatenate([packed, fifth.reshape(blocks, k // 32, 64)], axis=-1)
    packed = packed.reshape(blocks, -1)

    def by_block(a):
        return mx.pad(a, [(0, pad), (0, 0)]).reshape(blocks, 16, -1).transpose(0, 2, 1)

    return packed, by_block(scales), by_block(biases)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [16, 77, 130])
def test_the_packer_moves_every_code_where_the_layout_says(bits, group, n):
    q, s, b = mlx_weights(n, group * 4, bits, group, "bfloat16", seed=n)
    ours = mlx_adapter.pack_quantized(q, s, b, bits=bits, group_size=group)
    for got, want in zip(ours, pack_in_array_ops(q, s, b, bits, group)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 2}, "4-, 5- or 8-bit"),
        ({"group": 16}, "groups of 32, 64 or 128"),
        ({"w": mx.zeros((20, 7), mx.uint32)}, "multiple of the group"),
        ({"scales": mx.zeros((20, 3), mx.float16)}, "scales and biases"),
    ],
)
def test_the_packer_refuses_bad_input_with_a_message(change, message):
    q, s, b = mlx_weights(20, 64, 4, 32, "float16")
    args = {"w": q, "scales": s, "biases": b, "group": 32, "bits": 4, **change}
    with pytest.raises(ValueError, match=message):
        mlx_adapter.pack_quantized(
            args["w"], args["scales"], args["biases"], bits=args["bits"], group_size=args["group"]
        )


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_packing_is_lossless_and_packed_rows_dequantize_as_mlx(bits, group):
    n, k = 77, 256
    q, s, b = mlx_weights(n, k, bits, group, "float32", seed=11)
    codes, ps, pb = mlx_adapter.pack_quantized(q, s, b, bits=bits, group_size=group)
    assert codes.dtype == mx.uint8 and codes.shape == (5, k * 2 * bits)
    assert ps.shape == pb.shape == (5, k // group, 16)
    # the scales and biases, moved (zeros for the 3 padded columns)
    for ours, theirs in ((ps, s), (pb, b)):
        flat = np.array(ours).transpose(0, 2, 1).reshape(80, -1)
        np.testing.assert_array_equal(flat[:n], theirs)
        assert not flat[n:].any()
    # and the codes: every row comes back as MLX dequantizes it (float32 scales: exactly)
    ids = mx.array([[0, 15, 16], [76, 31, 40]])
    ours = np.array(mlx_adapter.packed_rows((codes, ps, pb), ids, bits=bits, group_size=group))
    want = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits))[np.array(ids)]
    assert ours.shape == (2, 3, k) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, want)


def test_layers_whose_outputs_are_not_a_multiple_of_16_are_cut_back():
    """A vocabulary of 50,257 (GPT-2's) or any N: the packed columns past N are cut, as the
    embedding's rows past it are never asked for."""
    import mlx.nn as nn

    mx.random.seed(3)
    model = nn.Module()
    model.proj = nn.QuantizedLinear(64, 77, bias=True, group_size=32, bits=4)
    model.embed = nn.QuantizedEmbedding(77, 64, group_size=64, bits=8)
    x = rows(5, 64, outliers=False)
    ids = mx.array([[0, 76, 15, 16]])
    want_proj, want_rows = model.proj(x), model.embed(ids).astype(mx.float32)
    want_head = model.embed.as_linear(x)
    assert mlx_adapter.use_cpu_quantized_matmul(model) == 2
    assert model.proj.weight.dtype == mx.uint8 and model.proj.agentkv_outputs == 77
    assert model.proj(x).shape == (5, 77) and model.embed.as_linear(x).shape == (5, 77)
    np.testing.assert_allclose(np.array(model.proj(x)), np.array(want_proj), atol=1e-3)
    np.testing.assert_allclose(np.array(model.embed.as_linear(x)), np.array(want_head), atol=1e-3)
    np.testing.assert_allclose(np.array(model.embed(ids)), np.array(want_rows), atol=1e-3)
