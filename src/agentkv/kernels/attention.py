"""Attention over agentkv caches: the one dispatch, and the protocol caches speak.

Three caches speak ``CacheBase`` (mlx-lm's model code drives them; ``mlx_adapter``'s
attention dispatch hands attention to their ``agentkv_attention``):

* ``AgentKVCache`` — one agent's layer, contiguous (the mlx-lm drop-in; prompt-cache files);
* ``BatchQuantizedKVCache`` — several of those as one left-padded batch (``BatchGenerator``);
* ``PagedLayerCache`` — one layer of a forward pass over the block pool (the engine).

Each call takes one of three paths, counted by ``paths_used``:

* ``fused_cpu`` — on CPU, the extension's fused kernels (``kernels/cpu.py``,
  csrc/core/attention*): keys and values dequantized 64 tokens at a time in L1, every query's
  result in one fixed order whether it runs alone or in a batch. They recompute the mask from
  the cache, so they run only for masks an agentkv cache made (``kernels/masks.py``).
* ``gpu_kernel`` — on Metal and CUDA, the shared body ``kernels/paged_attention.metal``
  (``kernels/gpu.py``, docs/gpu-attention.md), for the block pool's KV in every format;
* ``gpu_dense`` — on Metal and CUDA, a prefill chunk of the pool (``kernels/dense.py``): the
  rows it sees dequantized once, then MLX's fused attention;
* ``quantized_matmul`` — everywhere else, the pure-MLX reference (``kernels/reference.py``).
  ``AGENTKV_ATTENTION=reference`` forces it.

Format 2 (per-channel keys) also reads each row's float16 tail, its filling group. Its
rotation (keys and values stored times H): ``paged_attention`` takes queries as they are
where ``PagedQuery.rotate`` says so, and the paged kernel rotates them and their output
inside itself where it can (``PagedQuery.rotates_inside``; two operations a layer fewer), as
the dense path's gathering kernel rotates the rows back (kernels/dense_rows.metal); every
other path, and ``cache_attention``, gets queries rotated by the caller.
"""

from __future__ import annotations

import os
from typing import ClassVar

import mlx.core as mx

from ..format.quant import KVQuant, hadamard
from . import backend, cpu, dense, gpu, reference
from .masks import NOT_OURS, mask_window
from .types import PagedQuery

FUSED_BITS = (2, 4, 8, 16)
ENV = "AGENTKV_ATTENTION"  # "reference" forces the mx.quantized_matmul path
FUSED, KERNEL, DENSE, REFERENCE = "fused_cpu", "gpu_kernel", "gpu_dense", "quantized_matmul"
_PATHS = {FUSED: 0, KERNEL: 0, DENSE: 0, REFERENCE: 0}


class CacheBase:
    """What every agentkv cache is, for mlx-lm's model code and agentkv's attention.

    mlx-lm's models drive a cache through ``offset``, ``update_and_fetch`` and
    ``make_mask``; the attention dispatch then calls ``agentkv_attention``.
    """

    quant: KVQuant
    window: int | None = None
    trimmable: ClassVar[bool] = True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new keys and values [B, kv_heads, L, dim]; what attention will read."""
        raise NotImplementedError

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        raise NotImplementedError

    def agentkv_attention(
        self, queries, keys, values, *, scale, mask, sinks=None, softcap: float = 0.0
    ) -> mx.array:
        """Attention of ``queries`` over this cache (called by mlx-lm's model code through
        the dispatch ``mlx_adapter`` installs; ``softcap``: Gemma 2's scores' soft cap, 0:
        none)."""
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        return self.trimmable


def paths_used() -> dict[str, int]:
    """How many attention calls over agentkv caches took each path, in this process."""
    return dict(_PATHS)


def count_fused_attention() -> None:
    """One more attention call on the fused CPU kernels, made inside a fused decoder layer."""
    _PATHS[FUSED] += 1


def fused_takes(quant: KVQuant, queries: mx.array) -> bool:
    """Whether the fused CPU kernels take attention of ``queries`` over ``quant``'s KV."""
    return (
        os.environ.get(ENV) != "reference"
        and mx.default_device() == mx.cpu
        and queries.dtype == mx.float32
        and quant.key_bits in FUSED_BITS
        and quant.value_bits in FUSED_BITS
        and queries.shape[-1] % 8 == 0
        and queries.shape[-1] <= 256
    )


def fused_available(quant: KVQuant, queries: mx.array, mask) -> bool:
    """``fused_takes``, for a contiguous cache whose ``mask`` an agentkv cache made."""
    return fused_takes(quant, queries) and mask_window(mask, queries.shape[-2]) != NOT_OURS


