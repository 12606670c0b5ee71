"""Serve --concurrent N: N agents in flight at once against one ``agentkv serve`` vs the same
turns one at a time.

N agents share a system prompt (the team brief of ``bench peers``, its blocks shared in the
pool) and each runs ``turns`` turns of its own conversation (the client resends its growing
history) through the official ``openai`` SDK, streamed and greedy; each turn asks the agent
to quote a line of the brief and say what it does about it, as agents quote their context.

* concurrent: one server on an empty cache directory, the N clients all at once, each
  sending its next turn as soon as its last one ends;
* sequential: the same turns on fresh agents (another server, another empty cache
  directory), one at a time: agent after agent, turn after turn.

Aggregate tokens/s are completion tokens over the run's wall time; TTFT is measured at the
client (request sent -> first text); ``plans`` are the decode steps by plan that the server's
``/metrics`` counted (``agentkv_decode_steps``: one, draft, batch, both). Greedy turns give
the same replies either way (``same_replies``).
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .common import machine, percentile, progress
from .peers import BRIEF
from .server_process import ServerProcess

PARAGRAPHS = 6  # of the team brief: ~450 tokens of shared system prompt
STEPS = re.compile(r'^agentkv_decode_steps\{plan="(\w+)"\} ([0-9.e+]+)$', re.M)


def _system() -> str:
    text = "You are one agent of a team that builds csvjson. The team brief follows.\n"
    return text + "".join(BRIEF.format(i=i + 1) for i in range(PARAGRAPHS))


def _ask(agent: int, turn: int) -> str:
    return (
        f"Turn {turn + 1}. Quote the first sentence of paragraph {(agent + turn) % PARAGRAPHS + 1} "
        "of the brief word for word, then say in one sentence what you will do about it."
    )


def _turn(client, model: str, agent: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy turn through the SDK: its reply, TTFT and completion tokens."""
    out = {"text": "", "ttft_s": None, "tokens": 0, "error": None}
    sent = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-agent-id": agent},
        )
        for chunk in stream:
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - sent
                    out["text"] += choice.delta.content
    except Exception as exc:  # counted as an error, the run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _plans(server: ServerProcess) -> dict:
    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return {plan: int(float(n)) for plan, n in STEPS.findall(text)}


def _run(cache_dir: Path, agents: int, turns: int, max_tokens: int, together: bool) -> dict:
    """One arm on its own server: every agent's turns, all at once or one at a time."""
    from openai import OpenAI

    server = ServerProcess(cache_dir, None, "--max-batch", str(max(agents, 1)))
    server.start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        histories = [[{"role": "system", "content": _system()}] for _ in range(agents)]
        results: list[list[dict]] = [[] for _ in range(agents)]

        def one(i: int, t: int) -> None:
            histories[i].append({"role": "user", "content": _ask(i, t)})
            r = _turn(client, model, f"agent-{i}", histories[i], max_tokens)
            results[i].append(r)
            histories[i].append({"role": "assistant", "content": r["text"]})

        def client_turns(i: int) -> None:
            for t in range(turns):
                one(i, t)

        began = time.perf_counter()
        if together:
            threads = [threading.Thread(target=client_turns, args=(i,)) for i in range(agents)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for i in range(agents):
                client_turns(i)
        wall = time.perf_counter() - began
        plans = _plans(server)
    finally:
        server.stop()
    flat = [r for rs in results for r in rs]
    ttfts = sorted(r["ttft_s"] for r in flat if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in flat)
    return {
        "turns": len(flat),
        "errors": sum(1 for r in flat if r["error"]),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p95_ms": round(percentile(ttfts, 95) * 1000, 1) if ttfts else None,
        "plans": plans,
        "error_samples": [r["error"] for r in flat if r["error"]][:5],
        "replies": [[r["text"] for r in rs] for rs in results],
    }


def run(agents: int = 6, turns: int = 3, max_tokens: int = 64, as_json: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-concurrent-") as tmp:
        progress(f"serve --concurrent: {agents} agents x {turns} turns, one at a time...")
        sequential = _run(Path(tmp) / "sequential" / "kv", agents, turns, max_tokens, False)
        progress(f"serve --concurrent: {agents} agents x {turns} turns, all at once...")
        concurrent = _run(Path(tmp) / "concurrent" / "kv", agents, turns, max_tokens, True)
    same = sequential.pop("replies") == concurrent.pop("replies")
    result = {
        "bench": "serve --concurrent",
        "machine": machine(),
        "agents": agents,
        "turns_per_agent": turns,
        "max_tokens": max_tokens,
        "sequential": sequential,
        "concurrent": concurrent,
        "throughput_ratio": round(concurrent["tokens_per_s"] / sequential["tokens_per_s"], 2),
        "ttft_p95_ratio": (
            round(concurrent["ttft_p95_ms"] / sequential["ttft_p95_ms"], 2)
            if concurrent["ttft_p95_ms"] and sequential["ttft_p95_ms"]
            else None
        ),
        "same_replies": same,
    }
    if as_json:
        print(json.dumps(result, indent=2))
        return result
    for name in ("sequential", "concurrent"):
        arm = result[name]
        print(
            f"{name:>10}: {arm['tokens']} tokens in {arm['wall_s']} s, {arm['tokens_per_s']} "
            f"tok/s, TTFT p50 {arm['ttft_p50_ms']} ms p95 {arm['ttft_p95_ms']} ms, "
            f"{arm['errors']} errors, steps {arm['plans']}"
        )
    print(
        f"concurrent / sequential: {result['throughput_ratio']}x tokens/s, TTFT p95 "
        f"{result['ttft_p95_ratio']}x; same replies: {same}"
    )
    return result
