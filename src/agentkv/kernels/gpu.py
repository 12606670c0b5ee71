"""The kernels on Metal (``mx.fast.metal_kernel``) and CUDA (``mx.fast.cuda_kernel``).

The body of each kernel is the file in ``kernels/``; what differs per backend is a preamble
of a line or two (CUDA computes ``thread_position_in_grid``, Metal has it built in; paged
attention reads its thread and threadgroup ids, ``GROUP_IDS``; merge gathers its N source
pointers into ``srcs``) and, for paged attention, the helpers of ``kernels/<backend>.h``.
Merge and extract move one unit a thread, so neighbouring threads touch neighbouring memory;
paged attention runs a threadgroup per (query tile, part of the keys, KV head, row) and a
second pass merging the parts (docs/gpu-attention.md).

Neither backend runs on the machines this project is built on (Linux, CPU): there the CPU
build compiles the same bodies, and tests hold them to the reference. On a GPU, tests/gpu
holds these entry points to the reference (NVIDIA H100 and H200 through CUDA;
benchmarks/RESULTS.md, "GPU").
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from functools import cache, lru_cache, partial
from importlib import resources
from types import SimpleNamespace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..format.quant import FLOAT_BITS, KVQuant
from .types import THREADGROUP as PAGED_THREADGROUP
from .types import ExtractRow, Launch, PagedQuery, RowSource, as_units, from_units, store_dims

THREADGROUP = (256, 1, 1)
CUDA_THREAD_ID = (
    "const uint3 thread_position_in_grid = make_uint3("
    "blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, "
    "blockIdx.z * blockDim.z + threadIdx.z);\n"
)
# What a body that works by threadgroups reads first: its thread and its threadgroup
# (Metal declares an attribute only where the source names it).
GROUP_IDS = {
    "metal": (
        "const uint kv_tid = thread_index_in_threadgroup;\n"
        "const uint3 kv_group = threadgroup_position_in_grid;\n"
    ),
    "cuda": "const unsigned int kv_tid = threadIdx.x;\nconst uint3 kv_group = blockIdx;\n",
}


def metal_available() -> bool:
    return bool(getattr(mx, "metal", None) and mx.metal.is_available())


def cuda_available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


@cache
def body(name: str) -> str:
    """The kernel body shipped with agentkv (kernels/<name>.metal), compacted."""
    return compact(
        resources.files("agentkv").joinpath("_kernel_sources", f"{name}.metal").read_text()
    )


@cache
def helpers(backend: str) -> str:
    """The helpers the threadgroup bodies name, for ``backend`` (kernels/<backend>.h),
    compacted."""
    return compact(
        resources.files("agentkv").joinpath("_kernel_sources", f"{backend}.h").read_text()
    )


def compact(source: str) -> str:
    """``source`` without its comments, indentation and empty lines (no ``//`` lies inside a
    string literal in these sources). MLX writes a custom kernel's whole source into every
    call and hashes it at every evaluation (its CUDA backend:
    mlx/backend/cuda/custom_kernel.cpp): the paged kernel's 21.5 KB become 13 KB. A line
    that a backslash continues keeps its next one, emptied or not: it ends the macro."""
    out: list[str] = []
    for raw in source.splitlines():
        line = _COMMENT.sub("", raw).strip()
        if line or (out and out[-1].endswith("\\")):
            out.append(line)
    return "\n".join(out) + "\n"


_COMMENT = re.compile(r"//.*$")


def _pointers(backend: str, n: int) -> str:
    qualifier = "const device T*" if backend == "metal" else "const T*"
    names = ", ".join(f"src{i}" for i in range(n))
    return f"{qualifier} srcs[{n}] = {{{names}}};\n"


INPUTS = {
    "paged_attention": [
        "q_in", "kw", "ks", "kb", "vw", "vs", "vb", "tables", "lengths", "dims", "sinks",
        "scale", "tail", "tail_slots", "done", "done_first",
    ],
    "paged_attention_merge": ["parts", "stats", "sinks", "dims"],
    "extract": ["batch", "meta", "dims"],
    "store_rows": ["k_in", "v_in", "q_in", "dims", "scale", "starts", "rope", "norm"],
    "dense_rows": ["kw", "ks", "kb", "vw", "vs", "vb", "tail", "done", "src", "dims", "scale"],
    "quantize_groups": ["x", "dims"],
}  # fmt: skip
OUTPUTS = {
    "paged_attention": ["out", "stats"],
    "store_rows": ["k_out", "vw", "vs", "vb", "q_out"],
    "dense_rows": ["k_out", "v_out"],
    "quantize_groups": ["words", "scales", "biases"],
}
# bodies that read their thread and threadgroup ids and the backend's helpers
THREAD_GROUPS = ("paged_attention", "store_rows", "dense_rows", "quantize_groups")


@cache
def _kernel(backend: str, name: str, sources: int = 0):
    inputs = [f"src{i}" for i in range(sources)] + ["rows", "dims"]
    inputs = INPUTS.get(name, inputs)
    if name in THREAD_GROUPS:
        preamble = GROUP_IDS[backend]
    else:
        preamble = CUDA_THREAD_ID if backend == "cuda" else ""
    if name == "merge":
        preamble += _pointers(backend, sources)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=f"agentkv_{name}{sources or ''}",
        input_names=inputs,
        output_names=OUTPUTS.get(name, ["out"]),
        source=preamble + body(name),
        header=helpers(backend) if name.startswith(THREAD_GROUPS) else "",
    )


# AGENTKV_GPU_KERNELS=0: none of agentkv's own GPU kernels: every GPU path by MLX's
# operations (a step's store and groups, the dense path's gather, and attention itself
# through the dense path at every step, decode included; the batch cache's merge and
# extract by the CPU build). Slower: the way around a GPU compiler that refuses a kernel.
# Unset, an engine whose warm-up finds one refused turns them off for the process itself
# (``refuse``) and says so; AGENTKV_GPU_KERNELS=1 makes that refusal an error instead.
KERNELS_ENV = "AGENTKV_GPU_KERNELS"
_refused: str | None = None  # what turned the kernels off (``refuse``)
_here = threading.local()  # ``without_kernels`` on this thread


def kernels_on() -> bool:
    """Whether agentkv's own GPU kernels run: not with ``AGENTKV_GPU_KERNELS=0``, nor once
    this process has found them wrong on its GPU (``refuse``), nor inside
    ``without_kernels`` on this thread."""
    return (
        os.environ.get(KERNELS_ENV) != "0" and _refused is None and not getattr(_here, "off", False)
    )


@contextmanager
def without_kernels():
    """This thread runs no kernel of agentkv's inside (the warm-up's check against MLX's
    operations: ``engine/warmup.py``)."""
    before = getattr(_here, "off", False)
    _here.off = True
    try:
        yield
    finally:
        _here.off = before


def kernels_required() -> bool:
    """``AGENTKV_GPU_KERNELS=1``: a refused kernel is an error, never a way around."""
    return os.environ.get(KERNELS_ENV) == "1"


def refuse(report: str) -> None:
    """Turn agentkv's GPU kernels off for the rest of this process: this machine's GPU
    refused one or computed something else with it (``report``, in words). Arenas written
    by such a kernel are lost; the caller builds fresh ones (``Engine._start`` does)."""
    global _refused
    _refused = report


def kernels_state() -> str:
    """What runs attention, stores and gathers on a GPU, in words (``doctor``, the log)."""
    if os.environ.get(KERNELS_ENV) == "0":
        return f"MLX's operations ({KERNELS_ENV}=0)"
    if _refused is not None:
        return f"MLX's operations ({_refused[:300]})"
    return "agentkv's kernels"


# What MLX says where a GPU's compiler refuses a custom kernel or cannot launch it (Metal:
# mlx/backend/metal/device.cpp and custom_kernel.cpp; CUDA: mlx/backend/cuda/jit_module.cpp)
COMPILE_FAILURES = (
    "Unable to build metal library", "Unable to load kernel", "Thread group size",
    "Failed to compile kernel", "Failed to load compiled",
)  # fmt: skip


def refusal(exc: BaseException) -> str | None:
    """MLX's words where ``exc`` is its report of a GPU kernel its compiler refused or could
    not launch (``COMPILE_FAILURES``); else None."""
    if not isinstance(exc, RuntimeError) or not any(m in str(exc) for m in COMPILE_FAILURES):
        return None
    return str(exc).strip()[:2000]


def compile_failure(exc: BaseException) -> str | None:
    """Where ``exc`` is MLX's report of a refused kernel (``refusal``): what to tell the
    user, the way around named; else None."""
    if (words := refusal(exc)) is None:
        return None
    return way_around(
        f"this machine's GPU could not compile or launch one of agentkv's kernels ({words})"
    )


def way_around(problem: str) -> str:
    """What to tell the user of ``problem`` with agentkv's kernels: the way around named."""
    return (
        f"agentkv: {problem}. Start agentkv again with {KERNELS_ENV}=0 to run every GPU path "
        "on MLX's own operations instead (slower), and please report this with "
        "`agentkv doctor`'s output."
    )


