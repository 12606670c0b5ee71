"""KVSwap on the block pool (docs/kvswap.md): an agent decodes with most of its KV on disk.

::

    table.blocks   [ -- | -- | -- | ... | -- | 41 ]     blocks 0..E-1 evicted (their
                     evicted: only in block files        KV in block files), the last
                                                         block resident
    staging        [ 7 | 12 | 30 ]                       pool blocks: per layer a reuse
                                                         buffer of 64-token groups
    attention row  [ 7 | 12 | 30 | 41 ]                  staging, then the resident blocks

``SwapState.evict`` checksums each (block, layer, group) of the blocks it evicts, projects
their keys to the low rank (``Projections``) and gives the blocks back to the pool (they
stay cached by hash until the pool needs them). At each decode step and layer, the native
``KVSwapSet`` scores every evicted group from the low-rank keys and the step's query,
keeps the best groups in the layer's slots (reading misses from the block files with
``pread``, each checked against its checksum) and the attention runs over the staging
blocks and the resident blocks as one ordinary block table: every slot is a whole channel
group and positions live in the stored keys, so the kernel reads it as it reads any row.
RoPE takes the true positions (``PagedStep`` passes them apart from the table's lengths).

Invariants: while a table is swapped its ``blocks[:evicted]`` are -1 and the pool holds no
reference for them (their pages went back to the system when they were evicted: their
bytes are in their block files); only ``SwapState`` touches them (``release`` gives the
staging blocks and the table back; a save names their files: ``store.agent_store
.build_save_job``). Staging blocks are private to the state. A turn's prefill evicts too,
block by block as they fill (``engine/swapping.py``): its attention then reads the evicted
blocks back whole, chunk by chunk, into the staging blocks (exact: ``PagedStep(stream=)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from .. import _ext
from ..format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from .tables import BlockTable

SWAP_GROUP = GROUP_TOKENS  # a swap group is one channel group: 64 tokens of one layer
GROUPS_PER_BLOCK = BLOCK_TOKENS // SWAP_GROUP


class StoredFile(Protocol):
    """Where an evicted block's bytes are (``store.format.StoredBlock`` and its path)."""

    path: str
    offset: int  # where the block's region starts in the file
    layout: int  # of its region: KVSwap reads 1 (groups: store version 3) only


@dataclass(frozen=True)
class Projections:
    """Per layer and KV head, A [kv_heads, head_dim, rank] (float32) and the mean key it is
    centred on [kv_heads, head_dim]: a head's low-rank keys are (k - mean) A, k rotated as
    the pool stores it (``model/kvswap.py`` measures them)."""

    matrices: tuple[mx.array, ...]
    means: tuple[mx.array, ...]
    queries: tuple[
        mx.array, ...
    ]  # B [kv_heads, head_dim, rank]: q scores k as (q B).((k - mean) A)
    # the first layer whose reads start during the layer before, from a query predicted
    # there (KVSwapSet.predict_from); None: no reading ahead
    predict_from: int | None = None

    @property
    def rank(self) -> int:
        return int(self.matrices[0].shape[-1])


def plan_blocks(length: int, budget: int) -> tuple[int, int] | None:
    """(evicted blocks, staging blocks) for a table of ``length`` tokens under a budget of
    ``budget`` resident tokens per layer, or None where it is not worth swapping (the
    budget holds the context, or too little is left to evict)."""
    resident = (length + BLOCK_TOKENS - 1) // BLOCK_TOKENS  # every block, the last partial
    staging = budget // BLOCK_TOKENS - 1  # the last block stays resident
    evicted = resident - 1
    if staging < 1 or evicted <= staging or length <= budget:
        return None
    return evicted, staging


