"""GGUF tensors as MLX arrays: agentkv's own reader of GGUF's quantized types.

MLX's GGUF reader (``mx.load``) knows Q4_0, Q4_1 and Q8_0; the files people ship are
K-quant mixes (Q4_K_M: Q4_K and Q6_K, with Q5_0/Q5_1/Q8_0 where a row is not a multiple of
256). The ``gguf`` package reads the metadata and each tensor's raw blocks; this module
turns the blocks into MLX's affine format (``W = scale * q + bias`` per group along a row;
docs/compute.md), which agentkv's CPU kernel and ``mx.quantized_matmul`` run:

============  ==========================================================================
GGML type     becomes
============  ==========================================================================
Q4_0, Q4_1    4-bit affine, groups of 32, float16 scales and biases: **lossless**
Q5_0, Q5_1    5-bit affine, groups of 32, float16: **lossless**
Q8_0          8-bit affine, groups of 32, float16 (codes + 128, bias -128 d): **lossless**
Q4_K, Q5_K    4/5-bit affine, groups of 32 (the 8 sub-blocks of a 256 super-block), float32
              scales ``d * sc`` and biases ``-dmin * m``: both exact products of a float16
              and a 6-bit integer, so **lossless**; with each super-block's ``d`` and
              ``-dmin`` (``Converted.supers``), from which agentkv's CPU kernel holds the
              scales in two levels, 1.25 bytes a group and column instead of 4
              (``_ext.pack_super_scales``, the same floats)
Q6_K, Q2_K,   groups of 16 (or codebooks) that MLX's groups of 32-128 cannot hold: the exact
Q3_K, IQ*     float values requantized to 8-bit affine, groups of 32, float16 (the error is
              at most half a step of 8 bits over the group: ``requantize_8bit``)
F32, F16,     floats (F32 and F16 as float16 in a quantized import, as MLX's reader did;
BF16          BF16 kept as bfloat16)
============  ==========================================================================

Every lossless conversion is tested bit for bit against the ``gguf`` package's own
dequantization (tests/model/test_gguf_tensors.py); for the types MLX reads, the arrays are
the ones ``mx.load`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ModelImportError

GROUP = 32  # every quantized tensor's group along a row

#: How each quantized GGML type is kept: (bits, "lossless" or "requantized").
LOSSLESS_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
REQUANTIZED_BITS = 8
SUPER_GROUPS = 8  # a K-quant super-block's groups of 32
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGML type, its shape as rows x columns (numpy order,
    GGUF's ``ne`` reversed), its bytes in the file and its raw data (blocks or floats)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    file_bytes: int
    raw: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (plain Python values: str, int, float, lists) and tensors."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


@dataclass(frozen=True)
class Converted:
    """A tensor in MLX's terms: ``arrays`` holds ``weight`` (float) or ``weight``, ``scales``
    and ``biases`` (affine, ``bits`` and groups of ``GROUP``); ``how`` is "float",
    "lossless" or "requantized"."""

    arrays: dict[str, mx.array]
    bits: int | None
    how: str
    #: K-quants: each super-block's float16 factor of the scales (``d``) and of the biases
    #: (``-dmin``), [rows, K / 256], for the CPU kernel's two-level scales
    supers: dict[str, mx.array] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes agentkv's CPU kernel holds: with ``supers``, the codes and two-level
        scales and biases (per row and 256 K: a float16 factor and 8 one-byte multipliers
        each); else the arrays."""
        if not self.supers:
            return sum(a.nbytes for a in self.arrays.values())
        two_level = sum(a.nbytes + a.size * SUPER_GROUPS for a in self.supers.values())
        return self.arrays["weight"].nbytes + two_level


