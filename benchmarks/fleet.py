"""Fleet: two ``agentkv serve`` processes, each with a cache directory of its own, on one
S3-compatible store (docs/fleet.md). Everything goes through real servers on 127.0.0.1 and
their OpenAI endpoint, streaming; TTFT is measured at the client.

* handoff: each agent's first turn (~``context`` tokens, cold) on server A; its second turn
  on server B, whose cache directory is empty: B fetches it from the store and should resume
  it warm, every stored token reused. B is then restarted (its memory gone, its disk kept)
  and each agent's third turn is warm from B's own disk. The figures: B's TTFT from the store
  against B's from its disk (target <= 3x) and against the cold prefill (target >= 10x).
* bytes: the bytes A uploaded against what its saves wrote (its cache directory; target
  <= 1.2x), and the same for B's own turns (what it uploaded against what it wrote).
* race: ``race_turns`` turns at once on ``race_agents`` agents, alternating between the two
  servers, each continuing the agent's history with a question of its own. Each answer is
  200 (its turn kept) or 409 ``agent_busy`` (refused); afterwards each agent's history in the
  store must be its base history plus exactly one accepted turn (a serial order of accepted
  turns, each of which starts from the base here), with no 5xx.
* outage (a local store only): the link to the store is cut (a TCP relay in front of it), one
  turn per agent runs on A, the link comes back; 0 5xx expected, turns noted, A's uploads
  catch up; then every agent is pulled into a fresh directory and ``cache verify`` checks it.

With ``--store`` the servers use that store (the AWS_* variables as set); without it a local
moto server (``moto[server]``) is started on 127.0.0.1 with the relay in front.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import emit, progress
from .local_s3 import BUCKET, S3Server, StoreLink, aws_env, free_port
from .serve import FILLER, model_id, stream_turn
from .server_process import ServerProcess

TOKENS_PER_SECTION = 59  # about, for the embedded model's tokenizer (one FILLER section)


def run(
    *,
    agents: int = 8,
    context: int = 4096,
    race_agents: int = 4,
    race_turns: int = 16,
    store: str | None = None,
    as_json: bool = False,
) -> None:
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-fleet-") as tmp:
        root = Path(tmp)
        moto = link = None
        env = dict(os.environ)
        if store is None:
            try:
                import moto.server  # noqa: F401
            except ImportError:
                raise SystemExit(
                    "agentkv: error: bench fleet needs --store s3://bucket/prefix, or "
                    "moto[server] installed for a local store (pip install 'agentkv[bench]')"
                ) from None
            moto = S3Server(free_port()).start()
            link = StoreLink(moto.port).restore()
            env.update(aws_env(link.endpoint))
            os.environ.update(aws_env(link.endpoint))  # this process reads the store too
            store = f"s3://{BUCKET}/fleet"
        servers = [ServerProcess(root / name / "kv", env, "--store", store) for name in ("a", "b")]
        try:
            for s in servers:
                s.start()
            result = _phases(root, servers, env, store, link, agents, context, race_agents,
                             race_turns)  # fmt: skip
        finally:
            for s in servers:
                s.stop()
            if link is not None:
                link.cut()
            if moto is not None:
                moto.stop()
    rows, extra = result
    emit("fleet", rows, as_json, extra)


def _phases(root, servers, env, store, link, agents, context, race_agents, race_turns):
    a, b = servers
    ids = [f"fleet-{i}" for i in range(agents)]
    histories = {agent: _first_messages(agent, context) for agent in ids}
    rows = []
    progress(f"handoff: {agents} agents of ~{context} tokens, A cold then B from the store")
    for agent in ids:
        cold = _turn(a, agent, histories[agent])
        fetched = _turn(b, agent, histories[agent])
        rows.append({"agent": agent, "cold": cold, "from_store": fetched})
    a_moved, b_moved = _store_bytes(a), _store_bytes(b)
    b.stop()
    b.start()  # its memory gone, its disk kept
    for row in rows:
        row["from_disk"] = _turn(b, row["agent"], histories[row["agent"]])
    race = _race(servers, histories, ids[:race_agents], race_turns)
    outage = _outage(a, histories, ids, link) if link is not None else None
    verified = _verify(root / "verify", env, store)
    table = [_summary(row) for row in rows]
    extra = {
        "context_tokens": context,
        "handoff": {
            "all_warm_from_store": all(r["from_store"]["cache"] == "warm" for r in rows),
            "all_reused_in_full": all(_reused_in_full(r["from_store"]) for r in rows),
            "median_store_vs_disk": _median([t["store_vs_disk"] for t in table]),
            "median_cold_vs_store": _median([t["cold_vs_store"] for t in table]),
        },
        "bytes": {  # uploaded against what the saves wrote, each server's handoff turns
            "a_uploaded": a_moved["up"],
            "a_saved": a_moved["saved"],
            "a_ratio": _ratio(a_moved["up"], a_moved["saved"]),
            "b_fetched": b_moved["down"],
            "b_uploaded": b_moved["up"],
            "b_saved": b_moved["saved"],
            "b_ratio": _ratio(b_moved["up"], b_moved["saved"]),
        },
        "race": race,
        "outage": outage,
        "verify": verified,
        "note": "one machine, two CPU cores shared with other work; timings move 25-60%",
    }
    return table, extra


def _first_messages(agent: str, context: int) -> list[dict]:
    sections = max(1, context // TOKENS_PER_SECTION)
    text = "".join(FILLER.format(i=f"{agent}-{i}") for i in range(sections))
    return [
        {"role": "system", "content": "You answer questions about this archive.\n" + text},
        {"role": "user", "content": "Which record comes first?"},
    ]


def _turn(server, agent: str, messages: list[dict], question: str | None = None) -> dict:
    """A turn continuing ``messages`` (with ``question``, else a new one): the history
    grows by the question and the reply."""
    question = question or f"And then? ({len(messages)})"
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": question})
    out = stream_turn(server.url, agent, messages, 8)
    if out["error"] is None:
        messages.append({"role": "assistant", "content": out["text"]})
    return out


def _summary(row: dict) -> dict:
    cold, store, disk = row["cold"], row["from_store"], row["from_disk"]

    def ms(turn):
        return round(turn["ttft_s"] * 1000, 1) if turn.get("ttft_s") else None

    stats = store.get("agentkv") or {}
    return {
        "agent": row["agent"],
        "cold_ttft_ms": ms(cold),
        "store_cache": store.get("cache"),
        "store_reused": stats.get("reused_tokens"),
        "store_stored": stats.get("stored_tokens"),
        "store_ttft_ms": ms(store),
        "disk_cache": disk.get("cache"),
        "disk_ttft_ms": ms(disk),
        "store_vs_disk": _ratio(ms(store), ms(disk)),
        "cold_vs_store": _ratio(ms(cold), ms(store)),
    }


def _reused_in_full(turn: dict) -> bool:
    stats = turn.get("agentkv") or {}
    return bool(stats) and stats.get("reused_tokens") == stats.get("stored_tokens") > 0


def _race(servers, histories, agents: list[str], turns: int) -> dict:
    progress(f"race: {turns} turns at once on {len(agents)} agents across both servers")
    jobs = []
    for i in range(turns):
        agent = agents[i % len(agents)]
        messages = [*histories[agent], {"role": "user", "content": f"Race question {i}?"}]
        jobs.append((servers[(i // len(agents)) % 2], agent, messages))  # each agent on both
    with ThreadPoolExecutor(turns) as pool:
        outs = list(pool.map(lambda job: _whole_turn(*job), jobs))
    accepted: dict[str, list[str]] = {agent: [] for agent in agents}
    refused, errors = 0, []
    for (_, agent, messages), (status, body) in zip(jobs, outs):
        if status == 200:
            accepted[agent].append(messages[-1]["content"])
        elif status == 409 and body.get("error", {}).get("code") == "agent_busy":
            refused += 1
        else:
            errors.append(f"HTTP {status}: {json.dumps(body)[:300]}")
    time.sleep(1.0)  # the background commits of the last turns
    mixed = 0
    for agent in agents:
        final = _stored_history(servers[0], agent)
        base = histories[agent]
        if not (
            final is not None
            and len(final) == len(base) + 2
            and _texts(final[: len(base)]) == _texts(base)
            and final[len(base)]["content"] in accepted[agent]
        ):
            mixed += 1
        if final is not None:
            histories[agent] = final  # the next turns continue the store's history
    return {
        "turns": turns,
        "accepted": sum(len(v) for v in accepted.values()),
        "refused_409": refused,
        "other_errors": len(errors),
        "errors": sorted(set(errors)),
        "agents_with_history_not_a_serial_order": mixed,
    }


def _whole_turn(server, agent: str, messages: list[dict]) -> tuple[int, dict]:
    """One turn not streamed (its answer comes once it is committed): status and body."""
    import httpx

    body = {"model": model_id(server.url), "messages": messages, "max_tokens": 8}
    body["temperature"] = 0
    try:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json=body,
            headers={"x-agent-id": agent},
            timeout=600,
        )
        return r.status_code, r.json()
    except Exception as exc:  # counted as an error, the run goes on
        return 0, {"exception": f"{type(exc).__name__}: {exc}"}


def _texts(messages: list[dict]) -> list[tuple]:
    return [(m.get("role"), m.get("content")) for m in messages]


def _stored_history(server, agent: str) -> list[dict] | None:
    """The agent's messages as the store holds them (read through the server's own store)."""
    from agentkv.store.objects import ObjectStore
    from agentkv.store.remote import RemoteAgents, stored_models

    objects = ObjectStore(_store_of(server))
    for model in stored_models(objects):
        remote = RemoteAgents(objects, Path(model), threads=2)
        try:
            fetched = remote.fetch(agent)
        finally:
            remote.close()
        if fetched is not None:
            return fetched.manifest.messages
    return None


def _store_of(server) -> str:
    return server.extra[server.extra.index("--store") + 1]


def _outage(a, histories, ids, link) -> dict:
    progress("outage: the store's link cut, one turn per agent on A, then restored")
    for agent in ids:  # A takes every agent over first (fetching the newest from the store)
        _turn(a, agent, histories[agent])
    link.cut()
    outs = [_turn(a, agent, histories[agent]) for agent in ids]
    link.restore()
    server_errors = sum(1 for o in outs if o["error"] and "HTTP 5" in o["error"])
    noted = sum(1 for o in outs if "could not be reached" in str(o.get("agentkv") or {}))
    deadline = time.monotonic() + 120
    while _pending(a) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {
        "turns": len(outs),
        "http_5xx": server_errors,
        "other_errors": sum(1 for o in outs if o["error"]) - server_errors,
        "turns_noted": noted,
        "notes": sorted({str((o.get("agentkv") or {}).get("reuse_note")) for o in outs}),
        "pending_uploads_after": _pending(a),
    }


def _verify(directory: Path, env: dict, store: str) -> dict:
    """Every agent pulled from the store into an empty directory, then ``cache verify``."""
    cli = [sys.executable, "-m", "agentkv.cli.main", "cache", "--cache-dir", str(directory)]
    pulled = subprocess.run([*cli, "pull", "--store", store, "--json"], env=env,
                            capture_output=True, text=True)  # fmt: skip
    checked = subprocess.run([*cli, "verify"], env=env, capture_output=True, text=True)
    records = json.loads(pulled.stdout) if pulled.stdout.strip() else []
    last = checked.stdout.strip().splitlines()[-1] if checked.stdout.strip() else ""
    return {
        "pulled": sum(1 for r in records if r["outcome"] == "moved"),
        "pull_errors": sum(1 for r in records if r["error"]),
        "verify": last,
        "verify_exit": checked.returncode,
    }


def _metrics(server) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("agentkv_store", "agentkv_kv_saved")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _store_bytes(server) -> dict[str, int]:
    """Bytes the server sent to and read from the store, and its saves wrote to disk."""
    m = _metrics(server)
    out = {d: int(m.get(f'agentkv_store_bytes{{direction="{d}"}}', 0)) for d in ("up", "down")}
    out["saved"] = int(m.get("agentkv_kv_saved_bytes", 0))
    return out


def _pending(server) -> int:
    return int(_metrics(server).get("agentkv_store_pending_uploads", 0))


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None
