"""Compute: agentkv's engine (float32 weights, 4-bit weights as shipped) against llama.cpp on
the same GGUF file and thread count (issue 20).

Arms, run in interleaved rounds (every arm once per round, medians reported):

- ``agentkv-float32``, ``agentkv-quantized``: the engine in this process, a fresh engine and
  cache directory per round, the default KV format, drafts from the context off
  (``draft_tokens=0``: one token a step, as llama.cpp decodes here; docs/drafts.md);
- ``llama.cpp``, ``llama.cpp-q4``: llama-cpp-python in its own venv (``peer_llama.py``, a new
  process per round), its default f16 KV cache, and a q4_0 K/V cache with flash attention.

One workload for every arm (raw prompts, greedy, texts from the calibration text; every
prompt of a round is a different slice, so nothing is shared by accident):

- ``short``: a ~128-token prompt, then ``decode_tokens`` tokens: decode tokens/s there;
- ``cold``: one cold prompt per context size (e.g. 512 and 4096 tokens): prefill tokens/s
  (prompt tokens / time to first token); the longest then decodes ``decode_tokens`` tokens:
  decode tokens/s at that context;
- ``hot``: after the longest prompt, turns that add N new tokens (e.g. 17, then 112) to
  the history so far (prompt + the arm's own reply, as an agent's next turn does), the
  history still in the agent's cache (llama.cpp: its context, reused by
  ``Llama.generate``'s prefix match): time to first token;
- ``batch``: agentkv decodes ``batch_agents`` agents of ``batch_context`` tokens together:
  after their contexts are prefilled, two hot turns of the batch each add ~18 tokens an
  agent, the first generating one token, the second ``decode_tokens``; aggregate tokens/s =
  the second's extra tokens / its extra time (so the big prefill is not in the difference);
  llama.cpp decodes one sequence of that context.

Plus each arm's resident weight bytes, and agentkv's kernels alone (doctor's probes) as a
fraction of memcpy bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import emit, memcpy_gbps, progress

AGENTKV_ARMS = ("agentkv-float32", "agentkv-quantized")
PEER_ARMS = {"llama.cpp": "f16", "llama.cpp-q4": "q4_0"}
PEER_KV_LABELS = {"f16": "f16", "q4_0": "q4_0+flash-attn"}
PEER_PACKAGE = "llama-cpp-python"


def peer_dir() -> Path:
    from agentkv.paths import agentkv_home

    return agentkv_home() / "peers" / "llama-cpp"


def peer_python() -> Path | None:
    """The peer venv's python, where it imports llama-cpp-python (an install cut short
    leaves a venv without it: that counts as none, and ``--peer install`` builds it again)."""
    python = peer_dir() / "bin" / "python"
    if not python.exists():
        return None
    try:
        found = subprocess.run(
            [str(python), "-c", "import llama_cpp"], capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if found.returncode == 0 else None


def install_peer() -> Path:
    """Create the peer venv under the agentkv home and build llama-cpp-python into it for
    this CPU (minutes: it compiles llama.cpp). AMX stays off: a VM may report it and still
    fault on its first tile instruction (seen on this project's machines)."""
    import venv

    where = peer_dir()
    progress(f"compute: installing {PEER_PACKAGE} into {where} (compiles llama.cpp: minutes)")
    venv.create(where, with_pip=True, clear=True)
    env = dict(os.environ, CMAKE_ARGS=_cmake_args())
    subprocess.run(
        [str(where / "bin" / "python"), "-m", "pip", "install", "-q", PEER_PACKAGE],
        env=env, check=True,
    )  # fmt: skip
    return where / "bin" / "python"


def _cmake_args() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return ""
    if "avx2" not in flags:
        return ""  # llama.cpp's own native build
    wanted = {
        "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
        "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f",
        "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
        "GGML_AVX512_BF16": "avx512_bf16",
    }  # fmt: skip
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]
    args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in wanted.items()]
    return " ".join(args)


