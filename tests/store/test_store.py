"""AgentStore on real files: store version 3 (shared block files + private tails),
incremental saves, loading into the pool, store-version-1 files (version 2:
test_migrate.py), validation, quarantine."""

import dataclasses
import json
import os
import struct

import numpy as np
import pytest
from helpers import cache_arrays, fill_table, pool_for, synthetic_spec, table_arrays, text_for

from agentkv import _ext
from agentkv.errors import CacheFormatError, InvalidAgentIdError
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.store.agent_store import AgentStore, DurableState, build_save_job
from agentkv.store.format import MANIFEST_NAME, decode_manifest, encode_manifest


def save(store, pool, agent, table, durable=None, keep=0, messages=None, tokens=None):
    n = table.length
    ids, spans, text = text_for(n)
    job = build_save_job(
        pool.arena,
        table,
        agent_id=agent,
        keep=keep,
        tokens=tokens if tokens is not None else table.token_ids()[:n],
        spans=spans,
        text=text,
        messages=messages,
    )
    return store.write(job, durable or DurableState())


@pytest.fixture
def store(tmp_path):
    s = AgentStore(tmp_path / "kv", synthetic_spec(), "synthetic")
    s.ensure_layout()
    return s


@pytest.fixture
def pool(store):
    return pool_for(store.spec)


