"""Everything agentkv needs to know about mlx-lm's internals, in one place.

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
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

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


class InvariantLinear(nn.Linear):
    """A float32 linear layer on agentkv's batch-invariant GEMM (same weights, in place)."""

    def __call__(self, x: mx.array) -> mx.array:
        from . import _ext

        return _ext.invariant_linear(x, self.weight, self.get("bias"))


class InvariantTiedEmbedding(nn.Embedding):
    """An embedding whose output projection (tied lm_head) is batch-invariant."""

    def as_linear(self, x: mx.array) -> mx.array:
        from . import _ext

        return _ext.invariant_linear(x, self.weight)


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


# -- mlx-lm 0.32.2 prompt-cache files ---------------------------------------------------
# Tensors are tree_flatten([c.state for c in cache]) ("0.0.0", "0.2", ...); metadata is
# tree_flatten([user metadata, class names, scalars]) where scalars = ["", (path, kind)...]
# marks state entries stored as arrays but meant as Python scalars/strings/None.


def to_mlx_lm_cache(cache):
    """An mlx-lm cache object holding what ``cache`` holds (agentkv caches converted)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from .errors import InvalidRequestError
    from .kv.cache import AgentKVCache

    if not isinstance(cache, AgentKVCache):
        if type(cache).__module__.startswith("agentkv"):
            raise InvalidRequestError(f"{type(cache).__name__} has no mlx-lm equivalent")
        return cache
    if cache.start:
        raise InvalidRequestError(
            "this cache dropped the blocks its sliding window no longer sees; "
            "mlx-lm's prompt-cache files cannot describe that"
        )
    q = cache.quant
    keys, values = cache.keys_and_values() if cache.keys is not None else (None, None)
    if q.version > 1:
        return _format_2_to_mlx_lm(cache)
    if q.key_bits == q.value_bits == 16:
        out = KVCache()
        out.keys, out.values = (keys[0], values[0]) if keys else (None, None)
    elif q.key_bits == q.value_bits:
        out = QuantizedKVCache(group_size=q.group_size, bits=q.key_bits)
        out.keys, out.values = keys, values
    else:
        raise InvalidRequestError(
            f"mlx-lm's QuantizedKVCache has one bit width; this cache stores keys at "
            f"{q.key_bits} and values at {q.value_bits} bits"
        )
    out.offset = cache.offset
    return out


def _format_2_to_mlx_lm(cache):
    """mlx-lm's QuantizedKVCache for a format-2 cache: keys and values dequantized, rotated
    back and quantized again per token, at the wider of the cache's key and value bits
    (mlx-lm's cache has one width: a wide layer's 8-bit keys give an 8-bit cache). Lossy:
    the per-token 4-bit keys mlx-lm reads cost the model what format 1 costs (see
    docs/kv-format-v2.md)."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    q = cache.quant
    bits = max(q.key_bits, q.value_bits)
    out = QuantizedKVCache(group_size=q.group_size, bits=bits)
    if cache.keys is not None:
        k, v = (x.astype(mx.float16) for x in cache.dequantized())
        out.keys = tuple(mx.quantize(k, group_size=q.group_size, bits=bits))
        out.values = tuple(mx.quantize(v, group_size=q.group_size, bits=bits))
    out.offset = cache.offset
    return out


def prompt_cache_class(name: str):
    """The class a prompt-cache file names: mlx-lm's, or agentkv's own."""
    import mlx_lm.models.cache as mlx_cache

    from .kv.batch import BatchQuantizedKVCache
    from .kv.cache import AgentKVCache

    ours = {"AgentKVCache": AgentKVCache, "BatchQuantizedKVCache": BatchQuantizedKVCache}
    cls = ours.get(name) or getattr(mlx_cache, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_state"):
        raise ValueError(f"unknown cache class {name!r}")
    return cls


def split_prompt_cache_metadata(metadata: dict) -> tuple[dict, list[str], dict[str, str]]:
    """(user metadata, class names, {tensor name: scalar kind}) of a prompt-cache file."""
    from mlx.utils import tree_unflatten

    user, classes, scalars = tree_unflatten(list(metadata.items()))
    kinds = {pos: kind for pos, kind in scalars[1:]}
    return user, list(classes), kinds


def build_prompt_cache(arrays: dict, classes: list[str], kinds: dict[str, str]) -> list:
    """Cache objects from a prompt-cache file's arrays, as mlx-lm's loader builds them."""
    from mlx.utils import tree_unflatten

    values = dict(arrays)
    for pos, kind in kinds.items():
        array = values[pos]
        if kind == "scalar":
            values[pos] = array.item()
        elif kind == "string":
            values[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            values[pos] = None
        else:
            raise ValueError(f"unknown scalar kind {kind!r}")
    states = tree_unflatten(list(values.items()))
    return [prompt_cache_class(c).from_state(state) for c, state in zip(classes, states)]


# mlx-lm caches whose state starts (keys, values, offset, ...) over [B, H, T, D] buffers.
GROWABLE_CACHES = ("KVCache", "QuantizedKVCache")
