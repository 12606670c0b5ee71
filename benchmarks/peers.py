"""Peers: one scripted multi-agent workflow, driven through the official ``openai`` SDK,
against real server processes on 127.0.0.1, one after another (issue 21):

- ``agentkv``: ``agentkv serve`` on the embedded model (the default engine: 4-bit weights,
  KV format 2 on disk);
- ``llama.cpp``: llama-cpp-python's server (``llama_cpp.server``) in its own venv under the
  agentkv home (``bench compute``'s, with the ``[server]`` extra), on the same GGUF file and
  thread count, its prompt cache on (``--cache true``, RAM: the cache its docs name; it has
  one sequence, so no slots to set);
- ``llama.cpp-disk``: the same with its other prompt cache, on disk (``--cache_type disk``,
  in the server's working directory, kept over the restart), so after the restart it can
  load a stored state instead of prefilling the conversation again. Both run: which of the
  two is llama.cpp's best depends on the turn (the 2026-11-27 runs in RESULTS.md measured both);
- ``llama.cpp-lookup``: the RAM-cache server with its speculative decoding by prompt lookup
  (``--draft_model prompt-lookup-decoding``, 2 tokens a draft: its README's advice for
  CPU-only machines), the peer of agentkv's drafts from the context (docs/drafts.md);
- ``mlx-lm``: ``mlx_lm.server`` on the same weights dequantized to float32 (agentkv's float32
  import of the GGUF, an MLX model directory), its prompt cache on (the default), the same
  OpenBLAS agentkv gives MLX (``import agentkv`` before ``mlx_lm``: nothing else of agentkv
  runs there). Not the 4-bit weights themselves: MLX's CPU quantized matmul is scalar, one
  thread (measured here: 0.3 tokens/s prefill, 116 s for 32 tokens), so that run would take
  hours; float32 is mlx-lm's fastest configuration on this CPU (~235-325 tokens/s prefill,
  ~15 tokens/s decode).

The workflow: ``agents`` agents (planner, coder, reviewer, tester) share one system prompt of
~``system_tokens`` tokens and the same three tool schemas; in each of ``rounds`` rounds every
agent takes a turn carrying the previous agent's reply and a question of its own; each agent
makes one named tool call every two rounds (``tool_choice``; a server that answers without
the call is counted); temperature 0, ``max_tokens`` each, streamed (TTFT as the client sees
it), tokens from each server's usage (or, where a server sends none in a stream, its
streamed pieces). After round ``ceil(rounds / 2)`` the server gets
SIGTERM and is started again on the same cache directory.

Per server: end-to-end wall time (the workflow, restart included) and its parts, TTFT p50 /
p95 of the text turns by turn kind (first turns, later turns, each agent's first turn after
the restart; a reply with no output has no first token and is counted in ``empty_replies``
instead) and, for the tool-call turns, the time to the whole call (agentkv sends a call
once it is written; llama-cpp-python streams its arguments: the whole call is what a client
can act on),
decode tokens/s of the text turns (tokens after the first over the time after the first;
a tool call may arrive in one piece), generated tokens,
tool calls made as asked, and the server process's peak RSS (VmHWM, the larger of its two
lives). A server that cannot run is reported with the reason, never dropped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from agentkv._numerics import environ_as_found

from .common import emit, progress
from .server_process import ServerProcess, free_port

SERVERS = ("agentkv", "llama.cpp", "llama.cpp-disk", "llama.cpp-lookup", "mlx-lm")
ROLES = ("planner", "coder", "reviewer", "tester")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": arg_help}},
                "required": [arg],
            },
        },
    }
    for name, description, arg, arg_help in (
        ("read_file", "Read a file of the repository.", "path", "the file's path"),
        ("run_tests", "Run the test suite or one test file.", "target", "a test path or 'all'"),
        ("search_code", "Search the repository for a string.", "query", "what to look for"),
    )
]
TOOL_RESULTS = {
    "read_file": "def parse(text):\n    rows = [line.split(',') for line in text.splitlines()]\n",
    "run_tests": "12 passed, 1 failed: test_quoted_fields (expected 3 fields, got 4)",
    "search_code": "csvjson/parse.py:2: rows = [line.split(',') ...]",
}
BRIEF = (
    "Paragraph {i} of the team brief. The product is csvjson, a command-line tool and library "
    "that turns CSV files into JSON and back. It must handle quoted fields, embedded commas and "
    "newlines, byte order marks, very large files streamed row by row, and clear errors that "
    "name the line and column of every malformed record. Each agent keeps its own notes and "
    "hands a short summary to the next agent of the team.\n"
)


def run(
    *,
    quick: bool = False,
    agents: int | None = None,
    rounds: int | None = None,
    system_tokens: int = 1000,
    max_tokens: int = 64,
    servers: tuple[str, ...] = SERVERS,
    peer: str = "auto",
    as_json: bool = False,
) -> list[dict]:
    agents = agents or (2 if quick else 4)
    rounds = rounds or (3 if quick else 6)
    if not 1 <= agents <= len(ROLES):
        raise SystemExit(f"agentkv: error: --agents takes 1 to {len(ROLES)}")
    if rounds < 2:
        raise SystemExit("agentkv: error: --rounds must be at least 2 (a restart in the middle)")
    restart_after = math.ceil(rounds / 2)
    system = _system_prompt(system_tokens)
    rows = []
    for name in servers:
        progress(f"peers: {name}...")
        with tempfile.TemporaryDirectory(prefix=f"agentkv-bench-peers-{name}-") as tmp:
            try:
                server = _server(name, Path(tmp), peer)
            except _Unavailable as why:
                rows.append({"server": name, "ran": False, "reason": str(why)})
                progress(f"peers: {name} not run: {why}")
                continue
            try:
                rows.append(_workflow(server, system, agents, rounds, restart_after, max_tokens))
            except Exception as exc:  # reported, never dropped
                rows.append({"server": name, "ran": False, "reason": f"failed: {exc}"})
                progress(f"peers: {name} failed: {exc}")
            finally:
                server.stop()
    extra = {
        "agents": agents,
        "rounds": rounds,
        "restart_after_round": restart_after,
        "system_tokens": system_tokens,
        "max_tokens": max_tokens,
        "threads": os.cpu_count(),
        "summary": _summary(rows),
    }
    emit("peers", rows, as_json, extra)
    return rows


# -- the workflow -------------------------------------------------------------------------


def _system_prompt(tokens: int) -> str:
    """~``tokens`` tokens of the team brief (the embedded tokenizer counts)."""
    from transformers import AutoTokenizer

    from agentkv.model.load import ensure_embedded_model

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    text, i = "You are one agent of a team that builds csvjson. The team brief follows.\n", 0
    while len(tok.encode(text)) < tokens:
        text += BRIEF.format(i=i + 1)
        i += 1
    return text


def _workflow(server, system, agents, rounds, restart_after, max_tokens) -> dict:
    from openai import OpenAI

    started = time.perf_counter()
    startup = [server.start()]
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = server.model_id or client.models.list().data[0].id
    histories = {role: [{"role": "system", "content": system}] for role in ROLES[:agents]}
    turns, previous = [], None
    for r in range(1, rounds + 1):
        if r == restart_after + 1:
            progress(f"peers: {server.name}: restarting (SIGTERM) after round {restart_after}")
            server.stop()
            startup.append(server.start())
        for i, role in enumerate(ROLES[:agents]):
            said = f"The {previous[0]} said: {previous[1]}\n\n" if previous else ""
            question = (
                f"Round {r}. {said}As the {role}, what is your next step for csvjson? "
                "Answer in two sentences."
            )
            history = histories[role]
            history.append({"role": "user", "content": question})
            tool = TOOLS[(r + i) % len(TOOLS)]["function"]["name"] if (r + i) % 2 == 0 else None
            turn = _turn(client, model, role, history, max_tokens, tool)
            kind = "first" if r == 1 else "after_restart" if r == restart_after + 1 else "later"
            turns.append({"round": r, "agent": role, "kind": kind, **turn})
            if turn["tool_call"]:
                call = turn["tool_call"]
                # content "", not null: llama-cpp-python's request model wants a string
                history.append({"role": "assistant", "content": "", "tool_calls": [call]})
                result = TOOL_RESULTS.get(call["function"]["name"], "done")
                history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                previous = (role, f"(called {call['function']['name']}: {result})")
            else:
                history.append({"role": "assistant", "content": turn["text"]})
                previous = (role, turn["text"].strip() or "(nothing)")
    wall = time.perf_counter() - started
    return _server_row(server, turns, wall, startup)


def _turn(client, model, agent, messages, max_tokens, tool) -> dict:
    """One streamed turn: TTFT (first content or tool-call delta), decode rate, usage."""
    request = dict(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        tools=TOOLS,
        user=agent,
        extra_headers={"x-agent-id": agent},
    )
    if tool:
        request["tool_choice"] = {"type": "function", "function": {"name": tool}}
    sent = time.perf_counter()
    first = last = None
    text, chunks, usage = [], 0, None
    call = {"id": None, "name": "", "arguments": ""}
    raw = client.chat.completions.with_raw_response.create(**request)
    cache = {  # agentkv's headers (other servers send none)
        key: raw.headers.get(f"x-agentkv-{key}")
        for key in ("cache", "reused-tokens", "prefill-tokens")
    }
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            got = bool(delta.content) or bool(delta.tool_calls)
            if got:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
            if delta.content:
                text.append(delta.content)
            for tc in delta.tool_calls or []:
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    name = tc.function.name or ""
                    if name != call["name"]:  # llama-cpp-python repeats it in every delta
                        call["name"] += name
                    call["arguments"] += tc.function.arguments or ""
    done = time.perf_counter()
    # tokens from the server's usage; a server that sends none in a stream (llama-cpp-python)
    # has them counted as streamed pieces (one token each there)
    counted = usage.completion_tokens if usage is not None else chunks
    decode_s = (last or done) - (first or done)
    tool_call = None
    if call["name"]:
        tool_call = {
            "id": call["id"] or f"call_{agent}",
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"] or "{}"},
        }
    return {
        # None where nothing came back (an empty reply has no first token: its whole time
        # would flatter whoever answers it fastest)
        "ttft_ms": round((first - sent) * 1000, 1) if first is not None else None,
        "seconds": round(done - sent, 3),
        "ms": round((done - sent) * 1000, 1),
        "completion_tokens": counted,
        "usage_reported": usage is not None,
        # text turns streamed in pieces only: a server may send a whole tool call at once
        "decode_tps": (
            round((counted - 1) / decode_s, 2)
            if tool_call is None and chunks > 1 and counted > 1 and decode_s > 0
            else None
        ),
        "cache": cache if any(cache.values()) else None,
        "tool_asked": tool,
        "tool_call": tool_call,
        "tool_call_made": tool is not None and tool_call is not None and call["name"] == tool,
        "text": "".join(text),
    }


def _server_row(server, turns, wall, startup) -> dict:
    def spread(kind, calls, key):
        values = sorted(
            t[key]
            for t in turns
            if t["kind"] == kind and bool(t["tool_call"]) == calls and t[key] is not None
        )
        if not values:
            return None
        return {"p50": _pct(values, 50), "p95": _pct(values, 95), "n": len(values)}

    kinds = ("first", "later", "after_restart")

    generated = sum(t["completion_tokens"] or 0 for t in turns)
    decode = [t["decode_tps"] for t in turns if t["decode_tps"]]
    asked = [t for t in turns if t["tool_asked"]]
    return {
        "server": server.name,
        "ran": True,
        "configuration": server.configuration,
        "wall_s": round(wall, 2),
        "startup_s": [round(s, 2) for s in startup],
        "requests_s": round(sum(t["seconds"] for t in turns), 2),
        # text turns: to the first token; tool-call turns: to the whole call (a server may
        # send a call in one piece once it is written, as agentkv does)
        "ttft_ms": {kind: spread(kind, False, "ttft_ms") for kind in kinds},
        "tool_call_ms": {kind: spread(kind, True, "ms") for kind in kinds},
        "empty_replies": sum(t["ttft_ms"] is None for t in turns),
        "decode_tps_p50": round(statistics.median(decode), 2) if decode else None,
        "generated_tokens": generated,
        "usage_reported": all(t["usage_reported"] for t in turns),
        "tool_calls_asked": len(asked),
        "tool_calls_made": sum(t["tool_call_made"] for t in asked),
        "peak_rss_bytes": server.peak_rss,
        "turns": [{k: v for k, v in t.items() if k not in ("text", "tool_call")} for t in turns],
    }


def _pct(values: list[float], p: float) -> float:
    k = (len(values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 1)


def _summary(rows: list[dict]) -> dict:
    ran = {r["server"]: r for r in rows if r.get("ran")}
    out: dict = {}
    ours = ran.get("agentkv")
    peers = [r for name, r in ran.items() if name != "agentkv"]
    if not ours or not peers:
        return out
    best = min(peers, key=lambda r: r["wall_s"])
    out["best_peer"] = best["server"]
    out["end_to_end_vs_best_peer"] = round(best["wall_s"] / ours["wall_s"], 2)
    restart = ours["ttft_ms"]["after_restart"]
    for r in peers:
        theirs = r["ttft_ms"]["after_restart"]
        if restart and theirs:
            out[f"after_restart_ttft_vs_{r['server']}"] = round(theirs["p50"] / restart["p50"], 1)
    fastest = max((r["decode_tps_p50"] or 0) for r in peers)
    if ours["decode_tps_p50"] and fastest:
        out["decode_vs_best_peer"] = round(ours["decode_tps_p50"] / fastest, 2)
    return out


# -- the servers ----------------------------------------------------------------------------


class _Unavailable(Exception):
    pass


def _server(name: str, root: Path, peer: str):
    if name == "agentkv":
        return _Agentkv(root)
    if name == "llama.cpp":
        return _LlamaCpp(root, _llama_python(peer))
    if name == "llama.cpp-disk":
        return _LlamaCppDisk(root, _llama_python(peer))
    if name == "llama.cpp-lookup":
        return _LlamaCppLookup(root, _llama_python(peer))
    if name == "mlx-lm":
        return _MlxLm(root)
    raise SystemExit(f"agentkv: error: --servers takes {', '.join(SERVERS)}, not {name!r}")


def _rss_peak(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Agentkv:
    name = "agentkv"
    model_id = None  # the first of /v1/models

    def __init__(self, root: Path):
        self.process = ServerProcess(root / "kv", None)
        self.peak_rss: int | None = None
        self.configuration = (
            "agentkv serve, embedded model (4-bit weights as shipped), the default KV format "
            "(format 2 + wide layers), cache on disk under a fresh --cache-dir"
        )

    @property
    def url(self) -> str:
        return self.process.url

    def start(self) -> float:
        t = time.perf_counter()
        self.process.start(timeout=300)
        return time.perf_counter() - t

    def stop(self) -> None:
        if self.process.proc is not None and self.process.proc.poll() is None:
            self.peak_rss = max(self.peak_rss or 0, _rss_peak(self.process.proc.pid) or 0)
            self.process.stop()


class _Process:
    """A peer server in a subprocess on a free port, ready when ``ready_path`` answers."""

    name = ""
    ready_path = "/v1/models"
    model_id: str | None = None

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.peak_rss: int | None = None
        self.log = root / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 300) -> float:
        t = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=self.root, env=environ_as_found(), stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return time.perf_counter() - t
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not come up in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.peak_rss = max(self.peak_rss or 0, _rss_peak(self.proc.pid) or 0)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _llama_python(peer: str) -> Path:
    from .compute import PEER_PACKAGE, install_peer, peer_dir, peer_python

    if peer == "none":
        raise _Unavailable("not asked for (--peer none)")
    python = peer_python()
    if python is None and peer == "install":
        python = install_peer()
    if python is None:
        raise _Unavailable(
            f"llama-cpp-python is not installed: run with --peer install to build it into "
            f"{peer_dir()} (a separate venv, never agentkv's dependency)"
        )
    check = [str(python), "-c", "import llama_cpp.server.app, uvicorn"]
    if subprocess.run(check, capture_output=True).returncode != 0:
        progress(f"peers: installing {PEER_PACKAGE}[server]'s dependencies into {peer_dir()}")
        version = subprocess.run(
            [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"{PEER_PACKAGE}[server]=={version}"],
            check=True,
        )  # fmt: skip
    return python


class _LlamaCpp(_Process):
    name = "llama.cpp"
    cache_type = "ram"
    cache_note = "RAM, 2 GiB"

    def __init__(self, root: Path, python: Path):
        super().__init__(root)
        self.python = python
        self.threads = os.cpu_count() or 1
        self.configuration = (
            f"llama-cpp-python server ({python.parent.parent}), the embedded GGUF, "
            f"n_ctx 8192, {self.threads} threads, f16 KV, prompt cache on ({self.cache_note}), one "
            "sequence (no slots in llama-cpp-python's server)"
        )

    def command(self) -> list[str]:
        from agentkv.model.load import embedded_gguf_path

        return [
            str(self.python), "-m", "llama_cpp.server",
            "--model", str(embedded_gguf_path()),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", "8192",
            "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
            "--cache", "true", "--cache_type", self.cache_type,
            "--verbose", "false", *self.extra_args,
        ]  # fmt: skip

    extra_args: tuple[str, ...] = ()


class _LlamaCppDisk(_LlamaCpp):
    """The same server with llama-cpp-python's other prompt cache: its states on disk (the
    server's working directory, the same before and after the restart), so it can resume a
    conversation after a restart instead of prefilling it again."""

    name = "llama.cpp-disk"
    cache_type = "disk"
    cache_note = "disk, 2 GiB, kept over the restart"


class _LlamaCppLookup(_LlamaCpp):
    """The RAM-cache server drafting by prompt lookup (``LlamaPromptLookupDecoding``): 2
    tokens a draft, what llama-cpp-python's README advises for CPU-only machines (10, its
    default, for GPUs)."""

    name = "llama.cpp-lookup"
    cache_note = "RAM, 2 GiB; drafts by prompt lookup, 2 tokens"
    extra_args = ("--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "2")


class _MlxLm(_Process):
    name = "mlx-lm"
    # its /v1/models lists the Hugging Face cache (it fails without one); "default_model"
    # is the model named on its command line
    ready_path = "/health"
    model_id = "default_model"

    def __init__(self, root: Path):
        super().__init__(root)
        self.configuration = (
            "mlx_lm.server on the same weights dequantized to float32 (agentkv's float32 "
            "import of the GGUF: MLX's CPU 4-bit matmul prefills 0.3 tokens/s here, so the "
            "4-bit run would take hours), MLX on CPU with OpenBLAS, its prompt cache on "
            "(default)"
        )

    def command(self) -> list[str]:
        from agentkv.model.load import ensure_embedded_model

        model = ensure_embedded_model("float32")
        args = ["mlx_lm.server", "--model", str(model), "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--log-level", "WARNING"]
        code = (
            "import sys, runpy\n"
            "import agentkv  # MLX's BLAS: OpenBLAS, as in agentkv's own process\n"
            f"sys.argv = {json.dumps(args)}\n"
            "runpy.run_module('mlx_lm.server', run_name='__main__')\n"
        )
        return [sys.executable, "-c", code]
