"""The host's share of a GPU decode step, measured on the CPU.

The profile of decode on an H200 (docs/gpu-attention.md, "Profile") found the 135M shape
host-bound: Python building a step's graph (4.6 ms for 4-bit KV, 2.6 ms for float16 KV, 1.3
ms for mlx-lm) and MLX encoding its kernels (~800 / ~550 / ~500 a step). The Python and the
graph are the same on any machine, so this script measures them here: it loads a
model as a GPU does (mlx-lm's own layers, no CPU preparation; float32, as float16 matmuls
crawl on a CPU: where the GPU's float16 skips a cast, ``AsType`` counts one), sends every
attention call down the GPU kernel path with the kernels themselves, and MLX's fused
operations (which MLX builds from a dozen basic ones on a CPU), replaced by stand-ins of
their output shapes, and for each arm reports

* ``build_ms``: the median time to build one decode step (``PagedStep`` and the model's
  forward pass, not evaluated), as ``bench gpu``'s step anatomy times it on a GPU;
* ``nodes``: the operations in that step's graph (logits and the arenas' writes), by kind;
  ``kernels`` leaves out those that launch nothing on a GPU (views, broadcasts, reshapes)
  and the casts (``casts``), and counts each stand-in as the kernel it replaces;
* ``host_arrays``: the arrays the build makes from host data (``mx.array``), each a buffer
  in managed memory on MLX's CUDA backend.

mlx-lm's own step (its float16 cache) is measured the same way, and so, with
``--arms``, are agentkv's steps with every projection its own matmul
(``agentkv-q4-separate``, ``agentkv-kv16-separate``: ``AGENTKV_GPU_JOINT=0``) and
with MLX's RoPE rather than the store kernel's (``agentkv-q4-noprologue``);
``--tokens N`` builds steps of a prefill chunk of N tokens instead (a hot turn's: on a
GPU, 16 or more take the dense path, kernels/dense.py). Run:
``python tests/scripts/gpu_host_cost.py --context 320 --steps 40 [--json]`` (a context of
more than one part of the keys, so the merge pass runs; longer ones only take the CPU
longer to prefill).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_lab  # noqa: E402

from benchmarks import gpu as bench_gpu  # noqa: E402

# operations that launch no kernel on MLX's GPU backends (a view of their input, or folded
# into the operation that reads them)
NO_KERNEL = {
    "Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided",
    "StopGradient", "Depends", "View", "Full", "Split",
}  # fmt: skip
# each arm: gpu_lab's name for it, and its environment (``-separate``: every projection its
# own matmul, as before mlx_adapter.use_joint_projections)
SEPARATE = {"AGENTKV_GPU_JOINT": "0"}
ARMS = {
    "agentkv-q4": ("q4", {}),
    "agentkv-kv16": ("kv16", {}),
    "mlx-lm-fp16": ("mlx-lm", {}),
    "agentkv-q4-separate": ("q4", SEPARATE),
    "agentkv-kv16-separate": ("kv16", SEPARATE),
    "agentkv-q4-noprologue": ("q4", {"AGENTKV_GPU_PROLOGUE": "0"}),
}
CALLS: collections.Counter = collections.Counter()  # the stand-ins' calls, by kernel


def emulate_gpu() -> None:
    """Route everything as a GPU would, with stand-ins for the kernels (module docstring)."""
    from agentkv import kernels
    from agentkv.kernels import attention, gpu
    from agentkv.model import load
    from agentkv.pool import step

    def prepare(model, *_):  # mlx-lm's own layers, float32 (float16 matmuls crawl on a CPU)
        model.set_dtype(mx.float32)
        load._prepare_for_gpu(model)  # as load_model does on a GPU
        return False

    load._prepare_for_cpu = prepare
    step.fuses = lambda arena: False
    attention.fused_takes = lambda quant, queries: False
    # the backend looked up as on a CUDA machine (its availability said, not asked of MLX)
    gpu.cuda_available, gpu.metal_available = (lambda: True), (lambda: False)
    kernels.set_backend("cuda")

    def kernel(backend, name, sources=0):
        def run(*, inputs, output_shapes, output_dtypes, **_):
            CALLS[name] += 1
            # one operation over every input and every output, as the kernel is (``Depends``:
            # no kernel; ``Full``, the outputs' zeros, none either)
            outputs = [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
            return mx.depends(outputs, list(inputs))

        return run

    gpu._kernel = kernel
    fast_stand_ins()


def fast_stand_ins() -> None:
    """MLX's fused operations as stand-ins too: on a GPU each is one kernel, on the CPU
    MLX builds it from a dozen basic operations (every arm, mlx-lm's included: its quantized
    embedding's ``mx.dequantize``)."""

    def stand_in(name, shape_of):
        def run(*args, **kwargs):
            CALLS[name] += 1
            out = mx.zeros(shape_of(*args, **kwargs), args[0].dtype)
            return mx.depends(out, [a for a in args if isinstance(a, mx.array)])

        return run

    mx.fast.rms_norm = stand_in("rms_norm", lambda x, *a, **k: x.shape)
    mx.fast.rope = stand_in("rope", lambda x, *a, **k: x.shape)
    mx.fast.scaled_dot_product_attention = stand_in(
        "sdpa", lambda q, k, v, **_: (*q.shape[:-1], v.shape[-1])
    )
    dequantize = mx.dequantize  # one kernel on a GPU; ~20 shifts and casts on the CPU

    def dequantized(w, scales, biases=None, group_size=64, bits=4, **kwargs):
        CALLS["dequantize"] += 1
        shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)
        out = mx.zeros(shape, kwargs.get("dtype") or scales.dtype)
        return mx.depends(out, [a for a in (w, scales, biases) if a is not None])

    dequantized.original = dequantize
    mx.dequantize = dequantized