def loaded_into_pool(store, agent, tokens):
    """Read an agent's stored blocks into a fresh pool; the arrays they hold."""
    manifest, _ = store.read_manifest(agent)
    fresh = pool_for(store.spec)
    table = fresh.new_table(fresh.seed())
    sources = store.block_sources(manifest, agent, -(-tokens // BLOCK_TOKENS))
    items = []
    for i, src in enumerate(sources):
        block = fresh.blocks.allocate()
        table.attach(block, manifest.tokens[i * BLOCK_TOKENS : i * BLOCK_TOKENS + src.tokens])
        items.append((src, block))
    store.read_into(fresh.arena, agent, items)
    table.seal_full()
    return table_arrays(fresh, table, tokens)


def test_save_and_load_round_trip(store, pool):
    table = fill_table(pool, 600)
    report, durable = save(store, pool, "a1", table, messages=[{"role": "user", "content": "hi"}])
    manifest, read_durable = store.read_manifest("a1")
    ids, spans, text = text_for(600)
    assert manifest.tokens.tolist() == ids and manifest.text == text
    assert np.array_equal(manifest.spans, spans)
    assert manifest.messages == [{"role": "user", "content": "hi"}]
    assert read_durable.signature == durable.signature and read_durable.generation == 1
    # Two complete blocks in shared block files named by their chain hashes, the tail private.
    assert [b.segment.startswith("blocks/") for b in manifest.blocks] == [True, True, False]
    assert [b.hash is not None for b in manifest.blocks] == [True, True, False]
    want = table_arrays(pool, table)
    for got in (
        cache_arrays(store.load_caches(manifest, "a1", 600)),
        loaded_into_pool(store, "a1", 600),
    ):
        for w, g in zip(want, got):
            assert np.array_equal(w, g)


def test_files_are_private(store, pool):
    save(store, pool, "a1", fill_table(pool, 300))
    directory = store.agent_dir("a1")
    assert directory.stat().st_mode & 0o777 == 0o700
    files = [*directory.iterdir(), *store.shared.dir.rglob("*.safetensors")]
    assert len(files) >= 4
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600, f


def test_incremental_save_writes_only_new_blocks(store, pool):
    table = fill_table(pool, 1000)
    full, durable = save(store, pool, "a1", table)
    block_bytes = pool.block_bytes
    # 64 more tokens: the partial block 3 is written again, blocks 0-2 stay where they are.
    fill_table(pool, 1064, table=table)
    part, _ = save(store, pool, "a1", table, durable=durable, keep=3)
    assert part.blocks_written == 2 and full.blocks_written == 4
    assert part.bytes_written < block_bytes * 2 < full.bytes_written
    manifest, _ = store.read_manifest("a1")
    assert [b.segment for b in manifest.blocks[3:]] == [
        manifest.blocks[3].segment,
        "seg-00000002.safetensors",
    ]
    want = table_arrays(pool, table)
    for w, g in zip(want, loaded_into_pool(store, "a1", 1064)):
        assert np.array_equal(w, g)


def test_agents_sharing_a_prefix_store_its_blocks_once(store, pool):
    a = fill_table(pool, 700, seed=1)
    save(store, pool, "a", a)
    b = pool.new_table(pool.seed())
    for block in a.blocks[:2]:  # b shares a's first 512 tokens, then goes its own way
        b.adopt(block)
    fill_table(pool, 900, seed=2, table=b, ids=a.token_ids()[:512] + list(range(388)))
    before = {p.name for p in store.shared.dir.rglob("*.safetensors")}
    report, _ = save(store, pool, "b", b)
    after = {p.name for p in store.shared.dir.rglob("*.safetensors")}
    assert len(before) == 2 and len(after) == 3  # only b's third block is new
    assert report.bytes_written < 2 * pool.block_bytes
    ma, _ = store.read_manifest("a")
    mb, _ = store.read_manifest("b")
    assert [x.segment for x in ma.blocks[:2]] == [x.segment for x in mb.blocks[:2]]
    for w, g in zip(table_arrays(pool, b), loaded_into_pool(store, "b", 900)):
        assert np.array_equal(w, g)


def test_block_files_are_collected_only_when_no_manifest_names_them(store, pool):
    a = fill_table(pool, 600, seed=1)
    save(store, pool, "a", a)
    b = pool.new_table(pool.seed())
    b.adopt(a.blocks[0])
    fill_table(pool, 300, table=b, ids=a.token_ids()[:256] + list(range(44)))
    save(store, pool, "b", b)
    assert store.collect_blocks() == 0  # every file is named
    stray = store.shared.dir / "ab" / ("ab" * 32 + ".safetensors")
    stray.parent.mkdir()
    stray.write_bytes(b"left by a crashed save")
    (stray.parent / ".x.tmp").write_bytes(b"")
    store.delete("a")
    assert store.collect_blocks() == 3  # a's second block, the stray file, the temp file
    names = {p.name for p in store.shared.dir.rglob("*") if p.is_file()}
    mb, _ = store.read_manifest("b")
    assert names == {mb.blocks[0].segment.rsplit("/", 1)[1]}
    for w, g in zip(table_arrays(pool, b), loaded_into_pool(store, "b", 300)):
        assert np.array_equal(w, g)


def test_store_version_1_manifests_still_load(store, pool):
    """A state written before shared blocks existed: every block in the agent's segment."""
    table = fill_table(pool, 600)
    records = [pool.blocks.records[b] for b in table.blocks]
    hashes = [r.hash for r in records]
    for r in records:  # blocks as version 1 knew them: no hashes, all in the segment
        r.hash = None
    job = build_save_job(
        pool.arena,
        table,
        agent_id="old",
        keep=0,
        tokens=table.token_ids(),
        spans=text_for(600)[1],
        text=text_for(600)[2],
        messages=None,
    )
    for r, digest in zip(records, hashes):
        r.hash = digest
    store.write(job, DurableState())
    path = store.manifest_path("old")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    from safetensors.numpy import load
    from safetensors.numpy import save as st_save

    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    record = json.loads(meta["agentkv"])
    record["format_version"] = 1
    record["blocks"] = [entry[:5] for entry in record["blocks"]]
    del record["chain_seed"]
    meta["agentkv"] = json.dumps(record)
    meta["agentkv_crc32c"] = str(_ext.crc32c(meta["agentkv"].encode()))
    path.write_bytes(st_save(load(data), metadata=meta))
    manifest, _ = store.read_manifest("old")
    assert manifest.store_version == 1 and all(b.hash is None for b in manifest.blocks)
    for w, g in zip(table_arrays(pool, table), loaded_into_pool(store, "old", 600)):
        assert np.array_equal(w, g)


def test_old_segments_are_collected_after_the_switch(store, pool):
    table = fill_table(pool, 300)
    _, d = save(store, pool, "a1", table)
    _, d = save(store, pool, "a1", table, durable=d, keep=0)
    names = sorted(p.name for p in store.agent_dir("a1").iterdir())
    assert names == [".lock", MANIFEST_NAME, "seg-00000002.safetensors"]


def test_a_second_writer_is_refused_not_overwritten(store, pool):
    table = fill_table(pool, 300)
    _, stale = save(store, pool, "a1", table)
    save(store, pool, "a1", table, durable=stale)  # another process moved on
    from agentkv.store.agent_store import StoreConflictError

    before = (store.agent_dir("a1") / MANIFEST_NAME).read_bytes()
    with pytest.raises(StoreConflictError, match="changed on disk"):
        save(store, pool, "a1", table, durable=stale)
    assert (store.agent_dir("a1") / MANIFEST_NAME).read_bytes() == before


def test_a_save_does_not_build_on_blocks_an_earlier_failed_save_did_not_replace(store, pool):
    """The disk holds blocks [A, B]; a turn diverged after A, so save 1 (keep 1) would write
    B'; save 2 (keep 2) builds on [A, B']. Save 1 fails: save 2 must not name B with the new
    tokens. It is refused and the disk keeps [A, B]."""
    from agentkv.store.agent_store import StoreConflictError

    old = fill_table(pool, 2 * BLOCK_TOKENS + 10, seed=1)
    _, durable = save(store, pool, "diverged", old)
    new = fill_table(pool, 2 * BLOCK_TOKENS + 10, seed=2, ids=text_for(2 * BLOCK_TOKENS + 10, 2)[0])
    assert new.blocks[0] != old.blocks[0]  # other tokens: other blocks
    before = store.manifest_path("diverged").read_bytes()
    with pytest.raises(StoreConflictError, match="earlier save failed"):
        save(store, pool, "diverged", new, durable=durable, keep=2)
    assert store.manifest_path("diverged").read_bytes() == before


@pytest.mark.parametrize(
    "agent_id",
    ["", ".", "..", "a/b", "../etc", "a" * 129, "über", "a b", "a\x00b", 5, None, "x\n"],
)
def test_hostile_agent_ids_are_rejected_before_touching_disk(store, agent_id):
    before = sorted(store.root.rglob("*"))
    with pytest.raises(InvalidAgentIdError):
        store.read_manifest(agent_id)
    assert sorted(store.root.rglob("*")) == before


def test_valid_agent_ids(store):
    for agent_id in ("a", "A.b-c_d", "x" * 128, "..."):
        assert store.agent_dir(agent_id).name == agent_id


# -- bad files ---------------------------------------------------------------------


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip":
        data[len(data) - 2000] ^= 0x40
    elif how == "garbage_header":
        data[8:40] = b"\x00garbage!garbage!garbage!garbag"
    elif how == "huge_header":
        data[:8] = struct.pack("<Q", 2**62)
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage_header", "huge_header", "empty"])
def test_bad_manifest_is_reported_with_its_path(store, pool, how):
    save(store, pool, "a1", fill_table(pool, 300))
    path = store.agent_dir("a1") / MANIFEST_NAME
    corrupt(path, how)
    with pytest.raises(CacheFormatError) as info:
        store.read_manifest("a1")
    assert str(path) in str(info.value)


def rewrite_record(path, change):
    """Re-encode a manifest with its JSON record changed (checksums recomputed)."""
    data = path.read_bytes()
    manifest = decode_manifest(data, path)
    change(manifest)
    path.write_bytes(encode_manifest(manifest))


def test_wrong_fingerprint_and_geometry_are_rejected(store, pool):
    save(store, pool, "a1", fill_table(pool, 300))
    path = store.agent_dir("a1") / MANIFEST_NAME
    rewrite_record(path, lambda m: setattr(m, "model_fingerprint", "0" * 64))
    with pytest.raises(CacheFormatError, match="fingerprint"):
        store.read_manifest("a1")
    rewrite_record(path, lambda m: setattr(m, "model_fingerprint", store.spec.fingerprint))
    store.read_manifest("a1")
    rewrite_record(path, lambda m: m.geometry.update(attention_sinks=True))
    with pytest.raises(CacheFormatError, match="geometry"):
        store.read_manifest("a1")


def test_a_block_record_naming_another_hash_is_rejected(store, pool):
    save(store, pool, "a1", fill_table(pool, 600))
    path = store.agent_dir("a1") / MANIFEST_NAME

    def swap(m):
        m.blocks[0] = dataclasses.replace(m.blocks[0], segment=m.blocks[1].segment)

    rewrite_record(path, swap)
    with pytest.raises(CacheFormatError, match="not its hash's"):
        store.read_manifest("a1")


def test_unknown_store_version_is_rejected(store, pool):
    from safetensors.numpy import load
    from safetensors.numpy import save as st_save

    save(store, pool, "a1", fill_table(pool, 300))
    path = store.agent_dir("a1") / MANIFEST_NAME
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    record = json.loads(meta["agentkv"])
    record["format_version"] = 99
    meta["agentkv"] = json.dumps(record)  # as a future agentkv would write it
    meta["agentkv_crc32c"] = str(_ext.crc32c(meta["agentkv"].encode()))
    path.write_bytes(st_save(load(data), metadata=meta))
    with pytest.raises(CacheFormatError, match="unknown store version 99"):
        store.read_manifest("a1")


def test_edited_record_fails_its_checksum(store, pool):
    save(store, pool, "a1", fill_table(pool, 300))
    path = store.agent_dir("a1") / MANIFEST_NAME
    data = path.read_bytes()
    tampered = data.replace(b'\\"token_count\\":300', b'\\"token_count\\":301')
    assert tampered != data
    path.write_bytes(tampered)
    with pytest.raises(CacheFormatError, match="record checksum"):
        store.read_manifest("a1")


@pytest.mark.parametrize("which", ["segment", "block file"])
@pytest.mark.parametrize("how", ["truncate", "flip", "missing"])
def test_a_bad_file_fails_the_load_naming_it(store, pool, how, which):
    save(store, pool, "a1", fill_table(pool, 300))
    manifest, _ = store.read_manifest("a1")
    record = manifest.blocks[1 if which == "segment" else 0]
    path = store.file_path("a1", record.segment)
    if how == "missing":
        path.unlink()
    else:
        corrupt(path, how)
    with pytest.raises(CacheFormatError) as info:
        loaded_into_pool(store, "a1", 300)
    assert str(path) in str(info.value)
    with pytest.raises(CacheFormatError) as info:
        store.load_caches(manifest, "a1", 300)
    assert str(path) in str(info.value)


def test_a_damaged_block_file_is_not_found_and_goes_to_quarantine(store, pool):
    table = fill_table(pool, 300)
    save(store, pool, "a1", table)
    digest = pool.blocks.records[table.blocks[0]].hash
    assert store.find_shared(digest) is not None
    path = next(store.shared.dir.rglob("*.safetensors"))
    corrupt(path, "truncate")
    assert store.find_shared(digest) is None
    assert not path.exists()
    kept = list((store.quarantine_dir / "blocks").iterdir())
    assert len(kept) == 2 and any(p.name.endswith(".REASON.txt") for p in kept)


def test_quarantine_keeps_every_file(store, pool):
    save(store, pool, "a1", fill_table(pool, 300))
    files = sorted(p.name for p in store.agent_dir("a1").iterdir())
    moved = store.quarantine("a1", "testing")
    assert not store.agent_dir("a1").exists()
    assert sorted(p.name for p in moved.iterdir()) == sorted(files + ["QUARANTINE_REASON.txt"])
    assert (moved / "QUARANTINE_REASON.txt").read_text().strip() == "testing"
    assert moved.parent == store.quarantine_dir
    assert store.collect_blocks() == 0  # a quarantined manifest still names its blocks


def test_missing_manifest_means_no_state(store, pool):
    save(store, pool, "a1", fill_table(pool, 300))
    os.unlink(store.agent_dir("a1") / MANIFEST_NAME)
    assert store.read_manifest("a1")[0] is None
    assert store.read_manifest("never-seen")[0] is None


def test_a_block_file_is_reused_only_for_the_bytes_it_holds(store, pool):
    """Two agents hold the same tokens but other bytes (as an agent computed by an earlier
    agentkv or another machine would): the second does not take the first one's block files
    for its own; it writes *variants*, named by the hash and its bytes' checksum, and each
    loads back its own bytes. A third with the first one's bytes reuses its files."""
    from agentkv.store.format import block_file_name, is_variant

    ids = text_for(600, 1)[0]
    a = fill_table(pool, 600, seed=1)
    elsewhere = pool_for(store.spec)  # (in one pool, b's blocks would seal as a's)
    b = fill_table(elsewhere, 600, seed=2, ids=ids)  # the same tokens, other bytes
    save(store, pool, "a", a)
    report, _ = save(store, elsewhere, "b", b)
    ma, _ = store.read_manifest("a")
    mb, _ = store.read_manifest("b")
    for x, y in zip(ma.blocks[:2], mb.blocks[:2]):
        assert x.hash == y.hash and x.checksum != y.checksum
        assert x.segment == block_file_name(bytes.fromhex(x.hash)) and not is_variant(x.segment)
        assert y.segment == block_file_name(bytes.fromhex(y.hash), 3, y.checksum)
    assert report.bytes_written > 2 * pool.block_bytes  # b's own two block files
    for agent, table, held in (("a", a, pool), ("b", b, elsewhere)):
        for w, g in zip(table_arrays(held, table), loaded_into_pool(store, agent, 600)):
            assert np.array_equal(w, g)
    c_pool = pool_for(store.spec)
    c = fill_table(c_pool, 600, seed=1)  # a's bytes again
    again, _ = save(store, c_pool, "c", c)
    mc, _ = store.read_manifest("c")
    assert [x.segment for x in mc.blocks[:2]] == [x.segment for x in ma.blocks[:2]]
    assert again.bytes_written < pool.block_bytes  # only its tail
    # KVSwap's block files are the same ones: the pool's bytes, checked, never the others'.
    with store.shared.writing():
        files = store.shared.ensure_pool_blocks(elsewhere, b.blocks[:2])
    assert [f.path for f in files] == [str(store.model_dir / y.segment) for y in mb.blocks[:2]]
    assert [f.checksum for f in files] == [y.checksum for y in mb.blocks[:2]]
    assert store.collect_blocks() == 0  # every file is named
