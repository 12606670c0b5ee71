"""``agentkv bench compute --json``: both weights run in the engine on the same prompt."""

import json
import subprocess
import sys


def test_bench_compute_runs_both_weights_on_the_same_prompt(python_env):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "compute", "--runs", "1",
         "--max-tokens", "4", "--prompt-words", "40", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["bench"] == "compute" and result["max_tokens"] == 4
    f32, q = result["rows"]
    assert (f32["weights"], q["weights"]) == ("float32", "quantized")
    assert f32["prompt_tokens"] == q["prompt_tokens"] > 40
    assert q["weight_mb"] < 0.25 * f32["weight_mb"]  # 4-bit codes + scales vs float32
    for row in (f32, q):
        assert row["hot_cache"].startswith("hot/") and 0 < row["cold_generated"] <= 4
        assert row["kv_format"].startswith("q4.v2+k8@")
