"""ModelCacheSpec: the KV cache geometry of a loaded mlx-lm model, and its identity.

``mlx_adapter.cache_spec_of`` reads it off the model itself: mlx-lm's
``make_prompt_cache`` says which layers are full attention and which slide (with
their window); one token through the model gives each layer's KV heads and head
dims. The fingerprint is a chained sha256 of the geometry and the weights'
identity, so caches are never reused across different weights or geometry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

from .quant import Component, KVQuant

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