# AGENTKV_GPU_STORE=0: format 2 stores a step by MLX's operations (its transform and
# mx.quantize), not by kernels/store_rows.metal (the lab's A/B; a way around the kernel)
STORE_ENV = "AGENTKV_GPU_STORE"


def stores_rows(quant: KVQuant, keys: mx.array, values: mx.array) -> bool:
    """Whether ``store_rows`` stores these new keys and values: KV format 2 (rotating,
    per-channel keys) with 2/4/8-bit values, keys and values of one head dim with 8
    channels a lane (32 to 256), value groups of a multiple of 8 dividing it; not with
    ``AGENTKV_GPU_STORE=0``."""
    return values.shape == keys.shape and _stores(quant, keys.shape[-1])


# AGENTKV_GPU_PROLOGUE=0: a layer's queries and keys roped by MLX's RoPE, not by the store
# kernel from the joint q/k/v projection (the lab's A/B)
PROLOGUE_ENV = "AGENTKV_GPU_PROLOGUE"


def stores_prologue(quant: KVQuant, dim: int) -> bool:
    """Whether ``store_prologue`` takes a layer of head dim ``dim`` in this format: where
    ``store_rows`` stores it; not with ``AGENTKV_GPU_PROLOGUE=0``."""
    return os.environ.get(PROLOGUE_ENV) != "0" and _stores(quant, dim)


