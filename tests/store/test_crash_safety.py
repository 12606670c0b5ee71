"""A save killed at any point leaves the previous state or the new one, never a mix."""

import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import (
    SCRIPTS,
    TESTS,
    cache_arrays,
    fill_table,
    pool_for,
    synthetic_spec,
    table_arrays,
    text_for_count,
)

from agentkv.store.agent_store import AgentStore, build_save_job


def check_consistent(store) -> int:
    manifest, durable = store.read_manifest("crash")
    if manifest is None:
        return 0
    n = manifest.token_count
    ids, spans, text = text_for_count(n)
    assert manifest.tokens.tolist() == ids and manifest.text == text
    assert np.array_equal(manifest.spans, spans)
    pool = pool_for(store.spec, blocks=8)
    want = table_arrays(pool, fill_table(pool, n, positional=True, ids=ids))
    for w, g in zip(want, cache_arrays(store.load_caches(manifest, "crash", n))):
        assert np.array_equal(w, g)
    return n


# Every point of the save protocol, and what a restart must find if the process dies there:
# the state before the save ("old") or the one being saved ("new"), never a mix.
CRASH_POINTS = [
    ("block-written", "old"),  # a new shared block file written, not renamed
    ("block-renamed", "old"),  # the block file in place, no manifest names it yet
    ("segment-part-written", "old"),  # the new segment half written, not renamed
    ("segment-renamed", "old"),  # the segment in place, its directory entry not synced
    ("manifest-written", "old"),  # the new manifest written, not switched
    ("manifest-renamed", "new"),  # switched, the directory not synced
    ("manifest-switched", "new"),  # switched and synced, old segments still there
    ("garbage-removed", "new"),  # killed between deleting two dead segments
]


@pytest.mark.parametrize("point,expect", CRASH_POINTS, ids=[p for p, _ in CRASH_POINTS])
def test_a_save_killed_at_any_point_loads_as_the_old_or_the_new_state(
    tmp_path, python_env, point, expect
):
    root = tmp_path / "kv"
    store = AgentStore(root, synthetic_spec(), "synthetic")
    k = 0
    for hit in (1, 3):  # the first save, then a later one on top of older states
        prior = check_consistent(store)
        env = {**python_env, "AGENTKV_CRASH_AT": f"{point}:{hit}"}
        child = subprocess.run(
            [sys.executable, str(SCRIPTS / "save_loop.py"), str(root), str(TESTS), str(k)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr  # it died at the point
        lines = [line.split() for line in child.stdout.splitlines()]
        saving = [int(n) for word, _, n in lines if word == "saving"]
        saved = [int(n) for word, _, n in lines if word == "saved"]
        assert len(saving) == len(saved) + 1  # killed inside a save
        found = check_consistent(store)
        old = saved[-1] if saved else prior
        assert found == (saving[-1] if expect == "new" else old), (point, hit, lines)
        k = int(lines[-1][1])

    # Leftovers of killed saves (temporary files, orphan segments and block files) go with
    # the next save and the next collection.
    manifest, durable = store.read_manifest("crash")
    n = manifest.token_count
    ids, spans, text = text_for_count(n)
    pool = pool_for(store.spec, blocks=8)
    table = fill_table(pool, n, positional=True, ids=ids)
    job = build_save_job(
        pool.arena,
        table,
        agent_id="crash",
        keep=0,
        tokens=ids,
        spans=spans,
        text=text,
        messages=None,
    )
    store.write(job, durable)
    store.collect_blocks()
    manifest, _ = store.read_manifest("crash")
    names = {p.name for p in store.agent_dir("crash").iterdir()}
    private = {name for name in manifest.segments if not name.startswith("blocks/")}
    assert names == {".lock", "manifest.safetensors", *private}
    on_disk = {
        str(p.relative_to(store.model_dir)) for p in store.shared.dir.rglob("*") if p.is_file()
    }
    assert on_disk == {name for name in manifest.segments if name.startswith("blocks/")}