def run(
    rounds: int = 2,
    contexts: tuple[int, ...] = (512, 4096),
    short: int = 128,
    hot: tuple[int, ...] = (17, 112),
    decode_tokens: int = 32,
    batch_agents: int = 4,
    batch_context: int = 1024,
    peer: str = "auto",
    agentkv_arms: tuple[str, ...] = AGENTKV_ARMS,
    model: str | None = None,
    as_json: bool = False,
):
    """``model``: a GGUF file every arm runs (default: the embedded model's).
    ``peer``: "auto" (run llama.cpp if its venv exists, else say how to install it),
    "install" (install it first if missing), "none". ``agentkv_arms``: which of
    ``AGENTKV_ARMS`` run (the threads agentkv's kernels take: ``AGENTKV_THREADS``, recorded
    under ``machine``)."""
    gguf = _model_file(model)
    python = _peer(peer)
    arms = list(agentkv_arms) + (list(PEER_ARMS) if python else [])
    ours = str(gguf) if model is not None else None  # None: the embedded model's own import
    work = _workload(ours, contexts, short, hot, decode_tokens, batch_agents, batch_context)
    threads = os.cpu_count() or 1
    rows = []
    for r in range(rounds):
        for arm in arms:
            progress(f"compute: round {r + 1}/{rounds}, {arm}...")
            if arm in PEER_ARMS:
                out = _run_peer(python, gguf, PEER_ARMS[arm], work, threads)
            else:
                out = _run_agentkv(ours, arm.split("-", 1)[1], work)
            rows.append(_row(arm, r, out, work))
    extra = {
        "model": str(gguf),
        "threads": threads,
        "contexts": list(contexts),
        "hot_tokens": list(hot),
        "decode_tokens": decode_tokens,
        "batch_agents": batch_agents,
        "batch_context": batch_context,
        "peer": "llama-cpp-python in " + str(peer_dir()) if python else None,
        "summary": _summary(rows),
        "kernels": _kernels(),
    }
    if not python and peer == "auto":
        extra["peer_missing"] = (
            f"llama.cpp not measured: run with --peer install to build {PEER_PACKAGE} into "
            f"{peer_dir()} (a separate venv, never agentkv's dependency)"
        )
        progress("compute: " + extra["peer_missing"])
    emit("compute", rows, as_json, extra)
    return rows


def _model_file(model: str | None) -> Path:
    """The GGUF file every arm runs: ``model``, checked, or the embedded model's."""
    from agentkv.errors import ModelImportError
    from agentkv.model.load import embedded_gguf_path

    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ModelImportError(f"bench compute --model takes a GGUF file: no such file {model}")
    return path.resolve()


def _peer(peer: str) -> Path | None:
    if peer == "none":
        return None
    python = peer_python()
    if python is None and peer == "install":
        python = install_peer()
    return python


# -- the workload ---------------------------------------------------------------------------


def _workload(model, contexts, short, hot, decode_tokens, batch_agents, batch_context) -> dict:
    """Prompt texts of the asked token counts (the file's tokenizer as agentkv imports it;
    llama.cpp's tokenizer reads the same GGUF vocabulary), each from its own slice of the
    calibration text."""
    from agentkv.model.load import load_model
    from agentkv.model.wide_layers import calibration_text

    tokenizer = load_model(model, weights="quantized").tokenizer
    ids = tokenizer.encode(calibration_text())
    at = 0

    def take(n: int) -> str:
        nonlocal at
        if at + n > len(ids):
            raise ValueError(f"the calibration text has {len(ids)} tokens; the workload needs more")
        text = tokenizer.decode(ids[at : at + n])
        at += n
        return text

    contexts = sorted(contexts)
    cold = [take(n) for n in contexts]
    return {
        "contexts": contexts,
        "hot_tokens": list(hot),
        "short": take(short),
        "cold": cold,
        "hot": ["\n\n" + take(n) for n in hot],  # each appended to the history so far
        "batch": [take(batch_context) for _ in range(batch_agents)],
        # two short next turns per batched agent: the first timed with one token, the second
        # with decode_tokens (both hot: the difference is the batched decode)
        "batch_next": [["\n\n" + take(16), "\n\n" + take(16)] for _ in range(batch_agents)],
        "decode_tokens": decode_tokens,
    }


def _run_agentkv(model: str | None, weights: str, work: dict) -> dict:
    from mlx.utils import tree_flatten

    from agentkv import Engine

    n = work["decode_tokens"]
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-compute-") as tmp:
        with Engine(model=model, cache_dir=tmp, weights=weights, draft_tokens=0) as eng:

            def turn(agent: str, text: str, tokens: int) -> dict:
                result = eng.generate(agent, text, max_tokens=tokens, temperature=0.0)
                s = result.stats
                # the reply's exact bytes (the streamed text drops a first token's space)
                reply = b"".join(eng.token_text.generated_bytes(result.tokens))
                return {
                    "text": text + reply.decode("utf-8", errors="replace"),
                    "prompt_tokens": s.prompt_tokens,
                    "reused_tokens": s.prompt_tokens - s.prefill_tokens,
                    "prefill_tokens": s.prefill_tokens,
                    "ttft_s": s.ttft_ms / 1000,
                    "generated": s.generated_tokens,
                    "decode_tps": s.decode_tps if s.generated_tokens > 1 else None,
                }

            out = {"short": turn("short", work["short"], n), "cold": [], "hot": []}
            for i, text in enumerate(work["cold"]):
                longest = i == len(work["cold"]) - 1
                out["cold"].append(turn(f"cold-{i}", text, n if longest else 1))
            history = out["cold"][-1]["text"]
            for suffix in work["hot"]:
                out["hot"].append(turn(f"cold-{len(work['cold']) - 1}", history + suffix, 1))
                history = out["hot"][-1]["text"]
            out["batch"] = _agentkv_batch(eng, work)
            out["kv_format"] = eng.quant.label
            out["weight_bytes"] = sum(
                v.nbytes for _, v in tree_flatten(eng.loaded.model.parameters())
            )
    return out