class SwapState:
    """One agent's table while KVSwap keeps its leading blocks on disk (module docstring)."""

    def __init__(
        self,
        pool,
        table: BlockTable,
        swapset,
        staging: list[int],
        records: list,
        files: list,
        projections: Projections | None = None,
    ):
        self.projections = projections
        self.pool = pool
        self.table = table
        self.swapset = swapset
        self.evicted = len(records)
        self.staging = staging
        self.records = records  # (hash, parent, token ids) of each evicted block
        self.files = files

    @staticmethod
    def frees(pool, table: BlockTable, evicted: int) -> int:
        """Pool blocks evicting ``table``'s first ``evicted`` blocks would give back (those
        no other table holds)."""
        records = pool.blocks.records
        return sum(records[b].refs == 1 for b in table.blocks[:evicted])

    # -- building -------------------------------------------------------------------------

    @classmethod
    def evict(
        cls,
        pool,
        table: BlockTable,
        files: list[StoredFile],
        projections: Projections | None = None,
        *,
        query_heads: int,
        staging: int,
        demand: int | None = None,
        attention_scale: float | None = None,
        reservation=None,
        keys_dir=None,
        capacity: int = 0,
    ) -> SwapState:
        """Evict ``table``'s first ``len(files)`` blocks (complete and sealed; ``files[i]``
        holds block i) and take ``staging`` pool blocks for their reuse buffers, from
        ``reservation`` where given (it gets the evicted blocks back). The evicted blocks'
        pages go back to the system at once (their bytes are in their files). ``keys_dir``:
        the low-rank keys go to an unlinked file there (room for ``capacity`` blocks: the
        context's), out of the process's memory."""
        evicted = len(files)
        if pool.window is not None:
            raise ValueError("KVSwap needs a model without sliding-window layers")
        if not 1 <= evicted < len(table.blocks) or staging < 1:
            raise ValueError("KVSwap evicts some of a table's blocks, never its last")
        records = pool.blocks.records
        blocks = table.blocks[:evicted]
        if any(b < 0 or records[b].hash is None or not records[b].full for b in blocks):
            raise ValueError("KVSwap evicts only complete, sealed blocks")
        spare = reservation.left if reservation is not None else 0
        if pool.blocks.available() + spare + cls.frees(pool, table, evicted) < staging:
            raise ValueError(f"KVSwap needs {staging} free pool blocks for its reuse buffers")
        spec, arena = pool.spec, pool.arena
        pool.arena.settle()
        crcs = _ext.kvswap_group_crcs(
            arena._flat(), spec.num_layers, spec.kv_heads, BLOCK_TOKENS, SWAP_GROUP, blocks
        )
        offsets = _layer_offsets(arena.components, files)
        row_bytes = [c.row_bytes for comps in arena.components for c in comps]
        slots = staging * GROUPS_PER_BLOCK
        swapset = _ext.KVSwapSet(
            spec.num_layers,
            spec.kv_heads,
            query_heads,
            spec.key_head_dim,
            BLOCK_TOKENS,
            SWAP_GROUP,
            projections.rank if projections is not None else 4,  # bounds: no low-rank keys
            slots,
            demand if demand is not None else slots - 1,
            attention_scale if attention_scale is not None else spec.key_head_dim**-0.5,
            [str(f.path) for f in files],
            offsets,
            row_bytes,
            len(arena.components[0]),
            crcs,
        )
        if projections is not None and projections.predict_from is not None:
            swapset.predict_from = projections.predict_from
        if keys_dir is not None and projections is not None:
            swapset.keys_to_file(str(keys_dir), max(capacity, evicted))
        for layer in range(spec.num_layers):
            if projections is None:
                swapset.set_bounds(layer, *key_bounds(pool, layer, blocks))
            else:
                keys, scales = low_rank_keys(pool, layer, blocks, projections)
                swapset.set_layer(layer, projections.queries[layer], keys, scales)
        kept = [(records[b].hash, records[b].parent, tuple(records[b].tokens)) for b in blocks]
        freed = sum(pool.blocks.release(b, keep=False) for b in blocks)
        table.evicted_hashes = [digest for digest, _, _ in kept]
        table.blocks[:evicted] = [-1] * evicted
        pool.swapped_blocks += evicted
        if reservation is not None:
            reservation.refill(freed)
        take = reservation.take if reservation is not None else (lambda: False)
        taken = [pool.blocks.allocate(reserved=take()) for _ in range(staging)]
        swapset.staging = taken
        return cls(pool, table, swapset, taken, kept, list(files), projections)

    def next_evictable(self) -> int | None:
        """The pool block to evict next to keep the table at its budget: the block after
        the evicted ones once it is complete and sealed and another follows it (a block the
        table filled while decoding), else None."""
        table, index = self.table, self.evicted
        if self.projections is None or index + 1 >= len(table.blocks):
            return None
        record = self.pool.blocks.records[table.blocks[index]]
        return table.blocks[index] if record.hash is not None and record.full else None

    def evict_next(self, file: StoredFile, reservation=None) -> None:
        """Evict ``next_evictable()``, whose block file ``file`` is (its pages back to the
        system at once; ``reservation`` gets the block back)."""
        block = self.next_evictable()
        if block is None:
            raise ValueError("KVSwap: no complete, sealed block to evict next")
        pool, spec, arena = self.pool, self.pool.spec, self.pool.arena
        arena.settle()
        crcs = _ext.kvswap_group_crcs(
            arena._flat(), spec.num_layers, spec.kv_heads, BLOCK_TOKENS, SWAP_GROUP, [block]
        )
        parts = [
            low_rank_keys(pool, layer, [block], self.projections)
            for layer in range(spec.num_layers)
        ]
        self.swapset.add_block(
            str(file.path),
            _layer_offsets(arena.components, [file]),
            crcs,
            [keys[0] for keys, _ in parts],
            [scales[0] for _, scales in parts],
        )
        record = pool.blocks.records[block]
        self.records.append((record.hash, record.parent, tuple(record.tokens)))
        self.table.evicted_hashes.append(record.hash)
        self.files.append(file)
        freed = pool.blocks.release(block, keep=False)
        self.table.blocks[self.evicted] = -1
        self.evicted += 1
        pool.swapped_blocks += 1
        if reservation is not None and freed:
            reservation.refill(1)

    # -- a step ---------------------------------------------------------------------------

    def attention_row(self) -> list[int]:
        """The block table attention reads: the staging blocks, then the resident ones."""
        return self.staging + self.table.blocks[self.evicted :]

    def attention_length(self, length: int) -> int:
        """Tokens attention reads for a table of ``length`` tokens."""
        return len(self.staging) * BLOCK_TOKENS + length - self.evicted * BLOCK_TOKENS

    @property
    def error(self) -> str:
        return self.swapset.error

    def failed_file(self):
        """The block file a failed read came from (None if none failed)."""
        block = self.swapset.failed_block
        return self.files[block] if 0 <= block < len(self.files) else None

    # -- what it holds ----------------------------------------------------------------------

    def resident_tokens(self) -> int:
        """KV tokens per layer in memory: the staging blocks and the resident blocks."""
        return (len(self.staging) + len(self.table.blocks) - self.evicted) * BLOCK_TOKENS

    def stats(self) -> dict:
        return dict(self.swapset.stats)

    # -- ending ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give the staging blocks and the table's resident blocks back (the table is
        empty afterwards, like ``BlockTable.release``)."""
        for b in self.staging:
            self.pool.blocks.release(b)
        self.staging = []
        del self.table.blocks[: self.evicted]
        self.table.evicted_hashes = []
        self.pool.swapped_blocks -= self.evicted
        self.evicted = 0
        self.table.release()


def _key_rows(pool, layer: int, blocks: list[int]) -> tuple[mx.array, ...]:
    """The blocks' stored key components in ``layer``, [heads, tokens, width] each."""
    heads = pool.spec.kv_heads
    rows = (
        (
            np.arange(heads)[:, None, None]
            + np.asarray(blocks, dtype=np.int64)[None, :, None] * heads
        )
        * BLOCK_TOKENS
        + np.arange(BLOCK_TOKENS)
    ).reshape(-1)
    index = mx.array(rows.astype(np.int32))
    return tuple(
        p[index].reshape(heads, len(blocks) * BLOCK_TOKENS, -1) for p in pool.arena.keys(layer)
    )


