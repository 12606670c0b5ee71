"""The agentkv command line, run as a real subprocess."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from agentkv.cli import chat
from agentkv.cli.main import build_parser
from agentkv.cli.output import human_bytes
from agentkv.engine.results import ChatResult, TurnStats
from agentkv.format.geometry import BLOCK_TOKENS

# The embedded model's default KV format: 8-bit keys in the two layers its shipped calibration
# names (as tests/engine/test_engine_format_v2.py says).
DEFAULT_FORMAT = "q4.v2+k8@19,20"  # the default (4-bit) weights


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


def _commands(parser, path=()):
    """(command words, parser) for every parser under ``parser``, itself first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_command_has_help_and_every_option_says_what_it_does(capsys):
    commands = dict(_commands(build_parser()))
    benches = (
        "reload fleet ttft save compute perplexity peers kernels gpu batch pool serve constrained "
        "kv-candidates quality kvswap"
    )
    expected = {(), *[(c,) for c in ("demo", "chat", "serve", "cache", "doctor", "bench")]}
    expected |= {
        ("cache", a) for a in ("ls", "push", "pull", "gc", "show", "rm", "verify", "migrate")
    }
    expected |= {
        (m, a) for m in ("models", "model") for a in ("", "pull", "ls", "import", "import-gguf")
    }
    expected |= {("bench", b) for b in benches.split()}
    assert set(commands) == {tuple(w for w in words if w) for words in expected}
    for words, parser in commands.items():
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*words, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: {parser.prog} [-h]")
        silent = [
            a.option_strings
            for a in parser._actions
            if a.option_strings and a.help is None  # hidden ones are argparse.SUPPRESS
        ]
        assert silent == [], words


def test_doctor_reports_the_fast_blas_and_the_extension(python_env):
    out = agentkv("doctor", "--json", env=python_env)
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout)
    assert info["blas"]["preloaded_before_mlx"] is True
    assert "OpenBLAS" in info["blas"]["in_use"]
    assert isinstance(info["blas"]["matmul_gflops"], float)  # measured; how fast is no test's
    assert info["extension"]["mlx_version"] == info["mlx"]["version"]
    kernels = info["kernels"]
    assert kernels["quantized_matmul"]["implementation"] == info["extension"]["qmm"]
    assert kernels["attention"]["path"] == "fused_cpu"  # this CPU runs the fused kernels
    assert kernels["attention"]["implementation"] in (
        "avx512-vnni",
        "avx512",
        "avx2-fma-f16c",
        "neon",
        "portable",
    )
    assert kernels["quantized_matmul"]["weight_gbps"] > 0 and kernels["attention"]["kv_gbps"] > 0
    assert kernels["attention"]["error"] < 1e-3  # of the outputs' spread, against the reference
    assert info["warnings"] == []
    assert info["mlx"]["tf32"] is False  # agentkv's default: float32 batches keep a row's bits


def test_float32_matmuls_stay_float32_unless_the_environment_says_otherwise(python_env):
    """And the benchmarks' peers get the environment as it was (``environ_as_found``)."""
    code = (
        "import os, agentkv._numerics as n; "
        "print(os.environ[n.TF32_ENV], n.tf32_allowed(), n.environ_as_found().get(n.TF32_ENV))"
    )
    env = {k: v for k, v in python_env.items() if k != "MLX_ENABLE_TF32"}
    for value, expected in ((None, "0 False None"), ("1", "1 True 1"), ("0", "0 False 0")):
        run_env = env if value is None else dict(env, MLX_ENABLE_TF32=value)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=60
        )
        assert out.stdout.split("\n")[0] == expected, out.stderr


def test_doctor_warns_when_the_preload_is_off(python_env):
    env = dict(python_env, AGENTKV_NO_BLAS_PRELOAD="1")
    out = agentkv("doctor", env=env)
    assert out.returncode == 1
    assert "WARNING" in out.stdout and "AGENTKV_NO_BLAS_PRELOAD" in out.stdout


def test_doctor_takes_a_home_whose_parents_are_still_to_be_made(tmp_path):
    """On a new machine ``~/.cache`` may not exist yet: agentkv makes it with its home, so
    doctor looks at the nearest directory that exists; a home that cannot be made (a file
    in its way, which stops root too) is not writable."""
    from agentkv.doctor import can_make

    assert can_make(tmp_path / ".cache" / "agentkv")
    assert can_make(tmp_path)
    (tmp_path / "file").write_bytes(b"")
    assert not can_make(tmp_path / "file" / "agentkv")
    assert not can_make(tmp_path / "file")


