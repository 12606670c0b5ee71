"""Store version 3 (block files in groups) and the migration of version-2 stores
(``agentkv cache migrate``, store/migrate.py): a version-2 store loads as it is, migrates to
the same bits, and a migration killed at any point leaves every agent loadable."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import fill_table, pool_for, synthetic_spec, table_arrays, text_for

from agentkv import _ext
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.store.agent_store import AgentStore, DurableState, build_save_job
from agentkv.store.block_files import collect_block_files
from agentkv.store.format import GROUPS, PLANES, block_file_version, is_shared_file
from agentkv.store.migrate import Migration, migrate, regroup, rewrite_agent


def save(store, pool, agent, table):
    _, spans, text = text_for(table.length)
    job = build_save_job(
        pool.arena, table, agent_id=agent, keep=0, tokens=table.token_ids(), spans=spans,
        text=text, messages=None,
    )  # fmt: skip
    store.write(job, DurableState())


def loaded(store, agent):
    """The agent's stored KV read into a fresh pool (as a resume reads it)."""
    manifest, _ = store.read_manifest(agent)
    fresh = pool_for(store.spec)
    table = fresh.new_table(fresh.seed())
    items = []
    for i, src in enumerate(store.block_sources(manifest, agent, len(manifest.blocks))):
        block = fresh.blocks.allocate()
        table.attach(block, manifest.tokens[i * BLOCK_TOKENS : i * BLOCK_TOKENS + src.tokens])
        items.append((src, block))
    store.read_into(fresh.arena, agent, items)
    return table_arrays(fresh, table, manifest.token_count)


def versions(store, agent) -> set[int]:
    manifest, _ = store.read_manifest(agent)
    return {block_file_version(b.segment) for b in manifest.blocks if is_shared_file(b.segment)}


def as_version_2(store, agents):
    """Turn a store into what store version 2 wrote: block files in planes under their
    version-2 names; a manifest naming no version-3 file is written as version 2."""
    for agent in agents:
        rewrite_agent(store.model_dir, agent, 2, Migration())
    collect_block_files(store.model_dir)


@pytest.fixture
def stored(tmp_path):
    """Two agents sharing their first two blocks, saved, then turned into a version-2
    store: (store, {agent: the arrays it must load as})."""
    store = AgentStore(tmp_path / "kv", synthetic_spec(layers=3, heads=2), "synthetic")
    store.ensure_layout()
    pool = pool_for(store.spec, blocks=16)
    a = fill_table(pool, 900, positional=True)
    b = fill_table(pool, 700, positional=True)  # the same positions: blocks 0-1 shared
    save(store, pool, "a", a)
    save(store, pool, "b", b)
    want = {"a": table_arrays(pool, a), "b": table_arrays(pool, b)}
    as_version_2(store, want)
    return store, want


def test_regroup_round_trips_and_moves_each_group_into_one_extent():
    spec = synthetic_spec(layers=2, heads=3)
    pool = pool_for(spec)
    table = fill_table(pool, 256)
    planes, [(_, _, length, checksum, _)] = pool.arena.pack(table.blocks, [256], [PLANES])
    groups, [(_, _, _, grouped_checksum, _)] = pool.arena.pack(table.blocks, [256], [GROUPS])
    comps = spec.components(pool.quant)
    assert regroup(planes, comps, 256, GROUPS).tobytes() == groups.tobytes()
    assert regroup(groups, comps, 256, PLANES).tobytes() == planes.tobytes()
    assert _ext.block_checksum(groups) == grouped_checksum != checksum


def test_a_version_2_store_loads_then_migrates_to_the_same_bits(stored):
    store, want = stored
    for agent in want:
        manifest, _ = store.read_manifest(agent)
        assert manifest.store_version == 2 and versions(store, agent) == {2}
        for w, g in zip(want[agent], loaded(store, agent)):
            assert np.array_equal(w, g)
    (store.model_dir / "agents" / "no-manifest").mkdir()  # skipped, not reported
    report = migrate(store.root)
    # a: complete blocks 0-2 and a tail; b: blocks 0-1 (a's) and a tail: 3 block files
    assert (report.agents, report.switched, report.problems) == (2, 2, [])
    assert (report.written, report.reused) == (3, 2)
    assert report.collected == 3  # the version-2 files
    for agent in want:
        manifest, _ = store.read_manifest(agent)
        assert manifest.store_version == 3 and versions(store, agent) == {3}
        for w, g in zip(want[agent], loaded(store, agent)):
            assert np.array_equal(w, g)
    assert not [p for p in store.model_dir.glob("blocks/*/*") if block_file_version(p.name) == 2]
    again = migrate(store.root)
    assert (again.agents, again.switched, again.written, again.collected) == (2, 0, 0, 0)


