"""Where a decode step's GPU time goes, kernel by kernel, on a lent CUDA machine.

Runs agentkv's engine (the default 4-bit KV and ``kv_bits=16``) on a random-weight model
of a real shape (``benchmarks/gpu.py``'s) and records every CUDA kernel, copy and runtime
call of a few hot decode turns through PyTorch's profiler (CUPTI: it sees MLX's kernels,
those inside CUDA graphs included). Prints, per case, the wall time a token, the GPU's busy
time a token, and the kernels by total time; writes the same as JSON.

    python tests/scripts/gpu_profile.py --tokenizer .devkit/tokenizer --out $OUT/profile.json

A developer's tool for the device (docs/gpu-attention.md), not part of the product.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def summarize(trace: dict, tokens: int, wall: float) -> dict:
    """Kernels and copies of one profiled case, aggregated by name."""
    kernels: dict[str, list[float]] = defaultdict(list)
    runtime: dict[str, list[float]] = defaultdict(list)
    busy = []
    for event in trace.get("traceEvents", []):
        cat = event.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[f"{cat}: {event['name'][:120]}"].append(event.get("dur", 0))
            busy.append((event["ts"], event["ts"] + event.get("dur", 0)))
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime[event["name"]].append(event.get("dur", 0))
    busy.sort()
    covered, end = 0.0, None
    for a, b in busy:  # the union of the intervals: the GPU's busy time
        if end is None or a > end:
            covered += b - a
            end = b
        elif b > end:
            covered += b - end
            end = b
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    calls = sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "tokens": tokens,
        "wall_ms_per_token": round(wall * 1000 / tokens, 3),
        "gpu_busy_ms_per_token": round(covered / 1000 / tokens, 3),
        "kernels_per_token": round(sum(len(v) for v in kernels.values()) / tokens, 1),
        "kernels": [
            {
                "name": k,
                "count": len(v),
                "us_per_token": round(sum(v) / tokens, 1),
                "us_each": round(sum(v) / len(v), 2),
            }
            for k, v in top
        ],  # fmt: skip
        "runtime": [
            {"name": k, "count": len(v), "us_per_token": round(sum(v) / tokens, 1)}
            for k, v in calls
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true", help="no profiler (a CPU check)")
    args = parser.parse_args()

    if args.dry_run:
        import contextlib

        class _Profile(contextlib.nullcontext):
            def __enter__(self):
                return self

            def export_chrome_trace(self, path):
                Path(path).write_text("{}")

        def profile(**_):
            return _Profile()

        ProfilerActivity = type("ProfilerActivity", (), {"CPU": 0, "CUDA": 1})
    else:
        import torch  # noqa: F401  (CUPTI through PyTorch's profiler)
        from torch.profiler import ProfilerActivity, profile

    from agentkv import Engine
    from benchmarks import gpu

    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[str, dict] = {}

    def profiled(name: str, fn) -> None:
        fn(warm=True)  # once unprofiled: compiles, pools, the first turn's costs
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                tokens = fn(warm=False)
                wall = time.perf_counter() - start
            prof.export_chrome_trace(f.name)
            trace = json.loads(Path(f.name).read_text())
        results[name] = summarize(trace, tokens, wall)
        r = results[name]
        print(f"== {name}: {r['wall_ms_per_token']} ms/token wall, "
              f"{r['gpu_busy_ms_per_token']} ms/token GPU busy, "
              f"{r['kernels_per_token']} kernels/token", flush=True)  # fmt: skip
        for k in r["kernels"][:14]:
            print(f"   {k['us_per_token']:9.1f} us/tok {k['count']:6d}x {k['us_each']:8.2f} us  "
                  f"{k['name']}", flush=True)  # fmt: skip
        for k in r["runtime"][:6]:
            print(f"   host {k['us_per_token']:9.1f} us/tok {k['count']:6d}x {k['name']}")
        Path(args.out).write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        path = gpu.build_model(args.shape, Path(tmp) / "m", Path(args.tokenizer))
        from mlx_lm import load

        _, tokenizer = load(str(path))
        for arm, options in (("q4", {}), ("kv16", {"kv_bits": 16})):
            engine = Engine(model=str(path), cache_dir=Path(tmp) / arm, pool_bytes=3 << 30,
                            **options)  # fmt: skip
            try:
                for context in contexts:
                    agent = f"{arm}-{context}"
                    text = [gpu.prompt_text(tokenizer, context)]
                    engine.generate(agent, text[0], max_tokens=2, cache_salt=agent)
                    text[0] += "?"

                    def decode(warm: bool, agent=agent, text=text, engine=engine) -> int:
                        text[0] += "\n\nGo on."
                        r = engine.generate(agent, text[0], max_tokens=args.tokens,
                                            cache_salt=agent)  # fmt: skip
                        text[0] += r.text
                        return len(r.tokens)

                    profiled(f"{arm} decode at {context}", decode)
                n = args.batch
                prompts = [gpu.prompt_text(tokenizer, 1024, offset=i * 997) for i in range(n)]
                agents = [f"{arm}-batch{i}" for i in range(n)]
                first = engine.generate_many(list(zip(agents, prompts)), max_tokens=1)
                texts = [p + r.text for p, r in zip(prompts, first)]

                def batch(warm: bool, engine=engine, agents=agents, texts=texts, n=n) -> int:
                    for i in range(n):
                        texts[i] += "\n\nGo on:"
                    out = engine.generate_many(list(zip(agents, texts)), max_tokens=args.tokens)
                    for i, r in enumerate(out):
                        texts[i] += r.text
                    return sum(len(r.tokens) for r in out)

                profiled(f"{arm} batch of {n} at 1024", batch)
            finally:
                engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
