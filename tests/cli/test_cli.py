"""The agentkv command line, run as a real subprocess."""

import json
import subprocess
import sys

import pytest


def agentkv(*args, env, stdin=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        input=stdin,
        timeout=timeout,
    )


def test_help_lists_every_command(python_env):
    out = agentkv("--help", env=python_env)
    assert out.returncode == 0
    for command in ("demo", "chat", "cache", "doctor", "model", "bench"):
        assert command in out.stdout


def test_doctor_reports_the_fast_blas_and_the_extension(python_env):
    out = agentkv("doctor", "--json", env=python_env)
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout)
    assert info["blas"]["preloaded_before_mlx"] is True
    assert "OpenBLAS" in info["blas"]["in_use"] and info["blas"]["matmul_gflops"] > 0
    assert info["extension"]["mlx_version"] == info["mlx"]["version"]
    assert info["warnings"] == []


def test_doctor_warns_when_the_preload_is_off(python_env):
    env = dict(python_env, AGENTKV_NO_BLAS_PRELOAD="1")
    out = agentkv("doctor", env=env)
    assert out.returncode == 1
    assert "WARNING" in out.stdout and "AGENTKV_NO_BLAS_PRELOAD" in out.stdout


def test_importing_mlx_first_is_reported(python_env):
    code = (
        "import mlx.core, agentkv, agentkv.doctor, json; print(json.dumps(agentkv.doctor.report()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env
    )
    report = json.loads(out.stdout)
    assert report["blas"]["preloaded_before_mlx"] is False
    assert report["blas"]["in_use"] == "reference BLAS bundled with mlx"
    assert any("imported before agentkv" in w for w in report["warnings"])


@pytest.fixture
def stored_agents(fresh_engine, tmp_path):
    eng = fresh_engine()
    system = {"role": "system", "content": "You are a careful gardener. " * 60}  # > 256 tokens
    eng.chat("alpha", [system, {"role": "user", "content": "Name a fruit."}], max_tokens=6)
    eng.chat("beta", [system, {"role": "user", "content": "Name a tree."}], max_tokens=6)
    eng.close()
    return tmp_path / "kv"


def test_cache_ls_show_verify_rm(stored_agents, python_env):
    root = str(stored_agents)
    ls = agentkv("cache", "--cache-dir", root, "ls", "--json", env=python_env)
    listed = json.loads(ls.stdout)
    assert sorted(a["agent"] for a in listed) == ["alpha", "beta"]
    assert all(
        a["problem"] is None and a["kv_format"] == "q4.v2+k8@18,19" and a["tokens"] > 10
        for a in listed
    )
    assert all(a["shared_blocks"] >= 1 for a in listed)  # the system prompt's blocks
    table = agentkv("cache", "--cache-dir", root, "ls", env=python_env).stdout
    assert "SHARED" in table and "shared block files" in table
    show = agentkv("cache", "--cache-dir", root, "show", "alpha", env=python_env)
    assert show.returncode == 0 and "generation" in show.stdout and "fruit" in show.stdout
    assert agentkv("cache", "--cache-dir", root, "verify", env=python_env).returncode == 0
    blocks = sorted(stored_agents.glob("*/blocks/*/*.safetensors"))
    assert blocks  # stored once for both

    segment = next((stored_agents).glob("*/agents/beta/seg-*.safetensors"))
    data = bytearray(segment.read_bytes())
    data[-20] ^= 0x55
    segment.write_bytes(bytes(data))
    verify = agentkv("cache", "--cache-dir", root, "verify", env=python_env)
    assert verify.returncode == 1
    assert (
        "BAD" in verify.stdout and "beta" in verify.stdout and "checksum mismatch" in verify.stdout
    )

    rm = agentkv("cache", "--cache-dir", root, "rm", "beta", env=python_env)
    assert rm.returncode == 0 and "removed beta" in rm.stdout
    assert sorted(stored_agents.glob("*/blocks/*/*.safetensors")) == blocks  # alpha names them
    block = blocks[0]
    data = bytearray(block.read_bytes())
    data[-2000] ^= 0x55
    block.write_bytes(bytes(data))
    verify = agentkv("cache", "--cache-dir", root, "verify", env=python_env)
    assert verify.returncode == 1 and "alpha" in verify.stdout and str(block) in verify.stdout
    assert agentkv("cache", "--cache-dir", root, "rm", "alpha", env=python_env).returncode == 0
    assert not list(stored_agents.glob("*/blocks/*/*.safetensors"))  # named by none: collected
    assert agentkv("cache", "--cache-dir", root, "show", "beta", env=python_env).returncode == 1
    bad = agentkv("cache", "--cache-dir", root, "rm", "../alpha", env=python_env)
    assert bad.returncode == 2 and "invalid agent id" in bad.stderr


