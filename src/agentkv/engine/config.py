"""EngineConfig: the Engine's options in one frozen record, checked when it is made (before
any model loads), so a bad option costs nothing and names itself."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidRequestError
from ..format.quant import KVQuant
from ..model.load import WEIGHTS
from ..text.matcher import DEFAULT_MIN_REUSE
from .drafts import DEFAULT_DRAFT_TOKENS, MAX_DRAFT
from .scheduler import POLICIES

KV_FORMATS = (1, 2)
MIN_SWAP_BUDGET = 512  # tokens: one staging block and the last block


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an Engine runs: ``Engine(config=EngineConfig(...))`` or ``Engine(**options)``.

    ``model``: an mlx-lm model directory or hub id (None: the embedded SmolLM2-135M);
    ``weights``: ``"quantized"`` runs 4- and 8-bit weights as the model ships them (on CPU
    through agentkv's quantized matmul: 98 MB for the embedded model), ``"float32"``
    dequantizes them at load (538 MB); None: quantized (docs/compute.md);
    ``cache_dir``: where agents' KV is stored (None: ``$AGENTKV_HOME/kv``).
    ``store_url``: ``s3://bucket/prefix``, an S3-compatible object store several engines
    share (docs/fleet.md): each turn is committed there too, and an agent another engine ran
    is fetched from it; the cache directory stays a write-through cache (None: none).
    ``kv_bits`` / ``key_bits`` / ``value_bits``: the stored KV's bits (2-8, or 16 for
    float16); ``group_size``: values per scale (None: fitted to the model's head dims).
    ``kv_format`` (default 2) is the stored KV format: 2 keeps keys rotated and quantized
    per channel (docs/kv-format-v2.md: the same bytes as 1, at 4 bits +2.5% perplexity on
    the embedded model where KV format 1, per-token keys, costs +18%); agents stored in
    the other KV format convert once. Where KV format 2 cannot hold a model's KV (16-bit or
    3/5/6-bit keys, a head dim that is not a power of two) the engine uses 1.
    ``kv_wide_layers``: layers whose keys KV format 2 keeps at 8 bits (None: chosen per
    model, the layers whose 4-bit keys cost the most, measured once:
    ``model/wide_layers.py``; ``()``: none).
    ``pool_bytes``: the block pool's memory budget (None: ``pool.default_pool_bytes()``);
    ``min_reuse_tokens``: the least a partial match keeps where the cut would read the
    agent's keys back from their bits (a cut that keeps them exact is always taken: any cut in
    KV format 1, a cut in the last two channel groups in format 2); ``prefill_chunk``:
    prompt tokens per prefill step (None: 512 on the CPU, 2048 on a GPU, whose prefill
    chunks run through MLX's fused attention); ``max_batch``: turns decoded together;
    ``max_queue``: turns waiting before ``submit_chat`` raises ``EngineBusyError``;
    ``schedule``: one of ``scheduler.POLICIES``; ``warmup``: run the model once at start so
    the first turn pays no one-time costs (on a GPU, and checks agentkv's kernels there
    against MLX's operations: ``engine/warmup.py``).
    ``kv_swap_budget``: KVSwap (docs/kvswap.md): tokens of KV per layer an agent keeps in
    memory while it decodes (at least 512); the rest of its context stays in its block files
    and the groups each step's attention needs are read back. Prefill stays exact. None
    (the default): every agent's KV stays in memory and attention is exact.
    ``kv_swap_read_ahead``: with a swap budget, start each layer's reads during the layer
    before, from a predicted query, while reads go to disk (for slow disks; the same tokens
    either way; off by default: on this project's machines it costs more than it hides).
    ``draft_tokens``: the most tokens a turn decoding alone drafts from its context and
    checks in one step (engine/drafts.py: greedy, the same tokens; at a temperature, the same
    distribution; fewer steps where replies copy their context; CPU only); 0: off.
    """

    model: str | os.PathLike | None = None
    weights: str | None = None
    cache_dir: str | os.PathLike | None = None
    store_url: str | None = None
    kv_bits: int = 4
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int | None = None
    pool_bytes: int | None = None
    min_reuse_tokens: int = DEFAULT_MIN_REUSE
    prefill_chunk: int | None = None
    max_batch: int = 8
    max_queue: int = 64
    schedule: str = "interleave"
    warmup: bool = True
    kv_format: int = 2
    kv_wide_layers: Sequence[int] | None = None
    kv_swap_budget: int | None = None
    kv_swap_read_ahead: bool = False
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    def __post_init__(self):
        if self.weights is not None and self.weights not in WEIGHTS:
            raise InvalidRequestError(
                f"weights must be one of {', '.join(WEIGHTS)}, not {self.weights!r}"
            )
        self.requested_quant()  # the bits and the group size
        if self.store_url is not None:
            from ..store.objects import StoreURL, require_client

            StoreURL.parse(self.store_url)
            require_client()
        if self.min_reuse_tokens < 0 or (
            self.prefill_chunk is not None and self.prefill_chunk < 64
        ):
            raise InvalidRequestError("min_reuse_tokens must be >= 0 and prefill_chunk >= 64")
        if self.max_batch < 1 or self.max_queue < 1:
            raise InvalidRequestError("max_batch and max_queue must be >= 1")
        if self.schedule not in POLICIES:
            raise InvalidRequestError(f"schedule must be one of {', '.join(POLICIES)}")
        if self.kv_format not in KV_FORMATS:
            raise InvalidRequestError(f"kv_format must be 1 or 2, not {self.kv_format!r}")
        pool_bytes = self.pool_bytes
        if pool_bytes is not None and (not isinstance(pool_bytes, int) or pool_bytes < 1):
            raise InvalidRequestError("pool_bytes must be a positive number of bytes")
        budget = self.kv_swap_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_SWAP_BUDGET
        ):
            raise InvalidRequestError(
                f"kv_swap_budget must be at least {MIN_SWAP_BUDGET} tokens (a staging block and "
                f"the agent's last block), or None; not {budget!r}"
            )
        if not isinstance(self.kv_swap_read_ahead, bool):
            raise InvalidRequestError("kv_swap_read_ahead must be True or False")
        if self.kv_swap_read_ahead and budget is None:
            raise InvalidRequestError("kv_swap_read_ahead needs a kv_swap_budget")
        draft = self.draft_tokens
        if isinstance(draft, bool) or not isinstance(draft, int) or not 0 <= draft <= MAX_DRAFT:
            raise InvalidRequestError(f"draft_tokens must be an integer in [0, {MAX_DRAFT}]")
        if self.kv_wide_layers is not None:  # the indices now; against the model's layers later
            wide = KVQuant(wide_layers=self.kv_wide_layers).wide_layers
            object.__setattr__(self, "kv_wide_layers", wide)

    def requested_quant(self) -> KVQuant:
        """The bits the caller asked for (KV format 1; ``kv_format_for`` fits them to the
        model)."""
        return KVQuant.from_bits(
            self.kv_bits,
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            group_size=64 if self.group_size is None else self.group_size,
        )