@dataclass
class ImportReport:
    """What an import kept quantized, requantized or converted, per GGML type: tensors, the
    file's bytes and the resident bytes of what they became."""

    rows: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def add(self, tensor: GGUFTensor, converted: Converted) -> None:
        kept = converted.how if converted.bits is None else f"{converted.bits}-bit {converted.how}"
        row = self.rows.setdefault((tensor.ggml_type, kept), [0, 0, 0])
        row[0] += 1
        row[1] += tensor.file_bytes
        row[2] += converted.nbytes

    def as_json(self) -> list[dict]:
        return [
            {"type": t, "kept": kept, "tensors": n, "file_bytes": f, "resident_bytes": r}
            for (t, kept), (n, f, r) in sorted(self.rows.items())
        ]

    def notes(self) -> list[str]:
        """One line for each type that was not kept as shipped."""
        lines = []
        for (t, kept), (n, _, _) in sorted(self.rows.items()):
            if "requantized" in kept:
                lines.append(f"{n} {t} tensor(s) requantized to {kept} (groups of {GROUP})")
            elif kept == "float" and t not in FLOAT_TYPES:
                lines.append(f"{n} {t} tensor(s) dequantized to floats")
        return lines


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of a GGUF file (memory-mapped: nothing is converted yet)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises ValueError, struct errors, ...
        raise ModelImportError(f"cannot read {Path(path).name} as a GGUF file: {exc}") from None
    metadata = {}
    for name, entry in reader.fields.items():
        if name.startswith("GGUF."):  # the header's own fields
            continue
        metadata[name] = entry.contents()
    tensors = [
        GGUFTensor(
            name=t.name,
            ggml_type=t.tensor_type.name,
            shape=tuple(int(n) for n in reversed(t.shape.tolist())),
            file_bytes=int(t.n_bytes),
            raw=t.data,
        )
        for t in reader.tensors
    ]
    return GGUFFile(metadata, tensors)


def check_tensor(tensor: GGUFTensor, *, float32: bool = False) -> None:
    """Raise ModelImportError, naming the tensor and its type, if ``convert_tensor`` cannot
    convert it (reads no data: an import checks every tensor before it converts any)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    kind = tensor.ggml_type
    if kind in FLOAT_TYPES:
        return
    if kind not in _LOSSLESS:
        try:  # one block of zeros: whether the gguf package dequantizes the type
            qtype = GGMLQuantizationType[kind]
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except (NotImplementedError, KeyError, ValueError) as exc:
            raise ModelImportError(
                f"tensor {tensor.name} is of GGML type {kind}, which agentkv cannot read "
                f"({type(exc).__name__}: {exc})"
            ) from None
    if not float32 and (tensor.shape[-1] % GROUP != 0 or len(tensor.shape) != 2):
        raise ModelImportError(
            f"tensor {tensor.name} ({kind}, shape {list(tensor.shape)}): agentkv runs "
            f"quantized matrices whose rows are a multiple of {GROUP} weights"
        )


def convert_tensor(tensor: GGUFTensor, *, float32: bool = False) -> Converted:
    """``tensor`` in MLX's terms: quantized as the table above says, or dequantized to
    float32 (``float32``). Raises ModelImportError naming the tensor and its type where
    neither agentkv nor the ``gguf`` package can read the type (``check_tensor``)."""
    check_tensor(tensor, float32=float32)
    kind = tensor.ggml_type
    if kind in FLOAT_TYPES:
        return Converted({"weight": _float_array(tensor, float32)}, None, "float")
    if float32:
        return Converted({"weight": mx.array(_dequantized(tensor))}, None, "float")
    rows, supers = tensor.shape[0], {}
    convert = _LOSSLESS.get(kind)
    if convert is not None:
        q, scales, biases, *factors = convert(_blocks(tensor))
        bits = LOSSLESS_BITS[kind]
        how = "lossless"
        if factors:
            parts = ("scales", "biases")
            supers = {k: mx.array(f.reshape(rows, -1)) for k, f in zip(parts, factors)}
    else:
        values = _dequantized(tensor).reshape(tensor.shape[0], -1, GROUP)
        q, scales, biases = requantize_8bit(values)
        bits, how = REQUANTIZED_BITS, "requantized"
    arrays = {
        "weight": mx.array(_pack_codes(q.reshape(rows, -1), bits).view(np.uint32)),
        "scales": mx.array(scales.reshape(rows, -1)),
        "biases": mx.array(biases.reshape(rows, -1)),
    }
    return Converted(arrays, bits, how, supers)


def requantize_8bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float values [..., GROUP] as 8-bit affine codes with float16 scales and biases: the
    bias is the group's minimum and the scale its range over 255, both rounded to float16,
    and each code the nearest step from that bias (clipped to 0..255). Any value is within
    half a step (``scale / 2``, ~0.2% of the group's range) plus float16's rounding of the
    bias (the error test_gguf_tensors.py checks)."""
    low = values.min(axis=-1, keepdims=True)
    high = values.max(axis=-1, keepdims=True)
    bias = low.astype(np.float16)
    scale = ((high - bias.astype(np.float32)) / 255).astype(np.float16)
    step = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step > 0, np.rint((values - bias.astype(np.float32)) / step), 0)
    q = np.clip(codes, 0, 255).astype(np.uint8)
    return q, scale[..., 0], bias[..., 0]


