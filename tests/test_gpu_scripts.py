"""The developer's scripts for a lent GPU (tests/scripts/gpu_profile.py, gpu_lab.py) run
their whole course here on the CPU, a tiny shape, so a GPU call is not spent on a script
that breaks before it measures (the profiler and the CUDA-only variants left out); and
gpu_host_cost.py, which counts a GPU decode step's kernels on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import TOKENIZER_ENV

from agentkv.model.load import ensure_embedded_model

ROOT = Path(__file__).resolve().parents[1]


def tokenizer_dir() -> Path:
    import os

    return Path(os.environ.get(TOKENIZER_ENV) or ensure_embedded_model())


def run(python_env, *args) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=python_env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_profile_script_runs_every_case(python_env, tmp_path):
    out = tmp_path / "profile.json"
    run(python_env, "tests/scripts/gpu_profile.py", "--shape", "tiny", "--contexts", "160",
        "--tokens", "4", "--batch", "2", "--tokenizer", str(tokenizer_dir()), "--out", str(out),
        "--dry-run")  # fmt: skip
    cases = json.loads(out.read_text())
    assert set(cases) == {f"{arm} {what}" for arm in ("q4", "kv16")
                          for what in ("decode at 160", "batch of 2 at 1024")}  # fmt: skip
    assert cases["q4 decode at 160"]["tokens"] == 4
    assert cases["q4 batch of 2 at 1024"]["tokens"] == 8


def test_the_lab_runs_its_kernel_cases_and_a_decode_arm(python_env):
    tokenizer = str(tokenizer_dir())
    kernel = run(python_env, "tests/scripts/gpu_lab.py", "kernel", "--contexts", "160",
                 "--repeats", "1", "--shape", "tiny", "--tokenizer", tokenizer)  # fmt: skip
    rows = [json.loads(line) for line in kernel.stdout.splitlines()]
    assert {r["shape"] for r in rows} == {"135m", "8b"}
    assert all(r["us"] and r["us"] > 0 for r in rows), rows
    assert {"as shipped", "small inputs in device memory", "mlx sdpa fp16"} <= {
        r["case"] for r in rows
    }
    decode = run(python_env, "tests/scripts/gpu_lab.py", "decode", "--arm", "q4", "--shape",
                 "tiny", "--tokenizer", tokenizer)  # fmt: skip
    row = json.loads(decode.stdout.splitlines()[-1])
    assert row["tokens"] == 128 and row["cache"] == "cold" and row["hot_decode_tps"] > 0
    assert row["hot_ttft_ms"] > 0
    build = run(python_env, "tests/scripts/gpu_lab.py", "build", "--shape", "tiny", "--context",
                "70", "--tokenizer", tokenizer)  # fmt: skip
    rows = [json.loads(line) for line in build.stdout.splitlines() if '"top"' in line]
    assert [r["arm"] for r in rows] == ["q4", "kv16", "mlx-lm"]
    for r in rows:
        assert {"build_ms", "profiled_build_ms"} <= set(r) and 10 <= len(r["top"]) <= 25
    # agentkv's own step is in the profile (the paged cache's write and attention)
    names = " ".join(t["function"] for t in rows[0]["top"])
    assert "step.py" in names and "llama.py" in names


def test_the_host_cost_script_counts_what_a_gpu_decode_step_launches(python_env):
    """tests/scripts/gpu_host_cost.py: a decode step's graph as a GPU builds it, counted on
    the CPU. The counts are what docs/gpu-attention.md states a layer costs: a change that
    adds kernels to the GPU step shows here."""
    arms = "agentkv-q4,agentkv-kv16,mlx-lm-fp16,agentkv-q4-separate"
    done = run(python_env, "tests/scripts/gpu_host_cost.py", "--shape", "tiny", "--context",
               "70", "--steps", "3", "--json", "--tokenizer", str(tokenizer_dir()),
               "--arms", arms)  # fmt: skip
    rows = {r["arm"]: r for r in json.loads(done.stdout)}
    layers = 2
    q4, kv16, mlx_lm = rows["agentkv-q4"], rows["agentkv-kv16"], rows["mlx-lm-fp16"]
    # the joint projections: q/k/v one matmul and gate/up one (4 a layer, mlx-lm's 7), and
    # the store kernel's prologue: 4-bit layers rope their queries and keys in it
    separate = rows["agentkv-q4-separate"]
    assert separate["kernels"] - q4["kernels"] == (3 + 2) * layers
    assert "rope" not in q4["stand_ins"] and kv16["stand_ins"]["rope"] == 2 * layers
    assert separate["nodes"]["QuantizedMatmul"] - q4["nodes"]["QuantizedMatmul"] == 3 * layers
    # 70 keys are two parts of 64: each layer's kernel and its merge pass
    for row in (q4, kv16):
        assert row["stand_ins"]["paged_attention"] == layers
        assert row["stand_ins"]["paged_attention_merge"] == layers
        assert "sdpa" not in row["stand_ins"]
    assert mlx_lm["stand_ins"]["sdpa"] == layers and "paged_attention" not in mlx_lm["stand_ins"]
    # the 4-bit write: keys and values rotated and values quantized by one kernel
    # (kernels/store_rows.metal), then the values' words, scales and biases scattered, and
    # the keys into their float16 tails; no transform or quantization of MLX's is left
    assert q4["stand_ins"]["store_rows"] == layers
    assert not {"Hadamard", "AgentKVHadamard", "Quantize"} & set(q4["nodes"])
    assert q4["nodes"]["Scatter"] == 4 * layers
    assert kv16["nodes"]["Scatter"] == 2 * layers
    assert "store_rows" not in kv16["stand_ins"]
    assert q4["kernels"] - mlx_lm["kernels"] == (4 - 3 - 2) * layers
    assert kv16["kernels"] - mlx_lm["kernels"] == (1 - 3) * layers
    # each arm's build timed, and the arrays each step makes from host data counted: the
    # token (every arm) and, for agentkv, one array holding all of the step's indices
    # (pool.arena.index_arrays: a managed-memory buffer each on MLX's CUDA backend)
    assert all(isinstance(r["build_ms"], float) for r in rows.values())
    assert mlx_lm["host_arrays"] == 1 and q4["host_arrays"] == kv16["host_arrays"] == 2
    # a hot turn's chunk of 20 tokens: the dense path (MLX's fused attention over the rows
    # gathered once), the same one index array and no other host data
    done = run(python_env, "tests/scripts/gpu_host_cost.py", "--shape", "tiny", "--context",
               "70", "--steps", "2", "--tokens", "20", "--json", "--arms", "agentkv-q4",
               "--tokenizer", str(tokenizer_dir()))  # fmt: skip
    (chunk,) = json.loads(done.stdout)
    assert chunk["tokens"] == 20 and chunk["host_arrays"] == 2
    assert chunk["stand_ins"]["sdpa"] == chunk["stand_ins"]["store_rows"] == layers
    # its rows gathered, dequantized and rotated back by one kernel a layer, so no transform
    # around MLX's attention (kernels/dense_rows.metal)
    assert chunk["stand_ins"]["dense_rows"] == layers
    assert not {"Hadamard", "AgentKVHadamard"} & set(chunk["nodes"])
    assert "paged_attention" not in chunk["stand_ins"]
