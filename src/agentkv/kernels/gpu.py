"""The kernels on Metal (``mx.fast.metal_kernel``) and CUDA (``mx.fast.cuda_kernel``).

The body of each kernel is the file in ``kernels/``; what differs per backend
is a preamble of a line or two: CUDA computes ``thread_position_in_grid`` (Metal
has it built in), and merge's preamble gathers its N source pointers into
``srcs``. One GPU thread moves one unit (chunk 1), so neighbouring threads touch
neighbouring memory.

Neither backend runs on the machines this project is built on (Linux, CPU): there
the CPU build compiles the same bodies, and tests hold them bit for bit to the
reference. On a GPU, tests/gpu holds these entry points to the reference (run on
an H100 through CUDA; benchmarks/RESULTS.md, "GPU").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from types import SimpleNamespace

import mlx.core as mx

from .types import ExtractRow, PagedQuery, RowSource, as_units, from_units

THREADGROUP = (256, 1, 1)
CUDA_THREAD_ID = (
    "const uint3 thread_position_in_grid = make_uint3("
    "blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, "
    "blockIdx.z * blockDim.z + threadIdx.z);\n"
)


# What kernels/paged_attention.metal calls, spelled for each backend (the host's are in
# csrc/kernels_cpu.cpp).
HELPERS = {
    "metal": (
        "inline float kv_half(half x) { return float(x); }\n"
        "inline float kv_exp(float x) { return metal::exp(x); }\n"
        "inline float kv_max(float a, float b) { return metal::max(a, b); }\n"
        "constant float KV_NEG_INF = -INFINITY;\n"
    ),
    "cuda": (
        "#include <cuda_fp16.h>\n"
        "__device__ inline float kv_half(__half x) { return __half2float(x); }\n"
        "__device__ inline float kv_exp(float x) { return expf(x); }\n"
        "__device__ inline float kv_max(float a, float b) { return fmaxf(a, b); }\n"
        "#define KV_NEG_INF (-INFINITY)\n"
    ),
}


def metal_available() -> bool:
    return bool(getattr(mx, "metal", None) and mx.metal.is_available())


def cuda_available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


@cache
def body(name: str) -> str:
    """The kernel body shipped with agentkv (kernels/<name>.metal)."""
    return resources.files("agentkv").joinpath("_kernel_sources", f"{name}.metal").read_text()


def _pointers(backend: str, n: int) -> str:
    qualifier = "const device T*" if backend == "metal" else "const T*"
    names = ", ".join(f"src{i}" for i in range(n))
    return f"{qualifier} srcs[{n}] = {{{names}}};\n"


@cache
def _kernel(backend: str, name: str, sources: int = 0):
    inputs = {
        "paged_attention": [
            "q",
            "kw",
            "ks",
            "kb",
            "vw",
            "vs",
            "vb",
            "tables",
            "lengths",
            "dims",
            "sinks",
            "scale",
            "tail",
            "tail_slots",
        ],
        "merge": [f"src{i}" for i in range(sources)] + ["rows", "dims"],
        "extract": ["batch", "meta", "dims"],
    }[name]
    preamble = CUDA_THREAD_ID if backend == "cuda" else ""
    if name == "merge":
        preamble += _pointers(backend, sources)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=f"agentkv_{name}{sources or ''}",
        input_names=inputs,
        output_names=["out"],
        source=preamble + body(name),
        header=HELPERS[backend] if name == "paged_attention" else "",
    )


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


def for_backend(backend: str) -> SimpleNamespace:
    def paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
        dims = paged.dims(queries)
        B, q_heads, L, dim_v = dims[0], dims[1], dims[3], dims[5]
        sinks = paged.sinks if paged.sinks is not None else mx.zeros((q_heads,), mx.float32)
        kernel = _kernel(backend, "paged_attention")
        return kernel(
            inputs=[
                queries.astype(mx.float32),
                *paged.keys,
                *paged.values,
                paged.tables.astype(mx.int32),
                paged.lengths.astype(mx.int32),
                mx.array(dims, dtype=mx.int32),
                sinks.astype(mx.float32),
                mx.array([scale], dtype=mx.float32),
                paged.tail if paged.tail is not None else mx.zeros((1,), mx.float16),
                paged.tail_slots if paged.tail_slots is not None else mx.zeros((B,), mx.int32),
            ],
            grid=(L, q_heads, B),
            threadgroup=(min(L, 32), 1, 1),
            output_shapes=[(B, q_heads, L, dim_v)],
            output_dtypes=[mx.float32],
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

    return SimpleNamespace(paged_attention=paged_attention, merge=merge, extract_rows=extract_rows)
