"""Experiments on a lent CUDA machine, many in one call (docs/gpu-attention.md, "Profile").

``kernel``: the paged attention kernel alone (one layer, one decode query per query head,
the default format 2), at several contexts and two head shapes (SmolLM2-135M's 3 KV heads
of 64, Llama-3-8B's 8 of 128), in variants made here by text substitution: as shipped; its
small inputs (tables, lengths, tail slots, dims, scale) copied into device memory first
(MLX's CUDA backend keeps arrays made from host data in managed memory); ``__expf`` for
``expf``; other part sizes (32, 256, 1024 keys; as shipped: 64); 1 and 4 keys a team loads at
once (KU; as shipped: 2). Against MLX's fused attention over float16 keys and values.

``decode``: one engine (or mlx-lm) decoding 128 tokens after a 1K prompt, in this process,
for an A/B of environment settings run as separate processes by the caller.

``build``: where the host's time building one decode step's graph goes (``bench gpu``'s step
anatomy measured 4.6 ms for 4-bit KV, 2.6 for float16 KV, 1.3 for mlx-lm on an H200, where
tests/scripts/gpu_host_cost.py finds agentkv's within 1.01-1.28x of mlx-lm's on the CPU):
each arm's build timed, then the same builds under cProfile, the functions that take most.

    python tests/scripts/gpu_lab.py kernel --tokenizer .devkit/tokenizer
    MLX_USE_CUDA_GRAPHS=0 python tests/scripts/gpu_lab.py decode --arm q4 --tokenizer ...

A developer's tool for the device, not part of the product.
"""
# ruff: noqa: B023  (each closure runs inside the iteration that makes it)

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

CALLS = 20


REPEATS = [30]  # timed evaluations a case (--repeats)