def test_importing_mlx_first_is_reported(python_env):
    code = (
        "import mlx.core, agentkv, agentkv.doctor, json; print(json.dumps(agentkv.doctor.report()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env, timeout=600
    )
    report = json.loads(out.stdout)
    assert report["blas"]["preloaded_before_mlx"] is False
    assert report["blas"]["in_use"] == "reference BLAS bundled with mlx"
    assert any("imported before agentkv" in w for w in report["warnings"])


@pytest.fixture
def stored_agents(fresh_engine, tmp_path):
    """Two agents with one system prompt (> a block): {agent: tokens stored}."""
    eng = fresh_engine()
    system = {"role": "system", "content": "You are a careful gardener. " * 60}  # > 256 tokens
    eng.chat("alpha", [system, {"role": "user", "content": "Name a fruit."}], max_tokens=6)
    eng.chat("beta", [system, {"role": "user", "content": "Name a tree."}], max_tokens=6)
    tokens = {a: eng.agent_info(a).tokens for a in ("alpha", "beta")}
    eng.close()
    return tmp_path / "kv", tokens


def _dir_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def test_cache_ls_show_verify_rm(stored_agents, python_env):
    root, tokens = stored_agents
    (model_dir,) = root.iterdir()
    ls = agentkv("cache", "--cache-dir", str(root), "ls", "--json", env=python_env)
    listed = {a["agent"]: a for a in json.loads(ls.stdout)}
    assert sorted(listed) == ["alpha", "beta"]
    for name, a in listed.items():
        assert (a["tokens"], a["problem"], a["kv_format"]) == (tokens[name], None, DEFAULT_FORMAT)
        assert a["blocks"] == -(-tokens[name] // BLOCK_TOKENS)
        assert a["shared_blocks"] == tokens[name] // BLOCK_TOKENS == 1  # the system prompt's
        assert a["disk_bytes"] == _dir_bytes(model_dir / "agents" / name)
        assert a["fingerprint"] == model_dir.name
    blocks = sorted(model_dir.glob("blocks/*/*.safetensors"))
    assert len(blocks) == 1  # the system prompt's block, stored once for both
    table = agentkv("cache", "--cache-dir", str(root), "ls", env=python_env).stdout
    assert (
        f"{model_dir.name}: 1 shared block file, {human_bytes(blocks[0].stat().st_size)}" in table
    )
    assert [line.split()[5] for line in table.splitlines()[2:4]] == ["1/2", "1/2"]  # SHARED
    show = agentkv("cache", "--cache-dir", str(root), "show", "alpha", env=python_env)
    assert show.returncode == 0 and "fruit" in show.stdout
    assert "generation: 1" in show.stdout and "messages: 3" in show.stdout
    assert agentkv("cache", "--cache-dir", str(root), "verify", env=python_env).returncode == 0

    segment = next(model_dir.glob("agents/beta/seg-*.safetensors"))
    data = bytearray(segment.read_bytes())
    data[-20] ^= 0x55
    segment.write_bytes(bytes(data))
    verify = agentkv("cache", "--cache-dir", str(root), "verify", env=python_env)
    assert verify.returncode == 1
    ok, bad, summary = verify.stdout.splitlines()
    assert ok == f"ok   {model_dir.name}/alpha" and summary == "2 agents checked, 1 bad"
    assert bad.startswith(f"BAD  {model_dir.name}/beta: ") and "checksum mismatch" in bad

    beta_bytes = _dir_bytes(model_dir / "agents" / "beta")
    rm = agentkv("cache", "--cache-dir", str(root), "rm", "beta", env=python_env)
    assert rm.returncode == 0
    assert rm.stdout == (
        f"removed beta (smollm2-135m-instruct) from {model_dir / 'agents' / 'beta'}: "
        f"3 agent files ({human_bytes(beta_bytes)}) and 0 shared block files (0 B), "
        f"{human_bytes(beta_bytes)} in all; 1 shared block file kept, named by other agents\n"
    )  # manifest, segment, lock
    assert sorted(model_dir.glob("blocks/*/*.safetensors")) == blocks  # alpha names it
    block = blocks[0]
    data = bytearray(block.read_bytes())
    data[-2000] ^= 0x55
    block.write_bytes(bytes(data))
    verify = agentkv("cache", "--cache-dir", str(root), "verify", env=python_env)
    assert verify.returncode == 1 and "alpha" in verify.stdout and str(block) in verify.stdout
    alpha_bytes, block_bytes = _dir_bytes(model_dir / "agents" / "alpha"), block.stat().st_size
    rm = agentkv("cache", "--cache-dir", str(root), "rm", "alpha", env=python_env)
    assert rm.returncode == 0
    assert rm.stdout.endswith(
        f": 3 agent files ({human_bytes(alpha_bytes)}) and 1 shared block file "
        f"({human_bytes(block_bytes)}), {human_bytes(alpha_bytes + block_bytes)} in all\n"
    )
    assert not list(model_dir.glob("blocks/*/*"))  # named by none: collected
    assert (
        agentkv("cache", "--cache-dir", str(root), "show", "beta", env=python_env).returncode == 1
    )
    bad = agentkv("cache", "--cache-dir", str(root), "rm", "../alpha", env=python_env)
    assert bad.returncode == 2 and "invalid agent id" in bad.stderr


def test_chat_streams_and_resumes(tmp_path, python_env):
    kv = str(tmp_path / "kv")
    common = ["chat", "--agent", "cli-chat", "--cache-dir", kv, "--max-tokens", "24"]

    def stored():
        show = agentkv("cache", "--cache-dir", kv, "show", "cli-chat", "--json", env=python_env)
        (details,) = json.loads(show.stdout)
        return details["messages"], details["text_tail"]

    first = agentkv(*common, env=python_env, stdin="Name the capital of France.\n")
    assert first.returncode == 0, first.stderr
    # Input piped in: stdout is the answer alone (no prompt, no agent label), as stored.
    answer = first.stdout.removesuffix("\n")
    assert "Paris" in answer and "you>" not in answer and "cli-chat>" not in answer
    messages, tail = stored()
    assert messages == 2 and answer in tail
    assert "type a message" not in first.stderr and "[cold/" in first.stderr
    # A blank line is skipped; /exit ends the conversation before the line after it.
    second = agentkv(*common, env=python_env, stdin="And of Italy?\n\n/exit\nNever sent.\n")
    assert second.returncode == 0, second.stderr
    assert "resuming cli-chat: 2 messages" in second.stderr and "[warm/extend" in second.stderr
    messages, tail = stored()
    assert messages == 4 and second.stdout.removesuffix("\n") in tail
    assert second.stderr.count("first token") == 1


class _FakeStream:
    def __init__(self, text: str):
        self.text, self.result = text, None

    def __iter__(self):
        yield from (self.text[:3], self.text[3:])  # streamed in pieces
        stats = TurnStats(
            cache="hot",
            match="extend",
            stored_tokens=7,
            reused_tokens=7,
            prefill_tokens=3,
            prompt_tokens=10,
            generated_tokens=2,
            ttft_ms=12.0,
            decode_tps=50.0,
            load_ms=0.0,
            prefill_ms=12.0,
            total_ms=60.0,
            kv_format="q4",
        )
        self.result = ChatResult(self.text, [1, 2], "stop", stats)


class _FakeEngine:
    def stream_chat(self, agent, messages, *, max_tokens, temperature):
        return _FakeStream("Hello there")


@pytest.mark.parametrize("interactive", [True, False])
def test_chat_prompts_only_when_its_input_is_a_terminal(interactive, monkeypatch, capsys):
    lines, prompts = iter(["Hi", "  ", "/exit", "never read"]), []
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or next(lines))
    args = argparse.Namespace(max_tokens=8, temperature=0.0)
    messages = []
    chat._converse(_FakeEngine(), "bot", messages, args, interactive=interactive)
    out, err = capsys.readouterr()
    assert messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
    ]
    assert err.count("[hot/extend: reused 7 of 7 cached tokens, prefilled 3;") == 1
    if interactive:
        assert (prompts, out) == (["you> "] * 3, "bot> Hello there\n")
        assert err.startswith("type a message; /exit or Ctrl-D to leave\n")
    else:
        assert (prompts, out) == ([""] * 3, "Hello there\n")
        assert "type a message" not in err


