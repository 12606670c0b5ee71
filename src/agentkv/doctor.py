"""What agentkv runs on: MLX backend and BLAS, the native extension, the home directory."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import BLAS_STATUS, __version__, _ext
from ._numerics import tf32_allowed
from .paths import agentkv_home

# MLX's bundled reference BLAS runs a float32 matmul at ~3 GFLOP/s on this class of CPU and
# OpenBLAS at ~180; a busy machine can pull OpenBLAS's figure down to ~10, so only a figure
# near the reference BLAS's means the fast BLAS is not in use.
SLOW_BLAS_GFLOPS = 5.0
ATTENTION_ERROR = 0.01  # decode attention's largest gap from the reference, in its spread


def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """float32 n x n matmul throughput of MLX's default device (the best of ``repeats``,
    so another busy process on the machine does not pass for a slow BLAS)."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_quantized_matmul(n: int = 4096, repeats: int = 5) -> dict:
    """Which kernel runs 4-bit weights (one decode row through an n x n layer, group 32,
    float16 scales, as the embedded model ships) and the weight bytes it streams per second."""
    w, scales, biases = mx.quantize(mx.random.normal((n, n)) * 0.05, group_size=32, bits=4)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = mx.random.normal((1, n))
    mx.eval(w, scales, biases, x)
    if mx.default_device() == mx.cpu:
        from . import mlx_adapter

        name = _ext.build_info()["qmm"]
        packed = mlx_adapter.pack_quantized(w, scales, biases, bits=4, group_size=32)
        mx.eval(packed)

        def run():
            mx.eval(_ext.quantized_matmul(x, *packed, 32, 4))

    else:
        name = f"mx.quantized_matmul ({mx.default_device()})"

        def run():
            mx.eval(mx.quantized_matmul(x, w, scales, biases, group_size=32, bits=4))

    seconds = _best_seconds(run, repeats)
    weight_bytes = w.nbytes + scales.nbytes + biases.nbytes
    return {"implementation": name, "weight_gbps": round(weight_bytes / seconds / 1e9, 2)}


def measure_attention(tokens: int = 4096, repeats: int = 5) -> dict:
    """The path decode attention over the block pool takes (one row of ``tokens`` tokens,
    4-bit KV format 1, 9 query heads over 3 KV heads of 64) and the KV bytes it reads per
    second."""
    from .format.geometry import BLOCK_TOKENS, blocks_for
    from .format.quant import V1, KVQuant
    from .kernels import PagedQuery, attention, reference

    quant, heads, dim = KVQuant(4, 4, 64, **V1), 3, 64
    blocks = blocks_for(tokens)
    rows = blocks * heads * BLOCK_TOKENS
    parts = []
    for c in quant.components(heads, dim, dim):
        if c.dtype == "uint32":
            parts.append(mx.random.randint(0, 2**31, (rows, c.width)).astype(mx.uint32))
        else:
            parts.append((mx.random.uniform(shape=(rows, c.width)) * 0.05).astype(mx.float16))
    tables = mx.arange(blocks, dtype=mx.int32)[None]
    lengths = mx.array([tokens], dtype=mx.int32)
    paged = PagedQuery(
        tuple(parts[: quant.key_parts]), tuple(parts[quant.key_parts :]), tables, lengths,
        heads, BLOCK_TOKENS, 4, 4, 64, 0, None,
    )  # fmt: skip
    q = mx.random.normal((1, 3 * heads, 1, dim))
    mx.eval(parts, q)
    before = attention.paths_used()
    seconds = _best_seconds(
        lambda: mx.eval(attention.paged_attention(q, paged, scale=0.125)), repeats
    )
    after = attention.paths_used()
    path = max(after, key=lambda k: after[k] - before[k])
    kv_bytes = sum(p.nbytes for p in parts) * tokens // (blocks * BLOCK_TOKENS)
    got = np.array(attention.paged_attention(q, paged, scale=0.125).astype(mx.float32))
    want = np.array(reference.paged_attention(q, paged, scale=0.125).astype(mx.float32))
    return {
        "path": path,
        "implementation": _ext.build_info()["attention"],  # the CPU kernel's lanes
        "kv_gbps": round(kv_bytes / seconds / 1e9, 2),
        # its largest gap from the reference's MLX operations, in their spread: ~1e-5 on
        # a CPU; a kernel that reads the wrong head or key is ~1
        "error": float(np.max(np.abs(got - want)) / max(float(np.std(want)), 1e-30)),
    }