def cache_attention(
    queries,
    keys,
    values,
    *,
    scale,
    mask,
    quant: KVQuant,
    sinks=None,
    left_padding: mx.array | None = None,
    tail: mx.array | None = None,
    softcap: float = 0.0,
) -> mx.array:
    """Attention over a contiguous agentkv cache (one agent, or a left-padded batch).

    ``mask`` must come from the cache's ``make_mask`` (or be None/"causal") for the fused
    kernel, which recomputes it from the window recorded with it. Format 2 also reads
    ``tail`` [B, heads, ct, dim], each row's filling group. ``softcap`` > 0 (Gemma 2): each
    score s becomes softcap * tanh(s / softcap) before the mask, on every path.
    """
    fused = fused_available(quant, queries, mask)
    if quant.channel_keys and not fused:
        keys, quant = reference.channel_keys_as_float(keys, tail, quant, left_padding)
    if fused:
        _PATHS[FUSED] += 1
        window = mask_window(mask, queries.shape[-2])
        return cpu.fused_cache_attention(
            queries, keys, values, scale=scale, quant=quant, window=window,
            left_padding=left_padding, sinks=sinks, tail=tail, softcap=softcap,
        )  # fmt: skip
    _PATHS[REFERENCE] += 1
    return reference.quantized_attention(
        queries, keys, values, scale=scale, mask=mask, quant=quant, sinks=sinks, softcap=softcap
    )


def paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    """Attention of a jagged batch over the pool's arenas, read through block tables.

    Row ``b`` holds ``paged.lengths[b]`` tokens in blocks ``paged.tables[b]``; its ``L``
    queries are its last ``L`` tokens and see keys from 0 (or their sliding window's start)
    to themselves. The paths agree within float rounding (tests/kernels).
    """
    if paged.channel_tokens and (paged.tail is None or paged.tail_slots is None):
        raise ValueError("per-channel keys need their tails and tail slots")
    path, rotates, where = _path_of(queries, paged)
    if paged.rotate and not rotates:
        # q.(H k) == (H q).(H k); values are stored as H v
        plain = paged._replace(rotate=False)
        return hadamard(_run_path(path, hadamard(queries), plain, scale, where))
    return _run_path(path, queries, paged, scale, where)


def _path_of(queries: mx.array, paged: PagedQuery) -> tuple[str, bool, str]:
    """(the path these queries take, whether it rotates them itself where ``paged.rotate``,
    the backend); from the step's memo where a layer of the same shape decided
    (``HostIndex.memo``)."""
    memo = paged.host.memo if paged.host is not None else None
    if memo is not None:
        key = ("path", queries.shape, queries.dtype, paged.key_bits, paged.value_bits,
               paged.group, paged.channel_tokens, paged.rotate, paged.keys[0].shape[-1],
               paged.values[0].shape[-1])  # fmt: skip
        decided = memo.get(key)
        if decided is not None:
            return decided
    where = memo.get("backend") if memo is not None else None
    where = where or backend()  # a pool step's own (PagedStep.backend)
    if fused_takes(paged.quant(), queries):
        path = FUSED
    elif os.environ.get(ENV) != "reference" and where in ("metal", "cuda"):
        # without agentkv's GPU kernels (AGENTKV_GPU_KERNELS=0, or refused), a pool step's
        # every chunk and decode step takes the dense path, by MLX's operations (queries
        # without a step's host tables: the reference's)
        if not gpu.kernels_on():
            path = DENSE if paged.host is not None else REFERENCE
        else:
            path = DENSE if dense.takes(queries, paged) else KERNEL
    else:
        path = REFERENCE
    inside = path == KERNEL or (path == DENSE and gpu.gathers_rows(paged))
    decided = path, inside and paged.rotates_inside(queries), where
    if memo is not None:
        memo[key] = decided
    return decided


def _run_path(
    path: str, queries: mx.array, paged: PagedQuery, scale: float, where: str
) -> mx.array:
    _PATHS[path] += 1
    if path == FUSED:
        return cpu.fused_paged_attention(queries, paged, scale=scale)
    if path == DENSE:  # a chunk's rows by kernels/dense_rows.metal where it takes them
        rows = gpu.for_backend(where).dense_rows if gpu.gathers_rows(paged) else None
        return dense.paged_attention(queries, paged, scale=scale, rows_kernel=rows)
    if path == KERNEL:
        return gpu.for_backend(where).paged_attention(queries, paged, scale=scale)
    return reference.paged_attention(queries, paged, scale=scale)
