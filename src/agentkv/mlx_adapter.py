"""Everything agentkv needs to know about mlx-lm's internals, in one place: no other module
of agentkv imports ``mlx_lm`` (tests/test_layering.py checks it).

mlx-lm models call ``mlx_lm.models.base.scaled_dot_product_attention(queries,
keys, values, cache=..., scale=..., mask=...)``, which picks mlx-lm's quantized
SDPA only by ``hasattr(cache, "bits")`` and supports one bit width for keys and
values. ``install_attention_dispatch`` wraps that function once so that a cache
with an ``agentkv_attention`` method (``AgentKVCache``) runs its own attention;
every other cache takes mlx-lm's path unchanged. Model modules bind the
function by name at import, so each loaded ``mlx_lm.models.*`` module is
rebound too; call it again after importing a new model architecture.

``make_batch_invariant`` swaps a model's float32 linear layers (and a tied
embedding's output projection) for agentkv's batch-invariant GEMM on CPU, so
a row's result does not depend on which other rows share the matmul.

The rest names what agentkv uses of mlx-lm, pinned to 0.32.2 (its cache serialization
changed between 0.32.0 and 0.32.2): loading, sampling, its cache classes and masks, and its
prompt-cache files.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import _ext
from .errors import ModelImportError
from .format.spec import LayerKind, LayerSpec, ModelCacheSpec

_ORIGINAL = "__agentkv_original__"


def install_attention_dispatch() -> None:
    import mlx_lm.models.base as base

    current = base.scaled_dot_product_attention
    original = getattr(current, _ORIGINAL, current)

    if current is original:

        def dispatch(queries, keys, values, cache, scale, mask, sinks=None):
            attend = getattr(cache, "agentkv_attention", None)
            if attend is not None:
                return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        setattr(dispatch, _ORIGINAL, original)
        base.scaled_dot_product_attention = dispatch
        current = dispatch

    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None:
            if getattr(module, "scaled_dot_product_attention", None) is original:
                module.scaled_dot_product_attention = current
    gemma2 = sys.modules.get("mlx_lm.models.gemma2")
    if gemma2 is not None and not hasattr(gemma2.Attention.__call__, _ORIGINAL):
        gemma2.Attention.__call__ = _softcapped_attention(gemma2.Attention.__call__)


def _softcapped_attention(original):
    """Gemma 2's attention computes its soft-capped scores itself rather than through
    mlx-lm's ``scaled_dot_product_attention``: over an agentkv cache, the same projections,
    rotary embeddings and cache update (mlx-lm 0.32's ``gemma2.Attention``), then the cache's
    attention with the cap (c * tanh(s / c) of each scaled score s, before the mask).

    mlx-lm's ``GemmaModel`` makes one mask (an array), from layer 0's cache, for every layer;
    over agentkv caches every other layer has Gemma 2's sliding window (``cache_spec_of``),
    so each layer makes its own from its cache, as the model would have from that cache."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        attend = getattr(cache, "agentkv_attention", None)
        if attend is None:
            return original(self, x, mask, cache)
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        if isinstance(mask, mx.array):  # layer 0's cache's; this layer's, before the update
            mask = cache.make_mask(L, return_array=True, window_size=None)
        keys, values = cache.update_and_fetch(keys, values)
        out = attend(
            queries, keys, values, scale=self.scale, mask=mask,
            softcap=float(self.attn_logit_softcapping),
        )  # fmt: skip
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    setattr(__call__, _ORIGINAL, original)
    return __call__


class InvariantLinear(nn.Linear):
    """A float32 linear layer on agentkv's batch-invariant GEMM (same weights, in place)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _ext.invariant_linear(x, self.weight, self.get("bias"))


class InvariantTiedEmbedding(nn.Embedding):
    """An embedding whose output projection (tied lm_head) is batch-invariant."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _ext.invariant_linear(x, self.weight)


PACK_COLUMNS = 16  # output columns side by side in agentkv's packed weights (csrc/core/qmm.h)


def pack_quantized(
    weight: mx.array, scales: mx.array, biases: mx.array, *, bits: int, group_size: int
) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's affine weights (``nn.QuantizedLinear``'s uint32 ``weight`` [N, K * bits / 32],
    ``scales`` and ``biases`` [N, K / group_size]) in the layout agentkv's CPU quantized matmul
    reads (csrc/core/qmm.h): codes uint8 [N' / 16, K * 2 * bits] where each 32 K of 16
    columns is 8 "quads" of 64 bytes (byte 4 n + t: column n's code at k = 4 j + t; at 4
    bits quads 2p and 2p + 1 share bytes, low and high nibble), scales and biases
    [N' / 16, K / group_size, 16]. N' is N rounded up to 16 (zero columns). Lossless: the
    same codes, scales and biases, moved (``_ext.pack_quantized``, evaluated; tests hold it
    to the same move in MLX array ops)."""
    return _ext.pack_quantized(weight, scales, biases, group_size, bits)


@functools.cache
def _row_offsets(k: int, bits: int) -> mx.array:
    """Byte offsets, within a packed block row, of column 0's codes in K order (4 and 5 bits:
    each byte's two nibbles, quads 2p and 2p + 1)."""
    quads = 8 if bits == 8 else 4
    block = mx.arange(k // 32).reshape(-1, 1, 1) * (PACK_COLUMNS * 32 * bits // 8)
    return (block + mx.arange(quads).reshape(1, -1, 1) * 64 + mx.arange(4)).reshape(-1)


_FIFTH_BITS = PACK_COLUMNS * 32 // 2  # 5 bits: where a block's fifth bits start


@functools.cache
def _fifth_bit_offsets(k: int) -> tuple[mx.array, mx.array]:
    """5 bits: for column 0's code at each k, the byte offset of its fifth bit within a
    packed block row and that bit's position in the byte (add 4 * lane to the bit)."""
    j, t = mx.arange(32) // 4, mx.arange(32) % 4
    block = mx.arange(k // 32).reshape(-1, 1) * (PACK_COLUMNS * 32 * 5 // 8)
    return (block + _FIFTH_BITS + 8 * j).reshape(-1), mx.broadcast_to(t, (k // 32, 32)).reshape(-1)


def packed_rows(
    packed: tuple[mx.array, mx.array, mx.array], ids: mx.array, *, bits: int, group_size: int
) -> mx.array:
    """Rows ``ids`` of packed weights, dequantized to float32 (``scale * code + bias`` in
    float32: a GGUF Q8_0/Q4_0/Q4_1 row exactly as llama.cpp dequantizes it)."""
    codes, scales, biases = packed
    width, groups = codes.shape[1], scales.shape[1]
    k = width // (2 * bits)
    flat = ids.reshape(-1).astype(mx.int32)
    block, lane = flat // PACK_COLUMNS, flat % PACK_COLUMNS
    at = (block * width + lane * 4)[:, None] + _row_offsets(k, bits)
    raw = codes.reshape(-1)[at]  # [T, K * bits / 8]
    if bits != 8:
        raw = raw.reshape(raw.shape[0], -1, 4)  # [T, blocks * 4 (p), 4 (t)]
        raw = mx.stack([raw & 15, raw >> 4], axis=-2)  # [T, blocks * 4, 2, 4]: K order
    if bits == 5:
        byte, t = _fifth_bit_offsets(k)
        bit = t + 4 * lane[:, None]  # [T, K]: 0 .. 63 within the quad's mask
        fifth = codes.reshape(-1)[(block * width)[:, None] + byte + bit // 8]
        raw = raw.reshape(raw.shape[0], -1) | (((fifth >> (bit % 8).astype(mx.uint8)) & 1) << 4)
    groups = k // 32 if scales.dtype == mx.uint8 else groups
    q = raw.reshape(-1, groups, k // groups).astype(mx.float32)
    s, b = (_group_values(a, block, lane)[..., None] for a in (scales, biases))
    return (q * s + b).reshape(*ids.shape, k)


def _group_values(packed: mx.array, block: mx.array, lane: mx.array) -> mx.array:
    """The float32 scales or biases [T, K / group] of packed columns (``block``, ``lane``):
    as stored, or from two-level ones (``_ext.pack_super_scales``: d * m, exact)."""
    if packed.dtype != mx.uint8:
        return packed[block, :, lane].astype(mx.float32)
    rows = packed[block]  # [T, K / 256, 160]
    d = mx.take_along_axis(
        mx.contiguous(rows[..., :32]).view(mx.float16), lane[:, None, None], axis=2
    )  # [T, K / 256, 1]
    m = rows[..., 32:].reshape(*rows.shape[:2], 8, PACK_COLUMNS)
    m = mx.take_along_axis(m, lane[:, None, None, None], axis=3)[..., 0]  # [T, K / 256, 8]
    return (d.astype(mx.float32) * m.astype(mx.float32)).reshape(rows.shape[0], -1)


def _packed_matmul(module: nn.Module, x: mx.array, n: int) -> mx.array:
    """x @ W^T on a module's packed weights, the padded columns past ``n`` cut."""
    out = _ext.quantized_matmul(
        x, module["weight"], module["scales"], module["biases"], module.group_size, module.bits
    )
    return out if out.shape[-1] == n else out[..., :n]


class CPUQuantizedLinear(nn.QuantizedLinear):
    """A quantized linear layer on agentkv's CPU quantized matmul, its weights packed for it
    (``pack_quantized``; ``agentkv_outputs``: N before padding)."""

    agentkv_outputs: int

    def __call__(self, x: mx.array) -> mx.array:
        out = _packed_matmul(self, x, self.agentkv_outputs)
        return out + self["bias"] if "bias" in self else out


class CPUQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding on packed weights: its rows come out in float32
    (``packed_rows``), its output projection (tied lm_head) is agentkv's kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        packed = (self["weight"], self["scales"], self["biases"])
        return packed_rows(packed, x, bits=self.bits, group_size=self.group_size)

    def as_linear(self, x: mx.array) -> mx.array:
        return _packed_matmul(self, x, self.num_embeddings)


def _pack_module(module: nn.Module, supers: tuple[mx.array, mx.array] | None = None) -> bool:
    """Replace a quantized module's MLX-layout arrays by packed ones (evaluated, so the
    originals are freed one module at a time); with ``supers`` (a K-quant's float16
    super-block factors of its scales and biases, [N, K / 256]) its scales and biases in two
    levels (``_ext.pack_super_scales``: the same floats in 1.25 bytes a group and column, not
    4). Returns whether they are; factors that do not give the float32 values bit for bit
    (a damaged or stale file) leave them float32."""
    n = module["weight"].shape[0]
    packed = pack_quantized(
        module["weight"], module["scales"], module["biases"],
        bits=module.bits, group_size=module.group_size,
    )  # fmt: skip
    two_level = False
    if supers is not None and module.group_size == 32 and packed[1].dtype == mx.float32:
        try:
            two = [_ext.pack_super_scales(p, f) for p, f in zip(packed[1:], supers)]
            packed = (packed[0], *two)
            two_level = True
        except ValueError:
            pass
    module["weight"], module["scales"], module["biases"] = packed
    if isinstance(module, nn.QuantizedLinear):
        module.agentkv_outputs = n
    return two_level


class CPURMSNorm(nn.RMSNorm):
    """RMS normalization as one agentkv operation on CPU (MLX's CPU fallback for
    ``mx.fast.rms_norm`` is eight graph operations)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return super().__call__(x)
        return _ext.rms_norm(x, self["weight"], self.eps)


class CPURoPE(nn.RoPE):
    """``nn.RoPE`` as one agentkv operation on CPU (MLX's CPU fallback for
    ``mx.fast.rope`` is ~15 graph operations)."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if x.dtype != mx.float32:
            return super().__call__(x, offset)
        return _ext.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
            offset=offset,
        )  # fmt: skip


@functools.cache
def _llama3_rope():
    """(mlx-lm's Llama3RoPE, agentkv's CPU subclass of it), made once."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    class CPULlama3RoPE(Llama3RoPE):
        """mlx-lm's Llama 3 RoPE (frequencies given) as one agentkv operation on CPU."""

        def __call__(self, x: mx.array, offset=0) -> mx.array:
            if x.dtype != mx.float32:
                return super().__call__(x, offset)
            return _ext.rope(
                x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                offset=offset, freqs=self._freqs,
            )  # fmt: skip

    return Llama3RoPE, CPULlama3RoPE


def use_cpu_row_ops(model: nn.Module) -> int:
    """Route a model's ``nn.RMSNorm`` and RoPE modules (``nn.RoPE``, mlx-lm's Llama 3 RoPE)
    through agentkv's CPU operations; other norms and RoPE variants stay on ``mx.fast``.
    Each row is computed alone, as before. Returns how many were switched."""
    llama3, cpu_llama3 = _llama3_rope()
    kinds = {nn.RMSNorm: CPURMSNorm, nn.RoPE: CPURoPE, llama3: cpu_llama3}
    switched = 0
    for _, module in model.named_modules():
        ours = kinds.get(type(module))
        if ours is not None:
            module.__class__ = ours
            switched += 1
    return switched


@functools.cache
def _cpu_swiglu():
    """mlx-lm's ``swiglu`` (silu(gate) * up), as one agentkv operation for float32 on CPU."""
    from mlx_lm.models.activations import swiglu as original

    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if (
            gate.dtype == x.dtype == mx.float32
            and gate.shape == x.shape
            and mx.default_device() == mx.cpu
        ):
            return _ext.silu_mul(gate, x)
        return original(gate, x)

    return original, swiglu


def use_cpu_swiglu(model: nn.Module) -> int:
    """Route mlx-lm's ``swiglu`` through agentkv's CPU operation in the model modules this
    model's classes come from (mlx-lm imports it by name into each: ``from .activations
    import swiglu``); MLX's compiled version runs its exp one value at a time on x86.
    Returns how many modules were switched."""
    original, ours = _cpu_swiglu()
    switched = 0
    for name in {type(m).__module__ for _, m in model.named_modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "swiglu", None) is original:
            module.swiglu = ours
            switched += 1
    return switched


@dataclasses.dataclass(frozen=True)
class FusedLayer:
    """A Llama-family block's weights and shape as ``_ext.decoder_layer`` takes them
    (``arguments``: every keyword but the input and the KV cache's; ``predict``: the next
    block's query weights, for KVSwap's reading ahead, where that block is fused too)."""

    arguments: dict
    predict: dict | None = None

    def next_query(self) -> dict:
        """This block's input norm and query projection as ``decoder_layer``'s ``predict``
        arguments (the block before it predicts its query with them)."""
        a = self.arguments
        return {
            "predict": [*a["norms"][:1], *a["linears"][:3], a["linear_biases"][0]]
            + [a["qk_norms"][0] if a["qk_norms"] is not None else None],
            "predict_bits": a["bits"][0],
            "predict_group": a["groups"][0],
        }


# mlx-lm modules whose TransformerBlock is the Llama block (Qwen2's adds q/k/v biases,
# Qwen3's an RMSNorm of each q and k head).
_FUSABLE_BLOCKS = ("llama", "qwen2", "qwen3")


def _subclasses(names, attribute: str, class_name: str, make_call, doc) -> dict[type, type]:
    """{mlx-lm's ``attribute`` class of each model module in ``names``: agentkv's subclass of
    it, whose ``__call__`` is ``make_call(that class)`` and docstring ``doc(name)``}."""
    import importlib

    out = {}
    for name in names:
        base = getattr(importlib.import_module(f"mlx_lm.models.{name}"), attribute)
        namespace = {"__call__": make_call(base), "__doc__": doc(name), "__module__": __name__}
        out[base] = type(class_name, (base,), namespace)
    return out


@functools.cache
def _fused_blocks() -> dict[type, type]:
    """{mlx-lm's TransformerBlock of each fusable architecture: agentkv's CPU subclass of it},
    made once."""

    def make_call(block):
        def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
            run = getattr(cache, "fused_layer", None)
            if run is not None and x.dtype == mx.float32:
                out = run(self.agentkv_fused, x)
                if out is not None:
                    return out
            return block.__call__(self, x, mask, cache)

        return __call__

    return _subclasses(
        _FUSABLE_BLOCKS, "TransformerBlock", "CPUFusedBlock", make_call,
        lambda name: f"mlx-lm's {name} block, run as one agentkv operation where its cache "
        "offers one (``fused_layer``: the block pool's CPU steps), else as mlx-lm's.",
    )  # fmt: skip


def _fused_layer(block) -> FusedLayer | None:
    """What ``_ext.decoder_layer`` needs of ``block``, or None where it cannot run it (a
    layer not on agentkv's quantized matmul, another norm or RoPE)."""
    attn, mlp = block.self_attn, block.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    norms = [block.input_layernorm, block.post_attention_layernorm]
    _, cpu_llama3 = _llama3_rope()
    rope = attn.rope
    qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if (qk[0] is None) != (qk[1] is None) or any(
        n is not None and type(n) is not CPURMSNorm for n in qk
    ):
        return None
    if (
        any(type(m) is not CPUQuantizedLinear for m in linears)
        or any(m.agentkv_outputs % PACK_COLUMNS for m in linears)
        or any(type(n) is not CPURMSNorm for n in norms)
        or norms[0].eps != norms[1].eps
        or type(rope) not in (CPURoPE, cpu_llama3)
        or type(mlp).__name__ != "MLP"
    ):
        return None
    llama3 = type(rope) is cpu_llama3
    return FusedLayer(
        {
            "norms": [n["weight"] for n in norms],
            "eps": norms[0].eps,
            "linears": [m[part] for m in linears for part in ("weight", "scales", "biases")],
            "bits": [m.bits for m in linears],
            "groups": [m.group_size for m in linears],
            "heads": attn.n_heads,
            "kv_heads": attn.n_kv_heads,
            "attention_scale": attn.scale,
            "rope_dims": rope.dims,
            "rope_traditional": rope.traditional,
            "rope_base": None if llama3 else rope.base,
            "rope_scale": 1.0 if llama3 else rope.scale,
            "rope_freqs": rope._freqs if llama3 else None,
            "linear_biases": [m["bias"] if "bias" in m else None for m in linears],
            "qk_norms": [n["weight"] for n in qk] if qk[0] is not None else None,
            "qk_eps": qk[0].eps if qk[0] is not None else 0.0,
        }
    )


def use_fused_layers(model: nn.Module) -> int:
    """Let a Llama, Qwen2 or Qwen3 model's blocks run as one agentkv operation each on the block
    pool's CPU decode steps (``_ext.decoder_layer``: the same kernels and bits as the
    block's separate operations, without scheduling ~40 graph operations a layer). Call
    after ``use_cpu_quantized_matmul``, ``use_cpu_row_ops`` and ``use_cpu_swiglu``.
    Returns how many blocks were switched."""
    fused_classes = _fused_blocks()
    switched = 0
    for _, module in model.named_modules():
        fused_class = fused_classes.get(type(module))
        if fused_class is not None:
            fused = _fused_layer(module)
            if fused is not None:
                module.__class__ = fused_class
                object.__setattr__(module, "agentkv_fused", fused)
                switched += 1
    for _, module in model.named_modules():  # each fused block learns the next one's query
        blocks = getattr(module, "layers", None)
        if isinstance(blocks, list):
            for block, after in zip(blocks, blocks[1:]):
                here, there = (getattr(b, "agentkv_fused", None) for b in (block, after))
                if here is not None and there is not None:
                    predict = there.next_query()
                    object.__setattr__(block, "agentkv_fused", FusedLayer(here.arguments, predict))
    return switched


# -- a GPU's joint projections -------------------------------------------------------------

# The linear layers of one module that mlx-lm's blocks call on the same input, one after
# another: attention's query, key and value projections, the MLP's gate and up projections.
_JOINT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
JOINT_ENV = "AGENTKV_GPU_JOINT"  # "0": every projection its own matmul on a GPU too


class JointLinear(nn.Module):
    """Linear layers over one input as one matmul: their weights stacked along the outputs,
    the result cut back into each layer's part (views, no copy). The parts
    (``JointPart``) stand where the layers stood; the first to see an input computes all of
    them, the others take theirs, and the joint lets go of them once as many were taken as
    there are parts (a part called again on that input computes the matmul again)."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = linear
        object.__setattr__(self, "_cuts", [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)])
        object.__setattr__(self, "_count", len(sizes))
        # [the input, its parts, parts left to take]: a step's arrays, never past its layer
        object.__setattr__(self, "_held", [None, None, 0])

    def part(self, x: mx.array, index: int) -> mx.array:
        held = self._held
        if held[0] is not x:
            held[:] = x, mx.split(self.linear(x), self._cuts, axis=-1), self._count
        out = held[1][index]
        held[2] -= 1
        if not held[2]:
            held[:] = None, None, 0
        return out


class JointPart(nn.Module):
    """One layer's share of a ``JointLinear`` (it holds no weights; the joint does)."""

    def __init__(self, joint: JointLinear, index: int):
        super().__init__()
        object.__setattr__(self, "_joint", joint)
        object.__setattr__(self, "_index", index)

    def __call__(self, x: mx.array) -> mx.array:
        return self._joint.part(x, self._index)


def _joint_of(layers: list[nn.Module]) -> JointLinear | None:
    """One ``JointLinear`` doing ``layers``' matmuls, or None where they cannot be one (other
    kinds, inputs, quantizations, dtypes or biases)."""
    first = layers[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not kind for m in layers):
        return None
    keys = sorted(first.keys())
    if any(sorted(m.keys()) != keys for m in layers):
        return None
    if any(m[k].dtype != first[k].dtype or m[k].shape[1:] != first[k].shape[1:]
           for m in layers for k in keys):  # fmt: skip
        return None
    quantized = kind is nn.QuantizedLinear
    if quantized and any(
        (m.bits, m.group_size, m.mode) != (first.bits, first.group_size, first.mode) for m in layers
    ):
        return None
    sizes = [m["weight"].shape[0] for m in layers]
    # 32-bit words of packed codes a row (3, 5 and 6 bits do not divide 32)
    inputs = first["weight"].shape[1] * 32 // first.bits if quantized else first["weight"].shape[1]
    bias = "bias" in first
    joint = (
        nn.QuantizedLinear(inputs, sum(sizes), bias, first.group_size, first.bits, first.mode)
        if quantized
        else nn.Linear(inputs, sum(sizes), bias)
    )  # its own (lazy, never computed) weights replaced below
    if sorted(joint.keys()) != keys:  # parts the layers do not have, or the other way round
        return None
    joint.update({k: mx.concatenate([m[k] for m in layers]) for k in keys})
    return JointLinear(joint, sizes)


def use_joint_projections(model: nn.Module) -> int:
    """On a GPU, let each module's query, key and value projections run as one matmul, and
    its MLP's gate and up projections as another (``JointLinear``): 3 kernels a layer fewer
    (5 where q/k/v have biases, each its own add) to encode each step, where a small
    model's decode is bound by encoding them (docs/gpu-attention.md, "Profile"). Layers
    that differ in kind, quantization, dtype or bias stay as they are. Returns how many
    groups were joined (0 with ``AGENTKV_GPU_JOINT=0``)."""
    import os

    if os.environ.get(JOINT_ENV) == "0":
        return 0
    joined = 0
    # the modules holding a group, not every module: the list would keep each replaced layer
    # (and its weights, besides the joint's) alive until the end
    holders = [
        m for _, m in model.named_modules()
        if any(isinstance(getattr(m, names[0], None), nn.Module) for names in _JOINT_GROUPS)
    ]  # fmt: skip
    for module in holders:
        for names in _JOINT_GROUPS:
            layers = [getattr(module, n, None) for n in names]
            if any(not isinstance(m, nn.Module) for m in layers):
                continue
            joint = _joint_of(layers)
            if joint is None:
                continue
            mx.eval(joint.parameters())  # the layers' own arrays go with them below
            setattr(module, "agentkv_" + "_".join(n.split("_")[0] for n in names), joint)
            for i, name in enumerate(names):
                setattr(module, name, JointPart(joint, i))
            joined += 1
    return joined


# mlx-lm modules whose Attention is Llama's: the joint q/k/v projection, RoPE over whole
# heads, the cache, attention, the output projection (Qwen2's adds biases to the projection,
# Qwen3's and Gemma 3's an RMS norm of each query and key head before RoPE)
_PROLOGUE_ATTENTION = ("llama", "qwen2", "qwen3", "gemma3_text")


def rope_table(rope: nn.Module, head_dim: int) -> tuple[mx.array, int] | None:
    """A RoPE as the store kernel's prologue applies it (kernels/store_rows.metal): (its D / 2
    inverse frequencies then the positions' scale, float32; mode 1, channel c with c + D / 2,
    or 2, traditional), for ``nn.RoPE`` and mlx-lm's Llama 3 RoPE over whole heads; None
    for any other (it then runs as mlx-lm's)."""
    import numpy as np

    if getattr(rope, "dims", None) != head_dim:
        return None
    if type(rope) is nn.RoPE:
        inverse = rope.base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        scale = rope.scale
    elif type(rope).__name__ == "Llama3RoPE" and type(rope).__module__.startswith("mlx_lm."):
        inverse, scale = 1.0 / np.array(rope._freqs, dtype=np.float64), 1.0
    else:
        return None
    table = mx.array(np.append(inverse, scale).astype(np.float32))
    mx.eval(table)
    return table, 2 if rope.traditional else 1


@functools.cache
def _prologue_classes() -> dict[type, type]:
    """{mlx-lm's Attention of each architecture above: agentkv's GPU subclass of it}."""

    def make_call(attention):
        def __call__(self, x: mx.array, mask=None, cache=None):
            run = getattr(cache, "agentkv_prologue", None)
            if run is not None:
                B, L, _ = x.shape
                heads = (self.n_heads, self.n_kv_heads)
                joint = self.agentkv_q_k_v.linear
                out = run(lambda: joint(x), heads, self.agentkv_head_dim, self.agentkv_rope,
                          scale=self.scale, mask=mask, norms=self.agentkv_norms)  # fmt: skip
                if out is not None:
                    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            return attention.__call__(self, x, mask, cache)

        return __call__

    return _subclasses(
        _PROLOGUE_ATTENTION, "Attention", "GPUPrologueAttention", make_call,
        lambda name: f"mlx-lm's {name} attention, its RoPE and store in one kernel where its "
        "cache offers that (``agentkv_prologue``: the block pool's GPU steps), else as mlx-lm's.",
    )  # fmt: skip


def _rms_weight(norm) -> mx.array | None:
    """The weight ``norm`` hands ``mx.fast.rms_norm``: ``nn.RMSNorm``'s own, Gemma 3's
    ``1 + weight`` (its RMSNorm's, in the weight's dtype as it computes it); None for any
    other module."""
    if type(norm) is nn.RMSNorm:
        return norm.weight
    kind = type(norm)
    if kind.__name__ == "RMSNorm" and kind.__module__ == "mlx_lm.models.gemma3_text":
        return 1.0 + norm.weight
    return None


class HeadNorms(NamedTuple):
    """A layer's RMS norm of each query and key head before RoPE (Qwen3's and Gemma 3's
    ``q_norm`` and ``k_norm``), as the store kernel's prologue applies it
    (``kernels.gpu.store_prologue``'s ``norms``)."""

    weights: mx.array  # [2 D]: the queries' weights, then the keys'
    eps: float


def head_norms(module: nn.Module, head_dim: int):
    """Qwen3's and Gemma 3's RMS norm of each query and key head before RoPE as the store
    kernel's prologue applies it (``HeadNorms``: both weights in one array, their epsilon);
    None for an attention without one (Llama, Qwen2); False where it has one the kernel
    cannot apply (another norm module, weights of another width or epsilon)."""
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if q_norm is None and k_norm is None:
        return None
    weights = [_rms_weight(n) for n in (q_norm, k_norm)]
    if any(w is None or w.shape != (head_dim,) for w in weights) or q_norm.eps != k_norm.eps:
        return False
    joint = mx.concatenate(weights)
    mx.eval(joint)
    return HeadNorms(joint, float(q_norm.eps))


def use_gpu_prologue(model: nn.Module) -> int:
    """On a GPU, let each Llama, Qwen2, Qwen3 or Gemma 3 attention whose q/k/v projections
    are joint (``use_joint_projections``) and whose RoPE (and the norm of each head:
    ``head_norms``) the store kernel applies (``rope_table``) hand its joint projection to
    the block pool's step, which norms and ropes its queries and keys and stores its keys
    and values in one kernel (``PagedLayerCache.agentkv_prologue``; docs/gpu-attention.md,
    "The prologue"). Returns how many layers were switched (0 with
    ``AGENTKV_GPU_PROLOGUE=0``, which the step also reads)."""
    import os

    if os.environ.get("AGENTKV_GPU_PROLOGUE") == "0":
        return 0
    classes = _prologue_classes()
    switched = 0
    for _, module in model.named_modules():
        cls = classes.get(type(module))
        joint = getattr(module, "agentkv_q_k_v", None)
        if cls is None or not isinstance(joint, JointLinear):
            continue
        head_dim = joint._cuts[0] // module.n_heads  # the queries' part over their heads
        table, norms = rope_table(module.rope, head_dim), head_norms(module, head_dim)
        if table is not None and norms is not False:
            module.__class__ = cls
            object.__setattr__(module, "agentkv_rope", table)
            object.__setattr__(module, "agentkv_head_dim", head_dim)
            object.__setattr__(module, "agentkv_norms", norms)
            switched += 1
    return switched


CPU_QMM_BITS, CPU_QMM_GROUPS = (4, 5, 8), (32, 64, 128)


def use_cpu_quantized_matmul(
    model: nn.Module, *, super_scales: dict[str, mx.array] | None = None
) -> int:
    """Route a model's affine 4/5/8-bit layers (groups of 32/64/128) through agentkv's CPU
    quantized matmul, their weights packed for it in place (``pack_quantized``: the same
    bytes, moved). Others stay on ``mx.quantized_matmul``
    (logged). ``super_scales``: a GGUF import's K-quant factors (``{module}.scales`` and
    ``{module}.biases``, float16 [N, K / 256]), which put those modules' scales in two levels
    (``_pack_module``). Returns how many were switched."""
    import logging

    super_scales = super_scales or {}
    switched, left, not_two_level = 0, [], []
    for name, module in model.named_modules():
        kind = {
            nn.QuantizedLinear: CPUQuantizedLinear,
            nn.QuantizedEmbedding: CPUQuantizedEmbedding,
        }
        ours = kind.get(type(module))
        if ours is None:
            continue
        fits = (
            getattr(module, "mode", "affine") == "affine"
            and module.bits in CPU_QMM_BITS
            and module.group_size in CPU_QMM_GROUPS
        )
        if fits:
            factors = tuple(super_scales.get(f"{name}.{part}") for part in ("scales", "biases"))
            supers = factors if all(f is not None for f in factors) else None
            if not _pack_module(module, supers) and supers is not None:
                not_two_level.append(name)
            module.__class__ = ours
            switched += 1
        else:
            left.append(name)
    if not_two_level:
        logging.getLogger("agentkv.model").warning(
            "%d K-quant layers keep float32 scales: their super-block factors do not give "
            "them (a damaged or stale %s?): %s",
            len(not_two_level), "agentkv_super_scales.safetensors", ", ".join(not_two_level[:4]),
        )  # fmt: skip
    experts = [
        name
        for name, module in model.named_modules()
        if type(module).__name__ == "QuantizedSwitchLinear"
    ]
    if experts:
        logging.getLogger("agentkv.model").info(
            "%d mixture-of-experts expert layers stay on MLX's gather_qmm (agentkv's CPU kernel "
            "takes one weight matrix per call, not a gather over experts): %s",
            len(experts), ", ".join(experts[:4]),
        )  # fmt: skip
    if left:
        logging.getLogger("agentkv.model").info(
            "%d quantized layers stay on mx.quantized_matmul (agentkv's CPU kernel takes "
            "affine %s-bit weights in groups of %s): %s",
            len(left), "/".join(map(str, CPU_QMM_BITS)), "/".join(map(str, CPU_QMM_GROUPS)),
            ", ".join(left[:4]),
        )  # fmt: skip
    return switched


def float32_activations(model: nn.Module) -> None:
    """Every floating parameter in float32, except quantized layers' scales and biases,
    which the quantized kernels read as stored."""
    from mlx.utils import tree_flatten, tree_unflatten

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    keep = {
        f"{name}.{part}" if name else part
        for name, module in model.named_modules()
        if isinstance(module, quantized)
        for part in ("scales", "biases")
    }
    cast = [
        (name, value.astype(mx.float32))
        for name, value in tree_flatten(model.parameters())
        if name not in keep
        and mx.issubdtype(value.dtype, mx.floating)
        and value.dtype != mx.float32
    ]
    if cast:
        model.update(tree_unflatten(cast))


def make_batch_invariant(model: nn.Module) -> int:
    """Route float32 ``nn.Linear`` layers (and tied output embeddings) through agentkv's
    batch-invariant GEMM; the modules keep their weights. Returns how many were switched."""
    switched = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype == mx.float32:
            module.__class__ = InvariantLinear
            switched += 1
        elif type(module) is nn.Embedding and module.weight.dtype == mx.float32:
            module.__class__ = InvariantTiedEmbedding
    return switched


# Models whose call is mlx-lm's plain "inner model (ending in its norm), then the output
# projection" (tied embedding or lm_head), so the head can take the last position alone.
_HEAD_AFTER_INNER = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def projects_last_only(model: nn.Module) -> bool:
    """Whether ``last_logits`` runs ``model``'s output projection on the last position alone
    (else on every position of the chunk, then slices)."""
    return type(model).__module__ in _HEAD_AFTER_INNER and isinstance(
        getattr(model, "model", None), nn.Module
    )


def last_logits(model: nn.Module, inputs: mx.array, cache) -> mx.array:
    """The logits after each row's last token, [B, vocab]. Llama, Qwen2 and Qwen3 run their
    output projection on the last position only (a prefill chunk of L tokens otherwise
    projects all L onto the vocabulary: ~200 ms of a 512-token chunk on CPU); agentkv's
    matmuls reduce each row alone, so the logits are the same bits. Other models: their own
    call, sliced."""
    if projects_last_only(model):
        hidden = model.model(inputs, cache)[:, -1:, :]
        if model.args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(hidden)[:, -1, :]
        return model.lm_head(hidden)[:, -1, :]
    return model(inputs, cache=cache)[:, -1, :]


# -- loading, sampling, masks ------------------------------------------------------------


def load(target: str):
    """(model, tokenizer) of an mlx-lm model directory or hub id."""
    from mlx_lm import load as mlx_lm_load

    return mlx_lm_load(target)


def dequantize_model(model: nn.Module) -> None:
    from mlx_lm.utils import dequantize_model as mlx_lm_dequantize

    mlx_lm_dequantize(model)


def make_sampler(*, temp: float, top_p: float):
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    return mlx_lm_make_sampler(temp=temp, top_p=top_p)


def create_causal_mask(N: int, offset, *, window_size=None, right_padding=None, left_padding=None):
    from mlx_lm.models.base import create_causal_mask as mlx_lm_mask

    return mlx_lm_mask(
        N, offset, window_size=window_size, right_padding=right_padding, left_padding=left_padding
    )


def dynamic_roll(x: mx.array, shifts: mx.array, axis: int) -> mx.array:
    from mlx_lm.models.cache import dynamic_roll as mlx_lm_roll

    return mlx_lm_roll(x, shifts, axis)


def cache_class(name: str) -> type:
    """mlx-lm's cache class ``name`` (``KVCache``, ``QuantizedKVCache``, ...)."""
    import mlx_lm.models.cache as mlx_cache

    cls = getattr(mlx_cache, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_state"):
        raise ValueError(f"unknown cache class {name!r}")
    return cls


GEMMA2_WINDOW = 4096  # Gemma 2's sliding window where a config does not name one


def sliding_windows_left_out(model_type: str | None, config: dict, layers: int) -> dict[int, int]:
    """Sliding windows a model has that mlx-lm's class leaves out: {layer: window}. Gemma 2
    gives every even layer a window (``sliding_window``, 4,096 in every released config), as
    transformers and llama.cpp run it; mlx-lm 0.32's ``gemma2`` attends globally in every
    layer, so beyond the window the two differ. agentkv runs the windows."""
    if model_type != "gemma2":
        return {}
    window = config.get("sliding_window") or GEMMA2_WINDOW
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelImportError(
            f"gemma2: the config's sliding_window {window!r} is not a positive token count"
        )
    return {i: window for i in range(0, layers, 2)}


def cache_spec_of(
    model, *, weights_id: str, model_type: str | None = None, config: dict | None = None
) -> ModelCacheSpec:
    """The KV geometry of ``model``: its cache classes from mlx-lm's ``make_prompt_cache``
    (full attention or a sliding window) and the windows its class leaves out
    (``sliding_windows_left_out``, from its ``config``), and one probe token through it (KV
    heads, head dims)."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    model_type = model_type or getattr(model, "model_type", type(model).__module__)
    caches = make_prompt_cache(model)
    windows = sliding_windows_left_out(model_type, config or {}, len(caches))
    layers = []
    for i, cache in enumerate(caches):
        if i in windows and type(cache) is KVCache:
            layers.append(LayerSpec(LayerKind.SLIDING, windows[i]))
        elif isinstance(cache, RotatingKVCache):
            layers.append(LayerSpec(LayerKind.SLIDING, int(cache.max_size)))
        elif isinstance(cache, KVCache):
            layers.append(LayerSpec(LayerKind.FULL))
        else:
            what = ", a recurrent state (state-space or convolution layer)"
            raise ModelImportError(
                f"model {model_type!r}: layer {i} uses {type(cache).__name__}"
                f"{what if isinstance(cache, ArraysCache) else ''}; agentkv caches "
                "attention layers only (mlx-lm's KVCache or RotatingKVCache)"
            )
    model(mx.array([[0]]), cache=caches)
    shapes = {(c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1]) for c in caches}
    if len(shapes) != 1:
        raise ModelImportError(f"layers have different KV geometries {sorted(shapes)}")
    ((heads, key_dim, value_dim),) = shapes
    sinks = any(
        getattr(getattr(layer, "self_attn", None), "sinks", None) is not None
        for layer in getattr(model, "layers", [])
    )
    return ModelCacheSpec(
        model_type=model_type,
        num_layers=len(caches),
        kv_heads=int(heads),
        key_head_dim=int(key_dim),
        value_head_dim=int(value_dim),
        layers=tuple(layers),
        attention_sinks=bool(sinks),
        dtype=str(caches[0].keys.dtype).removeprefix("mlx.core."),
        weights_id=weights_id,
    )


# -- mlx-lm 0.32.2 prompt-cache files ---------------------------------------------------
# Tensors are tree_flatten([c.state for c in cache]) ("0.0.0", "0.2", ...); metadata is
# tree_flatten([user metadata, class names, scalars]) where scalars = ["", (path, kind)...]
# marks state entries stored as arrays but meant as Python scalars/strings/None.


def save_prompt_cache(path: str, caches: list, metadata: dict[str, str] | None) -> None:
    """mlx-lm's own writer (``caches``: mlx-lm cache objects)."""
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    mlx_lm_save(path, caches, metadata)


def split_prompt_cache_metadata(metadata: dict) -> tuple[dict, list[str], dict[str, str]]:
    """(user metadata, class names, {tensor name: scalar kind}) of a prompt-cache file."""
    from mlx.utils import tree_unflatten

    user, classes, scalars = tree_unflatten(list(metadata.items()))
    kinds = {pos: kind for pos, kind in scalars[1:]}
    return user, list(classes), kinds


# mlx-lm caches whose state starts (keys, values, offset, ...) over [B, H, T, D] buffers.
GROWABLE_CACHES = ("KVCache", "QuantizedKVCache")