# -- the lossless types ------------------------------------------------------------------------


def _blocks(tensor: GGUFTensor) -> np.ndarray:
    """The raw blocks of a quantized tensor, [blocks, bytes per block] uint8."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.ggml_type]]
    return np.ascontiguousarray(tensor.raw).view(np.uint8).reshape(-1, size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 32-weight nibble runs: bytes [.., 16] -> codes [.., 32] (low nibbles are
    weights 0-15, high nibbles 16-31)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: 4 bytes (a little-endian uint32, bit j for weight j) ->
    [.., 32] of 0 or 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << 4


def _q4_0(b: np.ndarray):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, d * np.float16(-8)


def _q4_1(b: np.ndarray):
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), d, d * np.float16(-16)


def _q5_1(b: np.ndarray):
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray):
    d = _f16(b, 0)
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, d * np.float16(-128)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, ...]:
    """A Q4_K/Q5_K super-block's float32 scales and biases, [blocks, 8]: d * sc and
    -dmin * m, with the 6-bit sc and m unpacked from their 12 bytes (bytes 0-3: sc 0-3 and
    the top bits of sc 4-7; 4-7: m 0-3 and the top bits of m 4-7; 8-11: the low nibbles of
    sc 4-7 and m 4-7); then the float16 factors d and -dmin, [blocks, 1]."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[:, 4:16]
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d.astype(np.float32) * sc.astype(np.float32)
    return scales, -(dmin.astype(np.float32) * m.astype(np.float32)), d, -dmin


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 code bytes -> [blocks, 8, 32]: sub-block 2j is the low nibbles of
    bytes 32j .. 32j + 31, sub-block 2j + 1 their high nibbles."""
    pairs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray):
    return _k_nibbles(b[:, 16:144]), *_k_scales(b)


def _q5_k(b: np.ndarray):
    qh = b[:, 16:48].reshape(-1, 1, 32)  # bit i of byte l: weight l of sub-block i
    high = ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    return _k_nibbles(b[:, 48:176]) | high, *_k_scales(b)


_LOSSLESS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
}


# -- helpers -----------------------------------------------------------------------------------


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, K] (uint8) in MLX's packing: element k of a row at bit ``k * bits`` of
    the row's little-endian bit stream (4 bits: byte p holds k = 2p, 2p + 1)."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
    if bits == 5:  # 8 codes -> 40 bits -> 5 bytes
        eight = codes.reshape(codes.shape[0], -1, 8).astype(np.uint64)
        word = np.zeros(eight.shape[:-1], dtype=np.uint64)
        for i in range(8):
            word |= eight[..., i] << np.uint64(5 * i)
        as_bytes = word[..., None].view(np.uint8).reshape(*word.shape, 8)[..., :5]
        return np.ascontiguousarray(as_bytes.reshape(codes.shape[0], -1))
    raise ValueError(f"no packing for {bits}-bit codes")


def _float_array(tensor: GGUFTensor, float32: bool) -> mx.array:
    raw = np.ascontiguousarray(tensor.raw).reshape(tensor.shape)
    if tensor.ggml_type == "BF16":
        value = mx.view(mx.array(raw.view(np.uint16)), mx.bfloat16)
        return value.astype(mx.float32) if float32 else value
    return mx.array(raw).astype(mx.float32 if float32 else mx.float16)


def _dequantized(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's exact float32 values, by the ``gguf`` package's own dequantization."""
    from gguf import GGMLQuantizationType, quants

    try:
        values = quants.dequantize(tensor.raw, GGMLQuantizationType[tensor.ggml_type])
    except (NotImplementedError, KeyError) as exc:
        raise ModelImportError(
            f"tensor {tensor.name} is of GGML type {tensor.ggml_type}, which agentkv cannot "
            f"read ({exc})"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(tensor.shape)