def _stores(quant: KVQuant, dim: int) -> bool:
    return (
        os.environ.get(STORE_ENV) != "0"
        and kernels_on()
        and quant.rotate
        and quant.channel_keys
        and quant.value_bits in (2, 4, 8)
        and dim in (32, 64, 128, 256)
        and quant.group_size % 8 == 0
        and dim % quant.group_size == 0
    )


# AGENTKV_GPU_GATHER=0: a prefill chunk's rows gathered and dequantized by MLX's operations,
# not by kernels/dense_rows.metal (the lab's A/B; a way around the kernel)
GATHER_ENV = "AGENTKV_GPU_GATHER"
DENSE_ROWS_BITS = (2, 4, 8, 16)


def gathers_rows(paged: PagedQuery) -> bool:
    """Whether ``dense_rows`` gathers this layer's rows: keys and values of 2, 4, 8 or 16
    bits, head dims a multiple of 8, groups of a multiple of 8 channels; not with
    ``AGENTKV_GPU_GATHER=0``."""
    bits = (paged.key_bits, paged.value_bits)
    return (
        os.environ.get(GATHER_ENV) != "0"
        and kernels_on()
        and paged.key_bits in DENSE_ROWS_BITS
        and paged.value_bits in DENSE_ROWS_BITS
        and paged.key_dim % 8 == 0
        and paged.value_dim % 8 == 0
        and all(b == FLOAT_BITS or paged.group % 8 == 0 for b in bits)
    )


