"""KV cache kernels on every backend from one source: paged attention (a jagged batch's
queries over the block pool, through block tables), merge (caches -> left-padded batch)
and extract (batch row -> one agent) for the mlx-lm drop-in batch cache.

What production calls for attention is ``kernels.attention`` (it picks the fused CPU kernels,
this package's GPU bodies or the reference); ``paged_attention_body`` here runs the shared
body itself on the selected backend, which is how tests hold it to the reference on CPU.

Each kernel body is written once in ``kernels/*.metal`` (installed as
``agentkv/_kernel_sources``) in the C++ subset that Metal, CUDA and host C++
share. It runs through ``mx.fast.metal_kernel`` on Metal, ``mx.fast.cuda_kernel``
on CUDA, and on CPU through the C++ extension, which compiles the same files
through ``kernels/shim.h``. ``reference`` is the same operation in plain MLX ops.

The backend is picked at run time (the default device's: metal, cuda, else
cpu) and can be forced with ``use_backend(name)``, ``set_backend(name)`` or
``AGENTKV_KERNELS=<name>``. Kernels only move bits: float16 components travel
as uint16 units, uint32 as uint32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager

import mlx.core as mx

from ..errors import InvalidRequestError
from ..format.quant import KVQuant, hadamard
from . import cpu, gpu, reference
from .types import ExtractRow, PagedQuery, RowSource

__all__ = [
    "BACKENDS",
    "ExtractRow",
    "PagedQuery",
    "RowSource",
    "available_backends",
    "backend",
    "bytes_moved",
    "extract",
    "extract_rows",
    "merge",
    "paged_attention_body",
    "set_backend",
    "store_rows",
    "use_backend",
]

BACKENDS = ("metal", "cuda", "cpu", "reference")
_MOVED = {"merge": 0, "extract": 0}


def bytes_moved() -> dict[str, int]:
    """Bytes the merge and extract kernels have written in this process (the copies the
    contiguous batch cache makes; the block pool's batches make none)."""
    return dict(_MOVED)


ENV = "AGENTKV_KERNELS"
_forced: str | None = None


def available_backends() -> list[str]:
    names = []
    if gpu.metal_available():
        names.append("metal")
    if gpu.cuda_available():
        names.append("cuda")
    return names + ["cpu", "reference"]


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise InvalidRequestError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    if name not in available_backends():
        raise InvalidRequestError(f"kernel backend {name!r} is not available on this machine")
    return name


def backend() -> str:
    """The backend the next kernel call runs on."""
    forced = _forced or os.environ.get(ENV)
    if forced:
        return _check(forced)
    if mx.default_device() == mx.gpu:
        if gpu.metal_available():
            return "metal"
        if gpu.cuda_available():
            return "cuda"
    return "cpu"


def set_backend(name: str | None) -> None:
    """Force a backend for every later call (None: pick by device again)."""
    global _forced
    _forced = None if name is None else _check(name)


@contextmanager
def use_backend(name: str):
    global _forced
    previous = _forced
    _forced = _check(name)
    try:
        yield
    finally:
        _forced = previous


def _impl():
    name = backend()
    if name == "reference":
        return reference
    if name == "cpu" or not gpu.kernels_on():  # AGENTKV_GPU_KERNELS=0: their CPU builds
        return cpu
    return gpu.for_backend(name)


def paged_attention_body(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    """The shared body kernels/paged_attention.metal on the selected backend: a jagged
    batch's queries over the pool's arenas, through block tables."""
    if paged.channel_tokens and (paged.tail is None or paged.tail_slots is None):
        raise InvalidRequestError("per-channel keys need their tails and tail slots")
    if paged.rotate and (_impl() is reference or not paged.rotates_inside(queries)):
        out = _impl().paged_attention(hadamard(queries), paged._replace(rotate=False), scale=scale)
        return hadamard(out)  # the body rotates inside itself where it can (PagedQuery.rotate)
    return _impl().paged_attention(queries, paged, scale=scale)


def store_rows(keys: mx.array, values: mx.array, quant: KVQuant) -> tuple[mx.array, ...]:
    """New keys and values [..., D] as KV format 2 stores them, on the selected backend:
    (H k in float16 [N, D], H v quantized: words, scales, biases [N, ...]), N the rows. The
    shared body kernels/store_rows.metal (``gpu.stores_rows`` says which formats and shapes);
    the reference: MLX's transform and ``mx.quantize``."""
    if not gpu.stores_rows(quant, keys, values):
        raise InvalidRequestError("store_rows: not a format and shape the kernel stores")
    if backend() == "reference":
        dim = keys.shape[-1]
        parts = quant.quantize(hadamard(values), quant.value_bits)
        return (hadamard(keys).astype(mx.float16).reshape(-1, dim),
                *(p.reshape(-1, p.shape[-1]) for p in parts))  # fmt: skip
    return _impl().store_rows(keys, values, quant.value_bits, quant.group_size)


def merge(sources: Sequence[RowSource], *, used: int, capacity: int) -> tuple[mx.array, ...]:
    """Rows of several caches -> one left-padded batch ``[rows, heads, capacity, width]``.

    Each source row's ``length`` tokens end at row ``used``; all else is zero.
    """
    if not sources:
        raise InvalidRequestError("merge needs at least one source")
    if any(s.length > used for s in sources) or used > capacity:
        raise InvalidRequestError("merge: a row is longer than `used`, or `used` > capacity")
    out = _impl().merge(sources, used=used, capacity=capacity)
    _MOVED["merge"] += sum(a.nbytes for a in out)
    return out


def extract(
    batch: Sequence[mx.array], *, row: int, first: int, length: int, capacity: int
) -> tuple[mx.array, ...]:
    """One batch row's ``length`` tokens from ``first`` -> ``[1, heads, capacity, width]``."""
    return extract_rows(batch, [ExtractRow(row, first, length, capacity)])[0]


def extract_rows(batch: Sequence[mx.array], rows: Sequence[ExtractRow]) -> list[tuple]:
    """``extract`` for several rows of one batch in one pass."""
    if any(r.length > r.capacity for r in rows):
        raise InvalidRequestError("extract: length exceeds capacity")
    out = _impl().extract_rows(batch, rows)
    _MOVED["extract"] += sum(a.nbytes for parts in out for a in parts)
    return out
