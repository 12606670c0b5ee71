"""A save killed at any point leaves the previous state or the new one, never a mix."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from helpers import held_arrays, positional_caches, synthetic_spec, text_for_count

from agentkv.store.agent_store import AgentStore, build_save_job

HERE = Path(__file__).parent


def check_consistent(store) -> int:
    manifest, durable = store.read_manifest("crash")
    if manifest is None:
        return 0
    n = manifest.token_count
    ids, spans, text = text_for_count(n)
    assert manifest.tokens.tolist() == ids and manifest.text == text
    assert np.array_equal(manifest.spans, spans)
    want = positional_caches(store.spec, n)
    got = store.load_caches(manifest, "crash", n)
    for a, b in zip(want, got):
        for x, y in zip(held_arrays(a), held_arrays(b)):
            assert np.array_equal(x, y)
    return n


def test_killed_saves_always_load_as_a_whole_state(tmp_path, python_env):
    root = tmp_path / "kv"
    store = AgentStore(root, synthetic_spec(), "synthetic")
    rng = random.Random(1234)
    seen = set()
    for _ in range(12):
        child = subprocess.Popen(
            [sys.executable, str(HERE / "scripts" / "save_loop.py"), str(root), str(HERE)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=python_env,
            text=True,
        )
        first_line = child.stdout.readline()  # wait until the child is saving
        assert first_line, child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        seen.add(check_consistent(store))
    assert len(seen) > 3  # the kills landed in different states

    # Leftovers of killed saves (temporary files, orphan segments) go with the next save.
    manifest, durable = store.read_manifest("crash")
    n = manifest.token_count
    ids, spans, text = text_for_count(n)
    job = build_save_job(
        store.spec,
        "crash",
        positional_caches(store.spec, n),
        tokens=ids,
        spans=spans,
        text=text,
        messages=None,
        first_block=0,
    )
    store.write(job, durable)
    manifest, _ = store.read_manifest("crash")
    names = {p.name for p in store.agent_dir("crash").iterdir()}
    assert names == {".lock", "manifest.safetensors", *manifest.segments}
