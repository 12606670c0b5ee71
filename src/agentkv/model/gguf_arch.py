"""GGUF architectures as mlx-lm model classes: each GGUF ``general.architecture`` agentkv
imports, the mlx-lm ``model_type`` it becomes, its config from the GGUF's metadata and its
tensors' names (the mapping transformers' ``integrations/ggml.py`` and llama.cpp's
converter agree on).

What differs between them, and why the import cares:

- **llama** (and Mistral-style models, which GGUF files carry as llama): llama.cpp's converter
  permutes the Q and K rows for interleaved rotary embeddings, hence ``rope_traditional``.
- **qwen2**: biases on q, k and v; rotary embeddings over halves (not permuted).
- **qwen3**: an RMSNorm of each q and k head; the head dim named by ``attention.key_length``.
- **gemma2**: four norms a block (gemma3's, without the q and k norms), norms stored as
  ``1 + w`` as gemma3's; its attention scores and final logits soft-capped
  (``attn_logit_softcapping`` 50, ``final_logit_softcapping`` 30 unless the file says
  otherwise). Every even layer has a sliding window (``attention.sliding_window``, 4,096),
  as llama.cpp and transformers run it; mlx-lm's ``gemma2`` class leaves the windows out and
  agentkv runs them (``mlx_adapter.sliding_windows_left_out``).
- **gemma3**: four norms a block, q and k norms, sliding-window layers (every sixth layer
  global, as llama.cpp has it) with their own RoPE base; llama.cpp's converter stores each
  norm weight as ``1 + w`` (its RMSNorm multiplies by the weight; mlx-lm's Gemma multiplies
  by ``1 + w``), so the import subtracts the 1 again (exact in float32).
- **phi3**: fused q/k/v and gate/up projections, a partial rotary dimension.

Rope scaling: none, linear (``rope.scaling.type``/``.factor``, as Gemma 3 4B and up ship),
or Llama 3's (the ``rope_freqs`` tensor, when it is exactly what Llama 3.1-3.3's
configs give).
Not imported, each refused by name with the reason: other rope scaling kinds (YaRN, ...),
and other rope scaling stored as frequency tensors
(phi3's ``rope_factors_*``, a ``rope_freqs`` no Llama 3 scaling gives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelImportError

_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2 and 3: a norm after attention, one before and one after the MLP
_GEMMA_BLOCK = {
    **{k: v for k, v in _LLAMA_BLOCK.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors GGUF files carry for rope scaling that mlx-lm's classes take as config instead.
_ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
#: Llama 3's per-dimension rope factors (llama.cpp's converter writes them as this tensor;
#: the import turns them back into the config that gives them, and writes no weight).
ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1/3.3 (factor 8) and 3.2 (factor 32) as their configs name them; GGUF keeps only
# the factors they give, so the import takes the one that gives exactly the file's.
_LLAMA3_SCALINGS = tuple(
    {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for factor in (8.0, 32.0)
)


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture becomes an mlx-lm model directory."""

    gguf_name: str
    model_type: str
    block_names: dict[str, str]
    rope_traditional: bool
    config: Callable[[Any], dict] = field(default=lambda meta: {})
    norm_offset: float = 0.0  # GGUF norm weights hold norm_offset + w (gemma: 1)

    def mlx_name(self, gguf_name: str) -> str | None:
        """The mlx-lm parameter name of a GGUF tensor, None for one the config holds
        instead (llama's ``rope_freqs``); ModelImportError for one this architecture has no
        place for."""
        if gguf_name == ROPE_FREQS and self.gguf_name == "llama":
            return None
        stem, _, suffix = gguf_name.rpartition(".")
        if stem.startswith("blk."):
            _, index, part = stem.split(".", 2)
            if part in self.block_names:
                return f"model.layers.{index}.{self.block_names[part]}.{suffix}"
        elif stem in _TOP:
            return f"{_TOP[stem]}.{suffix}"
        if stem in _ROPE_TENSORS:
            raise ModelImportError(
                f"tensor {gguf_name}: rope scaling stored as frequency factors "
                f"({self.gguf_name}) is not supported by the importer"
            )
        raise ModelImportError(f"tensor {gguf_name}: unexpected in a {self.gguf_name} GGUF")

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.endswith("norm.weight")


class Metadata:
    """A GGUF file's metadata read under its architecture's prefix (``llama.block_count``)."""

    def __init__(self, meta: dict, arch: str):
        self.meta, self.arch = meta, arch

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}", default)
        return value if value is not None else default

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelImportError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


def _gemma3(m: Metadata) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", 256))
    layers = int(m.need("block_count"))
    # llama.cpp scales Gemma 3's queries by 1/sqrt(head dim), by 1/sqrt(hidden / heads) for
    # the 27B model (62 layers), as its config's query_pre_attn_scalar says
    scalar = hidden // heads if layers == 62 else head_dim
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(m.get("attention.sliding_window", 4096)),
        "sliding_window_pattern": 6,
        "rope_theta": float(m.get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
    }