def test_model_import_gguf(tmp_path, python_env):
    from agentkv.model.load import embedded_gguf_path

    dest = tmp_path / "smol"
    out = agentkv("model", "import", str(embedded_gguf_path()), "--dest", str(dest), env=python_env)
    assert out.returncode == 0 and "imported:" in out.stdout and (dest / "config.json").exists()
    # what each GGML type became: the embedded file's Q4_1 and Q8_0 kept as shipped
    lines = out.stdout.splitlines()
    assert any(line.split()[:3] == ["Q4_1", "4-bit", "lossless"] for line in lines)
    assert any(line.split()[:3] == ["Q8_0", "8-bit", "lossless"] for line in lines)
    total = next(line for line in lines if line.startswith("total"))
    ratio = float(total.split("(")[1].split("x")[0])
    assert 1.0 <= ratio <= 1.15  # resident bytes against the file's tensor bytes
    again = agentkv(
        "model", "import-gguf", str(embedded_gguf_path()), "--dest", str(dest), env=python_env
    )
    assert "already imported" in again.stdout
    missing = agentkv("model", "import-gguf", str(tmp_path / "nope.gguf"), env=python_env)
    assert missing.returncode == 2 and "not found" in missing.stderr


TURN_LINE = re.compile(r"(cold|warm|hot) +reused +(\d+), prefilled +(\d+)")


