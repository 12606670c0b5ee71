"""RemoteAgents against a real S3-compatible server (moto, on 127.0.0.1): push and pull
byte for byte, shared blocks once, every byte checked on the way in, conditional writes
ordering two machines, a store that is down or a commit cut short."""

import numpy as np
import pytest
from helpers import fill_table, pool_for, synthetic_spec, table_arrays
from test_store import loaded_into_pool, save

from agentkv.errors import AgentBusyError
from agentkv.store.agent_store import AgentStore
from agentkv.store.format import MANIFEST_NAME
from agentkv.store.objects import ObjectStore, PreconditionFailed, StoreUnavailable
from agentkv.store.remote import Moved, RemoteAgents, RemoteDamaged, stored_models


def open_store(root):
    store = AgentStore(root, synthetic_spec(), "synthetic")
    store.ensure_layout()
    return store


@pytest.fixture
def machines(tmp_path, s3_store):
    """Two machines' local stores and the one object store they share."""
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    objects = ObjectStore(s3_store)
    remotes = [RemoteAgents(objects, s.model_dir) for s in (a, b)]
    yield a, b, *remotes
    for r in remotes:
        r.close()


def files_of(store):
    return {
        p.relative_to(store.model_dir): p.read_bytes()
        for p in store.model_dir.rglob("*.safetensors")
    }


def test_an_agent_pushed_from_one_machine_is_pulled_byte_for_byte_on_another(machines):
    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    table = fill_table(pool, 700)
    report, _ = save(a, pool, "x", table)
    sent = ra.push("x")
    assert sent.moved is Moved.MOVED
    # one save's files (its manifest given a version record) and model.json: no more
    assert report.bytes_written < sent.nbytes <= 1.2 * report.bytes_written
    assert ra.push("x").moved is Moved.SAME
    got = rb.pull("x")
    assert got.moved is Moved.MOVED and got.version == sent.version
    assert files_of(b) == files_of(a)
    for want, have in zip(table_arrays(pool, table), loaded_into_pool(b, "x", 700)):
        assert np.array_equal(want, have)
    assert rb.pull("x").moved is Moved.SAME
    assert rb.agent_ids() == ["x"] and stored_models(ra.objects) == [a.model_dir.name]
    assert (b.model_dir / "model.json").read_bytes() == (a.model_dir / "model.json").read_bytes()


def test_shared_prefix_blocks_are_uploaded_once_and_fetched_once(machines):
    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    first = fill_table(pool, 700, seed=1)
    save(a, pool, "p", first)
    second = pool.new_table(pool.seed())
    for block in first.blocks[:2]:  # the first 512 tokens are p's
        second.adopt(block)
    fill_table(pool, 600, seed=2, table=second, ids=first.token_ids()[:512] + list(range(88)))
    report, _ = save(a, pool, "q", second)
    whole = ra.push("p").nbytes
    sent = ra.push("q").nbytes
    assert sent < 1.2 * report.bytes_written < whole / 2
    model_record = (a.model_dir / "model.json").stat().st_size  # sent with p, not fetched
    assert rb.pull("p").nbytes == whole - model_record
    fetched = rb.pull("q").nbytes
    assert fetched < whole / 2  # the two shared block files were on b already
    for want, have in zip(table_arrays(pool, second), loaded_into_pool(b, "q", 600)):
        assert np.array_equal(want, have)


def test_incremental_turns_upload_only_what_they_add(machines):
    a, _, ra, _ = machines
    pool = pool_for(a.spec)
    table = fill_table(pool, 1000)
    _, durable = save(a, pool, "x", table)
    pushed = ra.push("x")
    a_durable = a.read_manifest("x")[1]  # given a version record by the push
    assert durable.remote is None and a_durable.remote.version == pushed.version
    fill_table(pool, 1064, table=table)
    report, _ = save(a, pool, "x", table, durable=a_durable, keep=3)
    local = a.read_manifest("x")[0].remote
    assert local.lineage[1:] == (pushed.version,)
    assert ra.push("x").nbytes <= 1.2 * report.bytes_written
    assert ra.head("x").version == local.version


