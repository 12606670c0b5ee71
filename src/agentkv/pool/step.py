"""PagedStep: one forward pass of a jagged batch over the pool, in mlx-lm's cache protocol.

A step runs ``L`` new tokens for each of ``B`` block tables (a prefill chunk of one agent,
or one decode token of many). It builds, once, the ``[B, max_blocks]`` table, the ``[B]``
lengths after the step and the arena rows the new tokens go to; each layer gets a
``PagedLayerCache`` that mlx-lm's model code drives like any cache:
``update_and_fetch`` scatters the layer's new keys and values into the pool, and the
attention dispatch (``mlx_adapter``) calls ``agentkv_attention``, which reads every row's
keys and values through its block table. Rows are never padded or copied, so agents join
and leave a running batch between steps by adding or dropping their table.

A jagged step (rows feeding different numbers of tokens: drafts checked in a batch) runs as
one-token rows (``token_rows``): a row feeding ``n`` tokens after ``start`` becomes ``n`` rows
over its one table, of lengths ``start + 1`` .. ``start + n``. Every new key and value is
written before any row attends, and a query's attention and a row's matmuls do not depend
on the rows beside it (docs/compute.md), so each token gets the bits it gets in a row of its
own. It holds while no row of several tokens completes a channel group (a group's keys are
gathered from its tail before the step writes): drafted steps never do
(``engine.drafts.room``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .. import _ext
from ..format.geometry import BLOCK_TOKENS, blocks_for
from ..format.quant import KVQuant, hadamard
from ..format.spec import ModelCacheSpec
from ..kernels import PagedQuery
from ..kernels import attention as dispatch
from ..kernels import gpu as gpu_kernels
from ..kernels.attention import ENV as ATTENTION_ENV
from ..kernels.attention import CacheBase, count_fused_attention, paged_attention
from ..kernels.masks import NOT_OURS, mask_window, remember_mask
from ..kernels.types import HostIndex
from ..mlx_adapter import FusedLayer
from .arena import KVArena, WritePlan
from .swap import SwapState
from .tables import BlockTable


class PagedStep:
    def __init__(
        self,
        arena: KVArena,
        spec: ModelCacheSpec,
        tables: Sequence[BlockTable],
        count: int,
        *,
        fused: bool = True,
        swaps: Sequence[SwapState | None] | None = None,
        stream: bool = False,
    ):
        if not tables or count < 1:
            raise ValueError("a step needs at least one table and one token")
        starts = [t.length for t in tables]
        for t in tables:
            if len(t.blocks) < blocks_for(t.length + count):
                raise ValueError("grow every table before its step")
        swaps = list(swaps) if swaps is not None else [None] * len(tables)
        if len(swaps) != len(tables) or any(
            s is not None and (s.table is not t or (count != 1 and not stream))
            for s, t in zip(swaps, tables)
        ):
            raise ValueError("a swapped table decodes one token a step, as its own row")
        if stream and (len(tables) != 1 or swaps[0] is None or not (fused and fuses(arena))):
            raise ValueError("a swapped table's prefill runs alone, through the fused layers")
        # What attention reads: a swapped row that decodes reads its staging blocks, then its
        # resident ones (pool/swap.py); one that prefills (``stream``) its whole table, its
        # evicted blocks (-1) read back chunk by chunk into its staging blocks.
        rows = [
            t.blocks if s is None or stream else s.attention_row() for s, t in zip(swaps, tables)
        ]
        width = max(len(r) for r in rows)
        table = np.full((len(tables), width), -1, dtype=np.int32)
        for b, r in enumerate(rows):
            table[b, : len(r)] = r
        if arena.ct and any(t.tail is None for t in tables):
            raise ValueError("per-channel keys: every table needs its tail slot (grow it)")
        self.arena = arena
        self.quant: KVQuant = arena.quant
        self.count = count
        ends = np.asarray(starts, dtype=np.int32) + count
        # What attention reads; a swapped row reads its staging blocks, then its resident
        # ones (pool/swap.py), and RoPE takes its true positions (`positions`).
        lengths = np.asarray(
            [e if s is None or stream else s.attention_length(int(e)) for s, e in zip(swaps, ends)],
            dtype=np.int32,
        )
        self.swapped = [(b, s) for b, s in enumerate(swaps) if s is not None]
        self.stream = stream
        # KVSwap's reading ahead, while some swapped row's reads go to disk (the fused layers
        # then take the next one's query weights, to predict its query)
        self.reading_ahead = any(s.swapset.reading_ahead for _, s in self.swapped)
        # the step's indices, the plan's with them: one array made from host data a step
        also = [table, lengths, starts]  # the starts: RoPE's offsets (the prologue's too)
        also += [ends] if self.swapped else []
        self.plan = WritePlan(arena, list(tables), starts, count, also)
        self.tables, self.lengths, self.starts, *rest = self.plan.also
        self.offset = starts[0] if len(tables) == 1 else self.starts
        self.positions = rest.pop(0) if self.swapped else None
        # the same on the host: the GPU paths plan by them without reading the device
        slots = np.asarray([t.tail for t in tables], np.int32) if arena.ct else None
        self.host = HostIndex(table, lengths, slots, {}, self.plan.done_first_host)
        # where this step's kernels run, looked up once rather than by every layer (its store
        # and its attention alike: attention reads it from the memo)
        self.backend = self.host.memo["backend"] = dispatch.backend()
        self.fused = fused and self._fusable()
        self.caches = [
            PagedLayerCache(self, i, layer.window) for i, layer in enumerate(spec.layers)
        ]

    def _fusable(self) -> bool:
        """Whether a block can run this step as one operation (``_ext.decoder_layer``): on
        CPU, format 2 with 2/4/8-bit values (a row completing a channel group included)."""
        return fuses(self.arena)


class TokenRow:
    """One token of a jagged step's row: the row's table read as if it held ``length``
    tokens (what ``PagedStep`` and ``WritePlan`` read of a table)."""

    __slots__ = ("blocks", "tail", "prev_group", "length")

    def __init__(self, table: BlockTable, length: int):
        self.blocks = table.blocks
        self.tail = table.tail
        self.prev_group = table.prev_group
        self.length = length


def token_rows(tables: Sequence[BlockTable], counts: Sequence[int], ct: int) -> list:
    """A jagged step's rows as one-token rows (module docstring): a row feeding one token is
    its table itself; one feeding ``n`` is ``n`` ``TokenRow`` s. Every table must have grown
    by its count; ``ct``: the arena's channel group (0: none), which no token may complete."""
    rows: list = []
    for table, count in zip(tables, counts):
        start = table.length
        if count == 1:  # its own table: it may complete a group, from its tail
            rows.append(table)
            continue
        if ct and (start % ct + count) // ct:
            raise ValueError("a jagged step's row of several tokens completes a channel group")
        rows.extend(TokenRow(table, start + j) for j in range(count))
    return rows