@pytest.mark.slow
def test_demo_json_shows_what_each_turn_prefilled(python_env):
    out = agentkv(
        "demo", "--agents", "2", "--turns", "2", "--max-tokens", "12", "--json", env=python_env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # Nothing but agentkv's own lines: no third-party notices (transformers, hub, pip...).
    foreign = [line for line in out.stderr.splitlines() if not line.startswith(("demo:", "  "))]
    assert foreign == []
    assert result["restart"] == "process" and result["kv_bits"] == DEFAULT_FORMAT
    assert [a["agent"] for a in result["agents"]] == ["planner", "coder"]
    turns = [
        (line.split()[1], *TURN_LINE.search(line).groups())
        for line in out.stderr.splitlines()
        if line.startswith("  phase ")
    ]
    assert [(phase, tier) for phase, tier, _, _ in turns] == [("1/2", "cold")] * 2 + [
        ("2/2", "hot")
    ] * 2
    assert all(int(reused) == 0 for _, tier, reused, _ in turns if tier == "cold")
    resumed = [
        TURN_LINE.search(line).groups()
        for line in out.stderr.splitlines()
        if line.startswith("    ")  # under "  resumed AGENT: context N tokens"
    ]
    assert len(resumed) == 6
    for i, row in enumerate(result["agents"]):
        assert row["resumed_as"] == "warm" and row["context_tokens"] > 200
        # The progress lines of the restarted process say what the table does.
        tiers = {tier: int(prefilled) for tier, _, prefilled in resumed[3 * i : 3 * i + 3]}
        assert tiers == {t: row[f"{t}_prefill_tokens"] for t in ("warm", "hot", "cold")}
        # Warm reuses the whole stored context and prefills the new question alone; cold
        # prefills the context and the question.
        assert row["cold_prefill_tokens"] == row["context_tokens"] + row["warm_prefill_tokens"]
        # The table's hot turn prefills one short question, where a hot phase turn
        # prefilled the other agents' replies.
        hot_phase_prefill = [int(p) for _, tier, _, p in turns if tier == "hot"]
        assert row["hot_prefill_tokens"] < min(hot_phase_prefill)


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
    assert [r["format"] for r in reload_["rows"]] == ["q4", "q4.v2", DEFAULT_FORMAT]
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
    row = ttft["rows"][0]
    assert set(row) >= {"tokens", "cold_ms", "warm_ms", "hot_ms"}
    # the restart row: a new process resumed both copies from disk (it raises otherwise)
    assert row["restart_first_ms"] > 0 and row["restart_warm_ms"] > 0
    assert row["restart_startup_s"] < row["restart_process_s"]
    bad = agentkv("bench", "reload", "--tokens", "abc", env=python_env)
    assert bad.returncode != 0 and "comma-separated" in bad.stderr


@pytest.mark.slow
def test_bench_kernels_and_serve_emit_their_json(python_env):
    kernels = json.loads(
        agentkv(
            "bench", "kernels", "--batches", "2", "--repeats", "1", "--json", env=python_env
        ).stdout
    )
    copies = [row for row in kernels["rows"] if row["op"] != "attention"]
    attention = [row for row in kernels["rows"] if row["op"] == "attention"]
    # --batches 2 (512 and 4096 tokens), then the fixed case of 4 agents x 4096 tokens.
    assert [(r["op"], r["batch"], r["tokens_total"]) for r in copies] == [
        ("merge", 2, 4608), ("extract", 2, 4608), ("merge", 4, 16384), ("extract", 4, 16384),
    ]  # fmt: skip
    per_token = copies[1]["bytes"] // (2 * 4608)  # an extract reads and writes each token once
    assert copies[3]["bytes"] == 2 * 16384 * per_token
    for row in copies:
        assert set(row) >= {"bytes", "agentkv_ms", "reference_ms", "mlx_lm_fp16_ms", "memcpy_gbps"}
        assert row["vs_reference"] == round(row["reference_ms"] / row["agentkv_ms"], 2)
        assert row["vs_mlx_lm_fp16"] == round(row["mlx_lm_fp16_ms"] / row["agentkv_ms"], 2)
    shapes = [(1, 1024), (1, 4096), (4, 4096)]
    assert [(r["agents"], r["context"]) for r in attention] == shapes * 2  # formats 1 and 2
    labels = [r["kv_format"] for r in attention]
    assert len(set(labels[:3])) == len(set(labels[3:])) == 1 and labels[0] != labels[3]
    serve = json.loads(
        agentkv(
            "bench", "serve", "--paragraphs", "2", "--clients", "2", "--turns", "2",
            "--max-tokens", "2", "--json", env=python_env,
        ).stdout
    )  # fmt: skip
    staggered = serve["staggered"]
    inter, fcfs = staggered["rows"]
    assert (inter["policy"], fcfs["policy"]) == ("interleave", "fcfs")
    assert inter["a_prompt_tokens"] == fcfs["a_prompt_tokens"]  # both arms did the same work
    assert staggered["b_ttft_speedup"] == round(fcfs["b_ttft_ms"] / inter["b_ttft_ms"], 2)
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
    assert rows["q4.v2"]["format"] == DEFAULT_FORMAT and rows["q4.v2"]["bytes_per_token"] == 6672
    q4, v2 = rows["q4"]["decode_attention_ms"], rows["q4.v2"]["decode_attention_ms"]
    assert rows["q4.v2"]["decode_attention_vs_q4"] == pytest.approx(v2 / q4, rel=0.01, abs=0.002)
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
    assert overload["ttft_p99_ms"] >= overload["ttft_p50_ms"]  # percentiles, in order


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
    # Only the constrained kinds replay a grammar; step_ratio is what that time predicts:
    # the free step over the free step plus the grammar's time for each of the 2 agents.
    assert [row["grammar_us"] is None for row in rows] == [True, False, False, False, False, True]
    free_step_us = 1e6 / rows[0]["decode_tps"]
    for row in rows[1:5]:
        predicted = free_step_us / (free_step_us + 2 * row["grammar_us"])
        assert row["step_ratio"] == pytest.approx(predicted, rel=0.01)
    engines = json.loads(
        agentkv("bench", "constrained", "--engines", "--json", env=python_env).stdout
    )
    assert engines["rows"][0]["engine"].startswith("llguidance")
    assert set(engines["rows"][0]) == {  # each walked its sample through (or raised)
        "engine",
        "tokenizer_ms",
        "schema_compile_ms",
        "schema_mask_us",
        "json_object_compile_ms",
        "json_object_mask_us",
    }


@pytest.mark.slow
def test_bench_serve_tools_emits_its_json(python_env):
    out = agentkv(
        "bench", "serve", "--tools", "--tool-rounds", "1", "--paragraphs", "6", "--json",
        env=python_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tools = json.loads(out.stdout)["tools"]
    assert tools["all_hot_extend"] is True
    (row,) = tools["rounds"]
    # The answer after the tool result reuses the cache; the same prompt cold prefills it all.
    assert (row["answer_cache"], row["cold_cache"]) == ("hot", "cold")
    assert row["answer_prefill_tokens"] < row["cold_prefill_tokens"]
    assert tools["speedup"] == round(row["cold_ttft_ms"] / row["answer_ttft_ms"], 1)
    assert row["json_schema_valid"] is True
    ratio = row["json_schema_decode_tps"] / row["free_decode_tps"]
    assert tools["constrained_vs_free_decode"] == round(ratio, 3)


@pytest.mark.slow
def test_bench_serve_concurrent_emits_its_json(python_env):
    out = agentkv(
        "bench", "serve", "--concurrent", "3", "--turns", "2", "--max-tokens", "24", "--json",
        env=python_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    sequential, concurrent = result["sequential"], result["concurrent"]
    for arm in (sequential, concurrent):
        assert arm["turns"] == 6 and arm["errors"] == 0 and arm["tokens"] > 0
        assert arm["ttft_p50_ms"] <= arm["ttft_p95_ms"]
        assert set(arm["plans"]) == {"one", "draft", "batch", "both"}
    # one at a time, no step batches turns; all at once, some do
    assert sequential["plans"]["batch"] == sequential["plans"]["both"] == 0
    assert concurrent["plans"]["batch"] + concurrent["plans"]["both"] > 0
    assert result["same_replies"] is True  # greedy: the same replies either way
    assert sequential["tokens"] == concurrent["tokens"]
    ratio = concurrent["tokens_per_s"] / sequential["tokens_per_s"]
    assert result["throughput_ratio"] == round(ratio, 2)