def key_bounds(pool, layer: int, blocks: list[int]) -> tuple[mx.array, mx.array]:
    """Per KV head, 64-token group and channel, the range the group's stored keys lie in
    (format 2 quantizes them per channel over the group: lo = bias, hi = bias + scale *
    levels), float32 [heads, groups, dim] each, groups in block order."""
    quant = pool.arena.layer_quants[layer]
    if not quant.channel_keys or quant.channel_tokens != SWAP_GROUP:
        raise ValueError("KVSwap's group bounds need KV format 2's 64-token channel groups")
    _, scales, biases = _key_rows(pool, layer, blocks)
    heads = scales.shape[0]
    shape = (heads, len(blocks) * GROUPS_PER_BLOCK, -1)  # a group's rows hold its channels
    lo = biases.reshape(shape).astype(mx.float32)
    hi = lo + scales.reshape(shape).astype(mx.float32) * ((1 << quant.key_bits) - 1)
    return lo, hi


def stored_keys(pool, layer: int, blocks: list[int]) -> mx.array:
    """The blocks' keys in ``layer`` as stored (rotated), read back: float32
    [heads, tokens, dim], tokens in block order."""
    spec, arena = pool.spec, pool.arena
    heads = spec.kv_heads
    rows = (
        (np.asarray(blocks, dtype=np.int64)[:, None, None] * heads + np.arange(heads)[:, None])
        * BLOCK_TOKENS
        + np.arange(BLOCK_TOKENS)
    ).reshape(-1)
    index = mx.array(rows.astype(np.int32))
    parts = tuple(
        p[index].reshape(len(blocks) * heads, BLOCK_TOKENS, -1) for p in arena.keys(layer)
    )
    keys = arena.layer_quants[layer].dequantize_keys(parts)  # [blocks*heads, 256, d]
    d = keys.shape[-1]
    keys = keys.reshape(len(blocks), heads, BLOCK_TOKENS, d).transpose(1, 0, 2, 3)
    return keys.reshape(heads, -1, d)