def test_chat_streams_and_resumes(tmp_path, python_env):
    common = [
        "chat",
        "--agent",
        "cli-chat",
        "--cache-dir",
        str(tmp_path / "kv"),
        "--max-tokens",
        "24",
    ]
    first = agentkv(*common, env=python_env, stdin="What is the capital of France?\n")
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout and "cold" in first.stderr
    second = agentkv(*common, env=python_env, stdin="And of Italy?\n")
    assert second.returncode == 0, second.stderr
    assert "resuming cli-chat: 2 messages" in second.stderr and "warm/extend" in second.stderr


def test_model_import_gguf(tmp_path, python_env):
    from agentkv.model.load import embedded_gguf_path

    dest = tmp_path / "smol"
    out = agentkv(
        "model", "import-gguf", str(embedded_gguf_path()), "--dest", str(dest), env=python_env
    )
    assert out.returncode == 0 and "imported:" in out.stdout and (dest / "config.json").exists()
    again = agentkv(
        "model", "import-gguf", str(embedded_gguf_path()), "--dest", str(dest), env=python_env
    )
    assert "already imported" in again.stdout
    missing = agentkv("model", "import-gguf", str(tmp_path / "nope.gguf"), env=python_env)
    assert missing.returncode == 2 and "not found" in missing.stderr


