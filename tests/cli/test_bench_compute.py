"""``agentkv bench compute --json``: both weights run in the engine on the same workload."""

import json
import subprocess
import sys


def test_bench_compute_runs_both_weights_on_the_same_workload(python_env):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "compute", "--rounds", "1",
         "--contexts", "48,300", "--short", "24", "--hot", "3,9", "--decode-tokens", "4",
         "--batch-agents", "2", "--batch-context", "24", "--peer", "none", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["bench"] == "compute" and result["decode_tokens"] == 4
    assert result["peer"] is None and "peer_missing" not in result  # --peer none: not asked
    f32, q = result["rows"]
    assert (f32["arm"], q["arm"]) == ("agentkv-float32", "agentkv-quantized")
    assert q["weight_mb"] < 0.25 * f32["weight_mb"]  # 4-bit codes + scales vs float32
    for row in (f32, q):
        # the prompts are the same token counts the workload asked for (the engine's tokenizer)
        assert abs(row["short_context"] - 24) <= 2 and abs(row["long_context"] - 300) <= 2
        # the hot turns prefilled only their new text (and the token that joins it): the
        # history stayed cached (over 256 tokens: a partial match is reused)
        assert 3 <= row["hot_prefilled_3"] <= 6 and 9 <= row["hot_prefilled_9"] <= 12
        assert row["prefill_tps_48"] > 0 and row["decode_tps_short"] > 0
        assert row["batch_agents"] == 2 and row["batch_tps"] > 0
        assert row["kv_format"].startswith("q4.v2+k8@")
    assert set(result["summary"]) == {"agentkv-float32", "agentkv-quantized"}
    kernels = result["kernels"]
    assert kernels["quantized_matmul"]["weight_gbps"] > 0 and kernels["memcpy_gbps"] > 0


def test_bench_peers_runs_the_workflow_over_a_restart_and_reports_a_peer_it_cannot_run(
    python_env,
):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "peers", "--servers",
         "agentkv,llama.cpp,llama.cpp-disk,llama.cpp-lookup", "--peer", "none",
         "--agents", "2", "--rounds", "2", "--system-tokens", "120", "--max-tokens", "8",
         "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert (result["agents"], result["rounds"], result["restart_after_round"]) == (2, 2, 1)
    ours, *peers = result["rows"]
    assert peers == [
        {"server": name, "ran": False, "reason": "not asked for (--peer none)"}
        for name in ("llama.cpp", "llama.cpp-disk", "llama.cpp-lookup")
    ]
    assert ours["server"] == "agentkv" and ours["ran"] and len(ours["startup_s"]) == 2
    turns = ours["turns"]
    assert [(t["round"], t["agent"], t["kind"]) for t in turns] == [
        (1, "planner", "first"), (1, "coder", "first"),
        (2, "planner", "after_restart"), (2, "coder", "after_restart"),
    ]  # fmt: skip
    # the second agent reused the shared system prompt (the first agent's blocks, in memory:
    # hot); after the restart both resumed from disk (agentkv's own headers, read through the
    # SDK's raw response)
    assert [t["cache"]["cache"] for t in turns] == ["cold", "hot", "warm", "warm"]
    assert int(turns[1]["cache"]["reused-tokens"]) > 100
    assert ours["usage_reported"] and ours["generated_tokens"] == sum(
        t["completion_tokens"] for t in turns
    )
    asked = [t for t in turns if t["tool_asked"]]
    assert len(asked) == 2 and ours["tool_calls_made"] == 2  # every named call made
    assert ours["ttft_ms"]["first"]["n"] + ours["tool_call_ms"]["first"]["n"] == 2
    # every turn answered something (a reply with nothing in it has no TTFT: counted apart)
    assert ours["empty_replies"] == 0 and all(t["ttft_ms"] > 0 for t in turns)
    assert ours["peak_rss_bytes"] > 100 << 20
    assert result["summary"] == {}  # no peer ran: nothing to compare


def test_a_peer_venv_without_llama_cpp_counts_as_none(tmp_path, monkeypatch):
    """An install cut short leaves a venv whose python cannot import llama_cpp: the benches
    say llama.cpp is not installed (and ``--peer install`` builds it again), never run it."""
    from agentkv.benchmarks.compute import peer_dir, peer_python

    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    assert peer_python() is None  # no venv
    bin_dir = peer_dir() / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)  # a python without llama_cpp
    assert peer_python() is None


def test_bench_perplexity_without_llama_cpp_says_how_to_get_it(python_env):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "perplexity", "--peer", "none"],
        env=python_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "bench perplexity needs llama.cpp: --peer install builds" in run.stderr


def test_bench_perplexity_scores_the_same_predictions_as_llama_cpp(
    python_env, llama_cpp_python, tmp_path
):
    """The embedded model's GGUF in agentkv and in llama.cpp (the user's llama-cpp-python
    venv, linked into this test's agentkv home): both texts, the same predictions scored,
    perplexities of the same model (its arithmetic apart, within a few percent)."""
    import os
    from pathlib import Path

    peers = Path(python_env["AGENTKV_HOME"]) / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    if not (peers / "llama-cpp").exists():
        os.symlink(llama_cpp_python.parents[1], peers / "llama-cpp")
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "perplexity", "--tokens", "300",
         "--window", "150", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["bench"] == "perplexity" and result["window"] == 150
    assert [r["text"] for r in result["rows"]] == ["prose (pydoc topics)", "code (stdlib source)"]
    for row in result["rows"]:
        assert row["tokens"] == 300 and row["scored"] == 298  # two windows, each from its start
        # the file's own weights as the engine runs them: its exact model's perplexity
        # (measured over 2,048 tokens: within 0.001%); llama.cpp's arithmetic, a few percent
        assert abs(row["exact_delta_pct"]) < 0.1 and abs(row["delta_pct"]) < 5
        assert 1.5 < row["agentkv_perplexity"] < 100
