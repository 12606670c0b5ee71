"""KVArena: the bytes of every pool block, one MLX array per layer and stored component.

::

    arrays[layer][comp]   [capacity * heads * 256, width]      comp: k.w k.s k.b v.w v.s v.b
                          (widths per layer: a KV format's wide layers hold 8-bit keys)
    row of (block, head, token t of the block) = (block * heads + head) * 256 + t

On CPU each array is allocated once and left untouched, so a block's pages are committed
when it is first written; ``release`` hands a freed block's pages back to the OS. On a GPU
nothing reads or writes the arrays from the host: MLX's CUDA backend moves an array that
the host touches into unified memory for good (``move_to_unified_memory``), where the GPU's
later reads and writes fault pages back and forth; so there the block I/O (``pack``,
``read_regions``, ``copy_rows``, the tails' ``read_*``/``write_*``) goes through MLX
operations and small staging copies, and only the copies meet the host. New
tokens land by MLX scatters, which run in place because the arena owns the only reference
to each array: **never keep an arena array anywhere else** (``copies`` counts writes whose
buffer moved; the tests require 0). A fused decoder layer (``_ext.decoder_layer``) writes
its step's rows into the arrays in place instead; ``settle`` evaluates it (``written_by``).
Between forward passes the arrays are evaluated, and
the block I/O here (``read_regions``, ``pack``, ``copy_rows``) works on their memory
directly through the extension.

Per-channel keys (KV format 2, ``quant.channel_keys``): a channel group of ``ct`` tokens is
quantized when it completes; until then its keys are float16 rows of the agent's *tail
slot*, one per block table that holds tokens::

    tails[layer]   [slots * heads * ct, key_dim] float16
    row of (slot, head, token t) = (slot * heads + head) * ct + t % ct
    prevs[layer]   the same rows: the float16 keys of the slot's last completed group, so a
                   trim back into that group (a cancelled reply, a re-fed last token, an
                   edited last message) restores its keys exactly (``BlockTable.prev_group``)

``WritePlan`` says, for one step, which new keys join a tail and which complete a group
(the group's tail rows and new keys quantized together into the group's arena rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .. import _ext
from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant, native_layout
from ..format.spec import LayerKind, ModelCacheSpec
from ..kernels import attention as dispatch
from ..kernels import gpu as gpu_kernels
from ..kernels.gpu import device_index, on_device
from .blocks import PoolExhaustedError

IO_THREADS = 2
FIRST_TAIL_SLOTS = 16


def index_arrays(*values) -> list[mx.array]:
    """Host indices (int32, any shapes) as MLX arrays, views of one array made from host data.

    On MLX's CUDA backend an array made from host data is a buffer in managed memory, and
    making one may first copy a cached device buffer into managed memory, synchronously
    (docs/gpu-attention.md, "Profile"): a step makes one, not one an index. On a GPU with
    ``AGENTKV_GPU_DEVICE_INDEX=1`` the one array is copied into device memory by one addition,
    which the kernels reading it then do not fault on (an experiment, off by default)."""
    arrays = [np.asarray(v, dtype=np.int32) for v in values]
    whole = mx.array(np.concatenate([a.reshape(-1) for a in arrays]))
    if whole.size and _device_index():
        whole = on_device(whole)
    out, at = [], 0
    for a in arrays:
        out.append(whole[at : at + a.size].reshape(a.shape))
        at += a.size
    return out


def one_buffer(parts: list[mx.array]) -> list[mx.array]:
    """``parts`` as views of one evaluated buffer (each 16-byte aligned), for the host to
    read. On a GPU the host's first read moves the array it reads into managed memory with a
    synchronous copy (MLX's CUDA backend): one buffer is one such copy a save or a tail read,
    where each part of its own was one (docs/gpu-attention.md, "Profile")."""
    if len(parts) < 2:
        mx.eval(parts)
        return list(parts)
    chunks, offsets, at = [], [], 0
    for part in parts:
        flat = mx.view(part, mx.uint8).reshape(-1)
        offsets.append(at)
        chunks.append(flat)
        at += flat.size
        if pad := -at % 16:
            chunks.append(mx.zeros((pad,), dtype=mx.uint8))
            at += pad
    whole = mx.concatenate(chunks)
    out = [
        mx.view(whole[o : o + part.nbytes], part.dtype).reshape(part.shape)
        for o, part in zip(offsets, parts)
    ]
    mx.eval(out)
    return out


def host_buffers(shapes: list[tuple[tuple[int, ...], mx.Dtype]]) -> list[mx.array]:
    """Zeroed arrays of these shapes and dtypes made from host data, as views of one array
    (``one_buffer``'s reason: one allocation in managed memory, not one each)."""
    sizes = [int(np.prod(shape)) * dtype.size for shape, dtype in shapes]
    aligned = [n + (-n % 16) for n in sizes]
    whole = mx.array(np.zeros(sum(aligned), np.uint8))
    out, at = [], 0
    for (shape, dtype), n, step in zip(shapes, sizes, aligned):
        out.append(mx.view(whole[at : at + n], dtype).reshape(shape))
        at += step
    mx.eval(out)
    return out


def _device_index() -> bool:
    return device_index()


class WritePlan:
    """Where one step's new keys and values go (host indices, shared by every layer).

    ``rows``: the arena rows of the new tokens, ordered (b, head, t) (values, and keys of
    the token scheme). Per-channel keys: the new keys of batch rows whose group stays
    incomplete go to tail rows ``tail_rows``; for rows completing groups, ``gather`` tail
    rows come first in a source list, then every new key; ``group_src`` picks each complete
    group's ``ct`` keys (per head, in token order) from it into arena rows ``group_rows``,
    and ``rest_src`` the keys after the last complete group into tail rows ``rest_rows``.
    ``key_plan`` / ``key_counts``: all of it as the fused decoder layer takes it (None where
    no row completes a group). The groups a step completes are listed row by row, group by
    group, head by head: row b's first is entry ``done_first[b]`` (-1: it completes none), and
    ``done[layer]`` holds them in float16 once ``KVArena.append`` has run: attention reads a
    query's own group there until the query is its last token (csrc/core/attention.h).

    Every index is a view of one array made from host data (``index_arrays``), and so are
    ``also``: the caller's own host indices sent with them (``PagedStep``'s table, lengths).
    """

    def __init__(
        self, arena: KVArena, tables: list, starts: list[int], count: int, also: Sequence = ()
    ):
        written = arena.write_rows([t.blocks for t in tables], starts, count)
        self.count = count
        self.done_first_host: np.ndarray | None = None  # done_first on the host (GPU paths)
        if not arena.quant.channel_keys:
            self.rows, *self.also = index_arrays(written, *also)
            return
        ct, heads = arena.ct, arena.heads
        direct, direct_src, gather = [], [], []
        group_src, group_rows, rest_src, rest_rows = [], [], [], []
        prev_src, prev_rows = [], []
        self.prev_groups: list[int | None] = [getattr(t, "prev_group", None) for t in tables]
        self.done: dict[int, mx.array] = {}
        done_first = [-1] * len(tables)
        completing = []
        for b, (t, start) in enumerate(zip(tables, starts)):
            r = start % ct
            if (r + count) // ct == 0:
                for h in range(heads):
                    first = (t.tail * heads + h) * ct + r
                    direct.extend(range(first, first + count))
                    direct_src.extend(range((b * heads + h) * count, (b * heads + h + 1) * count))
            else:
                completing.append((b, t, start, r))
        # every new key joins a tail, in order (no row completes a group): no gather needed
        self.direct_in_order = direct_src == list(range(len(tables) * heads * count))
        if completing:
            for _, t, _, r in completing:
                for h in range(heads):
                    first = (t.tail * heads + h) * ct
                    gather.extend(range(first, first + r))
            n_gather = len(gather)
            gathered = 0  # tail rows of the completing rows before this one, per head
            entries = 0  # groups (of one head) listed so far
            for b, t, start, r in completing:
                total = r + count
                full = total // ct * ct
                rows = arena.write_rows([t.blocks], [start - r], full).reshape(heads, full)
                seqs = []
                for h in range(heads):
                    old = [gathered * heads + h * r + i for i in range(r)]
                    new = [n_gather + (b * heads + h) * count + i for i in range(count)]
                    seq = old + new
                    seqs.append(seq)
                    rest_src.extend(seq[full:])
                    first = (t.tail * heads + h) * ct
                    rest_rows.extend(range(first, first + total - full))
                    prev_src.extend(seq[full - ct : full])  # the last group completed
                    prev_rows.extend(range(first, first + ct))
                for g in range(0, full, ct):  # group by group, head by head
                    for h in range(heads):
                        group_src.extend(seqs[h][g : g + ct])
                        group_rows.extend(rows[h][g : g + ct].tolist())
                done_first[b] = entries
                entries += full // ct * heads
                self.prev_groups[b] = start - r + full - ct
                gathered += r
        # the fused layer's form (csrc/ops.h, decoder_layer), of which each list is a view
        parts = [direct, direct_src, gather, group_src, group_rows, rest_src, rest_rows]
        parts += [prev_src, prev_rows, done_first if completing else []]
        slots = [t.tail for t in tables]
        plan = np.fromiter(itertools.chain.from_iterable(parts), np.int32)
        self.rows, self.tail_slots, key_plan, *self.also = index_arrays(written, slots, plan, *also)
        views, at = [], 0
        for part in parts:
            views.append(key_plan[at : at + len(part)] if part else None)
            at += len(part)
        (self.direct, self.direct_src, self._gather, self.group_src, self.group_rows) = views[:5]
        (self.rest_src, self.rest_rows, self.prev_src, self.prev_rows) = views[5:9]
        self.done_first = views[9]
        self.key_plan, self.key_counts = None, None
        if completing:
            self.key_plan = key_plan
            self.key_counts = [
                len(direct),
                len(gather),
                len(group_src),
                len(rest_src),
                len(prev_src),
                len(done_first),
            ]
            self.done_first_host = np.asarray(done_first, np.int32)
        self._arena = arena
        self._gathered: list[mx.array] | None = None
        for table, group in zip(tables, self.prev_groups):
            table.prev_group = group  # what its previous-group rows hold after this step

    @property
    def gathered(self) -> list[mx.array] | None:
        """Every layer's tail rows that the completing groups need (``KVArena.append``), read
        and evaluated at first use, before the step writes any tail: a scatter whose target
        is still read in the same graph is not in place. (The fused layer reads them itself.)"""
        if self._gather is not None and self._gathered is None:
            self._gathered = [tails[self._gather] for tails in self._arena.tails]
            mx.eval(self._gathered)
        return self._gathered


class KVArena:
    def __init__(self, spec: ModelCacheSpec, quant: KVQuant, capacity: int):
        self.spec = spec
        self.quant = quant
        self.capacity = capacity
        self.components = spec.components(quant)  # per layer
        self.layer_quants = [quant.layer(i) for i in range(spec.num_layers)]
        self.key_parts = quant.key_parts
        self.heads = spec.kv_heads
        self.rows = capacity * self.heads * BLOCK_TOKENS
        self._layout = (spec.num_layers, BLOCK_TOKENS, native_layout(self.components))
        lazy = mx.default_device() == mx.cpu
        self.arrays = [
            [self._allocate(c.width, c.dtype, lazy) for c in comps] for comps in self.components
        ]
        self._lazy = lazy
        self.ct = quant.channel_tokens if quant.channel_keys else 0
        self.tails: list[mx.array] = []
        self.prevs: list[mx.array] = []
        self._free_tails: list[int] = []
        if self.ct:
            self._grow_tails(FIRST_TAIL_SLOTS)
        self._addresses = self._data_addresses() if lazy else None
        self._sliding = [layer.kind is LayerKind.SLIDING for layer in spec.layers]
        self.copies = 0
        self.released_bytes = 0
        self._writers: list[mx.array] = []  # fused layers' outputs whose writes are pending

    def _allocate(self, width: int, dtype: str, lazy: bool, rows: int | None = None) -> mx.array:
        rows = self.rows if rows is None else rows
        if lazy:
            return _ext.uninitialized(rows, width, dtype)
        # Evaluated here: on a GPU, MLX's streams belong to the thread that made them, and the
        # arena is made on the caller's thread but written on the scheduler's.
        out = mx.zeros((rows, width), dtype=getattr(mx, dtype))
        mx.eval(out)
        return out

    # -- per-channel keys: the float16 tails of groups still filling ---------------------------

    @property
    def tail_slots(self) -> int:
        return self.tails[0].shape[0] // (self.heads * self.ct) if self.tails else 0

    def _grow_tails(self, slots: int) -> None:
        old = self.tail_slots
        dim = self.spec.key_head_dim

        def grown(arrays):
            out = []
            for layer in range(self.spec.num_layers):
                fresh = self._allocate(dim, "float16", self._lazy, slots * self.heads * self.ct)
                if old:
                    fresh[: old * self.heads * self.ct] = arrays[layer]
                out.append(fresh)
            mx.eval(out)
            return out

        self.tails, self.prevs = grown(self.tails), grown(self.prevs)
        self._free_tails.extend(range(slots - 1, old - 1, -1))
        if getattr(self, "_addresses", None) is not None:
            self._addresses = self._data_addresses()

    def take_tail(self) -> int:
        """A free tail slot (the tails grow, between steps, when none is left)."""
        if not self._free_tails:
            if self.tail_slots >= 2 * self.capacity + FIRST_TAIL_SLOTS:
                raise PoolExhaustedError("every tail slot is in use")
            self._grow_tails(min(2 * self.tail_slots, 2 * self.capacity + FIRST_TAIL_SLOTS))
        return self._free_tails.pop()

    def give_tail(self, slot: int) -> None:
        self._free_tails.append(slot)

    def _tail_rows(self, slot: int, first: int, count: int) -> mx.array:
        base = (slot * self.heads + np.arange(self.heads)[:, None]) * self.ct + first
        return mx.array((base + np.arange(count)[None]).reshape(-1).astype(np.int32))

    def copy_tail(self, src: int, dst: int, count: int, *, prev: bool = False) -> None:
        """Rows [0, count) of tail slot ``src`` into slot ``dst`` (every layer, in place);
        ``prev``: its previous-group rows too."""
        self._copy_rows(self.tails, src, dst, count, count)
        if prev:
            self._copy_rows(self.prevs, src, dst, self.ct, self.ct)

    def _copy_rows(self, arrays, src: int, dst: int, count: int, dst_count: int) -> None:
        if count:
            take, put = self._tail_rows(src, 0, count), self._tail_rows(dst, 0, dst_count)
            rows = [arrays[layer][take] for layer in range(self.spec.num_layers)]
            mx.eval(rows)  # read before the scatter, which then runs in place
            for layer, part in enumerate(rows):
                arrays[layer][put] = part
            self.settle()

    def refill_tail(self, slot: int, keep: int, prev_group: int | None) -> None:
        """The tail of a table cut to ``keep`` tokens inside its last complete channel group:
        the group's first ``keep % ct`` keys into ``slot``, from the slot's previous-group
        rows, which hold that group (``prev_group``, its first token) as it was computed.
        (``BlockTable.trim`` never cuts into an earlier group: its float16 keys are gone.)"""
        first = keep // self.ct * self.ct
        count = keep - first
        if not count:
            return
        if prev_group != first:
            raise ValueError(f"tail slot {slot} holds no float16 keys of the group at {first}")
        take, put = self._tail_rows(slot, 0, count), self._tail_rows(slot, 0, count)
        rows = [self.prevs[layer][take] for layer in range(self.spec.num_layers)]
        mx.eval(rows)
        for layer, part in enumerate(rows):
            self.tails[layer][put] = part
        self.settle()

    def _slot_views(self, slot: int, arrays: list[mx.array] | None = None) -> list[np.ndarray]:
        """Each layer's rows of a tail slot (or of ``arrays``: the prevs) as NumPy arrays
        [heads, ct, key_dim]: on CPU writable views of the evaluated arrays (between steps:
        no MLX op, no copy), on a GPU copies (the host never touches the arrays)."""
        arrays = self.tails if arrays is None else arrays
        mx.eval(arrays)
        first, last = slot * self.heads * self.ct, (slot + 1) * self.heads * self.ct
        if not self._lazy:
            rows = mx.arange(first, last, dtype=mx.int32)
            copies = one_buffer([mx.take(t, rows, axis=0) for t in arrays])
            return [np.array(c).reshape(self.heads, self.ct, -1) for c in copies]
        return [
            np.asarray(memoryview(t))[first:last].reshape(self.heads, self.ct, -1) for t in arrays
        ]

    def _write_slot(self, arrays: list[mx.array], slot: int, keys: np.ndarray) -> None:
        """Rows [0, keys.shape[2]) of a slot, every layer, from ``read_tail``'s layout."""
        count = keys.shape[2]
        if self._lazy:
            for view, layer_keys in zip(self._slot_views(slot, arrays), keys):
                view[:, :count] = layer_keys
            return
        rows = self._tail_rows(slot, 0, count)
        for layer, layer_keys in enumerate(keys):
            arrays[layer][rows] = mx.array(
                np.ascontiguousarray(layer_keys).reshape(-1, keys.shape[3])
            )
        self.settle()

    def read_tail(self, slot: int, count: int) -> np.ndarray:
        """Rows [0, count) of a tail slot: float16 [layers, heads, count, key_dim] (a copy)."""
        return np.stack([view[:, :count] for view in self._slot_views(slot)])

    def write_tail(self, slot: int, keys: np.ndarray) -> None:
        """Set a tail slot's first rows from ``read_tail``'s layout (in place)."""
        if keys.shape[2]:
            self._write_slot(self.tails, slot, keys)

    def read_prev(self, slot: int) -> np.ndarray:
        """A slot's previous-group rows: float16 [layers, heads, ct, key_dim] (a copy)."""
        return np.stack(self._slot_views(slot, self.prevs))

    def write_prev(self, slot: int, keys: np.ndarray) -> None:
        """Set a slot's previous-group rows from ``read_prev``'s layout (in place)."""
        self._write_slot(self.prevs, slot, keys)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.spec.bytes_per_token(self.quant) * BLOCK_TOKENS

    def sliding_block_bytes(self) -> int:
        """Bytes of one block in the sliding-window layers only."""
        return BLOCK_TOKENS * sum(
            c.heads * c.row_bytes
            for comps, s in zip(self.components, self._sliding)
            if s
            for c in comps
        )

    # -- the forward pass ------------------------------------------------------------------

    def write(self, layer: int, parts: tuple[mx.array, ...], rows: mx.array) -> None:
        """Scatter new token rows (``parts``: each stored component, [B, heads, L, width],
        keys' first) into ``rows`` (ordered batch, head, token)."""
        for target, part in zip(self.arrays[layer], parts):
            target[rows] = part.reshape(-1, part.shape[-1])

    def append(
        self, layer: int, keys: mx.array, values: mx.array, plan: WritePlan,
        backend: str | None = None,
    ) -> None:  # fmt: skip
        """Store one step's new keys and values [B, heads, L, dim] (model space: rotated
        and quantized here) as ``plan`` says. On a GPU, format 2's rotations and the values'
        quantization are one kernel (``store_rows``), and the completed groups'
        quantization another (``quantize_groups``): the same bits as the operations.
        ``backend``: where the step runs (None: ``dispatch.backend()``)."""
        q = self.layer_quants[layer]
        backend = backend or dispatch.backend()
        if self.ct and backend in ("metal", "cuda") and gpu_kernels.stores_rows(q, keys, values):
            store = gpu_kernels.for_backend(backend).store_rows
            new, *value_parts = store(keys, values, q.value_bits, q.group_size)
        else:
            keys, values = q.rotated(keys), q.rotated(values)
            value_parts = q.quantize(values, q.value_bits)
            if not self.ct:
                self.write(layer, (*q.quantize(keys, q.key_bits), *value_parts), plan.rows)
                return
            new = keys.astype(mx.float16).reshape(-1, keys.shape[-1])
        self._place(layer, new, value_parts, plan, backend)

    def append_prologue(
        self, layer: int, qkv: mx.array, heads: tuple[int, int], plan: WritePlan,
        starts: mx.array, rope: tuple[mx.array, int], backend: str | None = None,
        norms=None,
    ) -> mx.array:  # fmt: skip
        """A GPU layer's prologue and store in one kernel (``gpu.store_prologue``; the caller
        checked ``gpu.stores_prologue``): the joint q/k/v projection ``qkv`` [B, L, (Hq + 2
        Hkv) D] (``heads`` = (Hq, Hkv)), its queries and keys normed by ``norms`` (where
        given) and roped at ``starts`` by ``rope`` (its table and mode), the keys and values
        stored as ``append`` stores them. Returns the roped queries [B, Hq, L, D]."""
        q = self.layer_quants[layer]
        backend = backend or dispatch.backend()
        prologue = gpu_kernels.for_backend(backend).store_prologue
        table, mode = rope
        *stored, queries = prologue(
            qkv, heads, starts, table, mode, q.value_bits, q.group_size, norms
        )
        self._place(layer, stored[0], stored[1:], plan, backend)
        return queries

    def _place(self, layer: int, new: mx.array, value_parts, plan: WritePlan, backend) -> None:
        """Format 2's new rows into the pool: the values' parts at the plan's rows, the keys
        (float16 rows, rotated) into their tails, and each completed channel group quantized."""
        q = self.layer_quants[layer]
        arrays = self.arrays[layer]
        for target, part in zip(arrays[self.key_parts :], value_parts):
            target[plan.rows] = part.reshape(-1, part.shape[-1])
        dim = new.shape[-1]
        tails = self.tails[layer]
        if plan.direct is not None:
            tails[plan.direct] = new if plan.direct_in_order else new[plan.direct_src]
        if plan.group_src is not None:
            source = new if plan.gathered is None else mx.concatenate([plan.gathered[layer], new])
            groups = source[plan.group_src].reshape(-1, self.ct, dim)
            plan.done[layer] = groups.reshape(-1, dim)
            if backend in ("metal", "cuda") and gpu_kernels.quantizes_groups(q, dim):
                # one kernel for the groups' per-channel quantization (the same bits)
                parts = gpu_kernels.for_backend(backend).quantize_groups(groups, q.key_bits)
            else:
                parts = q.quantize_channels(groups)
            for target, part in zip(arrays[: self.key_parts], parts):
                target[plan.group_rows] = part.reshape(-1, part.shape[-1])
            if plan.rest_src is not None:
                tails[plan.rest_rows] = source[plan.rest_src]
            self.prevs[layer][plan.prev_rows] = source[plan.prev_src]
        self.tails[layer] = tails

    def keys(self, layer: int) -> tuple[mx.array, ...]:
        return tuple(self.arrays[layer][: self.key_parts])

    def values(self, layer: int) -> tuple[mx.array, ...]:
        return tuple(self.arrays[layer][self.key_parts :])

    def write_rows(self, tables: list[list[int]], starts: list[int], count: int) -> np.ndarray:
        """Rows of ``count`` new tokens after ``starts[b]`` of each table, ordered (b, h, t)."""
        out = np.empty((len(tables), self.heads, count), dtype=np.int32)
        t = np.arange(count)
        heads = np.arange(self.heads)[:, None]
        for b, (table, start) in enumerate(zip(tables, starts)):
            pos = start + t
            blocks = np.asarray(table, dtype=np.int64)[pos // BLOCK_TOKENS]
            out[b] = (blocks[None, :] * self.heads + heads) * BLOCK_TOKENS + pos % BLOCK_TOKENS
        return out.reshape(-1)

    def written_by(self, out: mx.array) -> None:
        """``out`` comes from an operation that writes into the arrays in place (a fused
        decoder layer): ``settle`` evaluates it, whether or not its step's logits are used."""
        self._writers.append(out)

    def discard_writes(self) -> None:
        """Forget the fused layers' pending writes of a step that failed before ``settle``: its
        agents are dropped, their blocks may go to others, and a later ``settle`` must not
        write into them behind the next step's back."""
        self._writers = []

    def settle(self) -> None:
        """Evaluate every arena (after a step) and count any write that was not in place."""
        writers, self._writers = self._writers, []
        mx.eval(writers, self._flat(), self.tails, self.prevs)
        if self._addresses is not None:
            now = self._data_addresses()
            self.copies += sum(a != b for a, b in zip(now, self._addresses))
            self._addresses = now

    def _data_addresses(self) -> list[int]:
        return [_ext.data_address(a) for a in self._flat() + self.tails + self.prevs]

    # -- block I/O between steps -------------------------------------------------------------

    def _flat(self) -> list[mx.array]:
        return [a for layer in self.arrays for a in layer]

    def read_regions(self, files, regions) -> None:
        """Copy stored block regions into their slots (verifying each; CacheFormatError).
        ``files``: (path, size, header CRC, layout: 0 planes, 1 groups). On a GPU they are
        read into host staging blocks, then copied into their slots by MLX scatters."""
        if self._lazy:
            _ext.read_regions(
                self._flat(), *self._layout, self.capacity, files, regions, IO_THREADS
            )
            return
        slots = sorted({r[5] for r in regions})
        index = {slot: i for i, slot in enumerate(slots)}
        rows = len(slots) * self.heads * BLOCK_TOKENS
        # unified memory from the start: the extension writes it, MLX reads it
        staging = host_buffers([((rows, a.shape[1]), a.dtype) for a in self._flat()])
        staged = [(*r[:5], index[r[5]]) for r in regions]
        _ext.read_regions(staging, *self._layout, len(slots), files, staged, IO_THREADS)
        self._scatter_blocks(staging, slots)

    def pack(self, slots: list[int], tokens: list[int], layouts: list[int] | None = None):
        """The blocks as checksummed regions: (bytes, [(0, offset, length, crc, tokens)]),
        each in its layout (default: planes, as segments hold them; see store/format.py).
        On a GPU the blocks are first gathered into staging copies the host reads."""
        layouts = [0] * len(slots) if layouts is None else layouts
        arrays, capacity = self._flat(), self.capacity
        if not self._lazy and slots:
            rows = self._block_rows(slots)
            arrays = one_buffer([mx.take(a, rows, axis=0) for a in arrays])
            slots, capacity = list(range(len(slots))), len(slots)
        return _ext.pack_regions(arrays, *self._layout, capacity, slots, tokens, layouts, 2)

    def copy_rows(self, src: int, dst: int, tokens: int) -> None:
        if self._lazy:
            _ext.copy_slot_rows(self._flat(), *self._layout, self.capacity, src, dst, tokens)
            return
        take, put = self._block_rows([src], tokens), self._block_rows([dst], tokens)
        self._copy_block_rows(range(self.spec.num_layers), take, put)

    def _block_rows(self, blocks: list[int], tokens: int = BLOCK_TOKENS) -> mx.array:
        """Arena rows of tokens [0, tokens) of each block, every head, block by block."""
        base = (np.asarray(blocks, np.int64)[:, None] * self.heads + np.arange(self.heads)) * (
            BLOCK_TOKENS
        )
        rows = base[:, :, None] + np.arange(tokens)
        return mx.array(rows.reshape(-1).astype(np.int32))

    def _copy_block_rows(self, layers, take: mx.array, put: mx.array) -> None:
        """GPU: ``take`` rows into ``put`` rows of every component of ``layers``, in place
        (read first: a scatter whose target is read in the same graph is not in place)."""
        layers = list(layers)
        parts = [a[take] for layer in layers for a in self.arrays[layer]]
        mx.eval(parts)
        at = iter(parts)
        for layer in layers:
            for target in self.arrays[layer]:
                target[put] = next(at)
        self.settle()

    def _scatter_blocks(self, staging: list[mx.array], slots: list[int]) -> None:
        """GPU: staging blocks 0.. into pool blocks ``slots``, every layer and component."""
        rows = self._block_rows(slots)
        at = iter(staging)
        for layer in self.arrays:
            for target in layer:
                target[rows] = next(at)
        self.settle()

    def copy_window_rows(self, src: int, dst: int) -> None:
        """Copy a block's rows in the sliding-window layers into another block (whose rows
        there were handed back), in place."""
        sliding = [a for layer, s in zip(self.arrays, self._sliding) if s for a in layer]
        if not sliding:
            return
        if self._addresses is None:  # a GPU
            layers = [i for i, s in enumerate(self._sliding) if s]
            self._copy_block_rows(layers, self._block_rows([src]), self._block_rows([dst]))
            return
        _, block_tokens, components = self._layout
        comps = [c for c, s in zip(components, self._sliding) if s]
        layers = len(comps)
        _ext.copy_slot_rows(
            sliding, layers, block_tokens, comps, self.capacity, src, dst, block_tokens
        )

    def release(self, block: int) -> None:
        """Hand a free block's pages back (CPU)."""
        self._release(block, [1] * self.spec.num_layers)

    def release_window(self, block: int) -> None:
        """Hand back a block's rows in the sliding-window layers only."""
        self._release(block, [int(s) for s in self._sliding])

    def _release(self, block: int, layers: list[int]) -> None:
        if self._addresses is None or not any(layers):
            return
        self.released_bytes += _ext.release_slot(
            self._flat(), *self._layout, self.capacity, block, layers
        )