@pytest.mark.slow
def test_demo_json_shows_warm_far_below_cold(python_env):
    out = agentkv(
        "demo", "--agents", "2", "--turns", "2", "--max-tokens", "12", "--json", env=python_env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # Nothing but agentkv's own lines: no third-party notices (transformers, hub, pip...).
    foreign = [line for line in out.stderr.splitlines() if not line.startswith(("demo:", "  "))]
    assert foreign == []
    assert result["restart"] == "process" and result["kv_bits"] == "q4.v2+k8@18,19"
    assert [a["agent"] for a in result["agents"]] == ["planner", "coder"]
    for row in result["agents"]:
        assert set(row) >= {
            "agent",
            "context_tokens",
            "cold_ttft_ms",
            "warm_ttft_ms",
            "hot_ttft_ms",
        }
        assert row["resumed_as"] == "warm" and row["context_tokens"] > 200
        assert row["warm_ttft_ms"] * 3 < row["cold_ttft_ms"]


@pytest.mark.slow
def test_bench_commands_emit_their_json(python_env):
    save = json.loads(
        agentkv(
            "bench", "save", "--tokens", "1000", "--turn", "64", "--json", env=python_env
        ).stdout
    )
    turn = save["rows"][1]
    assert turn["blocks_written"] == 2  # 1000 -> 1064 crosses the block boundary at 1024
    assert turn["bytes_written"] < 3 * save["block_bytes"]
    reload_ = json.loads(
        agentkv(
            "bench", "reload", "--tokens", "300", "--repeats", "2", "--json", env=python_env
        ).stdout
    )
    assert [r["format"] for r in reload_["rows"]] == ["q4", "q4.v2", "q4.v2+k8@18,19"]
    row = reload_["rows"][0]
    assert set(row) >= {
        "tokens",
        "kv_bits",
        "cache_bytes",
        "agentkv_load_ms",
        "mlx_lm_load_ms",
        "page_cache_read_ms",
    }
    ttft = json.loads(agentkv("bench", "ttft", "--tokens", "64", "--json", env=python_env).stdout)
    assert set(ttft["rows"][0]) >= {"tokens", "cold_ms", "warm_ms", "hot_ms"}
    bad = agentkv("bench", "reload", "--tokens", "abc", env=python_env)
    assert bad.returncode != 0 and "comma-separated" in bad.stderr


@pytest.mark.slow
def test_bench_kernels_and_serve_emit_their_json(python_env):
    kernels = json.loads(
        agentkv(
            "bench", "kernels", "--batches", "2", "--repeats", "1", "--json", env=python_env
        ).stdout
    )
    ops = {row["op"] for row in kernels["rows"]}
    assert ops == {"merge", "extract"}
    assert set(kernels["rows"][0]) >= {
        "op",
        "batch",
        "tokens_total",
        "bytes",
        "agentkv_ms",
        "reference_ms",
        "mlx_lm_fp16_ms",
        "memcpy_gbps",
    }
    serve = json.loads(
        agentkv(
            "bench", "serve", "--paragraphs", "2", "--clients", "2", "--turns", "2",
            "--max-tokens", "2", "--json", env=python_env,
        ).stdout
    )  # fmt: skip
    policies = [row["policy"] for row in serve["staggered"]["rows"]]
    assert policies == ["interleave", "fcfs"] and serve["staggered"]["b_ttft_speedup"] > 0
    load = serve["load"]
    assert load["requests"] == 4 and load["errors"] == 0
    assert load["post_restart_first_turn"] == {"warm": 2}
    attention = json.loads(
        agentkv(
            "bench", "quality", "--attention-only", "--formats", "q4,q4.v2", "--json",
            env=python_env,
        ).stdout
    )  # fmt: skip
    rows = {row["kv"]: row for row in attention["rows"]}
    assert sorted(rows) == ["fp16", "q4", "q4.v2"] and rows["q4"]["decode_attention_vs_q4"] == 1
    assert rows["q4.v2"]["format"] == "q4.v2+k8@18,19" and rows["q4.v2"]["bytes_per_token"] == 6672
    assert rows["q4.v2"]["decode_attention_ms"] > 0
    bad = agentkv("bench", "quality", "--formats", "q5", env=python_env)
    assert bad.returncode != 0 and "--formats" in bad.stderr
    bad = agentkv("bench", "quality", "--contexts", "2047", env=python_env)
    assert bad.returncode != 0 and "--contexts" in bad.stderr
    bad = agentkv("bench", "kv-candidates", "--context", "1k", env=python_env)
    assert bad.returncode != 0 and "--context" in bad.stderr
    bad = agentkv("bench", "kv-candidates", "--context", "512", "--scored", "512", env=python_env)
    assert bad.returncode != 0 and "--scored" in bad.stderr


@pytest.mark.slow
def test_bench_pool_emits_its_json(python_env):
    out = agentkv(
        "bench", "pool", "--sections", "ops,shared,overload", "--agents", "3",
        "--system-tokens", "300", "--overload-agents", "4", "--overload-tokens", "200",
        "--overload-fit", "2", "--json", env=python_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["ops"]) >= {"allocate_release_us", "seal_us", "lookup_us"}
    shared = result["shared"]
    later = shared["agents"][1:]
    assert all(r["shared_tokens"] >= 256 and r["excess_prefill"] <= 64 for r in later)
    assert shared["resident_ratio"] < 1 and shared["disk_ratio"] < 1
    assert shared["after_restart_shared"] >= 256
    overload = result["overload"]
    assert (overload["completed"], overload["errors"]) == (4, 0)
    assert overload["ttft_p99_ms"] >= overload["ttft_p50_ms"] > 0


@pytest.mark.slow
def test_bench_constrained_emits_its_json(python_env):
    out = agentkv(
        "bench", "constrained", "--agents", "2", "--max-tokens", "6", "--repeats", "1",
        "--json", env=python_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    kinds = [row["constraint"] for row in rows]
    assert kinds == ["none", "json_object", "json_schema", "tool_calls", "tool_calls_auto", "mixed"]
    assert all(row["agents"] == 2 and row["tokens"] == 12 for row in rows)
    bound = rows[1:5]
    assert all(row["grammar_us"] > 0 and 0 < row["step_ratio"] < 1 for row in bound)
    engines = json.loads(
        agentkv("bench", "constrained", "--engines", "--json", env=python_env).stdout
    )
    assert engines["rows"][0]["engine"].startswith("llguidance")
    assert engines["rows"][0]["schema_mask_us"] > 0


@pytest.mark.slow
def test_bench_serve_tools_emits_its_json(python_env):
    out = agentkv(
        "bench", "serve", "--tools", "--tool-rounds", "1", "--paragraphs", "6", "--json",
        env=python_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tools = json.loads(out.stdout)["tools"]
    assert tools["all_hot_extend"] is True and tools["speedup"] > 1
    (row,) = tools["rounds"]
    assert row["json_schema_valid"] is True and row["free_decode_tps"] > 0
    assert tools["constrained_vs_free_decode"] > 0
