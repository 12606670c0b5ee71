"""Give MLX's Linux CPU backend a fast BLAS before ``mlx.core`` is imported.

MLX's Linux wheel links a reference BLAS: float32 matmul runs at ~3 GFLOP/s.
The scipy-openblas32 wheel ships OpenBLAS, but with every symbol prefixed
``scipy_``, so it cannot interpose on the ``cblas_sgemm`` MLX calls. agentkv
loads it with ``RTLD_GLOBAL``, then its own ``_blas_shim`` library (unprefixed
``cblas_*gemm`` forwarding to it, also ``RTLD_GLOBAL``); when ``mlx.core`` is
imported afterwards, the dynamic linker binds MLX's calls to the shim. Measured
here: ~180 GFLOP/s. Once ``mlx.core`` is loaded its calls are bound and nothing
can change them, hence "import agentkv before mlx".

Set ``AGENTKV_NO_BLAS_PRELOAD=1`` to leave MLX's BLAS alone.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DISABLE_ENV = "AGENTKV_NO_BLAS_PRELOAD"
SHIM_NAME = "_blas_shim.so"


@dataclass(frozen=True)
class BlasStatus:
    """What ``import agentkv`` did about MLX's BLAS, and why."""

    preloaded: bool  # OpenBLAS + shim are loaded and were in place before mlx.core
    description: str  # which BLAS MLX's matmul uses
    library: str | None  # path of the OpenBLAS loaded, if any
    warning: str | None  # set when MLX runs a slow BLAS that agentkv could not replace


def _openblas_path() -> Path:
    import scipy_openblas32

    lib_dir = Path(scipy_openblas32.get_lib_dir())
    return lib_dir / f"lib{scipy_openblas32.get_library()}.so"


def _shim_path() -> Path:
    """The shim next to this file, or wherever an editable install put the built one."""
    local = Path(__file__).with_name(SHIM_NAME)
    if local.exists():
        return local
    spec = importlib.util.find_spec(f"{__package__}._blas_shim")  # a .so is found, not loaded
    return Path(spec.origin) if spec and spec.origin else local


def preload() -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, "MLX's own BLAS (Accelerate on macOS)", None, None)
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return BlasStatus(
            False,
            "reference BLAS bundled with mlx (preload disabled)",
            None,
            f"{DISABLE_ENV} is set: MLX uses its bundled reference BLAS (~3 GFLOP/s matmul)",
        )
    if "mlx.core" in sys.modules:
        return BlasStatus(
            False,
            "reference BLAS bundled with mlx",
            None,
            "mlx.core was imported before agentkv, so MLX is bound to its bundled reference "
            "BLAS (~3 GFLOP/s matmul, ~50x slower): import agentkv before mlx / mlx_lm",
        )
    try:
        library = _openblas_path()
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(_shim_path()), mode=ctypes.RTLD_GLOBAL)
    except (ImportError, OSError) as exc:
        return BlasStatus(
            False,
            "reference BLAS bundled with mlx",
            None,
            f"could not load OpenBLAS ({exc}); MLX uses its reference BLAS (~3 GFLOP/s)",
        )
    return BlasStatus(
        True, "OpenBLAS (scipy-openblas32, via agentkv's cblas shim)", str(library), None
    )


STATUS = preload()