def _gemma2(m: Metadata) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", 256))
    # llama.cpp scales Gemma 2's queries by 1/sqrt(head dim), by 1/sqrt(hidden / heads) for
    # the 27B model (46 layers), as its config's query_pre_attn_scalar says
    scalar = hidden // heads if int(m.need("block_count")) == 46 else head_dim
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": float(m.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(m.get("final_logit_softcapping", 30.0)),
        "sliding_window": int(m.get("attention.sliding_window", 4096)),
    }


def _qwen3(m: Metadata) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    return {"head_dim": int(m.get("attention.key_length", hidden // heads))}


def _phi3(m: Metadata) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    rotary = int(m.get("rope.dimension_count", hidden // heads))
    context = int(m.get("context_length", 4096))
    return {
        "partial_rotary_factor": rotary / (hidden // heads),
        "original_max_position_embeddings": int(
            m.get("rope.scaling.original_context_length", context)
        ),
    }


def _llama(m: Metadata) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    return {"head_dim": int(m.get("rope.dimension_count", hidden // heads))}


ARCHITECTURES = {
    a.gguf_name: a
    for a in (
        Architecture("llama", "llama", _LLAMA_BLOCK, rope_traditional=True, config=_llama),
        Architecture("qwen2", "qwen2", _LLAMA_BLOCK, rope_traditional=False),
        Architecture("qwen3", "qwen3", _LLAMA_BLOCK | _QK_NORMS, False, config=_qwen3),
        Architecture(
            "gemma2",
            "gemma2",
            _GEMMA_BLOCK,
            rope_traditional=False,
            config=_gemma2,
            norm_offset=1.0,
        ),
        Architecture(
            "gemma3",
            "gemma3_text",
            _GEMMA_BLOCK | _QK_NORMS,
            rope_traditional=False,
            config=_gemma3,
            norm_offset=1.0,
        ),
        Architecture(
            "phi3",
            "phi3",
            {
                "attn_qkv": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_up": "mlp.gate_up_proj",
                "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
            },
            rope_traditional=False,
            config=_phi3,
        ),
    )
}
_REFUSED: dict[str, str] = {}  # architecture -> why, for one a user may expect


def architecture_of(meta: dict, source: str) -> Architecture:
    """The Architecture of a GGUF file's ``general.architecture``, or ModelImportError in one
    line naming it and what imports."""
    name = meta.get("general.architecture")
    name = name if isinstance(name, str) else None
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    why = _REFUSED.get(name or "", "")
    raise ModelImportError(
        f"{source}: architecture {name!r} is not supported"
        + (f" ({why})" if why else "")
        + f"; GGUF files of {', '.join(sorted(ARCHITECTURES))} import"
    )


def _rope_scaling(m: Metadata) -> dict | None:
    """mlx-lm's ``rope_scaling`` for the GGUF's ``rope.scaling.type``: none, or linear
    (Gemma 3's 4B and up); any other kind (YaRN, ...) is refused by name rather than run
    with the wrong positions."""
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(m.need("rope.scaling.factor"))}
    raise ModelImportError(
        f"{m.arch}.rope.scaling.type {kind!r} is not supported by the importer "
        "(none and linear are)"
    )


def llama3_rope_factors(scaling: dict, base: float, dims: int) -> np.ndarray:
    """The per-dimension factors of a Llama 3 rope scaling (float32 [dims / 2]), as
    llama.cpp's converter computes its ``rope_freqs`` tensor (each dimension's rotation
    period multiplied by its factor)."""
    periods = base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    wavelen = 2 * np.pi * periods
    old = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factor = scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    factors = np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old / high, 1.0, factors).astype(np.float32)


def _llama3_scaling(factors: np.ndarray, config: dict) -> dict:
    dims = config["head_dim"]
    for scaling in _LLAMA3_SCALINGS:
        want = llama3_rope_factors(scaling, config["rope_theta"], dims)
        if factors.shape == want.shape and np.allclose(factors, want, rtol=1e-5, atol=0):
            return dict(scaling)
    raise ModelImportError(
        f"tensor {ROPE_FREQS}: rope frequency factors that no Llama 3 rope scaling gives "
        "(factor 8 or 32, low 1, high 4, original context 8192) are not supported"
    )


def build_config(
    meta: dict, arch: Architecture, *, tied: bool, rope_freqs: np.ndarray | None = None
) -> dict:
    """mlx-lm's config.json for a GGUF file of ``arch`` (``rope_freqs``: the file's
    ``rope_freqs`` tensor, llama 3's rope scaling, if it has one)."""
    m = Metadata(meta, arch.gguf_name)
    scaling = _rope_scaling(m)
    heads = int(m.need("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "model_type": arch.model_type,
        "hidden_size": int(m.need("embedding_length")),
        "num_hidden_layers": int(m.need("block_count")),
        "intermediate_size": int(m.need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(m.need("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(m.get("vocab_size", len(tokens))),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "rope_traditional": arch.rope_traditional,
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "tie_word_embeddings": tied,
        **arch.config(m),
    }
    if rope_freqs is not None:
        if scaling:
            raise ModelImportError(f"{ROPE_FREQS} and {m.arch}.rope.scaling.type both set")
        scaling = _llama3_scaling(rope_freqs.reshape(-1), config)
    if scaling:
        config["rope_scaling"] = scaling
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config
