"""Two engines with cache directories of their own and one S3-compatible store (moto's
server on 127.0.0.1), on the embedded model: an agent one engine ran resumes warm on the
other, a lost race is refused and kept aside, a store that goes down costs a note, not a
turn."""

import time

import pytest

from agentkv import AgentBusyError


def conversation(turns: int) -> list[dict]:
    """A conversation long enough to fill complete blocks (shared block files)."""
    text = " ".join(f"Item {i}: the planner lists step {i} of the migration." for i in range(60))
    messages = [{"role": "system", "content": "You are a careful planner. " + text}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what is step {i + 3}?"})
    return messages


def turn(eng, agent, messages, **options):
    r = eng.chat(agent, messages, max_tokens=8, **options)
    eng.wait_saved(agent)
    return r


@pytest.fixture
def two_engines(tmp_path, s3_store, fresh_engine):
    a = fresh_engine(cache_dir=tmp_path / "a", store_url=s3_store, warmup=False)
    b = fresh_engine(cache_dir=tmp_path / "b", store_url=s3_store, warmup=False)
    return a, b


def test_an_agent_run_on_one_engine_resumes_warm_on_another(two_engines):
    a, b = two_engines
    first = conversation(1)
    r1 = turn(a, "planner", first)
    assert r1.stats.cache == "cold"
    second = first + [{"role": "assistant", "content": r1.text}] + conversation(2)[-1:]
    on_b = b.chat("planner", second, max_tokens=8)
    assert on_b.stats.cache == "warm", on_b.stats.reuse_note
    assert on_b.stats.reused_tokens == on_b.stats.stored_tokens > 256
    on_a = a.chat("planner", second, max_tokens=8)  # the same turn where it ran: hot
    assert on_a.stats.cache == "hot" and on_a.tokens == on_b.tokens
    assert b.fleet.counts["fetch", "ok"] == 1 and not b.fleet.counts["fetch", "damaged"]


def test_a_lost_race_is_refused_and_its_turn_kept_aside(two_engines):
    a, b = two_engines
    first = conversation(1)
    r1 = turn(a, "x", first)
    base = first + [{"role": "assistant", "content": r1.text}]
    turn(b, "x", base + conversation(2)[-1:])  # b now holds a's version, and one turn more
    a.writer.on_saved = None  # a's next turn is committed only by wait_saved, after b's
    a_turn = a.chat("x", base + [{"role": "user", "content": "A asks."}], max_tokens=8)
    b_turn = turn(b, "x", base + conversation(2)[-1:] + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "B asks."}
    ])  # fmt: skip
    with pytest.raises(AgentBusyError, match="does not continue"):
        a.wait_saved("x")
    assert a_turn.stats.cache == "warm"  # a fetched b's first turn before its own
    assert b_turn.stats.cache == "hot"  # b's state was still the store's
    # a's next turn starts from the store's (b's) state; a's own turn is not mixed in
    nxt = a.chat("x", base + [{"role": "user", "content": "A asks again."}], max_tokens=8)
    assert "kept aside" in (nxt.stats.reuse_note or "")
    assert a.history("x")[-2]["content"] == "A asks again."
    assert "B asks." in [m["content"] for m in b.history("x")]
    assert a.fleet.counts["commit", "conflict"] >= 1


def test_a_store_that_goes_down_costs_a_note_and_uploads_catch_up(two_engines, s3_server):
    a, _ = two_engines
    s3_server.stop()
    r = turn(a, "y", conversation(1))
    assert r.text and "could not be reached" in r.stats.reuse_note
    assert a.fleet.counts["fetch", "unavailable"] >= 1 and a.fleet.pending == 1
    s3_server.start()
    deadline = time.monotonic() + 60
    while a.fleet.remote.head("y") is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert a.fleet.remote.head("y") is not None and a.fleet.pending == 0


def test_damaged_bytes_in_the_store_are_never_used(two_engines, s3_server):
    a, b = two_engines
    messages = conversation(1)
    r1 = turn(a, "z", messages)
    url = a.fleet.objects.url
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=url.bucket, Prefix=url.prefix + "/")["Contents"]
    block = next(o["Key"] for o in listed if "/blocks/" in o["Key"])
    data = bytearray(client.get_object(Bucket=url.bucket, Key=block)["Body"].read())
    data[len(data) // 2] ^= 0x10  # one bit of KV
    client.put_object(Bucket=url.bucket, Key=block, Body=bytes(data))
    nxt = messages + [{"role": "assistant", "content": r1.text}, conversation(2)[-1]]
    r = b.chat("z", nxt, max_tokens=8)
    assert r.stats.cache == "cold" and "damaged" in r.stats.reuse_note
    assert b.fleet.counts["fetch", "damaged"] == 1 and b.fleet.counts["fetch", "ok"] == 0
    assert r.tokens == a.chat("z-cold", nxt, max_tokens=8).tokens  # a cold turn's own tokens


def test_a_store_without_its_bucket_is_refused_at_start(tmp_path, s3_store, fresh_engine):
    from agentkv.store.objects import StoreMisconfigured

    with pytest.raises(StoreMisconfigured, match="has no bucket"):
        fresh_engine(cache_dir=tmp_path / "a", store_url="s3://no-such-bucket/x", warmup=False)


def test_the_store_is_looked_at_off_the_scheduler_thread(two_engines):
    """A turn's look at the store (HEAD, and a fetch where needed) runs on the fleet's own
    threads before the turn is admitted: while one agent's look waits on the store, another
    agent's turn runs to its end, and the first turn then resumes warm as ever."""
    import threading

    a, b = two_engines
    first = conversation(1)
    r1 = turn(a, "slow", first)
    second = first + [{"role": "assistant", "content": r1.text}] + conversation(2)[-1:]
    release, looked_from = threading.Event(), []
    head = b.fleet.remote.head

    def held_head(agent_id):  # the real HEAD, after the store "stalls" for this agent
        looked_from.append(threading.current_thread().name)
        if agent_id == "slow":
            assert release.wait(60)
        return head(agent_id)

    b.fleet.remote.head = held_head
    slow = b.submit_chat("slow", second, max_tokens=8)
    other = b.chat("other", conversation(1), max_tokens=4)  # runs while "slow" waits
    assert other.text and not slow.done.is_set()
    release.set()
    result = slow.wait()
    assert result.stats.cache == "warm", result.stats.reuse_note
    assert "agentkv-scheduler" not in looked_from  # (the uploads' thread HEADs too)
    assert any(name.startswith("agentkv-s3-look") for name in looked_from)
