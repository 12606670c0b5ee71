"""AgentStore on real files: format, incremental saves, validation, quarantine."""

import json
import os
import struct

import numpy as np
import pytest
from helpers import filled_caches, held_arrays, synthetic_spec, text_for

from agentkv import _ext
from agentkv.errors import CacheFormatError, InvalidAgentIdError
from agentkv.store.agent_store import AgentStore, DurableState, build_save_job
from agentkv.store.format import MANIFEST_NAME, decode_manifest, encode_manifest


def save(store, agent, caches, tokens, durable=None, first_block=0, messages=None):
    ids, spans, text = text_for(tokens)
    job = build_save_job(
        store.spec,
        agent,
        caches,
        tokens=ids,
        spans=spans,
        text=text,
        messages=messages,
        first_block=first_block,
    )
    return store.write(job, durable or DurableState())


@pytest.fixture
def store(tmp_path):
    s = AgentStore(tmp_path / "kv", synthetic_spec(), "synthetic")
    s.ensure_layout()
    return s


def test_save_and_load_round_trip(store):
    caches = filled_caches(store.spec, 600)
    report, durable = save(store, "a1", caches, 600, messages=[{"role": "user", "content": "hi"}])
    manifest, read_durable = store.read_manifest("a1")
    ids, spans, text = text_for(600)
    assert manifest.tokens.tolist() == ids and manifest.text == text
    assert np.array_equal(manifest.spans, spans)
    assert manifest.messages == [{"role": "user", "content": "hi"}]
    assert read_durable.signature == durable.signature and read_durable.generation == 1
    loaded = store.load_caches(manifest, "a1", 600)
    for a, b in zip(caches, loaded):
        assert b.offset == 600 and b.capacity >= 600 + 256
        for x, y in zip(held_arrays(a), held_arrays(b)):
            assert np.array_equal(x, y)


def test_files_are_private(store):
    save(store, "a1", filled_caches(store.spec, 10), 10)
    directory = store.agent_dir("a1")
    assert directory.stat().st_mode & 0o777 == 0o700
    for f in directory.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600, f


