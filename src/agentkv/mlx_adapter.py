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
