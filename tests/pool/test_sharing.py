"""Shared prefix blocks on the real model: what is shared, and that nothing else is.

Isolation: 16 agents whose prompts share prefixes of random lengths run at once, in the
default KV format; every one gives exactly the tokens it gives alone (with nothing shared),
batched or not, in other prefill chunks, and after a restart; and holds only blocks whose
tokens are its own."""

import random

import pytest

from agentkv.format.geometry import BLOCK_TOKENS, GROUP_TOKENS

BRIEF = (
    "The team builds csvjson, a command line tool that converts CSV files to JSON. "
    "It must handle quoted fields, embedded newlines, other delimiters and files larger "
    "than memory, and its errors must name the line that failed. "
)


def brief(words: int) -> str:
    text = BRIEF * 40
    return " ".join(text.split()[:words])


def test_a_second_agent_shares_the_first_ones_system_prompt(fresh_engine):
    eng = fresh_engine()
    system = {"role": "system", "content": brief(420)}
    a = eng.chat("share-a", [system, {"role": "user", "content": "Who parses?"}], max_tokens=4)
    b = eng.chat("share-b", [system, {"role": "user", "content": "Who writes?"}], max_tokens=4)
    assert a.stats.shared_tokens == 0 and a.stats.cache == "cold"
    s = b.stats
    assert (s.cache, s.match) == ("hot", "none") and s.shared_tokens >= 2 * BLOCK_TOKENS
    assert s.reuse_note == (
        f"{s.shared_tokens} tokens from blocks of the same prefix, found by their content; a "
        "new agent: nothing stored for it yet"
    )
    assert s.shared_tokens % GROUP_TOKENS == 0 and s.reused_tokens == s.shared_tokens
    assert s.prefill_tokens < GROUP_TOKENS + 20  # its own question, and under 64 more
    stats = eng.pool_stats()
    assert stats.shared_blocks >= 2 and stats.arena_copies == 0


def test_sharing_gives_the_same_tokens_as_prefilling_alone(fresh_engine):
    """The stored bits are a function of the tokens (docs/kv-format-v2.md), so a shared prefix
    gives the very tokens of a cold prefill (a tenant salt keeps that one apart)."""
    eng = fresh_engine()
    system = {"role": "system", "content": brief(420)}
    eng.chat("same-a", [system, {"role": "user", "content": "Who parses?"}], max_tokens=4)
    ask = [system, {"role": "user", "content": "Who writes?"}]
    shared = eng.chat("same-b", ask, max_tokens=4)
    apart = eng.chat("same-c", ask, max_tokens=4, cache_salt="tenant-c")
    assert shared.stats.shared_tokens >= 2 * BLOCK_TOKENS and apart.stats.shared_tokens == 0
    assert apart.tokens == shared.tokens


def test_shared_blocks_are_found_on_disk_after_a_restart(fresh_engine, tmp_path):
    eng = fresh_engine()
    system = {"role": "system", "content": brief(420)}
    eng.chat("first", [system, {"role": "user", "content": "Hi."}], max_tokens=2)
    eng.close()
    again = fresh_engine()
    r = again.chat("newcomer", [system, {"role": "user", "content": "Hello."}], max_tokens=2)
    assert r.stats.cache == "warm" and r.stats.shared_tokens >= 2 * BLOCK_TOKENS  # read back
    assert again.disk_bytes() > 0


@pytest.mark.slow
def test_an_agent_continues_only_under_the_salt_its_cache_was_built_with(fresh_engine):
    """A turn under another salt starts over under its own salt (in memory and from disk):
    it neither continues nor shares into the other tenant's blocks."""
    eng = fresh_engine()
    system = {"role": "system", "content": brief(300)}
    first = [system, {"role": "user", "content": "Who parses?"}]
    r = eng.chat("salted", first, max_tokens=4, cache_salt="tenant-a")
    turn = first + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Go."}]
    other = eng.chat("salted", turn, max_tokens=4, cache_salt="tenant-b")
    assert other.stats.cache == "cold" and other.stats.reused_tokens == 0
    assert "cache_salt" in (other.stats.reuse_note or "")
    turn = turn + [{"role": "assistant", "content": other.text}, {"role": "user", "content": "On."}]
    again = eng.chat("salted", turn, max_tokens=4, cache_salt="tenant-b")
    assert again.stats.cache == "hot"
    eng.close()
    restarted = fresh_engine()
    turn = turn + [
        {"role": "assistant", "content": again.text},
        {"role": "user", "content": "Yes."},
    ]
    back = restarted.chat("salted", turn, max_tokens=4, cache_salt="tenant-a")
    assert back.stats.reused_tokens == back.stats.shared_tokens  # none of its own continued
    assert back.stats.cache in ("cold", "warm")  # (it may share tenant-a blocks on disk)
    assert "cache_salt" in (back.stats.reuse_note or "")


def test_forked_agents_share_every_block_until_one_writes(fresh_engine):
    eng = fresh_engine()
    messages = [{"role": "system", "content": brief(300)}, {"role": "user", "content": "Go."}]
    eng.chat("trunk", messages, max_tokens=4)
    used = eng.pool_stats().used_blocks
    eng.fork_agent("trunk", "branch")
    assert eng.pool_stats().used_blocks == used  # refcounts, no block copied
    info = eng.agent_info("branch")
    assert info.tier == "hot" and info.shared_blocks == len(
        eng.residency.get("branch").table.blocks
    )
    history = eng.history("trunk")
    r = eng.chat("branch", history + [{"role": "user", "content": "And then?"}], max_tokens=4)
    assert r.stats.cache == "hot"
    assert eng.pool_stats().used_blocks <= used + 2  # its own tail (copied once) and growth


