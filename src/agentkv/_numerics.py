"""Keep float32 matmuls in float32 on GPUs that could run them in TF32.

MLX runs float32 matrix products in TF32 (a 10-bit mantissa) by default where the hardware has
it: NVIDIA GPUs through its CUDA backend, and the Neural Accelerators of M5-class Macs. Those
products then depend on how many rows share the call (one row takes a full-precision GEMV, two
or more a TF32 GEMM), so a float32 model's batch gives other logits than each agent alone, at
~1e-3 relative, enough to change greedy tokens; measured on an H100 (benchmarks/RESULTS.md,
2026-11-27 @ 3b5b02d). The engine promises a batch the tokens of each turn alone, so agentkv
turns TF32 off unless the environment already says otherwise: ``MLX_ENABLE_TF32=1`` opts back
in. Quantized and 16-bit weights never take TF32; only float32 models pay. MLX reads the
variable when it first needs it, so it must be set before the first matmul on the GPU: ``import
agentkv`` first.
"""

from __future__ import annotations

import os

TF32_ENV = "MLX_ENABLE_TF32"

SET_HERE = TF32_ENV not in os.environ  # agentkv's setting, not the user's
os.environ.setdefault(TF32_ENV, "0")


def environ_as_found() -> dict[str, str]:
    """The environment without agentkv's setting: for other programs (the benchmarks' peers),
    which should run as they would without agentkv."""
    env = dict(os.environ)
    if SET_HERE:
        env.pop(TF32_ENV, None)
    return env


def tf32_allowed() -> bool:
    """Whether MLX may run float32 matmuls in TF32 (MLX's reading: ``0`` off, other integers on)."""
    value = os.environ.get(TF32_ENV, "1").strip()
    try:
        return int(value) != 0
    except ValueError:
        return True  # not an integer: MLX keeps its default