def test_version_3_block_files_are_plain_safetensors_by_group(stored):
    """Any safetensors reader opens a version-3 block file: tensor ``l001.g2.k.w`` is layer
    1's rows 128-191 of that component."""
    from safetensors import safe_open

    store, want = stored
    migrate(store.root)
    manifest, _ = store.read_manifest("a")
    comps = manifest.components()
    per = len(comps[0])
    for index, block in enumerate(manifest.blocks[:3]):
        with safe_open(store.model_dir / block.segment, framework="numpy") as f:
            assert (
                f.get_tensor("tokens").tolist()
                == manifest.tokens[index * BLOCK_TOKENS : (index + 1) * BLOCK_TOKENS].tolist()
            )
            for layer in range(len(comps)):
                for c, comp in enumerate(comps[layer]):
                    rows = slice(index * BLOCK_TOKENS + 128, index * BLOCK_TOKENS + 192)
                    expected = want["a"][layer * per + c][:, rows]
                    got = f.get_tensor(f"l{layer:03d}.g2.{comp.name}")
                    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_a_damaged_version_2_file_leaves_its_agent_as_it_was(stored):
    store, want = stored
    manifest, _ = store.read_manifest("a")
    last = manifest.blocks[2]  # a's own third block
    path = store.model_dir / last.segment
    data = bytearray(path.read_bytes())
    data[last.offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    report = migrate(store.root)
    assert report.agents == 1 and len(report.problems) == 1
    assert "a:" in report.problems[0] and "checksum" in report.problems[0]
    assert versions(store, "a") == {2} and versions(store, "b") == {3}
    for w, g in zip(want["b"], loaded(store, "b")):
        assert np.array_equal(w, g)


# Every point a migration writes or deletes at (the block file, the manifest switch, the
# collection of the old files).
CRASH_POINTS = [
    "block-written",
    "block-renamed",
    "manifest-written",
    "manifest-renamed",
    "manifest-migrated",
    "block-collected",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_migration_killed_at_any_point_loads_and_a_rerun_finishes(stored, python_env, point):
    store, want = stored
    env = {**python_env, "AGENTKV_CRASH_AT": f"{point}:2"}
    command = [sys.executable, "-m", "agentkv.cli.main", "cache", "--cache-dir", str(store.root)]
    child = subprocess.run(
        [*command, "migrate"], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    for agent in want:
        for w, g in zip(want[agent], loaded(store, agent)):
            assert np.array_equal(w, g)
    rerun = subprocess.run(
        [*command, "migrate", "--json"], env=python_env, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["agents"] == 2
    for agent in want:
        assert versions(store, agent) == {3}
        for w, g in zip(want[agent], loaded(store, agent)):
            assert np.array_equal(w, g)
    names = {p.name for p in store.model_dir.glob("blocks/*/*")}
    assert len(names) == 3 and all(block_file_version(n) == 3 for n in names)


def test_cache_ls_names_version_2_files_until_migrated(stored, python_env):
    store, _ = stored
    command = [sys.executable, "-m", "agentkv.cli.main", "cache", "--cache-dir", str(store.root)]

    def run(*args):
        out = subprocess.run([*command, *args], env=python_env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "3 of them of store version 2" in run("ls")
    assert "2 agents on store version 3 (2 switched now)" in run("migrate")
    assert "store version 2" not in run("ls")


@pytest.mark.parametrize("version", [2, 3])
def test_a_written_block_file_reads_back_as_write_returned_it(tmp_path, version):
    """``SharedBlocks.write`` describes the file it wrote without reading it back: what a
    later ``find_file`` reads from the file (header checksum, sizes, tokens, parent) is the
    same, in both store versions."""
    store = AgentStore(tmp_path / "kv", synthetic_spec(layers=3, heads=2), "synthetic")
    store.ensure_layout()
    pool = pool_for(store.spec, blocks=4)
    table = fill_table(pool, 300, positional=True)
    table.seal_full()
    record = pool.blocks.records[table.blocks[0]]
    assert record.hash is not None
    layout = GROUPS if version == 3 else PLANES
    packed, regions = pool.arena.pack([table.blocks[0]], [BLOCK_TOKENS], [layout])
    _, offset, length, checksum, _ = regions[0]
    region = memoryview(packed)[offset : offset + length]
    with store.shared.writing():
        written = store.shared.write(
            record.hash, record.parent, record.tokens, region, checksum, version
        )
    assert block_file_version(written.name) == version
    assert store.shared.find_file(written.name, record.hash) == written