def test_agents_that_start_at_once_compute_their_shared_system_prompt_once(fresh_engine):
    """Three agents whose turns arrive together, with the same ~560-token system prompt: the
    first prefills it (in five chunks), the other two wait for those chunks and share its
    blocks, so the prompt is computed once, not three times; each gives the tokens it gives
    with nothing shared (its own salt)."""
    eng = fresh_engine(max_batch=8, prefill_chunk=128)
    system = {"role": "system", "content": brief(420)}
    turns = [
        (f"at-once-{i}", [system, {"role": "user", "content": f"Agent {i}: who parses?"}])
        for i in range(3)
    ]
    solo = [eng.chat(a, m, max_tokens=4, cache_salt=f"solo-{a}").tokens for a, m in turns]
    results = eng.chat_many(turns, max_tokens=4)
    assert [r.tokens for r in results] == solo
    stats = sorted((r.stats for r in results), key=lambda s: s.shared_tokens)
    assert stats[0].shared_tokens == 0 and stats[0].prefill_tokens > 2 * BLOCK_TOKENS
    for s in stats[1:]:  # all but their own question and the prompt's last group
        assert s.shared_tokens >= 2 * BLOCK_TOKENS and s.prefill_tokens < GROUP_TOKENS + 20
        assert s.cache == "hot" and "found by their content" in s.reuse_note


@pytest.mark.slow
def test_sixteen_agents_sharing_a_prompt_give_their_solo_tokens_batched_and_after_a_restart(
    fresh_engine, tmp_path
):
    """The default KV format. 16 agents whose system prompts share prefixes of random lengths
    (a brief cut anywhere: whole shared blocks, copied groups, nothing) each run alone (a
    salt of their own: nothing shared), then all together in a random order, batched 8 at a
    time with other prefill chunks, then a second turn each after a restart, warm, in
    another order and other chunks: every agent gives exactly its solo tokens each time."""
    rng = random.Random(20261127)
    base = brief(700)
    first_turns = []
    for i in range(16):
        system = {"role": "system", "content": base[: rng.randint(0, len(base))]}
        first_turns.append([system, {"role": "user", "content": f"Agent {i}: sum it up."}])
    alone = fresh_engine(cache_dir=tmp_path / "alone")
    solo, second_turns, solo_again = [], [], []
    for i, messages in enumerate(first_turns):
        first = alone.chat(f"solo-{i}", messages, max_tokens=6, cache_salt=f"solo-{i}")
        more = messages + [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "Then list its three parts."},
        ]
        second = alone.chat(f"solo-{i}", more, max_tokens=6, cache_salt=f"solo-{i}")
        assert second.stats.cache == "hot"
        solo.append(first.tokens)
        second_turns.append(more)
        solo_again.append(second.tokens)
    order = rng.sample(range(16), 16)
    eng = fresh_engine(max_batch=8, prefill_chunk=rng.choice([96, 160, 200]))
    results = eng.chat_many([(f"agent-{i}", first_turns[i]) for i in order], max_tokens=6)
    assert [r.tokens for r in results] == [solo[i] for i in order]
    assert sum(r.stats.shared_tokens for r in results) > 4 * BLOCK_TOKENS  # sharing did happen
    records = eng.pool.blocks.records
    for i in range(16):
        state = eng.residency.get(f"agent-{i}")
        # Every block it holds carries exactly its own tokens at that place.
        assert state.table.token_ids()[: state.table.length] == state.tokens
        for index, block in enumerate(state.table.blocks):
            start = index * BLOCK_TOKENS
            held = records[block].tokens[: min(BLOCK_TOKENS, state.size - start)]
            assert held == state.tokens[start : start + len(held)]
    eng.pool.blocks.check()
    eng.close()
    restarted = fresh_engine(max_batch=8, prefill_chunk=rng.choice([64, 128, 300]))
    order = rng.sample(range(16), 16)
    results = restarted.chat_many([(f"agent-{i}", second_turns[i]) for i in order], max_tokens=6)
    assert all(r.stats.cache == "warm" for r in results)
    assert [r.tokens for r in results] == [solo_again[i] for i in order]


@pytest.mark.slow
def test_more_agents_than_the_pool_holds_all_complete_and_resume_warm(fresh_engine):
    block = 6_672 * BLOCK_TOKENS  # one block of the embedded model: 4-bit, 8-bit keys in 2 layers
    eng = fresh_engine(pool_bytes=block * 6, max_batch=4)
    prompts = [(f"crowd-{i}", f"Agent {i} reports: " + brief(260 + 7 * i)) for i in range(6)]
    first = eng.generate_many(prompts, max_tokens=4)
    assert all(r.stats.cache == "cold" and r.tokens for r in first)
    stats = eng.pool_stats()
    assert stats.reserved_blocks == 0 and stats.used_blocks <= 6
    assert eng.residency.evicted > 0  # idle agents gave their blocks back
    again = [eng.generate(agent, text + " And?", max_tokens=2) for agent, text in prompts]
    assert all(r.stats.cache in ("hot", "warm") and r.stats.reused_tokens > 100 for r in again)