def timed(fn, repeats: int | None = None) -> float:
    """Median microseconds of one call (CALLS calls an evaluation)."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeats or REPEATS[0]):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6 / CALLS


def device_copy(a):
    """``a`` in device memory (an operation's output), evaluated."""
    if a is None:
        return None
    out = a + mx.zeros((), dtype=a.dtype) if a.dtype != mx.bool_ else a
    mx.eval(out)
    return out


def variant(suffix: str, subs: list[tuple[str, str]]):
    """Make the kernels gpu.py builds carry ``subs`` (and another name, so MLX compiles them
    anew)."""
    from agentkv.kernels import gpu

    original = variant.original
    if suffix:

        def make(*, name, input_names, output_names, source, header="", **options):
            for a, b in subs:
                source, header = source.replace(a, b), header.replace(a, b)
            return original(name=name + suffix, input_names=input_names,
                            output_names=output_names, source=source, header=header,
                            **options)  # fmt: skip

        mx.fast.cuda_kernel = make
    else:
        mx.fast.cuda_kernel = original
    gpu._kernel.cache_clear()


variant.original = mx.fast.cuda_kernel


def kernel_lab(args) -> list[dict]:
    from agentkv import Engine, kernels
    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.kernels import gpu as gpu_kernels
    from agentkv.kernels.types import HostIndex, PagedQuery
    from agentkv.pool import KVPool
    from benchmarks import gpu
    from benchmarks.common import synthetic_table

    rows = []
    cuda = "cuda" in kernels.available_backends()
    with tempfile.TemporaryDirectory() as tmp:
        path = gpu.build_model(args.shape, Path(tmp) / "m", Path(args.tokenizer))
        engine = Engine(model=str(path), cache_dir=Path(tmp) / "kv", pool_bytes=256 << 20)
        try:
            base_spec, quant = engine.spec, engine.quant
            # the model's own KV shape (SmolLM2-135M's by default), and Llama-3-8B's
            shapes = {"135m": (base_spec, 3 * base_spec.kv_heads), "8b": (replace(
                base_spec, kv_heads=8, key_head_dim=128, value_head_dim=128), 32)}  # fmt: skip
            for shape, (spec, q_heads) in shapes.items():
                for context in [int(c) for c in args.contexts.split(",")]:
                    layer = 0
                    block_bytes = KVPool(spec, quant, pool_bytes=64 << 20).arena.block_bytes
                    pool = KVPool(
                        spec, quant, pool_bytes=(context // BLOCK_TOKENS + 4) * block_bytes
                    )
                    table = synthetic_table(pool, context)
                    arena = pool.arena
                    lq = arena.layer_quants[layer]
                    ct = lq.channel_tokens if lq.channel_keys else 0
                    host = HostIndex(
                        tables=np.asarray([table.blocks], np.int32),
                        lengths=np.asarray([context], np.int32),
                        tail_slots=np.asarray([table.tail], np.int32) if ct else None,
                    )
                    dim = spec.key_head_dim

                    def paged(device: bool):
                        f = device_copy if device else (lambda a: a)
                        return PagedQuery(
                            arena.keys(layer), arena.values(layer),
                            f(mx.array([table.blocks], dtype=mx.int32)),
                            f(mx.array([context], dtype=mx.int32)),
                            spec.kv_heads, BLOCK_TOKENS, lq.key_bits, lq.value_bits,
                            lq.group_size, 0, None, ct, arena.tails[layer] if ct else None,
                            f(mx.array(host.tail_slots)) if ct else None, host,
                        )  # fmt: skip

                    queries = [
                        mx.random.normal((1, q_heads, 1, dim)).astype(mx.float16)
                        for _ in range(CALLS)
                    ]
                    mx.eval(queries)
                    kv_bytes = context * sum(c.heads * c.row_bytes for c in arena.components[layer])
                    longest = context

                    def run(p, launch=None):
                        return lambda: [
                            kernels.paged_attention_body(x, p, scale=dim**-0.5)
                            if launch is None
                            else gpu_kernels.for_backend("cuda").paged_attention(
                                x, p, scale=dim**-0.5, launch=launch)
                            for x in queries
                        ]  # fmt: skip

                    plain, on_device = paged(False), paged(True)
                    base_launch = plain.launch(queries[0])
                    cases = [("as shipped", "", [], plain, None),
                             ("small inputs in device memory", "", [], on_device, None),
                             ("__expf", "_fastexp", [("expf(x)", "__expf(x)")], plain, None),
                             ("__expf + device inputs", "_fastexp", [("expf(x)", "__expf(x)")],
                              on_device, None)]  # fmt: skip
                    for keys_a_part in (32, 256, 1024) if cuda else ():  # shipped: 64
                        splits = max(1, min(1024, math.ceil(longest / keys_a_part)))
                        launch = plain.launch(queries[0], splits=splits)
                        cases.append((f"{splits} parts", "", [], on_device, launch))
                    for ku in (1, 4) if cuda else ():  # keys a team loads at once (KU)
                        launch = plain.launch(queries[0], keys_in_flight=ku)
                        cases.append((f"{ku} keys in flight + device inputs", "", [], on_device,
                                      launch))  # fmt: skip
                    if spec.key_head_dim == spec.value_head_dim and dim in (64, 128):
                        cases.append(("rotated inside + device inputs", "", [],
                                      on_device._replace(rotate=True), None))  # fmt: skip
                    originals = gpu_kernels._ints, gpu_kernels._floats, gpu_kernels._zeros
                    for name, suffix, subs, p, launch in cases:
                        variant(suffix, subs)
                        if p.tables is on_device.tables:  # the kernel's dims and scale too
                            made = ({}, {}, {})  # device copies made once, outside the timing
                            gpu_kernels._ints, gpu_kernels._floats, gpu_kernels._zeros = (
                                lambda *v, f=f, c=c: c.setdefault(v, device_copy(f(*v)))
                                for f, c in zip(originals, made)
                            )
                        try:
                            us = timed(run(p, launch))
                        except Exception as exc:  # noqa: BLE001  (a variant that fails says so)
                            us = None
                            name += f" (failed: {type(exc).__name__}: {str(exc)[:120]})"
                        finally:
                            gpu_kernels._ints, gpu_kernels._floats, gpu_kernels._zeros = originals
                            variant("", [])
                        row = {"shape": shape, "context": context, "case": name,
                               "launch": str(launch or base_launch), "us": us and round(us, 1),
                               "gbps": us and round(kv_bytes / (us * 1e-6) / 1e9, 1)}  # fmt: skip
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                    keys = mx.random.normal((1, spec.kv_heads, context, dim)).astype(mx.float16)
                    values = mx.random.normal((1, spec.kv_heads, context, dim)).astype(mx.float16)
                    us = timed(lambda: [mx.fast.scaled_dot_product_attention(
                        x, keys, values, scale=dim**-0.5) for x in queries])  # fmt: skip
                    gbps = (keys.nbytes + values.nbytes) / (us * 1e-6) / 1e9
                    row = {"shape": shape, "context": context, "case": "mlx sdpa fp16",
                           "us": round(us, 1), "gbps": round(gbps, 1)}  # fmt: skip
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    table.release()
                    mx.clear_cache()
        finally:
            engine.close()
    return rows


def decode(args) -> dict:
    """128 tokens after a 1K prompt, timed from outside (bench gpu's way)."""
    from benchmarks import gpu

    with tempfile.TemporaryDirectory() as tmp:
        path = gpu.build_model(args.shape, Path(tmp) / "m", Path(args.tokenizer))
        import mlx_lm

        model, tokenizer = mlx_lm.load(str(path))
        prompt = gpu.prompt_text(tokenizer, args.context)
        if args.arm == "mlx-lm":
            gpu.mlx_lm_generate(model, tokenizer, prompt[:2000], 8)
            row = gpu.mlx_lm_generate(model, tokenizer, prompt, 128)
        else:
            from agentkv import Engine

            options = {"kv_bits": 16} if args.arm == "kv16" else {}
            # no engine warm-up (nor its check of the kernels: tests/gpu runs that): the
            # turn below warms the arm up, within the arm's time limit
            engine = Engine(model=str(path), cache_dir=Path(tmp) / "kv", pool_bytes=1 << 30,
                            warmup=False, **options)  # fmt: skip
            try:
                gpu._warm_up(model, tokenizer, {"a": engine})
                row, text = gpu.agentkv_generate(engine, "a", prompt, 128)
                row2, _ = gpu.agentkv_generate(engine, "a", prompt + text + "\n\nGo on.", 128)
                row["hot_decode_tps"] = row2["decode_tps"]
                # a hot turn's first token: its ~140 new tokens take the dense path
                row["hot_ttft_ms"] = row2["engine_ttft_ms"]
            finally:
                engine.close()
    return {"arm": args.arm, "shape": args.shape, "context": args.context, **row}


BUILD_STEPS = 40


def build_profile(args) -> list[dict]:
    """The ``build`` experiment (module docstring): per arm, the median build of a decode
    step at ``--context`` tokens unprofiled, then under cProfile the functions taking most."""
    import cProfile
    import pstats

    from benchmarks import gpu

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = gpu.build_model(args.shape, Path(tmp) / "m", Path(args.tokenizer))
        for arm in ("q4", "kv16", "mlx-lm"):
            step, finish = step_builder(arm, path, Path(tmp) / arm, args.context)
            try:
                plain = [_built(step, None) for _ in range(BUILD_STEPS)]
                profile = cProfile.Profile()
                profiled = [_built(step, profile) for _ in range(BUILD_STEPS)]
            finally:
                finish()
            stats = pstats.Stats(profile)
            top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
            rows.append({
                "arm": arm, "shape": args.shape, "context": args.context,
                "build_ms": round(float(np.median(plain)) * 1e3, 3),
                "profiled_build_ms": round(float(np.median(profiled)) * 1e3, 3),
                "top": [
                    {"function": f"{Path(f).name}:{line}({name})", "calls": nc,
                     "own_ms_a_step": round(tt * 1e3 / BUILD_STEPS, 3),
                     "total_ms_a_step": round(ct * 1e3 / BUILD_STEPS, 3)}
                    for (f, line, name), (_, nc, tt, ct, _) in top
                ],
            })  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "top"}), flush=True)
    return rows