def test_a_damaged_object_is_rejected_and_nothing_installed(machines, s3_server):
    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    save(a, pool, "x", fill_table(pool, 700))
    ra.push("x")
    client = s3_server.client()
    bucket, _, prefix = ra.objects.url.bucket, None, ra.objects.url.prefix
    block_key = next(
        k for k in (o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
        if k.startswith(prefix + "/") and "/blocks/" in k
    )  # fmt: skip
    good = client.get_object(Bucket=bucket, Key=block_key)["Body"].read()
    bad = bytearray(good)
    bad[-2000] ^= 0x40  # one bit of KV
    client.put_object(Bucket=bucket, Key=block_key, Body=bytes(bad))
    with pytest.raises(RemoteDamaged, match="checksum"):
        rb.pull("x")
    assert not (b.agent_dir("x") / MANIFEST_NAME).exists()
    assert not list(b.model_dir.rglob("blocks/**/*.safetensors"))
    bad = bytearray(good)
    bad[-100] ^= 0x01  # one bit of the block's token ids (the file's last 1 KiB)
    client.put_object(Bucket=bucket, Key=block_key, Body=bytes(bad))
    with pytest.raises(RemoteDamaged, match="token ids"):
        rb.pull("x")
    assert not list(b.model_dir.rglob("blocks/**/*.safetensors"))
    client.put_object(Bucket=bucket, Key=block_key, Body=good[:-10])  # cut short
    with pytest.raises(RemoteDamaged, match="bytes, expected"):
        rb.pull("x")
    client.put_object(Bucket=bucket, Key=block_key, Body=good)
    manifest_key = f"{prefix}/{ra.manifest_key('x')}"
    head = client.head_object(Bucket=bucket, Key=manifest_key)
    data = client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read()
    client.put_object(
        Bucket=bucket, Key=manifest_key, Body=data[:-1] + b"\0", Metadata=head["Metadata"]
    )
    with pytest.raises(RemoteDamaged, match="its manifest"):
        rb.pull("x")
    assert not (b.agent_dir("x") / MANIFEST_NAME).exists()


def test_two_machines_racing_on_one_agent_one_wins_the_other_is_refused(machines):
    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    table = fill_table(pool, 600)
    save(a, pool, "x", table)
    ra.push("x")
    rb.pull("x")
    base = ra.head("x")
    # both machines run a turn on top of the same version
    fill_table(pool, 700, table=table)
    save(a, pool, "x", table, durable=a.read_manifest("x")[1], keep=2)
    other = fill_table(pool_for(b.spec), 650, seed=9)
    save(b, pool, "x", other, durable=b.read_manifest("x")[1])
    won = ra.push("x")
    with pytest.raises(AgentBusyError, match="does not continue"):
        rb.push("x")
    assert ra.head("x").version == won.version != base.version
    # the PUT itself is conditional: a commit on top of a version that is gone fails
    data, manifest = rb.read_local("x")
    with pytest.raises(PreconditionFailed):
        rb.commit(data, manifest, base)
    with pytest.raises(AgentBusyError, match="turns the store"):
        rb.pull("x")  # b's own turn is not thrown away silently
    assert rb.pull("x", force=True).version == won.version
    assert (
        files_of(b)[b.agent_dir("x").relative_to(b.model_dir) / MANIFEST_NAME]
        == (a.agent_dir("x") / MANIFEST_NAME).read_bytes()
    )


def test_a_commit_cut_short_leaves_no_manifest_naming_missing_files(machines):
    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    save(a, pool, "x", fill_table(pool, 700))
    data, manifest = ra.read_local("x")
    tail = next(n for n in manifest.segments if n.startswith("seg-"))
    (a.agent_dir("x") / tail).unlink()  # its upload fails after the block files went
    with pytest.raises(FileNotFoundError):
        ra.commit(data, manifest, None)
    assert ra.head("x") is None and rb.pull("x").moved is Moved.ABSENT


def test_a_store_that_is_down_is_a_clear_error_naming_no_endpoint(tmp_path, s3_store, s3_server):
    store = open_store(tmp_path / "a")
    remote = RemoteAgents(ObjectStore(s3_store), store.model_dir)
    s3_server.stop()
    try:
        with pytest.raises(StoreUnavailable, match="could not be reached") as info:
            remote.pull("x")
        assert s3_server.endpoint not in str(info.value) and "s3://" in str(info.value)
    finally:
        remote.close()
        s3_server.start()


@pytest.mark.parametrize(
    "url", ["/tmp/kv", "s3://", "http://bucket/x", "s3://key:secret@bucket/x", "s3://b/x?y=1"]
)
def test_store_urls_are_checked(url):
    from agentkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="s3://bucket/prefix"):
        ObjectStore(url)


def test_a_version_record_keeps_its_newest_lineage_and_malformed_ones_are_rejected(tmp_path):
    from agentkv.store.format import MAX_LINEAGE, RemoteRecord, decode_manifest, encode_manifest

    record = RemoteRecord.first()
    for _ in range(MAX_LINEAGE + 5):
        record = record.successor()
    assert len(record.lineage) == MAX_LINEAGE and len(set(record.lineage)) == MAX_LINEAGE
    assert record.continues(record.lineage[-1]) and not record.continues("0" * 16)
    store = open_store(tmp_path)
    pool = pool_for(store.spec)
    save(store, pool, "x", fill_table(pool, 300))
    manifest, _ = store.read_manifest("x")
    manifest.remote = record
    path = store.manifest_path("x")
    assert decode_manifest(encode_manifest(manifest), path).remote == record
    for bad in ([], ["not hex!"], ["ab"] * (MAX_LINEAGE + 1), "abc", [7]):
        with pytest.raises(ValueError):
            RemoteRecord.from_dict({"lineage": bad})


def test_a_file_collected_under_a_commit_is_uploaded_again_once_its_sighting_is_old(
    machines, monkeypatch
):
    """A commit trusts a file it saw in the store for PRESENT_TTL_S; past that it asks the
    store again, so a block file ``collect`` deleted (or any file gone from the store) is
    uploaded again by the next commit that names it, and the agent reads back whole."""
    from agentkv.store import remote as remote_module

    a, b, ra, rb = machines
    pool = pool_for(a.spec)
    table = fill_table(pool, 1000)
    _, durable = save(a, pool, "x", table)
    ra.push("x")
    durable = a.read_manifest("x")[1]
    block = next(k for k in ra.objects.keys(f"{ra.model}/blocks/"))
    ra.objects.delete(block)  # as if collected while this machine still believed in it
    fill_table(pool, 1064, table=table)
    save(a, pool, "x", table, durable=durable, keep=3)
    ra.push("x")  # within the TTL: trusted, not uploaded again
    assert block not in ra.objects.keys(f"{ra.model}/blocks/")
    monkeypatch.setattr(remote_module, "PRESENT_TTL_S", 0.0)
    durable = a.read_manifest("x")[1]
    fill_table(pool, 1100, table=table)
    save(a, pool, "x", table, durable=durable, keep=3)
    ra.push("x")  # the sighting is old: asked again, uploaded again
    assert block in ra.objects.keys(f"{ra.model}/blocks/")
    assert rb.pull("x").moved is Moved.MOVED
    for want, have in zip(table_arrays(pool, table), loaded_into_pool(b, "x", 1100)):
        assert np.array_equal(want, have)