def _agentkv_batch(eng, work: dict) -> dict:
    """The agents' contexts prefilled (a turn of one token each), then two hot turns of the
    batch, each adding a short suffix: one token each, then ``decode_tokens`` each. Aggregate
    decode rate: the second turn's extra tokens over the second turn's extra time (the two
    prefill alike: ~18 new tokens an agent)."""
    n = work["decode_tokens"]
    agents = [f"batch-{i}" for i in range(len(work["batch"]))]
    history = list(work["batch"])

    def turn(tokens: int) -> tuple[float, list]:
        start = time.perf_counter()
        results = eng.generate_many(list(zip(agents, history)), max_tokens=tokens, temperature=0.0)
        elapsed = time.perf_counter() - start
        for i, r in enumerate(results):
            history[i] += b"".join(eng.token_text.generated_bytes(r.tokens)).decode(
                "utf-8", errors="replace"
            )
        return elapsed, results

    turn(1)  # cold prefill of every context
    for i, suffixes in enumerate(work["batch_next"]):
        history[i] += suffixes[0]
    t_one, _ = turn(1)
    for i, suffixes in enumerate(work["batch_next"]):
        history[i] += suffixes[1]
    t_all, results = turn(n)
    decoded = sum(r.stats.generated_tokens - 1 for r in results)
    return {
        "agents": len(agents),
        "prompt_tokens": [r.stats.prompt_tokens for r in results],
        "caches": [r.stats.cache for r in results],
        "decoded": decoded,
        "aggregate_tps": decoded / (t_all - t_one) if t_all > t_one else None,
    }


def _run_peer(python: Path, gguf: Path, kv: str, work: dict, threads: int) -> dict:
    job = {
        "model": str(gguf),
        "threads": threads,
        "kv": kv,
        "n_ctx": 8192,
        "work": {**work, "batch": work["batch"][:1], "batch_next": []},
    }
    script = Path(__file__).with_name("peer_llama.py")
    done = subprocess.run(
        [str(python), str(script)], input=json.dumps(job), capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp arm failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    out["batch"] = {"agents": 1, "aggregate_tps": out.pop("batch_context")["decode_tps"]}
    out["kv_format"] = PEER_KV_LABELS[kv]
    return out


# -- rows and summary -----------------------------------------------------------------------


def _row(arm: str, r: int, out: dict, work: dict) -> dict:
    row = {"arm": arm, "round": r + 1, "weight_mb": round(out["weight_bytes"] / 1e6, 1)}
    row["kv_format"] = out["kv_format"]
    row["decode_tps_short"] = _round(out["short"]["decode_tps"])
    row["short_context"] = out["short"]["prompt_tokens"]
    for n, c in zip(work["contexts"], out["cold"]):
        row[f"prefill_tps_{n}"] = _round(c["prompt_tokens"] / c["ttft_s"])
    longest = out["cold"][-1]
    row["decode_tps_long"] = _round(longest["decode_tps"])
    row["long_context"] = longest["prompt_tokens"]
    for n, h in zip(work["hot_tokens"], out["hot"]):
        row[f"hot_ttft_ms_{n}"] = round(h["ttft_s"] * 1000, 1)
        row[f"hot_prefilled_{n}"] = h["prompt_tokens"] - h["reused_tokens"]
    batch = out["batch"]
    row["batch_agents"] = batch["agents"]
    row["batch_tps"] = _round(batch["aggregate_tps"])
    return row


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _summary(rows: list[dict]) -> dict:
    """Per arm, the median of every numeric field over rounds (fields an arm lacks: none)."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        fields = {}
        for key in mine[0]:
            values = [r.get(key) for r in mine]
            if key in ("arm", "round") or not all(isinstance(v, int | float) for v in values):
                continue
            fields[key] = round(statistics.median(values), 1)
        out[arm] = fields
    return out


def _kernels() -> dict:
    """agentkv's kernels alone (doctor's probes) as a fraction of memcpy bandwidth."""
    from agentkv.doctor import measure_attention, measure_quantized_matmul

    copy = memcpy_gbps()
    qmm, attention = measure_quantized_matmul(), measure_attention()
    return {
        "memcpy_gbps": round(copy, 2),
        "quantized_matmul": {**qmm, "of_memcpy": round(qmm["weight_gbps"] / copy, 2)},
        "attention": {**attention, "of_memcpy": round(attention["kv_gbps"] / copy, 2)},
    }


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: agentkv bench compute")
