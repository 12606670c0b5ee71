"""What a block's hash names: the bytes its tokens give in this engine (``pool.hashing``).
Agents whose bytes came from elsewhere (converted from another KV format, stored by an
earlier agentkv) keep them as their own: they resume warm with exactly their bytes, and
their blocks are never taken by other agents for the bytes these tokens give here."""

import shutil

import pytest

from agentkv.pool.hashing import chain, chain_seed
from agentkv.store.format import MANIFEST_NAME, encode_manifest

SYSTEM = {"role": "system", "content": " ".join(["Answer briefly, plainly and kindly."] * 90)}
ASK = [SYSTEM, {"role": "user", "content": "Which river runs through Paris?"}]


def follow_up(reply: str) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And through Rome?"},
    ]


@pytest.mark.slow
def test_a_converted_agent_keeps_its_bytes_to_itself(fresh_engine, tmp_path):
    v1 = fresh_engine(cache_dir=tmp_path / "kv", kv_format=1)
    first = v1.chat("conv", ASK, max_tokens=4)
    v1.close()
    eng = fresh_engine(cache_dir=tmp_path / "kv")
    second = eng.chat("conv", follow_up(first.text), max_tokens=4)
    assert second.stats.cache == "warm" and "converted" in second.stats.reuse_note
    assert second.stats.reused_tokens > 2 * 256
    assert eng.residency.get("conv").table.nonce is not None
    # Another agent with the same prompt takes none of the converted bytes, and gives the
    # tokens it gives alone.
    other = eng.chat("other", ASK, max_tokens=4)
    assert other.stats.shared_tokens == 0
    alone = fresh_engine(cache_dir=tmp_path / "alone").chat("other", ASK, max_tokens=4)
    assert other.tokens == alone.tokens
    eng.close()
    # Saved as its own: a restart resumes it warm under the same seed, nothing converted.
    again = fresh_engine(cache_dir=tmp_path / "kv")
    manifest, _ = again.store.read_manifest("conv")
    assert manifest.nonce is not None
    history = follow_up(first.text) + [
        {"role": "assistant", "content": second.text},
        {"role": "user", "content": "Thanks."},
    ]
    third = again.chat("conv", history, max_tokens=2)
    assert third.stats.cache == "warm" and third.stats.reuse_note is None
    assert again.residency.get("conv").table.nonce == manifest.nonce


@pytest.mark.slow
def test_an_agent_stored_under_an_earlier_seed_continues_as_its_own(fresh_engine, tmp_path):
    """A manifest whose chain seed does not name the arithmetic (agentkv before it did):
    the agent resumes warm with its own bytes (the tokens of the same agent stored now),
    under a seed of its own, none of its blocks findable by the hashes its tokens give."""
    eng = fresh_engine(cache_dir=tmp_path / "kv")
    first = eng.chat("old", ASK, max_tokens=4)
    eng.close()
    shutil.copytree(tmp_path / "kv", tmp_path / "earlier")
    store = fresh_engine(cache_dir=tmp_path / "earlier").store
    manifest, _ = store.read_manifest("old")
    manifest.chain_seed = chain_seed(store.spec.fingerprint, manifest.quant.identity).hex()
    (store.agent_dir("old") / MANIFEST_NAME).write_bytes(encode_manifest(manifest))

    now = fresh_engine(cache_dir=tmp_path / "kv").chat("old", follow_up(first.text), max_tokens=4)
    earlier = fresh_engine(cache_dir=tmp_path / "earlier")
    then = earlier.chat("old", follow_up(first.text), max_tokens=4)
    assert now.stats.cache == then.stats.cache == "warm" and now.stats.reuse_note is None
    assert "earlier agentkv" in then.stats.reuse_note
    assert then.tokens == now.tokens
    state = earlier.residency.get("old")
    assert state.table.nonce is not None
    held = set(state.table.blocks)
    assert all(
        earlier.pool.blocks.lookup(h) not in held for h in chain(earlier.pool.seed(), state.tokens)
    )