def dense_rows(
    backend: str, paged: PagedQuery, src: mx.array, count: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """The keys [count, D] and values [count, Dv] that ``src`` (int32 [3 + count * 3]:
    count, then each output row's key source, key row and value row;
    kernels/dense_rows.metal) names, gathered from this layer's arenas and dequantized in
    one pass, in ``dtype``; rotated back from KV format 2's H where ``paged.rotate``."""
    dims = paged.dense_rows_dims()
    threads = count * dims[6]  # units: a thread a row's 8 channels
    return tuple(
        _kernel(backend, "dense_rows")(
            inputs=[
                *paged.kernel_parts(),
                paged.tail if paged.tail is not None else _zeros(1, mx.float16),
                paged.done if paged.done is not None else _zeros(1, mx.float16),
                src,
                _ints(dims),
                _floats((1 / math.sqrt(dims[0]),)),
            ],
            template=[("T", dtype), ("TG", THREADGROUP[0])],
            grid=(-(-threads // THREADGROUP[0]) * THREADGROUP[0], 1, 1),
            threadgroup=THREADGROUP,
            output_shapes=[(count, dims[0]), (count, dims[1])],
            output_dtypes=[dtype, dtype],
        )
    )


def quantizes_groups(quant: KVQuant, dim: int) -> bool:
    """Whether ``quantize_groups`` quantizes this format's completed channel groups of keys
    of head dim ``dim``: per-channel keys of 2, 4 or 8 bits (``AGENTKV_GPU_STORE=0``: MLX's
    operations, as for the step's store)."""
    return (
        os.environ.get(STORE_ENV) != "0"
        and kernels_on()
        and quant.channel_keys
        and quant.key_bits in (2, 4, 8)
        and dim % quant.channel_tokens == 0
        and dim * quant.key_bits % 32 == 0
    )


def quantize_groups(backend: str, groups: mx.array, bits: int) -> tuple[mx.array, ...]:
    """Whole channel groups of keys [G, channel_tokens, D] (float16, rotated) -> KV format 2's
    words, scales and biases [G * channel_tokens, ...] (quantize_groups.metal; the layout of
    ``quant.quantize_channels``)."""
    count, ct, dim = groups.shape
    row_words = dim * bits // 32
    return tuple(
        _kernel(backend, "quantize_groups")(
            inputs=[groups.astype(mx.float16).reshape(-1), _ints((dim, bits, ct))],
            template=[("H", mx.float16)],
            grid=(count * row_words, 1, 1),
            threadgroup=(row_words, 1, 1),
            output_shapes=[(count * ct, row_words), *[(count * ct, dim // ct)] * 2],
            output_dtypes=[mx.uint32, mx.float16, mx.float16],
        )
    )


@lru_cache(maxsize=512)
def _ints(values: tuple[int, ...]) -> mx.array:
    """A small constant argument, made once (data on the host: any thread's graph takes it)."""
    return _constant(np.asarray(values, dtype=np.int32))


@lru_cache(maxsize=64)
def _floats(values: tuple[float, ...]) -> mx.array:
    return _constant(np.asarray(values, dtype=np.float32))


@lru_cache(maxsize=64)
def _zeros(n: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    return _constant(np.zeros(n, dtype=np.dtype(str(dtype).split(".")[-1])))


def _constant(values: np.ndarray) -> mx.array:
    """``values`` as an evaluated MLX array; in device memory where the step's indices are
    (``device_index``: an array made from host data lives in managed memory on MLX's CUDA
    backend)."""
    a = mx.array(values)
    if a.size and device_index():
        a = on_device(a)
    mx.eval(a)
    return a


# AGENTKV_GPU_DEVICE_INDEX=1: a step's indices (``pool.arena.index_arrays``) and the kernels'
# small constants copied into device memory (an experiment, off by default)
DEVICE_INDEX_ENV = "AGENTKV_GPU_DEVICE_INDEX"


@cache
def device_index() -> bool:
    """Whether ``AGENTKV_GPU_DEVICE_INDEX=1`` applies (on a GPU only)."""
    return mx.default_device() != mx.cpu and os.environ.get(DEVICE_INDEX_ENV) == "1"


def on_device(a: mx.array) -> mx.array:
    """``a`` copied into device memory by one addition (an operation's output)."""
    return a + _zero(a.dtype)


@cache
def _zero(dtype: mx.Dtype) -> mx.array:
    zero = mx.zeros((), dtype=dtype)  # made by a kernel: in device memory
    mx.eval(zero)
    return zero


def _run(backend, name, inputs, grid, shape, dtype, sources=0):
    kernel = _kernel(backend, name, sources)
    grid = tuple(max(1, g) for g in grid)
    return kernel(
        inputs=inputs,
        template=[("T", dtype)],
        grid=grid,
        threadgroup=(min(THREADGROUP[0], grid[0]), 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )[0]


def store_rows(
    backend: str, keys: mx.array, values: mx.array, value_bits: int, group: int
) -> tuple[mx.array, ...]:
    """KV format 2's store of new keys and values [..., D] in one pass (store_rows.metal):
    (H k float16 [N, D], H v's words, scales and biases [N, ...]), N the rows."""
    dim = keys.shape[-1]
    n = keys.size // dim
    dims = store_dims(n, dim, value_bits, group)
    # no queries: the body never reads q_in (the keys stand in; NumPy has no bfloat16)
    return _store(backend, keys, values, keys, dims, _zeros(1, mx.int32), _zeros(1))[:4]


def store_prologue(
    backend: str,
    qkv: mx.array,
    heads: tuple[int, int],
    starts: mx.array,
    rope: mx.array,
    rope_mode: int,
    value_bits: int,
    group: int,
    norms: tuple[mx.array, float] | None = None,
) -> tuple[mx.array, ...]:
    """The prologue of a layer's attention in the same pass (store_rows.metal): from the
    joint q/k/v projection ``qkv`` [B, L, (Hq + 2 Hkv) D] (``heads`` = (Hq, Hkv)), the
    queries and keys (RMS-normed first where ``norms`` = (the queries' then the keys'
    weights [2 D], epsilon) is given: Qwen3's, Gemma 3's) roped at ``starts[b] + t``
    (``rope``: D / 2 inverse frequencies, then the positions' scale), the keys and values
    stored as ``store_rows`` stores them: (H k float16 [N, D], H v's words, scales, biases,
    the roped queries [B, Hq, L, D])."""
    if rope_mode not in (1, 2):
        raise ValueError(f"the prologue ropes in mode 1 or 2, not {rope_mode}")
    B, L, width = qkv.shape
    q_heads, kv_heads = heads
    dim = width // (q_heads + 2 * kv_heads)
    dims = store_dims(B * kv_heads * L, dim, value_bits, group, prologue=(L, kv_heads, q_heads),
                      rope_mode=rope_mode, norm=norms is not None)  # fmt: skip
    *stored, queries = _store(backend, qkv, qkv, qkv, dims, starts, rope, norms)
    return (*stored, queries.reshape(B, q_heads, L, dim))


def _store(backend, k_in, v_in, q_in, dims, starts, rope, norms=None) -> list[mx.array]:
    n, dim, value_bits, group, n_queries = dims[:5]
    lanes = dim // 8
    rows_a_group = PAGED_THREADGROUP // lanes
    weights, eps = (_zeros(1), 0.0) if norms is None else norms
    scales = _floats((1 / math.sqrt(dim), eps))
    return _kernel(backend, "store_rows")(
        inputs=[k_in, v_in, q_in, _ints(dims), scales, starts, rope, weights],
        template=[("T", k_in.dtype), ("H", mx.float16), ("KL", lanes), ("TG", PAGED_THREADGROUP)],
        grid=(-(-(n + n_queries) // rows_a_group) * PAGED_THREADGROUP, 1, 1),
        threadgroup=(PAGED_THREADGROUP, 1, 1),
        output_shapes=[
            (n, dim),
            (n, dim * value_bits // 32),
            (n, dim // group),
            (n, dim // group),
            (max(n_queries, 1) * dim,),
        ],
        output_dtypes=[mx.float16, mx.uint32, mx.float16, mx.float16, k_in.dtype],
    )


class _PagedPlan(NamedTuple):
    """What a paged-attention call hands MLX besides its arrays: the same for every layer
    of one shape in a step, so a pool step makes it once (``HostIndex.memo``)."""

    dims: mx.array
    scales: mx.array
    template: list
    grid: tuple[int, int, int]
    shapes: list
    dtypes: list
    sinks: mx.array  # the placeholders of absent inputs
    no_tail: mx.array
    no_slots: mx.array
    no_done: mx.array
    merge: mx.array | None  # pass 2's dims (None: one part, no pass 2)
    merge_grid: tuple[int, int, int]


def _paged_plan(
    queries: mx.array, paged: PagedQuery, scale: float, launch: Launch | None
) -> _PagedPlan:
    """The call's launch, grid and constants (``_PagedPlan``), from the step's memo where
    a layer of the same shape made them (``launch`` given: never memoized)."""
    memo = paged.host.memo if paged.host is not None and launch is None else None
    if memo is not None:
        key = ("paged", queries.shape, queries.dtype, scale, paged.tables.shape,
               paged.kv_heads, paged.block_tokens, paged.key_bits, paged.value_bits,
               paged.group, paged.window, paged.sinks is None, paged.channel_tokens,
               paged.rotate, paged.softcap, paged.keys[0].shape[-1],
               paged.values[0].shape[-1])  # fmt: skip
        plan = memo.get(key)
        if plan is not None:
            return plan
    launch = launch or paged.launch(queries)
    B, q_heads, L, _ = queries.shape
    dim_v, splits = paged.value_dim, launch.splits
    tiles = -(-L * (q_heads // paged.kv_heads) // launch.vectors)
    vectors = B * q_heads * L
    out_dtype = queries.dtype if splits == 1 else mx.float32
    plan = _PagedPlan(
        dims=_ints(paged.dims(queries, launch)),
        scales=_floats(paged.kernel_scales(scale, queries)),
        template=[
            ("T", out_dtype),
            ("NQ", launch.vectors),
            ("KL", launch.lanes_per_key),
            ("TG", PAGED_THREADGROUP),
            ("KU", launch.keys_in_flight),
        ],
        grid=(splits * tiles * PAGED_THREADGROUP, paged.kv_heads, B),
        shapes=[(vectors * splits * dim_v,), (vectors * splits * 2,)],
        dtypes=[out_dtype, mx.float32],
        sinks=_zeros(q_heads),
        no_tail=_zeros(1, mx.float16),
        no_slots=_zeros(B, mx.int32),
        no_done=_ints((-1,) * B),
        merge=(
            None if splits == 1
            else _ints((B, q_heads, L, dim_v, splits, int(paged.sinks is not None)))
        ),
        merge_grid=(dim_v, q_heads * L, B),
    )  # fmt: skip
    if memo is not None:
        memo[key] = plan
    return plan


@cache  # called for every layer of every step: its functions made once a backend
def for_backend(backend: str) -> SimpleNamespace:
    def paged_attention(
        queries: mx.array, paged: PagedQuery, *, scale: float, launch: Launch | None = None
    ) -> mx.array:
        """Pass 1 over (splits * tiles, KV heads, rows) threadgroups, then pass 2 where the
        keys were split; the result in the queries' dtype (docs/gpu-attention.md)."""
        plan = _paged_plan(queries, paged, scale, launch)
        sinks = plan.sinks if paged.sinks is None else paged.sinks.astype(mx.float32)
        first, stats = _kernel(backend, "paged_attention")(
            inputs=[
                queries,
                *paged.kernel_parts(),
                paged.tables,
                paged.lengths,
                plan.dims,
                sinks,
                plan.scales,
                paged.tail if paged.tail is not None else plan.no_tail,
                paged.tail_slots if paged.tail_slots is not None else plan.no_slots,
                paged.done if paged.done is not None else plan.no_tail,
                paged.done_first if paged.done_first is not None else plan.no_done,
            ],
            template=plan.template,
            grid=plan.grid,
            threadgroup=(PAGED_THREADGROUP, 1, 1),
            output_shapes=plan.shapes,
            output_dtypes=plan.dtypes,
        )
        if plan.merge is None:
            return first.reshape(queries.shape[:3] + (paged.value_dim,))
        return _kernel(backend, "paged_attention_merge")(
            inputs=[first, stats, sinks, plan.merge],
            template=[("T", queries.dtype)],
            grid=plan.merge_grid,
            threadgroup=(plan.merge_grid[0], 1, 1),
            output_shapes=[queries.shape[:3] + (paged.value_dim,)],
            output_dtypes=[queries.dtype],
        )[0]

    def merge(sources: Sequence[RowSource], *, used: int, capacity: int) -> tuple[mx.array, ...]:
        unique, index_of = [], {}
        for s in sources:
            if id(s.arrays[0]) not in index_of:
                index_of[id(s.arrays[0])] = len(unique)
                unique.append(s.arrays)
        rows = mx.array(
            [
                [index_of[id(s.arrays[0])], s.row, s.first, s.length, s.arrays[0].shape[2]]
                for s in sources
            ],
            dtype=mx.int32,
        )
        outputs = []
        for k, template in enumerate(sources[0].arrays):
            srcs = [as_units(a[k]) for a in unique]
            heads, width = srcs[0].shape[1], srcs[0].shape[3]
            dims = mx.array([heads, width, used, capacity, 1], dtype=mx.int32)
            grid = (capacity * width, len(sources), heads)
            out = _run(
                backend,
                "merge",
                [*srcs, rows, dims],
                grid,
                (len(sources), heads, capacity, width),
                srcs[0].dtype,
                len(srcs),
            )
            outputs.append(from_units(out, template.dtype))
        return tuple(outputs)

    def extract_rows(batch: Sequence[mx.array], rows: Sequence[ExtractRow]) -> list[tuple]:
        results = []
        for r in rows:
            outputs = []
            for a in batch:
                u = as_units(a)
                meta = mx.array(
                    [r.row, r.first, r.length, u.shape[1], u.shape[3], u.shape[2], r.capacity],
                    dtype=mx.int32,
                )
                grid = (r.capacity * u.shape[3], 1, u.shape[1])
                out = _run(
                    backend,
                    "extract",
                    [u, meta, mx.array([1], dtype=mx.int32)],
                    grid,
                    (1, u.shape[1], r.capacity, u.shape[3]),
                    u.dtype,
                )
                outputs.append(from_units(out, a.dtype))
            results.append(tuple(outputs))
        return results

    return SimpleNamespace(
        paged_attention=paged_attention, merge=merge, extract_rows=extract_rows,
        store_rows=partial(store_rows, backend), dense_rows=partial(dense_rows, backend),
        store_prologue=partial(store_prologue, backend),
        quantize_groups=partial(quantize_groups, backend),
    )  # fmt: skip