def _built(step, profile) -> float:
    """One step: its graph built (timed, under ``profile`` if given), then evaluated."""
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    evaluate, _ = step()
    if profile is not None:
        profile.disable()
    took = time.perf_counter() - start
    evaluate()
    return took


def step_builder(arm: str, path: Path, kv: Path, context: int, steps: int = 2 * BUILD_STEPS,
                 options: dict | None = None, tokens: int = 1):  # fmt: skip
    """(step, finish) for up to ``steps`` steps of ``tokens`` tokens each (1: decode; more: a
    prefill chunk, as a hot turn's) after ``context`` tokens: ``step()``
    builds one step of ``arm`` ("q4", "kv16" or "mlx-lm"; ``bench gpu``'s anatomy: agentkv's
    runner one operation at a time, or mlx-lm's model over its float16 cache) and returns
    (what evaluates it, the arrays its graph ends in: the logits and the arenas' or the
    cache's arrays); ``finish()`` lets go. ``options``: the agentkv engine's, besides
    ``kv_bits``. (tests/scripts/gpu_host_cost.py builds its steps here too.)"""
    if arm == "mlx-lm":
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache

        model, _ = mlx_lm.load(str(path))
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # float16 matmuls crawl on a CPU
        cache = make_prompt_cache(model)
        mx.eval(model.model(mx.array([[7] * context]), cache=cache), [c.state for c in cache])

        def mlx_lm_step():
            logits = model(mx.array([[7] * tokens]), cache=cache)[:, -1, :]
            arrays = [a for c in cache for a in (c.keys, c.values)]
            return lambda: mx.eval(logits, arrays), [logits, *arrays]

        return mlx_lm_step, lambda: None
    from agentkv import Engine, mlx_adapter
    from agentkv.pool.step import PagedStep

    options = {**(options or {}), **({"kv_bits": 16} if arm == "kv16" else {})}
    engine = Engine(model=str(path), cache_dir=kv, pool_bytes=1 << 30, draft_tokens=0, **options)
    runner, pool = engine.runner, engine.pool
    table = pool.new_table(pool.seed("lab/build"))
    reservation = pool.reserve(-(-(context + steps * tokens + 2) // 256) + 1)
    runner.forward([table], [[7] * context], reservations=[reservation])

    def agentkv_step():
        table.grow(tokens, pool.arena.copy_rows, reservation)
        paged = PagedStep(pool.arena, engine.loaded.spec, [table], tokens, fused=False)
        logits = mlx_adapter.last_logits(runner.model, mx.array([[7] * tokens]), paged.caches)

        def evaluate():
            mx.eval(logits)
            pool.arena.settle()
            table.written([7] * tokens)

        arena = pool.arena
        return evaluate, [logits, *arena._flat(), *arena.tails, *arena.prevs]

    def finish():
        reservation.close()
        table.release()
        engine.close()

    return agentkv_step, finish


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["kernel", "decode", "build"])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--arm", default="q4", choices=["q4", "kv16", "mlx-lm"])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30, help="timed evaluations a case")
    args = parser.parse_args()
    REPEATS[0] = args.repeats
    if args.what == "kernel":
        kernel_lab(args)
    elif args.what == "build":
        for row in build_profile(args):
            print(json.dumps(row), flush=True)
    else:
        print(json.dumps(decode(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