class _ArrayType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_ARRAY)


_REAL_ARRAY = mx.array


class _CountedArray(metaclass=_ArrayType):
    """``mx.array`` counting the arrays made from host data (``made``): on MLX's
    CUDA backend each is a buffer in managed memory (docs/gpu-attention.md, "Profile")."""

    made = 0

    def __new__(cls, *args, **kwargs):
        _CountedArray.made += 1
        return _REAL_ARRAY(*args, **kwargs)


def counting_host_arrays(build):
    """``build()``'s result and how many arrays it made from host data."""
    before = _CountedArray.made
    mx.array = _CountedArray
    try:
        out = build()
    finally:
        mx.array = _REAL_ARRAY
    return out, _CountedArray.made - before


def count_nodes(outputs: list[mx.array]) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'label ="(\w+)"', text))


def kernels_of(nodes: collections.Counter, stand_ins: int) -> int:
    return sum(n for kind, n in nodes.items() if kind not in NO_KERNEL | {"AsType"}) + stand_ins


def measure(
    arm: str, name: str, path: Path, kv: Path, context: int, steps: int, tokens: int = 1
) -> dict:
    """One arm's row (module docstring): its first step's graph counted, the arrays its
    second makes from host data (the first also makes the kernels' constants, once), every
    later one timed."""
    # a wide layer named (the calibration would measure them for minutes on the CPU);
    # which layers are wide changes their bits, not the step's operations
    options = {"kv_wide_layers": (0,)} if arm == "q4" else {}
    step, finish = gpu_lab.step_builder(arm, path, kv / name, context, steps + 2, options, tokens)
    try:
        before = dict(CALLS)
        evaluate, outputs = step()
        nodes, stand_ins = count_nodes(outputs), _since(before)
        evaluate()
        (evaluate, _), host_arrays = counting_host_arrays(step)
        evaluate()
        builds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            evaluate, _ = step()
            builds.append(time.perf_counter() - t0)
            evaluate()
    finally:
        finish()
    return {**_row(name, context, builds, nodes, stand_ins, host_arrays), "tokens": tokens}


def _since(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in CALLS.items() if v > before.get(k, 0)}


def _row(name, context, builds, nodes, stand_ins: dict, host_arrays: int) -> dict:
    return {
        "arm": name,
        "context": context,
        "build_ms": round(statistics.median(builds) * 1e3, 3),
        "kernels": kernels_of(nodes, sum(stand_ins.values())),
        "casts": nodes.get("AsType", 0),
        "host_arrays": host_arrays,
        "stand_ins": stand_ins,
        "nodes": dict(sorted(nodes.items(), key=lambda kv: -kv[1])),
    }


@contextlib.contextmanager
def _environment(env: dict):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(bench_gpu.SHAPES))
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--tokens", type=int, default=1, help="tokens a step (1: decode; more: a prefill chunk)"
    )
    parser.add_argument("--arms", default="agentkv-q4,agentkv-kv16,mlx-lm-fp16")
    parser.add_argument("--tokenizer", help="tokenizer files (default: the embedded model's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if unknown := set(args.arms.split(",")) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {sorted(ARMS)}")
    emulate_gpu()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = bench_gpu.build_model(args.shape, root, bench_gpu.tokenizer_dir(args.tokenizer))
        for name in args.arms.split(","):
            arm, env = ARMS[name]
            with _environment(env):
                rows.append(
                    measure(arm, name, path, root / "kv", args.context, args.steps, args.tokens)
                )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["nodes"].items())[:12])
        head = f"{r['arm']:>14}  build {r['build_ms']:7.3f} ms  kernels {r['kernels']:5d}"
        print(f"{head} + casts {r['casts']:4d}  host arrays {r['host_arrays']:3d}  ({top})")


if __name__ == "__main__":
    main()