def _backend() -> dict:
    info = {"default_device": str(mx.default_device())}
    for name in ("metal", "cuda"):
        module = getattr(mx, name, None)
        available = getattr(module, "is_available", None)
        info[f"{name}_available"] = bool(available()) if available else False
    return info


def _attention(warnings: list[str]) -> dict:
    """``measure_attention``, and on a GPU what runs it (``gpu_kernels``); where the GPU
    refuses agentkv's kernel, a warning, and the measure without them (as an engine does)."""
    from .kernels import gpu

    try:
        out = measure_attention()
    except RuntimeError as exc:
        if (words := gpu.refusal(exc)) is None or not gpu.kernels_on():
            raise
        problem = f"this GPU's compiler refused one of agentkv's kernels ({words})"
        warnings.append(
            f"{problem}; engines run every GPU path on MLX's own operations instead, slower: "
            "please report this with this output"
        )
        gpu.refuse(problem)
        out = measure_attention()
    if out["error"] > ATTENTION_ERROR:
        warnings.append(
            f"decode attention ({out['path']}) lies {out['error']:.3g} of its spread from the "
            "reference's MLX operations (at most "
            f"{ATTENTION_ERROR}): please report this with this output"
        )
    out["gpu_kernels"] = None if mx.default_device() == mx.cpu else gpu.kernels_state()
    return out


def can_make(directory: Path) -> bool:
    """Whether this process can write in ``directory``, or make it: agentkv makes a missing
    home and its missing parents (``~/.cache`` on a new machine), so the nearest existing
    one must be a directory it may write in."""
    nearest = Path(directory)
    while not nearest.exists() and nearest.parent != nearest:
        nearest = nearest.parent
    return nearest.is_dir() and os.access(nearest, os.W_OK)


def report() -> dict:
    """Everything ``agentkv doctor`` prints, as data; ``warnings`` lists what needs action."""
    warnings = []
    gflops = measure_matmul_gflops(512 if mx.default_device() == mx.cpu else 2048)
    if BLAS_STATUS.warning:
        warnings.append(BLAS_STATUS.warning)
    if mx.default_device() == mx.cpu and gflops < SLOW_BLAS_GFLOPS:
        warnings.append(
            f"float32 matmul runs at {gflops:.1f} GFLOP/s: MLX is on a slow BLAS "
            "(import agentkv before mlx, and do not set AGENTKV_NO_BLAS_PRELOAD)"
        )
    matmul = measure_quantized_matmul()
    if mx.default_device() == mx.cpu and matmul["implementation"] == "portable":
        warnings.append(
            "4-bit weights run on the portable C++ path: this CPU (or AGENTKV_QMM=portable) "
            "gives agentkv no AVX2/FMA/F16C, so decoding is slower"
        )
    attention = _attention(warnings)
    home = agentkv_home()
    writable = can_make(home)
    if not writable:
        warnings.append(f"{home} is not writable: set AGENTKV_HOME to a writable directory")
    return {
        "agentkv": __version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": {"version": mx.__version__, **_backend(), "tf32": tf32_allowed()},
        "blas": {
            "in_use": BLAS_STATUS.description,
            "library": BLAS_STATUS.library,
            "preloaded_before_mlx": BLAS_STATUS.preloaded,
            "matmul_gflops": round(gflops, 1),
        },
        "kernels": {"quantized_matmul": matmul, "attention": attention},
        "extension": _ext.build_info(),
        "home": {"path": str(home), "writable": writable},
        "warnings": warnings,
    }
