"""``agentkv bench gpu --json``: every row it promises, here on the CPU with a tiny shape
(the harness; its figures mean something on a GPU: docs/gpu-attention.md)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_gpu_runs_every_part(python_env):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "gpu", "--shapes", "tiny",
         "--contexts", "160", "--decode-tokens", "4", "--prefill-context", "200",
         "--hot-tokens", "20", "--batch", "2", "--batch-context", "96",
         "--kernel-context", "512", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["bench"] == "gpu" and result["copy_gbps"] > 0
    assert result["gpu_kernels"] == {"tiny": "agentkv's kernels"}  # what ran attention
    rows = result["rows"]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    decode = {(r["arm"], r["context"]): r for r in rows if "measure" not in r}
    for arm in ("mlx-lm-fp16", "agentkv-q4", "agentkv-kv16"):
        assert decode[arm, 160]["tokens"] == 4 and decode[arm, 160]["decode_tps"] > 0
        assert decode[arm, 200]["ttft_ms"] > 0  # the cold prefill measured
    # every cold arm prefills its whole prompt (no block shared with the arms before it)
    assert all(decode[arm, c]["cache"] == "cold" and decode[arm, c]["reused_tokens"] == 0
               for arm in ("agentkv-q4", "agentkv-kv16") for c in (160, 200))  # fmt: skip
    measures = {(r["arm"], r["measure"]) for r in rows if "measure" in r}
    for arm in ("agentkv-q4", "agentkv-kv16"):
        assert {(arm, m) for m in ("start_s", "hot_turn", "batch_tps", "step_anatomy")} <= measures
    assert ("mlx-lm-fp16", "hot_turn") in measures and ("mlx-lm-fp16", "batch_tps") in measures
    hot = [r for r in rows if r.get("measure") == "hot_turn" and r["arm"].startswith("agentkv")]
    assert all(r["cache"] == "hot" for r in hot)
    # pipelined and unpipelined decode side by side (the CPU does not pipeline: both rows so)
    again = [r for r in rows if r.get("measure") == "decode_unpipelined"]
    assert sorted(r["arm"] for r in again) == ["agentkv-kv16"] * 2 + ["agentkv-q4"] * 2
    assert all(r["cache"] == "hot" and r["tokens"] == 4 and r["context"] == 160 for r in again)
    kernel = [r for r in rows if r.get("measure") == "attention_kernel"]
    assert {r["arm"] for r in kernel} == {"agentkv-q4", "mlx-sdpa-fp16"}
    assert all(r["us"] > 0 and r["kv_bytes"] > 0 for r in kernel)
    anatomy = [r for r in rows if r.get("measure") == "step_anatomy"]
    assert all(r["step_ms"] >= r["eval_ms"] > 0 for r in anatomy)
