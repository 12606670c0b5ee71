"""Serve: the interleaved scheduler vs first-come-first-served, and a load run with a restart.

Everything goes through real ``agentkv serve`` processes on 127.0.0.1 and its
OpenAI endpoint, streaming; TTFT is measured at the client (request sent ->
first text received).

* staggered (seed 000, section 4.4): agent A sends a long cold prompt at t=0,
  agent B a short one 1 s later. The same two requests run against a server
  with ``--schedule interleave`` (prefill chunks interleaved with batched
  decode, the default) and one with ``--schedule fcfs`` (one turn at a time,
  first come first served), each on an empty cache directory.
* load: ``clients`` clients, each its own agent, each running ``turns`` turns
  of a conversation (the client resends its growing history, as any chat
  client does), all at once. After half the turns the server gets SIGTERM
  and is started again; every agent's first turn after the restart should
  find its cache on disk (``warm``). Requests/s and tokens/s count the time
  the server was up and serving (not the restart).
* tools (``--tools``, instead of the two above): per round, decode tokens/s under a
  ``response_format`` JSON schema vs free (client-side, after the first token): two agents
  continuing the same history with the same ``max_tokens``, which goes first alternating
  by round; and a tool round trip per agent -- a named
  ``tool_choice`` call (valid thanks to the tool-call grammar), the tool's result, the
  answer -- and the answer's TTFT (the turn after the tool result, hot: the call and its
  result re-render to the text the cache holds) against the same prompt sent cold (a new
  agent under its own ``cache_salt``, so nothing is shared).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .common import machine, percentile, progress
from .server_process import ServerProcess

MODEL_ROUTE = "/v1/chat/completions"
FILLER = (
    "Section {i}. The archive keeps every record of the harbour town: ships that arrived, "
    "cargo they carried, the names of their captains and the weather on the day they left. "
    "Clerks copied each entry twice, once for the mayor and once for the guild.\n"
)
_MODELS: dict[str, str] = {}  # server url -> the model it serves
ROLES = ["planner", "coder", "reviewer", "tester", "writer", "critic", "analyst", "manager"]


def model_id(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]


def stream_turn(
    url: str,
    agent: str,
    messages: list[dict],
    max_tokens: int,
    *,
    tools: list[dict] | None = None,
    salt: str | None = None,
    extra: dict | None = None,
) -> dict:
    """One streamed OpenAI chat turn; TTFT and counts as the client sees them (``extra``:
    more request fields, e.g. ``response_format``)."""
    import httpx

    if url not in _MODELS:
        _MODELS[url] = model_id(url)
    body = {
        "model": _MODELS[url],
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = tools
    if salt is not None:
        body["cache_salt"] = salt
    body.update(extra or {})
    sent = time.perf_counter()
    out = {"agent": agent, "ttft_s": None, "text": "", "error": None}
    try:
        with httpx.Client(timeout=600) as http:
            with http.stream(
                "POST", url + MODEL_ROUTE, json=body, headers={"x-agent-id": agent}
            ) as r:
                out["cache"] = r.headers.get("x-agentkv-cache")
                if r.status_code != 200:
                    r.read()
                    out["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                    return out
                failed = False
                for line in r.iter_lines():
                    if line == "event: error":
                        failed = True  # the server reports a failure inside the stream
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if failed or "error" in chunk:
                        out["error"] = f"stream error: {line[6:206]}"
                        break
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
                        out["agentkv"] = chunk.get("agentkv")
                    for choice in chunk.get("choices") or []:
                        piece = choice["delta"].get("content")
                        if piece:
                            if out["ttft_s"] is None:
                                out["ttft_s"] = time.perf_counter() - sent
                            out["text"] += piece
                            out["last_s"] = time.perf_counter() - sent
    except Exception as exc:  # counted as an error, the run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["total_s"] = time.perf_counter() - sent
    return out


def decode_tps(turn: dict) -> float | None:
    """Tokens per second after the first one, as the client received them."""
    tokens = (turn.get("usage") or {}).get("completion_tokens", 0)
    if tokens < 2 or turn.get("ttft_s") is None or turn.get("last_s") is None:
        return None
    span = turn["last_s"] - turn["ttft_s"]
    return round((tokens - 1) / span, 2) if span > 0 else None


REPORT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "rain": {"type": "boolean"},
        "advice": {"type": "string", "maxLength": 60},
    },
    "required": ["city", "rain", "advice"],
    "additionalProperties": False,
}


def _long_prompt(paragraphs: int) -> list[dict]:
    text = "".join(FILLER.format(i=i) for i in range(paragraphs))
    return [{"role": "user", "content": text + "\nIn one sentence, what does the archive keep?"}]


def _staggered_pair(url: str, long: list[dict], short: list[dict], delay_s: float) -> dict:
    """A's long prompt at t=0, B's short one ``delay_s`` later; both results."""
    results = {}
    a = threading.Thread(target=lambda: results.update(a=stream_turn(url, "agent-a", long, 16)))
    a.start()
    time.sleep(delay_s)
    results["b"] = stream_turn(url, "agent-b", short, 16)
    a.join()
    return results


def staggered(tmp: Path, paragraphs: int, delay_s: float = 1.0) -> dict:
    short = [{"role": "user", "content": "Name a colour."}]
    rows = []
    for policy in ("interleave", "fcfs"):
        progress(f"serve: staggered arrivals, --schedule {policy}...")
        server = ServerProcess(tmp / f"staggered-{policy}" / "kv", None, "--schedule", policy)
        server.start()
        try:
            results = _staggered_pair(server.url, _long_prompt(paragraphs), short, delay_s)
        finally:
            server.stop()
        for key in ("a", "b"):
            if results[key]["error"]:
                raise RuntimeError(f"staggered {policy}: {results[key]['error']}")
        rows.append(
            {
                "policy": policy,
                "a_prompt_tokens": results["a"]["usage"]["prompt_tokens"],
                "a_ttft_ms": round(results["a"]["ttft_s"] * 1000, 1),
                "b_ttft_ms": round(results["b"]["ttft_s"] * 1000, 1),
                "a_total_ms": round(results["a"]["total_s"] * 1000, 1),
                "b_total_ms": round(results["b"]["total_s"] * 1000, 1),
            }
        )
        row = rows[-1]
        progress(f"serve: {policy}: A TTFT {row['a_ttft_ms']} ms, B {row['b_ttft_ms']} ms")
    inter, fcfs = rows
    return {
        "b_delay_s": delay_s,
        "rows": rows,
        "b_ttft_speedup": round(fcfs["b_ttft_ms"] / inter["b_ttft_ms"], 2),
        "a_ttft_change_pct": round((inter["a_ttft_ms"] / fcfs["a_ttft_ms"] - 1) * 100, 1),
    }


def load(tmp: Path, clients: int, turns: int, max_tokens: int) -> dict:
    server = ServerProcess(tmp / "load" / "kv", None, "--max-batch", str(clients))
    histories = [
        [
            {
                "role": "system",
                "content": f"You are the {ROLES[i % len(ROLES)]} #{i} of a small team building a "
                "CSV to JSON converter. Answer in one or two short sentences. " * 3,
            }
        ]
        for i in range(clients)
    ]
    results: list[list[dict]] = [[] for _ in range(clients)]
    half = turns // 2

    def client(i: int, first: int, last: int) -> None:
        for t in range(first, last):
            histories[i].append({"role": "user", "content": f"Step {t + 1}: what next?"})
            r = stream_turn(server.url, f"load-{i}", histories[i], max_tokens)
            r["turn"] = t
            results[i].append(r)
            histories[i].append({"role": "assistant", "content": r["text"]})

    def phase(first: int, last: int) -> float:
        threads = [threading.Thread(target=client, args=(i, first, last)) for i in range(clients)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - began

    server.start()
    progress(f"serve: load: {clients} clients x {half} turns...")
    before = phase(0, half)
    progress("serve: load: restarting the server (SIGTERM, start)...")
    restart_began = time.perf_counter()
    server.stop()
    server.start()
    restart_s = time.perf_counter() - restart_began
    progress(f"serve: load: {clients} clients x {turns - half} more turns...")
    try:
        after = phase(half, turns)
    finally:
        server.stop()
    flat = [r for rs in results for r in rs]
    ttfts = sorted(r["ttft_s"] for r in flat if r["ttft_s"] is not None)
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) for r in flat)
    first_after = [next(r for r in rs if r["turn"] == half) for rs in results]
    outcomes: dict[str, int] = {}
    for r in first_after:
        outcomes[r.get("cache") or "error"] = outcomes.get(r.get("cache") or "error", 0) + 1
    serving_s = before + after
    return {
        "clients": clients,
        "turns_per_client": turns,
        "requests": len(flat),
        "errors": sum(1 for r in flat if r["error"]),
        "requests_per_s": round(len(flat) / serving_s, 3),
        "tokens_per_s": round(tokens / serving_s, 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1) if ttfts else None,
        "serving_s": round(serving_s, 1),
        "restart_s": round(restart_s, 1),
        "post_restart_first_turn": outcomes,
        "error_samples": [r["error"] for r in flat if r["error"]][:5],
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city today",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _post(url: str, agent: str, body: dict) -> tuple[dict, dict]:
    import httpx

    body = {"model": model_id(url), "temperature": 0, **body}
    with httpx.Client(timeout=600) as http:
        r = http.post(url + MODEL_ROUTE, json=body, headers={"x-agent-id": agent})
    if r.status_code != 200:
        raise RuntimeError(f"tools: HTTP {r.status_code}: {r.text[:200]}")
    return dict(r.headers), r.json()


def tools(tmp: Path, rounds: int, paragraphs: int) -> dict:
    """Tool round trips: the answer after a tool result, hot vs the same prompt cold."""
    server = ServerProcess(tmp / "tools" / "kv", None)
    server.start()
    rows = []
    try:
        for i in range(rounds):
            progress(f"serve: tools: round trip {i + 1}/{rounds}...")
            agent = f"tools-{i}"
            context = "".join(FILLER.format(i=f"{i}.{k}") for k in range(paragraphs))
            messages = [
                {"role": "system", "content": "You are a travel agent. " + context},
                {"role": "user", "content": "Should I pack an umbrella for Paris?"},
            ]
            named = {"type": "function", "function": {"name": "get_weather"}}
            call_headers, call = _post(
                server.url,
                agent,
                {"messages": messages, "tools": [WEATHER_TOOL], "tool_choice": named},
            )
            message = call["choices"][0]["message"]
            (tool_call,) = message["tool_calls"]
            messages += [
                {k: v for k, v in message.items() if v is not None},
                {"role": "tool", "tool_call_id": tool_call["id"], "content": "rain, 14 C"},
            ]
            hot = stream_turn(server.url, agent, messages, 16, tools=[WEATHER_TOOL])
            cold = stream_turn(
                server.url, f"{agent}-cold", messages, 16, tools=[WEATHER_TOOL], salt=f"cold-{i}"
            )
            for r in (hot, cold):
                if r["error"]:
                    raise RuntimeError(f"tools: {r['error']}")
            # Decode under a JSON schema vs free: two agents continuing the same history (each
            # reuses its shared blocks alike), the same max_tokens, the order alternating.
            ask = messages + [
                {"role": "assistant", "content": hot["text"]},
                {"role": "user", "content": "Describe the weather in Paris for a traveller."},
            ]
            schema = {
                "type": "json_schema",
                "json_schema": {"name": "report", "schema": REPORT_SCHEMA, "strict": True},
            }
            pair = {}
            for kind in ("free", "bound") if i % 2 == 0 else ("bound", "free"):
                extra = {"response_format": schema} if kind == "bound" else None
                pair[kind] = stream_turn(server.url, f"{agent}-{kind}", ask, 48, extra=extra)
            free, bound = pair["free"], pair["bound"]
            for r in (free, bound):
                if r["error"]:
                    raise RuntimeError(f"tools: {r['error']}")
            rows.append(
                {
                    "call_cache": call_headers.get("x-agentkv-cache"),
                    "call_arguments": tool_call["function"]["arguments"],
                    "call_ttft_ms": round(call["agentkv"]["ttft_ms"], 1),
                    "answer_cache": hot["cache"],
                    "answer_match": hot["agentkv"]["match"],
                    "answer_reused_tokens": hot["agentkv"]["reused_tokens"],
                    "answer_prefill_tokens": hot["agentkv"]["prefill_tokens"],
                    "answer_ttft_ms": round(hot["ttft_s"] * 1000, 1),
                    "cold_cache": cold["cache"],
                    "cold_prefill_tokens": cold["agentkv"]["prefill_tokens"],
                    "cold_ttft_ms": round(cold["ttft_s"] * 1000, 1),
                    "constrained_first": i % 2 == 1,
                    "free_decode_tps": decode_tps(free),
                    "json_schema_decode_tps": decode_tps(bound),
                    "json_schema_valid": _valid_json(bound["text"]),
                }
            )
    finally:
        server.stop()
    hot_ms = statistics.median(r["answer_ttft_ms"] for r in rows)
    cold_ms = statistics.median(r["cold_ttft_ms"] for r in rows)
    ratios = [
        r["json_schema_decode_tps"] / r["free_decode_tps"]
        for r in rows
        if r["json_schema_decode_tps"] and r["free_decode_tps"]
    ]
    return {
        "constrained_vs_free_decode": round(statistics.median(ratios), 3) if ratios else None,
        "rounds": rows,
        "answer_ttft_p50_ms": hot_ms,
        "cold_ttft_p50_ms": cold_ms,
        "speedup": round(cold_ms / hot_ms, 1),
        "all_hot_extend": all(
            (r["answer_cache"], r["answer_match"]) == ("hot", "extend") for r in rows
        ),
    }


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run(
    paragraphs: int = 30,
    clients: int = 8,
    turns: int = 10,
    max_tokens: int = 24,
    as_json: bool = False,
    tool_rounds: int = 0,
) -> dict:
    if tool_rounds:
        return _run_tools(tool_rounds, paragraphs, as_json)
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-serve-") as tmp:
        result = {
            "bench": "serve",
            "machine": machine(),
            "staggered": staggered(Path(tmp), paragraphs),
            "load": load(Path(tmp), clients, turns, max_tokens),
        }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        s, ld = result["staggered"], result["load"]
        for row in s["rows"]:
            print(
                f"{row['policy']:>10}: A ({row['a_prompt_tokens']} prompt tokens) TTFT "
                f"{row['a_ttft_ms']:.0f} ms, B TTFT {row['b_ttft_ms']:.0f} ms"
            )
        print(
            f"B's TTFT {s['b_ttft_speedup']}x better interleaved; A's TTFT "
            f"{s['a_ttft_change_pct']:+.1f}%"
        )
        print(
            f"load: {ld['requests']} requests, {ld['errors']} errors, "
            f"{ld['requests_per_s']} req/s, {ld['tokens_per_s']} tok/s, TTFT p50 "
            f"{ld['ttft_p50_ms']} ms p99 {ld['ttft_p99_ms']} ms, first turn after restart: "
            f"{ld['post_restart_first_turn']}"
        )
    return result


def _run_tools(rounds: int, paragraphs: int, as_json: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-serve-") as tmp:
        result = {"bench": "serve --tools", "machine": machine()}
        result["tools"] = tools(Path(tmp), rounds, paragraphs)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        t = result["tools"]
        for r in t["rounds"]:
            print(
                f"call ({r['call_cache']}) {r['call_arguments']} in {r['call_ttft_ms']:.0f} ms; "
                f"answer after the result: {r['answer_cache']} {r['answer_match']}, "
                f"{r['answer_prefill_tokens']} prefilled, TTFT {r['answer_ttft_ms']:.0f} ms; "
                f"cold: {r['cold_prefill_tokens']} prefilled, TTFT {r['cold_ttft_ms']:.0f} ms"
            )
        print(
            f"answer after a tool result: TTFT p50 {t['answer_ttft_p50_ms']:.0f} ms hot vs "
            f"{t['cold_ttft_p50_ms']:.0f} ms cold ({t['speedup']}x); decode under a JSON "
            f"schema {t['constrained_vs_free_decode']}x free"
        )
    return result
