"""The Metal source MLX writes for each kernel call, parsed by Clang as Metal's dialect.

No Mac is available to this project, so no Metal compiler has seen the bodies. On a Mac,
``mx.fast.metal_kernel`` writes each call's source (the helpers of kernels/metal.h, the
kernel's signature, its body, its template instantiation) and hands it to Apple's compiler
when it first runs. Outside a Metal device MLX still writes a call inside an export trace,
where a graph is recorded without being run. So these tests drive agentkv's own Metal entry
points (``gpu.for_backend("metal")``) on the shapes and dtypes the engine gives them, take the
source MLX writes (``verbose``), and parse it with libclang in C++14 (what MSL 3.1 is based
on) after ``metal_shim.h``, a model of what Metal puts in front (standing in for MLX's own
prelude too): its address spaces as Clang's (a pointer does not leave its space), its
keywords kept, the functions the helpers call declared with Metal's overloads, ``as_type``
between types of one size, no float made bfloat implicitly. Every template instantiation is
compiled; no diagnostic may come back, warnings included (a C++17 feature warns here).

What the parse also refuses, as the Metal Shading Language does: lambdas, ``goto``,
``new``/``delete``, exceptions, RTTI, virtual functions, threadgroup arrays initialized or
outside the kernel; and ``double`` (Apple's GPUs have none; stricter than Apple's compiler,
which may take an unsuffixed literal as a float: the bodies suffix theirs). The AST walk
sees templates' patterns, not their instantiations (Clang's diagnostics see both).

What only Apple's compiler can say: its own diagnostics, its register use and its code
(docs/gpu-attention.md, "What only a Mac can confirm").
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

clang = pytest.importorskip("clang.cindex", reason="libclang is a test extra")

SHIM = (Path(__file__).parent / "metal_shim.h").read_text()
SOURCE = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", re.S)
# MLX names the instantiation for Metal's library; host Clang takes no attribute there
HOST_NAME = re.compile(r"template \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] decltype")
FORBIDDEN = {
    "LAMBDA_EXPR": "a lambda",
    "GOTO_STMT": "goto",
    "CXX_NEW_EXPR": "new",
    "CXX_DELETE_EXPR": "delete",
    "CXX_THROW_EXPR": "throw",
    "CXX_TRY_STMT": "try",
    "CXX_TYPEID_EXPR": "typeid",
    "CXX_DYNAMIC_CAST_EXPR": "dynamic_cast",
}


def _calls():
    """(what, a function making agentkv's Metal calls): every kernel, on the shapes and
    dtypes the engine gives it (query dtypes float32, float16 and bfloat16; NQ 1-8, KL 4-32,
    KU 1-4; one part and several; formats 1 and 2, 16-bit kinds; sinks, windows)."""
    from helpers import format_2_batch, jagged_batch

    from agentkv.format.quant import V1, KVQuant
    from agentkv.kernels import gpu
    from agentkv.kernels.types import ExtractRow, RowSource

    metal = gpu.for_backend("metal")
    _, q2, paged2 = format_2_batch(q_heads=6, new=1)
    _, q2c, paged2c = format_2_batch(q_heads=4, new=3)
    _, _, q1, paged1 = jagged_batch(KVQuant(**V1), [300, 70], queries=2, q_heads=8)
    _, _, q16, paged16 = jagged_batch(KVQuant(16, 16, **V1), [300, 5], q_heads=4, dim=128)
    _, _, q256, paged256 = jagged_batch(KVQuant(8, 4, **V1), [300], heads=2, q_heads=2, dim=256)
    _, _, q32, paged32 = jagged_batch(KVQuant(4, 4, 32, **V1), [40], heads=2, q_heads=2, dim=32)
    # 9 rows: the lengths (fewer than 8 elements go in Metal's constant space) in device
    _, _, q9, paged9 = jagged_batch(KVQuant(**V1), [70 + 9 * i for i in range(9)], q_heads=4)
    sinks = mx.zeros((6,))
    rng = np.random.default_rng(0)
    kv = mx.array(rng.standard_normal((2, 1, 2, 1, 64)).astype(np.float32))
    qkv = mx.array(rng.standard_normal((2, 1, (6 + 2 * 2) * 64)).astype(np.float32))
    rope = mx.array(np.append(10000.0 ** -(np.arange(0, 64, 2) / 64), 1.0).astype(np.float32))
    cache = tuple(mx.zeros((2, 2, 32, w), dt) for w, dt in ((8, mx.uint32), (4, mx.float16)))

    def paged(dtype):
        return [
            metal.paged_attention(q2.astype(dtype), paged2, scale=0.125),
            metal.paged_attention(q2.astype(dtype), paged2._replace(rotate=True), scale=0.125),
            metal.paged_attention(q2c.astype(dtype), paged2c._replace(window=100), scale=0.125),
            metal.paged_attention(
                q2.astype(dtype),
                paged2._replace(sinks=sinks),
                scale=0.125,
                launch=paged2.launch(q2, splits=3),
            ),
            metal.paged_attention(q1.astype(dtype), paged1, scale=0.125),
            metal.paged_attention(q16.astype(dtype), paged16, scale=0.125),
            metal.paged_attention(
                q256.astype(dtype),
                paged256,
                scale=0.125,
                launch=paged256.launch(q256, keys_in_flight=4),
            ),
            metal.paged_attention(q32.astype(dtype), paged32, scale=0.125),
            metal.paged_attention(q9.astype(dtype), paged9, scale=0.125),
        ]

    def store(dtype):
        k, v = kv[0].astype(dtype), kv[1].astype(dtype)
        starts = mx.array([3, 9], dtype=mx.int32)
        norms = (mx.ones((128,), dtype), 1e-6)  # Qwen3's heads' norm: weights, epsilon
        return [
            *metal.store_rows(k, v, 4, 64),
            *metal.store_rows(k, v, 8, 32),
            *metal.store_prologue(qkv.astype(dtype), (6, 2), starts, rope, 1, 4, 64),
            *metal.store_prologue(qkv.astype(dtype), (6, 2), starts, rope, 2, 2, 64),
            *metal.store_prologue(qkv.astype(dtype), (6, 2), starts, rope, 1, 4, 64, norms),
        ]

    def rows(dtype):
        from agentkv.kernels import dense

        n = int(paged2c.host.lengths[0])
        first = dense.first_key(paged2c, n, 3)
        own = dense._own_groups(paged2c, 0, n, 3)
        src, count = dense._sources(paged2c, 0, first, n, own)
        return [*metal.dense_rows(paged2c._replace(rotate=True), src, count, dtype)]

    def moves():
        groups = mx.zeros((3, 64, 64), mx.float16)
        return [
            *metal.quantize_groups(groups, 4),
            *metal.merge(
                [RowSource(cache, 0, 0, 20), RowSource(cache, 1, 0, 8)], used=20, capacity=32
            ),
            *[a for row in metal.extract_rows(cache, [ExtractRow(1, 0, 8, 16)]) for a in row],
        ]

    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        name = str(dtype).split(".")[-1]
        yield f"paged attention, {name} queries", lambda d=dtype: paged(d)
        yield f"store, {name} rows", lambda d=dtype: store(d)
        yield f"dense rows, {name}", lambda d=dtype: rows(d)
    yield "quantize groups, merge, extract", moves


@pytest.fixture(scope="module")
def metal_sources(tmp_path_factory) -> dict[str, str]:
    """{the kernel's function name (MLX's: its name, template constants and input kinds):
    the source MLX writes for Apple's compiler}, from
    every call ``_calls`` makes, each inside an export trace."""
    import os
    import sys

    from agentkv.kernels import gpu

    real = mx.fast.metal_kernel

    def verbose(**kwargs):
        kernel = real(**kwargs)
        return lambda **call: kernel(**call, verbose=True)

    tmp = tmp_path_factory.mktemp("metal")
    out = tmp / "sources.txt"
    gpu._kernel.cache_clear()
    mx.fast.metal_kernel = verbose
    saved = os.dup(1)
    try:  # MLX writes the sources to the process's standard output (C++'s std::cout)
        with open(out, "w") as f:
            sys.stdout.flush()
            os.dup2(f.fileno(), 1)
            for i, (_, make) in enumerate(_calls()):
                mx.export_function(str(tmp / f"{i}.mlxfn"), lambda _x, m=make: m(), mx.zeros(1))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        mx.fast.metal_kernel = real
        gpu._kernel.cache_clear()
    text = out.read_text()
    sources = [m.group(2) for m in SOURCE.finditer(text)]
    assert len(sources) == text.count("Generated source code for `")  # every one read
    named: dict[str, str] = {}
    for s in sources:  # MLX's name says its constants and input kinds: one source a name
        name = re.search(r"\[\[kernel\]\] void (\w+)\(", s).group(1)
        assert named.setdefault(name, s) == s, name
    return named


def parse(source: str):
    """libclang's translation unit of ``source`` after the shim, in C++14."""
    text = SHIM + HOST_NAME.sub("template decltype", source)
    index = clang.Index.create()
    args = ["-x", "c++", "-std=c++14", "-fsyntax-only", "-Wno-unknown-attributes",
            "-Wimplicit-float-conversion"]  # fmt: skip
    return index.parse("kernel.metal.cpp", args=args, unsaved_files=[("kernel.metal.cpp", text)])


def problems(source: str) -> list[str]:
    """What Clang or the rules above say of one kernel's source (empty: nothing)."""
    unit = parse(source)
    lines = (SHIM + source).splitlines()
    found = [
        f"line {d.location.line}: {d.spelling} | {lines[d.location.line - 1].strip()[:100]}"
        for d in unit.diagnostics
        if d.severity >= clang.Diagnostic.Warning
        # a float made half implicitly is Metal's rule too; made bfloat, it is not
        and (d.option != "-Wimplicit-float-conversion" or "__bf16" in d.spelling)
    ]
    shim_lines = SHIM.count("\n")
    for node in unit.cursor.walk_preorder():
        if node.location.file is None or node.location.line <= shim_lines:
            continue
        kind = node.kind.name
        where = f"line {node.location.line}"
        if node.kind == clang.CursorKind.VAR_DECL and "address_space(3)" in node.type.spelling:
            # a threadgroup array: declared in the kernel, never initialized (Metal's rules)
            text = "\n".join(lines[node.extent.start.line - 1 : node.extent.end.line])
            if re.search(r"(?<![=!<>])=(?!=)", text):  # (its macro's tokens: the lines')
                found.append(f"{where}: a threadgroup array with an initializer")
            if not node.semantic_parent.spelling.startswith("custom_kernel_"):
                found.append(f"{where}: a threadgroup array outside the kernel function")
        if kind in FORBIDDEN:
            found.append(f"{where}: {FORBIDDEN[kind]}, which Metal does not have")
        elif node.kind == clang.CursorKind.CXX_METHOD and node.is_virtual_method():
            found.append(f"{where}: a virtual function, which Metal does not have")
        elif node.kind.is_expression() and node.type._kind_id == clang.TypeKind.DOUBLE.value:
            # (the raw kind: libclang's Python names no kind for _Float16, which half is)
            found.append(f"{where}: a double ({node.spelling or kind}), which Metal does not have")
    return found


def test_every_kernel_call_is_written_for_metal(metal_sources):
    """The calls above reach every kernel: each body MLX would compile on a Mac, in more
    than one instantiation where its constants vary."""
    names = {n.split("__")[0].removeprefix("custom_kernel_agentkv_") for n in metal_sources}
    kernels = {"paged_attention", "paged_attention_merge", "store_rows", "dense_rows",
               "quantize_groups", "merge1", "extract"}  # fmt: skip
    assert kernels <= names, names
    paged = [n for n in metal_sources if n.startswith("custom_kernel_agentkv_paged_attention__")]
    # (T, then NQ_KL_TG_KU) of each instantiation of the paged kernel
    shape = re.compile(r"\w+?__(float|float16_t|bfloat16_t)_(\d+_\d+_\d+_\d+)_")
    shapes = {shape.match(n).groups() for n in paged}
    constants = {c for _, c in shapes}
    assert constants == {
        "1_32_128_4", "1_4_128_2", "2_16_128_2", "2_8_128_2", "4_8_128_2", "8_8_128_1"
    }  # fmt: skip
    assert {t for t, _ in shapes} == {"float", "float16_t", "bfloat16_t"}
    # inputs of fewer than 8 elements go in Metal's constant space, others in device: a
    # batch's lengths in both (4 rows and 9)
    assert all(" device " in s and " constant " in s for s in metal_sources.values())
    lengths = {
        re.search(r"const (\w+) int32_t\* lengths", metal_sources[n]).group(1) for n in paged
    }
    assert lengths == {"constant", "device"}


def test_metal_source_parses_as_metal(metal_sources):
    """Each source MLX writes parses and instantiates without a diagnostic under Metal's
    rules as modelled (module docstring)."""
    failed = {name: found for name, s in metal_sources.items() if (found := problems(s))}
    assert not failed, failed


@pytest.mark.parametrize(
    "change, says",
    [
        # a constant input (fewer than 8 elements) taken as a pointer of another space
        ("const int n_rows = dims[0];", "cannot initialize"),
        # a Metal keyword as a name
        ("int half = 1;", "expected"),
        ("auto f = [](int x) { return x; };", "a lambda"),
        ("if constexpr (true) {}", "C++17"),
        ("float twice = 2.0 * kv_max(1.0f, 2.0f);", "a double"),
        ("bfloat16_t b = kv_max(1.0f, 2.5f);", "implicit conversion"),
        ("float f = as_type<float>((ushort)1);", "as_type"),
        ("KV_SHARED_ARRAY(float, shared, 4) = {0.0f};", "initializer"),
    ],
)
def test_the_parse_refuses_what_metal_refuses(metal_sources, change, says):
    """The check can fail: each of these, put into the merge pass's body, is refused."""
    name = next(
        n for n in metal_sources if n.startswith("custom_kernel_agentkv_paged_attention_merge")
    )
    source = metal_sources[name]
    anchor = "const int n_rows = dims[0];"
    assert anchor in source
    if change == anchor:  # the pointer taken in the thread space
        changed = source.replace(anchor, "const int32_t* p = dims;\nconst int n_rows = p[0];")
    else:
        changed = source.replace(anchor, change + "\n" + anchor)
    assert any(says in p for p in problems(changed)), problems(changed)
