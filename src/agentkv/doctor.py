"""What agentkv runs on: MLX backend and BLAS, the native extension, the home directory."""

from __future__ import annotations

import os
import platform
import sys
import time

import mlx.core as mx

from . import BLAS_STATUS, __version__, _ext
from .paths import agentkv_home

# MLX's bundled reference BLAS runs a float32 matmul at ~3 GFLOP/s on this class of CPU and
# OpenBLAS at ~180; a busy machine can pull OpenBLAS's figure down to ~10, so only a figure
# near the reference BLAS's means the fast BLAS is not in use.
SLOW_BLAS_GFLOPS = 5.0


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


def _backend() -> dict:
    info = {"default_device": str(mx.default_device())}
    for name in ("metal", "cuda"):
        module = getattr(mx, name, None)
        available = getattr(module, "is_available", None)
        info[f"{name}_available"] = bool(available()) if available else False
    return info


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
    home = agentkv_home()
    writable = os.access(home if home.exists() else home.parent, os.W_OK)
    if not writable:
        warnings.append(f"{home} is not writable: set AGENTKV_HOME to a writable directory")
    return {
        "agentkv": __version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": {"version": mx.__version__, **_backend()},
        "blas": {
            "in_use": BLAS_STATUS.description,
            "library": BLAS_STATUS.library,
            "preloaded_before_mlx": BLAS_STATUS.preloaded,
            "matmul_gflops": round(gflops, 1),
        },
        "extension": _ext.build_info(),
        "home": {"path": str(home), "writable": writable},
        "warnings": warnings,
    }