def fuses(arena: KVArena) -> bool:
    """Whether the pool's steps can run their blocks as one operation each
    (``PagedStep._fusable``)."""
    quant = arena.quant
    return (
        mx.default_device() == mx.cpu
        and os.environ.get(ATTENTION_ENV) != "reference"
        and quant.channel_keys
        and quant.value_bits in (2, 4, 8)
    )


GPUS = ("metal", "cuda")


class PagedLayerCache(CacheBase):
    """One layer of a ``PagedStep`` (mlx-lm's cache protocol, for one forward pass)."""

    trimmable = False  # a step lives for one forward pass; agents trim their block tables

    def __init__(self, step: PagedStep, layer: int, window: int | None):
        self.step = step
        self.layer = layer
        self.window = window

    @property
    def offset(self):
        return self.step.offset

    @property
    def quant(self) -> KVQuant:
        """This layer's KV format (8-bit keys in a wide layer)."""
        return self.step.arena.layer_quants[self.layer]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        arena = self.step.arena
        arena.append(self.layer, keys, values, self.step.plan, backend=self.step.backend)
        return arena.keys(self.layer), arena.values(self.layer)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        """The attention kernel masks from each row's length and the layer's window; what
        the model gets is a marker it hands back unchanged."""
        if not return_array:
            return None if N == 1 else "causal"
        return remember_mask(mx.array(True), window_size or self.window)

    def agentkv_prologue(
        self, project, heads: tuple[int, int], dim: int, rope, *, scale: float, mask, norms=None
    ) -> mx.array | None:
        """A GPU layer's attention with its prologue in one kernel (``KVArena.append_prologue``):
        ``project()`` gives the joint q/k/v projection [B, L, (Hq + 2 Hkv) D] (``heads`` = (Hq,
        Hkv), D = ``dim``), ``rope`` = (table, mode) the layer's RoPE, ``norms`` its heads'
        RMS norm before RoPE (``mlx_adapter.HeadNorms``: Qwen3's, Gemma 3's; None: none);
        returns the attention's output [B, Hq, L, D], or None where this step or layer does
        not take it (the caller then runs the layer's own operations): a format the store
        kernel does not store, a swapped row, a backend that is not a GPU's."""
        step, quant = self.step, self.quant
        if rope is None or step.swapped or not step.arena.ct or step.backend not in GPUS:
            return None
        key = ("prologue", id(quant), dim)  # the step's layers of one format decide alike
        takes = step.host.memo.get(key)
        if takes is None:
            takes = step.host.memo[key] = gpu_kernels.stores_prologue(quant, dim)
        if not takes:
            return None
        arena = step.arena
        queries = arena.append_prologue(
            self.layer, project(), heads, step.plan, step.starts, rope, step.backend, norms
        )
        keys, values = arena.keys(self.layer), arena.values(self.layer)
        return self.agentkv_attention(queries, keys, values, scale=scale, mask=mask)

    def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None, softcap=0.0):
        if mask_window(mask, queries.shape[-2]) == NOT_OURS:
            raise ValueError(
                "this model builds its own attention mask; agentkv's paged cache masks "
                "causally (with the layer's sliding window) and cannot honour it"
            )
        step, quant = self.step, self.quant
        channel = step.arena.ct > 0
        paged = PagedQuery(
            keys=tuple(keys),
            values=tuple(values),
            tables=step.tables,
            lengths=step.lengths,
            kv_heads=step.arena.heads,
            block_tokens=BLOCK_TOKENS,
            key_bits=quant.key_bits,
            value_bits=quant.value_bits,
            group=quant.group_size,
            window=self.window or 0,
            sinks=sinks,
            channel_tokens=quant.channel_tokens if quant.channel_keys else 0,
            tail=step.arena.tails[self.layer] if channel else None,
            tail_slots=step.plan.tail_slots if channel else None,
            host=step.host,
            done=step.plan.done.get(self.layer) if channel else None,
            done_first=step.plan.done_first if channel else None,
            softcap=float(softcap or 0.0),
        )
        if step.stream:
            raise ValueError("a swapped table's prefill runs through the fused layers only")
        rotate = quant.rotate
        if not step.swapped:  # the path rotates (the GPU kernel inside itself)
            return paged_attention(queries, paged._replace(rotate=rotate), scale=scale)
        # the swapped rows' groups come into their staging blocks first, for rotated queries
        q = hadamard(queries) if rotate else queries  # q.(H k) == (H q).(H k)
        q = _ext.kvswap_stage(
            q.astype(mx.float32),
            list(keys),
            list(values),
            step.tables,
            [s.swapset for _, s in step.swapped],
            [b for b, _ in step.swapped],
            self.layer,
        )
        out = paged_attention(q, paged, scale=scale)
        return hadamard(out) if rotate else out  # values are stored as H v

    def fused_layer(self, layer: FusedLayer, x: mx.array) -> mx.array | None:
        """The whole decoder layer over ``x`` [B, L, D] as one CPU operation (``mlx_adapter``'s
        fused blocks call this; the same bits as the layer's separate operations), or None
        where this step needs those (``PagedStep.fused``)."""
        step = self.step
        if not step.fused:
            return None
        arena, quant, plan = step.arena, self.quant, step.plan
        # KVSwap: the next layer's query, predicted here, starts that layer's reads
        reads_ahead = step.reading_ahead and not step.stream and layer.predict is not None
        predict = layer.predict if reads_ahead else {}
        keys = {"tail_rows": plan.direct}  # where the new keys go
        if plan.key_plan is not None:  # a row completes a channel group
            keys = {
                "tail_rows": None,
                "key_plan": plan.key_plan,
                "key_counts": plan.key_counts,
                "prevs": arena.prevs[self.layer],
            }
        out = _ext.decoder_layer(
            x,
            **layer.arguments,
            keys=list(arena.keys(self.layer)),
            values=list(arena.values(self.layer)),
            tail=arena.tails[self.layer],
            tables=step.tables,
            lengths=step.lengths,
            tail_slots=plan.tail_slots,
            rows=plan.rows,
            **keys,
            key_bits=quant.key_bits,
            value_bits=quant.value_bits,
            group=quant.group_size,
            channel_tokens=quant.channel_tokens,
            block_tokens=BLOCK_TOKENS,
            window=self.window or 0,
            rotate=quant.rotate,
            positions=step.positions,
            swaps=[s.swapset for _, s in step.swapped],
            swap_rows=[b for b, _ in step.swapped],
            layer=self.layer,
            swap_stream=step.stream,
            **predict,
        )
        arena.written_by(out)
        count_fused_attention()
        return out

    def empty(self) -> bool:
        return False