def low_rank_keys(pool, layer: int, blocks: list[int], projections: Projections):
    """The blocks' keys in ``layer`` projected per KV head, as ``KVSwapSet`` holds them:
    int8 [blocks, heads, rank, 256] and a float32 scale per block, head and 64-token group
    [blocks, heads, 4]."""
    keys = stored_keys(pool, layer, blocks) - projections.means[layer][:, None, :]
    low = keys @ projections.matrices[layer]  # [heads, tokens, rank]
    heads, _, rank = low.shape
    grouped = low.reshape(heads, len(blocks), GROUPS_PER_BLOCK, SWAP_GROUP * rank)
    scales = mx.maximum(mx.abs(grouped).max(axis=-1), 1e-12) / 127
    codes = mx.clip(mx.round(grouped / scales[..., None]), -127, 127).astype(mx.int8)
    codes = codes.reshape(heads, len(blocks), BLOCK_TOKENS, rank).transpose(1, 0, 3, 2)
    return codes, scales.transpose(1, 0, 2).astype(mx.float32)


def _layer_offsets(components, files) -> list[int]:
    """[block][layer] file offset of each layer's first 64-token group extent (a block
    file of store version 3 lays its region out layer-major from the file's ``offset``,
    each layer as 4 extents of every component's rows of one group, head by head)."""
    if any(f.layout != 1 for f in files):
        raise ValueError("KVSwap reads block files of store version 3 (groups) only")
    within = []
    position = 0
    for comps in components:
        within.append(position)
        position += sum(c.heads * BLOCK_TOKENS * c.row_bytes for c in comps)
    return [int(f.offset) + w for f in files for w in within]
