"""agentkv's CPU row operations (csrc/core/rows.h): RMS normalization, rotary embedding and
the SwiGLU gate as one graph operation each, against MLX's own ``mx.fast.rms_norm`` /
``mx.fast.rope`` / mlx-lm's ``swiglu``, on strided inputs, per-row offsets, and every row
alone == in a batch, bit for bit."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from agentkv import _ext, mlx_adapter

ROPE_CASES = [  # (shape, dims, traditional, base, scale, offset)
    ((1, 9, 1, 64), 64, False, 10000.0, 1.0, 130),  # one decode token, the embedded model
    ((2, 3, 17, 64), 64, True, 10000.0, 1.0, 0),
    ((2, 4, 5, 96), 32, False, 500000.0, 0.5, 7),  # only the first 32 features rotate
    ((3, 11, 48), 48, False, 10000.0, 1.0, 4000),  # 3 axes: [B, L, D]
]


@pytest.mark.parametrize(("shape", "dims", "traditional", "base", "scale", "offset"), ROPE_CASES)
def test_rope_matches_mlx(shape, dims, traditional, base, scale, offset):
    mx.random.seed(1)
    x = mx.random.normal(shape)
    kw = dict(traditional=traditional, base=base, scale=scale, offset=offset)
    theirs = mx.fast.rope(x, dims, **kw)
    ours = _ext.rope(x, dims, **kw)
    # float32 angles: both round position * frequency, to ~1e-7 of the angle
    tol = 1e-5 + 5e-7 * (offset + shape[-2]) * scale
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=tol)
    np.testing.assert_array_equal(np.array(ours[..., dims:]), np.array(x[..., dims:]))


def test_rope_reads_strided_inputs_and_per_row_offsets():
    """The model hands over queries [B, L, H, D] transposed to [B, H, L, D] (a view), and a
    batch of agents one start position each."""
    mx.random.seed(2)
    x = mx.random.normal((3, 5, 4, 64)).transpose(0, 2, 1, 3)
    starts = mx.array([0, 250, 4097])
    kw = dict(traditional=False, base=10000.0, scale=1.0)
    ours = _ext.rope(x, 64, offset=starts, **kw)
    np.testing.assert_allclose(
        np.array(ours), np.array(mx.fast.rope(x, 64, offset=starts, **kw)), atol=2e-3
    )
    for b in range(3):  # each row alone, at its own start: the same bits
        alone = _ext.rope(x[b : b + 1], 64, offset=int(starts[b]), **kw)
        assert mx.array_equal(alone, ours[b : b + 1])


def test_rope_with_frequencies_matches_mlx():
    mx.random.seed(3)
    x = mx.random.normal((1, 2, 6, 64))
    freqs = mx.random.uniform(1.0, 5000.0, (32,))
    kw = dict(traditional=False, base=None, scale=1.0, offset=11, freqs=freqs)
    np.testing.assert_allclose(
        np.array(_ext.rope(x, 64, **kw)), np.array(mx.fast.rope(x, 64, **kw)), atol=1e-5
    )


def test_rms_norm_matches_mlx_and_rows_are_alone():
    mx.random.seed(4)
    x = mx.random.normal((4, 7, 579)) * 3  # a width that is not a multiple of 8
    w = mx.random.normal((579,))
    ours = _ext.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(
        np.array(ours), np.array(mx.fast.rms_norm(x, w, 1e-5)), rtol=1e-5, atol=1e-5
    )
    assert mx.array_equal(_ext.rms_norm(x[2:3, 4:5], w, 1e-5), ours[2:3, 4:5])
    strided = x.transpose(1, 0, 2)
    assert mx.array_equal(_ext.rms_norm(strided, w, 1e-5), ours.transpose(1, 0, 2))


@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 300, 1536), (3, 7), (5,)])
def test_silu_mul_matches_mlx_lm_swiglu(shape):
    from mlx_lm.models.activations import swiglu

    mx.random.seed(5)
    gate = mx.random.normal(shape) * 8  # far into both tails of the sigmoid
    up = mx.random.normal(shape)
    ours = _ext.silu_mul(gate, up)
    np.testing.assert_allclose(np.array(ours), np.array(swiglu(gate, up)), rtol=2e-6, atol=1e-7)
    if len(shape) > 1:  # strided views are read in place, and a row alone is the same bits
        t = _ext.silu_mul(gate.swapaxes(0, -1), up.swapaxes(0, -1))
        assert mx.array_equal(t, ours.swapaxes(0, -1))
        assert mx.array_equal(_ext.silu_mul(gate[:1], up[:1]), ours[:1])


def test_the_model_s_swiglu_runs_on_agentkv_on_cpu_only_for_float32():
    import mlx_lm.models.llama as llama

    original, ours = mlx_adapter._cpu_swiglu()
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=32, num_key_value_heads=1,
    )  # fmt: skip
    model = llama.Model(args)
    mlx_adapter.use_cpu_swiglu(model)
    assert llama.swiglu is ours
    g = mx.random.normal((2, 64))
    assert mx.array_equal(llama.swiglu(g, g), _ext.silu_mul(g, g))
    half = g.astype(mx.float16)  # not ours: mlx-lm's own
    assert mx.array_equal(llama.swiglu(half, half), original(half, half))
    assert mlx_adapter.use_cpu_swiglu(model) == 0  # switched once


def test_nan_propagates_like_mlx():
    x = mx.ones((2, 1, 3, 64))
    x[1, 0, 1, 5] = float("nan")
    w = mx.ones((64,))
    norm = np.isnan(np.array(_ext.rms_norm(x, w, 1e-5)))
    assert norm[1, 0, 1].all() and norm.sum() == 64
    gate = np.isnan(np.array(_ext.silu_mul(x, x)))
    assert gate[1, 0, 1, 5] and gate.sum() == 1
    rope = np.isnan(np.array(_ext.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=3)))
    assert np.array_equal(
        rope,
        np.isnan(np.array(mx.fast.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=3))),
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: _ext.rms_norm(mx.ones((2, 8), mx.float16), mx.ones((8,), mx.float16), 1e-5),
            "float32",
        ),
        (lambda: _ext.rms_norm(mx.ones((2, 8)), mx.ones((7,)), 1e-5), "do not match"),
        (lambda: _ext.silu_mul(mx.ones((2, 8)), mx.ones((2, 7))), "same shape"),
        (lambda: _ext.silu_mul(mx.ones((2,), mx.float16), mx.ones((2,), mx.float16)), "float32"),
        (
            lambda: _ext.rope(mx.ones((2, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0),
            "3 axes",
        ),
        (
            lambda: _ext.rope(
                mx.ones((1, 2, 8)), 7, traditional=False, base=1e4, scale=1.0, offset=0
            ),
            "even",
        ),
        (
            lambda: _ext.rope(
                mx.ones((1, 2, 8)), 8, traditional=False, base=None, scale=1.0, offset=0
            ),
            "one of them",
        ),
        (
            lambda: _ext.rope(
                mx.ones((2, 2, 8)),
                8,
                traditional=False,
                base=1e4,
                scale=1.0,
                offset=mx.array([1, 2, 3]),
            ),
            "one per batch row",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_modules_switch_and_keep_other_dtypes_on_mlx():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(64)
            self.rope = nn.RoPE(64)

    block = Block()
    assert mlx_adapter.use_cpu_row_ops(block) == 2
    assert type(block.norm) is mlx_adapter.CPURMSNorm and type(block.rope) is mlx_adapter.CPURoPE
    x = mx.random.normal((1, 2, 3, 64))
    np.testing.assert_allclose(
        np.array(block.rope(x, offset=5)),
        np.array(mx.fast.rope(x, 64, traditional=False, base=10000, scale=1.0, offset=5)),
        atol=1e-5,
    )
    half = x.astype(mx.float16)  # not ours: MLX's own path
    assert mx.array_equal(block.norm(half), nn.RMSNorm.__call__(block.norm, half))
    assert mx.array_equal(block.rope(half, offset=2), nn.RoPE.__call__(block.rope, half, offset=2))
