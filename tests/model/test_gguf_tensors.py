"""agentkv's GGUF tensor reader (``model.gguf_tensors``): every type kept as shipped gives,
through MLX's own ``dequantize``, bit for bit the values of the ``gguf`` package's
dequantization; the types MLX reads give the arrays ``mx.load`` gives; the requantized
types stay within their stated error; a type nobody reads is refused by name."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from agentkv.errors import ModelImportError
from agentkv.model.gguf_tensors import (
    GROUP,
    LOSSLESS_BITS,
    REQUANTIZED_BITS,
    GGUFTensor,
    convert_tensor,
    read_gguf,
    requantize_8bit,
)
from agentkv.model.load import embedded_gguf_path

# Where each type keeps its float16 super-scale(s) in a block (the rest is codes and
# sub-block scales, any bytes of which are valid).
_F16_AT = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q3_K": (108,),
    "Q2_K": (80, 82),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> GGUFTensor:
    """A tensor of GGML type ``kind`` with random blocks: random codes and sub-scales,
    finite float16 super-scales of either sign."""
    rng = np.random.default_rng(seed)
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for at in _F16_AT[kind]:
        d = rng.uniform(1e-3, 0.05, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
        blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    return GGUFTensor(f"blk.0.{kind}.weight", kind, (rows, cols), raw.nbytes, raw)


def reference(tensor: GGUFTensor) -> np.ndarray:
    kind = GGMLQuantizationType[tensor.ggml_type]
    return np.asarray(quants.dequantize(tensor.raw, kind), np.float32).reshape(tensor.shape)


def dequantized(converted) -> np.ndarray:
    """The stored values in float32 (as agentkv's CPU kernel reads them: float16 scales and
    biases widened exactly)."""
    a = converted.arrays
    s, b = (a[k].astype(mx.float32) for k in ("scales", "biases"))
    return np.array(mx.dequantize(a["weight"], s, b, group_size=GROUP, bits=converted.bits))


@pytest.mark.parametrize("kind", sorted(LOSSLESS_BITS))
def test_types_kept_as_shipped_dequantize_bit_for_bit_as_the_gguf_package(kind):
    tensor = random_tensor(kind, 48, 512, seed=len(kind))
    converted = convert_tensor(tensor)
    assert (converted.bits, converted.how) == (LOSSLESS_BITS[kind], "lossless")
    want = reference(tensor)
    got = dequantized(converted)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


def test_q4_k_is_4_bit_affine_in_groups_of_32_with_float32_scale_and_bias():
    tensor = random_tensor("Q4_K", 16, 256, seed=3)
    a = convert_tensor(tensor).arrays
    assert a["weight"].dtype == mx.uint32 and a["weight"].shape == (16, 256 * 4 // 32)
    assert a["scales"].shape == a["biases"].shape == (16, 256 // GROUP)
    assert a["scales"].dtype == a["biases"].dtype == mx.float32


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quants_keep_their_super_block_factors_for_two_level_scales(kind):
    """Each super-block's float16 d and -dmin, from which the CPU kernel holds the scales
    and biases (``_ext.pack_super_scales``: d times an integer, the same floats): resident
    within 3% of the file's bytes (float32 scales alone: 4.5 -> 6 bits a weight)."""
    tensor = random_tensor(kind, 32, 512, seed=4)
    converted = convert_tensor(tensor)
    supers = converted.supers
    assert set(supers) == {"scales", "biases"}
    assert all(f.dtype == mx.float16 and f.shape == (32, 2) for f in supers.values())
    for part in ("scales", "biases"):
        values = np.array(converted.arrays[part]).reshape(32, 2, 8)
        factor = np.array(supers[part]).astype(np.float32)[..., None]
        m = values / factor
        assert ((m == np.rint(m)) & (m >= 0) & (m <= 63)).all()
        np.testing.assert_array_equal(factor * m, values)
    assert converted.nbytes <= 1.03 * tensor.file_bytes
    assert convert_tensor(random_tensor("Q8_0", 32, 512)).supers == {}


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_other_types_are_requantized_to_8_bits_within_half_a_step(kind):
    tensor = random_tensor(kind, 32, 512, seed=7)
    converted = convert_tensor(tensor)
    assert (converted.bits, converted.how) == (REQUANTIZED_BITS, "requantized")
    want = reference(tensor).reshape(32, -1, GROUP)
    got = dequantized(converted).reshape(32, -1, GROUP)
    step = np.array(converted.arrays["scales"].astype(mx.float32)).reshape(32, -1, 1)
    low = want.min(axis=-1, keepdims=True)
    # half a step, plus the float16 rounding of the group's minimum (the bias)
    bound = step / 2 + np.abs(low) * 2.0**-11 + 1e-7
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() > 0  # a real requantization, not a copy


def test_requantize_8bit_keeps_a_constant_group_exact():
    values = np.full((2, 1, GROUP), 0.25, np.float32)
    q, scale, bias = requantize_8bit(values)
    assert (q == 0).all() and (scale == 0).all() and (bias == np.float16(0.25)).all()


def test_the_types_mlx_reads_come_out_as_mx_load_gives_them():
    path = embedded_gguf_path()
    loaded = mx.load(str(path))
    tensors = {t.name: t for t in read_gguf(path).tensors}
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight"):
        tensor = tensors[name]
        assert tensor.ggml_type in ("Q8_0", "Q4_1")
        arrays = convert_tensor(tensor).arrays
        stem = name.removesuffix(".weight")
        for part, key in (
            ("weight", name),
            ("scales", f"{stem}.scales"),
            ("biases", f"{stem}.biases"),
        ):
            want = loaded[key]
            assert arrays[part].dtype == want.dtype, (name, part)
            assert mx.array_equal(arrays[part], want), (name, part)


def test_a_type_nothing_reads_is_refused_by_tensor_and_type():
    raw = np.zeros((4, 8 * 40), np.uint8)  # Q8_1: llama.cpp's activation type, no reader
    tensor = GGUFTensor("blk.2.ffn_up.weight", "Q8_1", (4, 256), raw.nbytes, raw)
    with pytest.raises(ModelImportError, match=r"blk\.2\.ffn_up\.weight.*Q8_1"):
        convert_tensor(tensor)


def test_a_row_not_a_multiple_of_32_is_refused_by_name():
    raw = np.zeros((4, 16), np.float16)
    floats = GGUFTensor("blk.0.attn_k.weight", "F16", (4, 16), raw.nbytes, raw)
    assert convert_tensor(floats).bits is None  # floats take any shape
    q = random_tensor("Q8_0", 4, 64)
    odd = GGUFTensor(q.name, "Q8_0", (2, 48), q.file_bytes, q.raw)
    with pytest.raises(ModelImportError, match=r"blk\.0\.Q8_0\.weight.*multiple of 32"):
        convert_tensor(odd)
