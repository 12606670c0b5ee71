"""ModelCacheSpec: the KV cache geometry of a loaded mlx-lm model, and its identity.

Read off the model itself: mlx-lm's ``make_prompt_cache`` says which layers are
full attention (``KVCache``) and which slide (``RotatingKVCache`` with its
window); one token through the model gives each layer's KV heads and head
dims. The fingerprint is a chained sha256 of the geometry and the weights'
identity, so caches are never reused across different weights or geometry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

import mlx.core as mx

from ..errors import ModelImportError
from ..kv.quant import Component, KVQuant

SPEC_DOMAIN = b"agentkv/model-cache-spec/v1"


class LayerKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int | None = None


@dataclass(frozen=True)
class ModelCacheSpec:
    """Everything about a model that decides the shape and meaning of its KV cache."""

    model_type: str
    num_layers: int
    kv_heads: int
    key_head_dim: int
    value_head_dim: int
    layers: tuple[LayerSpec, ...]
    attention_sinks: bool
    dtype: str
    weights_id: str

    @property
    def head_dim(self) -> int:
        return self.key_head_dim

    @property
    def has_sliding_layers(self) -> bool:
        return any(layer.kind is LayerKind.SLIDING for layer in self.layers)

    def geometry(self) -> dict:
        """The cache geometry as plain JSON data (stored in every manifest)."""
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "key_head_dim": self.key_head_dim,
            "value_head_dim": self.value_head_dim,
            "layers": [[layer.kind.value, layer.window] for layer in self.layers],
            "attention_sinks": self.attention_sinks,
            "dtype": self.dtype,
        }

    @property
    def fingerprint(self) -> str:
        geometry = json.dumps(self.geometry(), sort_keys=True, separators=(",", ":")).encode()
        link = hashlib.sha256(SPEC_DOMAIN).digest()
        link = hashlib.sha256(link + geometry).digest()
        return hashlib.sha256(link + self.weights_id.encode()).hexdigest()

    def bytes_per_token(self, quant: KVQuant) -> int:
        """Stored bytes per token (all layers, keys and values) in ``quant``'s format."""
        return quant.bytes_per_token(
            self.num_layers, self.kv_heads, self.key_head_dim, self.value_head_dim
        )

    def components(self, quant: KVQuant) -> list[list[Component]]:
        """Every layer's stored components in ``quant``'s format (``quant.layer(i)``)."""
        return quant.layer_components(
            self.num_layers, self.kv_heads, self.key_head_dim, self.value_head_dim
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = [[layer.kind.value, layer.window] for layer in self.layers]
        data["fingerprint"] = self.fingerprint
        return data

    @classmethod
    def from_model(cls, model, *, weights_id: str, model_type: str | None = None) -> ModelCacheSpec:
        """Inspect ``model``: its cache classes, and one probe token through it."""
        from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

        model_type = model_type or getattr(model, "model_type", type(model).__module__)
        caches = make_prompt_cache(model)
        layers = []
        for i, cache in enumerate(caches):
            if isinstance(cache, RotatingKVCache):
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
        dtype = caches[0].keys.dtype
        return cls(
            model_type=model_type,
            num_layers=len(caches),
            kv_heads=int(heads),
            key_head_dim=int(key_dim),
            value_head_dim=int(value_dim),
            layers=tuple(layers),
            attention_sinks=bool(sinks),
            dtype=str(dtype).removeprefix("mlx.core."),
            weights_id=weights_id,
        )