def test_incremental_save_writes_only_new_blocks(store):
    caches = filled_caches(store.spec, 1000)
    full, durable = save(store, "a1", caches, 1000)
    block_bytes = store.spec.bytes_per_token(caches[0].quant) * 256
    # 64 more tokens: the partial block 3 is rewritten, blocks 0-2 stay where they are.
    grown = filled_caches(store.spec, 1064)
    part, durable2 = save(store, "a1", grown, 1064, durable=durable, first_block=1000 // 256)
    assert part.blocks_written == 2 and full.blocks_written == 4
    assert part.bytes_written < block_bytes * 2 < full.bytes_written
    manifest, _ = store.read_manifest("a1")
    assert {b.segment for b in manifest.blocks} == {
        "seg-00000001.safetensors",
        "seg-00000002.safetensors",
    }
    loaded = store.load_caches(manifest, "a1", 1064)
    # blocks 0-2 came from the first save (same data: filled_caches is seeded)
    for a, b in zip(grown, loaded):
        for x, y in zip(held_arrays(a), held_arrays(b)):
            assert np.array_equal(x, y)


def test_old_segments_are_collected_after_the_switch(store):
    caches = filled_caches(store.spec, 300)
    _, d = save(store, "a1", caches, 300)
    _, d = save(store, "a1", caches, 300, durable=d, first_block=0)
    names = sorted(p.name for p in store.agent_dir("a1").iterdir())
    assert names == [".lock", MANIFEST_NAME, "seg-00000002.safetensors"]


def test_a_second_writer_is_refused_not_overwritten(store):
    caches = filled_caches(store.spec, 300)
    _, stale = save(store, "a1", caches, 300)
    save(store, "a1", caches, 300, durable=stale)  # another process moved on
    from agentkv.store.agent_store import StoreConflictError

    before = (store.agent_dir("a1") / MANIFEST_NAME).read_bytes()
    with pytest.raises(StoreConflictError, match="changed on disk"):
        save(store, "a1", caches, 300, durable=stale)
    assert (store.agent_dir("a1") / MANIFEST_NAME).read_bytes() == before


@pytest.mark.parametrize(
    "agent_id",
    [
        "",
        ".",
        "..",
        "a/b",
        "../etc",
        "a" * 129,
        "über",
        "a b",
        "a\x00b",
        5,
        None,
        "x\n",
    ],
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
        data[len(data) - 10] ^= 0x40
    elif how == "garbage_header":
        data[8:40] = b"\x00garbage!garbage!garbage!garbag"
    elif how == "huge_header":
        data[:8] = struct.pack("<Q", 2**62)
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage_header", "huge_header", "empty"])
def test_bad_manifest_is_reported_with_its_path(store, how):
    save(store, "a1", filled_caches(store.spec, 300), 300)
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


def test_wrong_fingerprint_and_geometry_are_rejected(store):
    save(store, "a1", filled_caches(store.spec, 300), 300)
    path = store.agent_dir("a1") / MANIFEST_NAME
    rewrite_record(path, lambda m: setattr(m, "model_fingerprint", "0" * 64))
    with pytest.raises(CacheFormatError, match="fingerprint"):
        store.read_manifest("a1")
    rewrite_record(path, lambda m: setattr(m, "model_fingerprint", store.spec.fingerprint))
    store.read_manifest("a1")
    rewrite_record(path, lambda m: m.geometry.update(attention_sinks=True))
    with pytest.raises(CacheFormatError, match="geometry"):
        store.read_manifest("a1")


def test_unknown_version_is_rejected(store):
    from safetensors.numpy import load
    from safetensors.numpy import save as st_save

    save(store, "a1", filled_caches(store.spec, 300), 300)
    path = store.agent_dir("a1") / MANIFEST_NAME
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    record = json.loads(meta["agentkv"])
    record["format_version"] = 99
    meta["agentkv"] = json.dumps(record)  # as a future agentkv would write it
    meta["agentkv_crc32c"] = str(_ext.crc32c(meta["agentkv"].encode()))
    path.write_bytes(st_save(load(data), metadata=meta))
    with pytest.raises(CacheFormatError, match="unknown format version 99"):
        store.read_manifest("a1")


def test_edited_record_fails_its_checksum(store):
    save(store, "a1", filled_caches(store.spec, 300), 300)
    path = store.agent_dir("a1") / MANIFEST_NAME
    data = path.read_bytes()
    tampered = data.replace(b'\\"token_count\\":300', b'\\"token_count\\":301')
    assert tampered != data
    path.write_bytes(tampered)
    with pytest.raises(CacheFormatError, match="record checksum"):
        store.read_manifest("a1")


@pytest.mark.parametrize("how", ["truncate", "flip", "missing"])
def test_bad_segment_fails_the_load_naming_the_segment(store, how):
    _, _ = save(store, "a1", filled_caches(store.spec, 300), 300)
    manifest, _ = store.read_manifest("a1")
    segment = store.agent_dir("a1") / manifest.blocks[0].segment
    if how == "missing":
        segment.unlink()
    else:
        corrupt(segment, how)
    with pytest.raises(CacheFormatError) as info:
        store.load_caches(manifest, "a1", 300)
    assert str(segment) in str(info.value)


def test_quarantine_keeps_every_file(store):
    save(store, "a1", filled_caches(store.spec, 300), 300)
    files = sorted(p.name for p in store.agent_dir("a1").iterdir())
    moved = store.quarantine("a1", "testing")
    assert not store.agent_dir("a1").exists()
    assert sorted(p.name for p in moved.iterdir()) == sorted(files + ["QUARANTINE_REASON.txt"])
    assert (moved / "QUARANTINE_REASON.txt").read_text().strip() == "testing"
    assert moved.parent == store.quarantine_dir


def test_missing_manifest_means_no_state(store):
    save(store, "a1", filled_caches(store.spec, 300), 300)
    os.unlink(store.agent_dir("a1") / MANIFEST_NAME)
    assert store.read_manifest("a1")[0] is None
    assert store.read_manifest("never-seen")[0] is None
