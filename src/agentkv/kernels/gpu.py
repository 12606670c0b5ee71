"""The kernels on Metal (``mx.fast.metal_kernel``) and CUDA (``mx.fast.cuda_kernel``).

The body of each kernel is the file in ``kernels/``; what differs per backend
is a preamble of a line or two: CUDA computes ``thread_position_in_grid`` (Metal
has it built in), and merge's preamble gathers its N source pointers into
``srcs``. One GPU thread moves one unit (chunk 1), so neighbouring threads touch
neighbouring memory.

Neither backend can run on the machines this project is built on (Linux, CPU);
the CPU build compiles the same bodies, and tests hold them bit for bit to the
reference there.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from types import SimpleNamespace

import mlx.core as mx

from .types import BlockTable, ExtractRow, Geometry, RowSource, as_units, from_units

THREADGROUP = (256, 1, 1)
CUDA_THREAD_ID = (
    "const uint3 thread_position_in_grid = make_uint3("
    "blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, "
    "blockIdx.z * blockDim.z + threadIdx.z);\n"
)


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
        "gather": ["blocks", "table", "meta"],
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
    def gather(
        regions: mx.array, table: BlockTable, geometry: Geometry, *, length: int, capacity: int
    ) -> list[tuple[mx.array, ...]]:
        units = mx.view(regions, mx.uint16)
        rows = mx.array(
            [v for pair in zip((o // 2 for o in table.offsets), table.tokens) for v in pair],
            dtype=mx.int32,
        )
        n_blocks = min(len(table.tokens), (length + 255) // 256)
        out = []
        for layer in range(geometry.layers):
            arrays = []
            for i, c in enumerate(geometry.components):
                width = c.row_bytes // 2
                meta = mx.array(
                    [
                        geometry.plane_offset(layer, i),
                        c.heads,
                        width,
                        length,
                        capacity,
                        1,
                        n_blocks,
                    ],
                    dtype=mx.int32,
                )
                grid = (256 * width, (capacity + 255) // 256, c.heads)
                a = _run(
                    backend,
                    "gather",
                    [units, rows, meta],
                    grid,
                    (1, c.heads, capacity, width),
                    mx.uint16,
                )
                arrays.append(
                    from_units(a, mx.uint32 if c.dtype == "uint32" else getattr(mx, c.dtype))
                )
            out.append(tuple(arrays))
        return out

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

    return SimpleNamespace(gather=gather, merge=merge, extract_rows=extract_rows)
