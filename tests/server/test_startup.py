"""``agentkv serve`` starting up, as a new user meets it: the port is bound first, then the
model loads, then "serving" is said once it listens; every failure is one line and a
non-zero exit."""

from __future__ import annotations

import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import agentkv
from agentkv.benchmarks.server_process import free_port

DEADLINE_S = 120  # the longest a start may take here (loading the embedded model)


def _env(**extra: str) -> dict:
    env = dict(os.environ, **extra)
    root = str(Path(agentkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _serve(tmp_path: Path, port: int, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "agentkv.cli.main", "serve", "--port", str(port)]
    return args + ["--cache-dir", str(tmp_path / "kv"), "--log-level", "warning", *extra]


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=DEADLINE_S)


def test_a_port_in_use_fails_at_once_in_one_line_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run(_serve(tmp_path, port), _env())
    assert done.returncode != 0
    # The only line: no "loading" came before it (the model was not loaded).
    assert done.stderr.splitlines() == [
        f"agentkv: error: cannot serve on 127.0.0.1:{port}: in use (another server? --port "
        "picks another)"
    ]
    assert done.stdout == ""


def test_a_model_that_cannot_load_fails_in_one_line(tmp_path):
    done = _run(_serve(tmp_path, free_port(), "--model", "nosuchmodel"), _env(HF_HUB_OFFLINE="1"))
    assert done.returncode != 0
    loading, error = done.stderr.splitlines()  # no traceback, no uvicorn lines
    assert loading == "agentkv: loading nosuchmodel..."
    assert error.startswith("agentkv: error: cannot load model 'nosuchmodel': ")
    assert done.stdout == ""


def _bound_elsewhere(port: int) -> bool:
    """Whether another socket holds ``port`` on 127.0.0.1 (bound, listening or not)."""
    with socket.socket() as probe:  # no SO_REUSEADDR: any socket bound there refuses it
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return True
    return False


def test_serving_is_said_once_the_server_listens_after_one_loading_line(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        _serve(tmp_path, port),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    seen = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not seen or not seen[-1].startswith("agentkv: serving"):
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"no 'serving' line; stderr: {seen}"
            try:
                line = lines.get(timeout=min(left, 1.0)).rstrip("\n")
            except queue.Empty:
                continue
            seen.append(line)
            if line.startswith("agentkv: loading"):
                assert _bound_elsewhere(port)  # the port is taken before the model loads
        # Said once it listens: the first request gets an answer, with no retry.
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 200 and health.json()["model"] == "smollm2-135m-instruct"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert [x for x in seen if "loading" in x] == ["agentkv: loading smollm2-135m-instruct..."]
    assert seen[-1] == (
        f"agentkv: serving smollm2-135m-instruct on http://127.0.0.1:{port} (OpenAI "
        "/v1/chat/completions and /v1/responses, Anthropic /v1/messages, agents /v1/agents)"
    )


def test_a_host_that_cannot_be_bound_fails_in_one_line(tmp_path):
    host = "no-such-host.invalid"  # a name that never resolves (RFC 2606)
    done = _run(_serve(tmp_path, free_port(), "--host", host, "--api-key", "k"), _env())
    assert done.returncode != 0
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"agentkv: error: cannot serve on {host!r}: ")


def test_a_served_engine_builds_its_grammar_table_before_the_first_request(tmp_path):
    """The serve command's engines build the constrained decoding's token table on a
    background thread as they load (it took ~0.6 s of the first request with tools), and
    the first constrained turn then uses that table."""
    from agentkv import Constraint
    from agentkv.cli.parser import build_parser
    from agentkv.cli.serve import _engine_factory

    args = build_parser().parse_args(["serve", "--cache-dir", str(tmp_path / "kv")])
    engine = _engine_factory(args)(None)
    try:
        warm = [t for t in threading.enumerate() if t.name == "agentkv-grammar-warm"]
        assert warm, "no warm-up thread started"
        for thread in warm:
            thread.join(timeout=DEADLINE_S)
        table = engine.grammars._tokenizer
        assert table is not None
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        reply = engine.chat(
            "a",
            [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
            max_tokens=16,
            temperature=0,
            constraint=Constraint.json_schema(schema),
        )
        assert reply.text.startswith("{")
        assert engine.grammars._tokenizer is table  # built once, before the turn
    finally:
        engine.close()


def test_freezing_the_heap_keeps_no_garbage_of_an_earlier_freeze():
    """``freeze_heap`` keeps what the process holds out of the collector, yet an object that
    was frozen and became cyclic garbage since (a swapped-out model) is collected at the next
    freeze, not kept for good."""
    import gc
    import weakref

    from agentkv.cli.serve import freeze_heap

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    gone = weakref.ref(a)
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert gone() is not None  # frozen: a collection does not look at it
        freeze_heap()
        assert gone() is None
    finally:
        gc.unfreeze()
