"""KVSwap through the engine (``Engine(kv_swap_budget=...)``, engine/swapping.py): a budget
the context fits in changes nothing; an agent over it decodes with its leading blocks
evicted, is saved whole (its evicted blocks named by hash) and resumes; a block file
damaged while it decodes fails that agent's turn alone and is quarantined; agents whose
contexts together are over the pool all decode, without a whole agent evicted."""

import fcntl
import os
import threading

import pytest

from agentkv import InvalidRequestError
from agentkv.engine import swapping
from agentkv.errors import TurnFailedError

PROMPT_TOKENS = 1100


def _prompt(engine, seed: int, tokens: int = PROMPT_TOKENS) -> str:
    from agentkv.model.wide_layers import calibration_text

    tok = engine.loaded.tokenizer
    ids = tok.encode(calibration_text())
    return tok.decode(ids[seed * tokens : (seed + 1) * tokens])


def test_the_budget_is_checked():
    from agentkv.engine.config import EngineConfig

    for bad in (0, 100, 511, -1, 2.5, True):
        with pytest.raises(InvalidRequestError, match="kv_swap_budget"):
            EngineConfig(kv_swap_budget=bad)
    assert EngineConfig(kv_swap_budget=512).kv_swap_budget == 512
    with pytest.raises(InvalidRequestError, match="kv_swap_read_ahead needs"):
        EngineConfig(kv_swap_read_ahead=True)
    with pytest.raises(InvalidRequestError, match="True or False"):
        EngineConfig(kv_swap_budget=512, kv_swap_read_ahead="yes")
    assert EngineConfig(kv_swap_budget=512, kv_swap_read_ahead=True).kv_swap_read_ahead


def test_a_budget_the_context_fits_in_gives_todays_tokens(engine, fresh_engine):
    prompt = _prompt(engine, 0)
    swapping_engine = fresh_engine(kv_swap_budget=4096)
    got = swapping_engine.generate("a", prompt, max_tokens=12)
    want = engine.generate("budget-ref", prompt, max_tokens=12)
    assert got.tokens == want.tokens
    assert swapping_engine.swapper.swapped == 0


def test_an_agent_over_the_budget_decodes_is_saved_whole_and_resumes(fresh_engine):
    eng = fresh_engine(kv_swap_budget=512)
    prompt = _prompt(eng, 1)
    first = eng.generate("a", prompt, max_tokens=8)
    assert eng.swapper.swapped == 1
    assert first.stats.generated_tokens == 8
    assert eng.pool.stats().used_blocks == 0  # saved, then dropped from memory
    eng.flush()
    again = eng.generate("a", prompt + first.text, max_tokens=4)
    assert again.stats.reused_tokens >= PROMPT_TOKENS  # its own tokens, none prefilled again
    assert eng.swapper.swapped == 2
    eng.pool.blocks.check()


def _collector_could_run(lock) -> bool:
    """Whether the block files' collector would get its exclusive lock now."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_collection_waits_for_a_swapped_agents_save(fresh_engine):
    """A swap writes block files no manifest names until the turn's save: a collection
    meanwhile (here: another agent deleted) must not delete them. The engine's own
    collections skip while the lock is held; the agent's files are there for its save."""
    eng = fresh_engine(kv_swap_budget=512)
    eng.generate("other", "Say hello.", max_tokens=2)
    eng.flush()
    prompt = _prompt(eng, 2)
    lock = eng.store.model_dir / ".blocks.lock"
    assert _collector_could_run(lock)
    during, text, deleter = None, "", None
    for piece in eng.stream_generate("a", prompt, max_tokens=12):
        text += piece
        if deleter is None and eng.swapper.swapped == 1:  # swapped, decoding
            during = _collector_could_run(lock)
            deleter = threading.Thread(target=eng.delete_agent, args=("other",))
            deleter.start()
    assert deleter is not None, "the agent never swapped"
    deleter.join(timeout=300)
    assert not deleter.is_alive()
    eng.flush()
    assert during is False and _collector_could_run(lock)  # held until the save, then freed
    manifest, _ = eng.store.read_manifest("a")
    assert all((eng.store.model_dir / b.segment).exists() for b in manifest.blocks[:4])
    again = eng.generate("a", prompt + text, max_tokens=2)
    assert again.stats.reused_tokens >= PROMPT_TOKENS
    eng.pool.blocks.check()


def test_a_block_filled_while_decoding_is_evicted_too(fresh_engine):
    """A swapped agent whose reply fills a block: the block is written as a block file and
    evicted, so the resident KV stays at the budget; the agent is saved whole and resumes."""
    eng = fresh_engine(kv_swap_budget=512)
    prompt = _prompt(eng, 4, tokens=1272)
    first = eng.generate("a", prompt, max_tokens=24)
    fed = first.stats.prompt_tokens + first.stats.generated_tokens - 1
    assert fed > 1281, "the reply crosses the block boundary at 1,280"
    assert eng.swapper.filled_evicted == 1
    eng.flush()
    again = eng.generate("a", prompt + first.text, max_tokens=2)
    assert again.stats.reused_tokens >= 1280  # every evicted block found again by hash
    eng.pool.blocks.check()


def _damage(files) -> None:
    """Flip every byte of the block files' regions (their headers intact)."""
    for f in files:
        with open(f.path, "r+b") as fh:
            fh.seek(f.offset)
            data = fh.read(f.length)
            fh.seek(f.offset)
            fh.write(bytes(b ^ 0xFF for b in data))


def _nothing_holds_nan(eng) -> None:
    """No block the pool holds (in use or cached) and no block file on disk holds a NaN or
    an infinity in its float16 scales and biases."""
    import mlx.core as mx
    import numpy as np
    from safetensors.numpy import load_file

    pool = eng.pool
    held = [r.id for r in pool.blocks.records if r.refs or r.hash is not None]
    if held:
        rows = pool.arena._block_rows(held)
        for layer in pool.arena.arrays:
            for part in layer:
                if part.dtype == mx.float16:
                    assert np.isfinite(np.array(part[rows]).astype(np.float32)).all()
    for path in (eng.store.model_dir / "blocks").rglob("*.safetensors"):
        for name, array in load_file(str(path)).items():
            if array.dtype == np.float16:
                assert np.isfinite(array.astype(np.float32)).all(), (path, name)


@pytest.mark.parametrize(
    "budget,where", [(512, "start"), (1024, "evict_filled")], ids=["decoding", "prefilling"]
)
def test_a_failed_read_fails_that_turn_alone_and_keeps_nothing(
    fresh_engine, monkeypatch, budget, where
):
    """The block file of agent "bad"'s first block is damaged as soon as it is evicted: while it
    decodes (a budget of 512: it prefilled in memory) or while it prefills into its block
    files (1,024: the next chunk reads them back). Its turn fails with an error that names
    no file (the log does; the file is quarantined), keeping nothing: no NaN in any pool
    block or block file. "good", beside it, gets the tokens it gets alone; "bad"'s turn sent
    again gives a clean engine's tokens."""
    prompt_tokens = 1100 if budget == 512 else 2200
    eng = fresh_engine(kv_swap_budget=budget, draft_tokens=0)
    bad_prompt, good_prompt = _prompt(eng, 2, prompt_tokens), _prompt(eng, 3)
    clean = fresh_engine(
        kv_swap_budget=budget, draft_tokens=0, cache_dir=eng.config.cache_dir.parent / "clean"
    )
    want_good = clean.generate("good", good_prompt, max_tokens=6)
    want_bad = clean.generate("bad", bad_prompt, max_tokens=6)
    original = getattr(swapping.Swapper, where)
    damaged = []

    def then_damage(self, state, *args, **kwargs):
        out = original(self, state, *args, **kwargs)
        if state.agent_id == "bad" and state.swap is not None and not damaged:
            _damage(state.swap.files[:1])  # its first block: group 0 is read first
            damaged.append(True)
        return out

    monkeypatch.setattr(swapping.Swapper, where, then_damage)
    results = {}

    def run(agent, prompt):
        try:
            results[agent] = eng.generate(agent, prompt, max_tokens=6)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[agent] = exc

    threads = [
        threading.Thread(target=run, args=a) for a in (("bad", bad_prompt), ("good", good_prompt))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert damaged, "the agent never swapped"
    error = results["bad"]
    assert isinstance(error, TurnFailedError), error
    assert "could not be read back" in str(error) and "/" not in str(error)
    assert results["good"].tokens == want_good.tokens
    quarantined = list((eng.store.model_dir / "quarantine").rglob("*"))
    assert quarantined, "the damaged block file is quarantined"
    eng.pool.blocks.check()
    _nothing_holds_nan(eng)
    monkeypatch.setattr(swapping.Swapper, where, original)
    again = eng.generate("bad", bad_prompt, max_tokens=6)
    assert again.tokens == want_bad.tokens
    _nothing_holds_nan(eng)


def test_a_context_larger_than_the_pool_prefills_into_its_block_files(engine, fresh_engine):
    """A budget of 1,024 tokens and a pool of 9 blocks; a prompt of 2,600 tokens (11 blocks).
    The turn prefills block by block into its block files, each evicted (its pages back to
    the system) as it fills, its attention reading them back chunk by chunk: every block
    file holds the bytes of the prefill all in memory, and the first token is the same. Its
    next turn resumes warm the same way, reading its blocks one after another."""
    block = engine.pool.block_bytes
    prompt = _prompt(engine, 5, tokens=2600)
    in_memory = fresh_engine(draft_tokens=0, cache_dir=engine.config.cache_dir.parent / "mem")
    want = in_memory.generate("long", prompt, max_tokens=4)
    in_memory.flush()
    eng = fresh_engine(kv_swap_budget=1024, pool_bytes=9 * block, draft_tokens=0)
    assert eng.swapper.streams and eng.pool.capacity == 9
    got = eng.generate("long", prompt, max_tokens=4)
    assert got.tokens[0] == want.tokens[0]  # the prefill's logits: exact
    eng.flush()

    def files(e):
        return {
            p.name: p.read_bytes() for p in (e.store.model_dir / "blocks").rglob("*.safetensors")
        }

    stored, wanted = files(eng), files(in_memory)
    assert len(stored) >= 9 and set(stored) <= set(wanted)
    assert all(stored[name] == wanted[name] for name in stored)
    stats = eng.pool_stats()
    assert stats.used_blocks == 0 and stats.swapped_blocks == 0  # saved, then dropped
    again = eng.generate("long", prompt + got.text + " And then?", max_tokens=2)
    assert again.stats.cache == "warm" and again.stats.reused_tokens >= 2600
    eng.pool.blocks.check()


def test_a_reply_that_takes_an_agent_over_the_budget_swaps_it_then(fresh_engine):
    """A context under the budget (900 tokens of 1,024) whose reply takes it over: the turn
    holds a few blocks (it may stream), and swaps once the reply crosses the budget, so it
    runs to the end in a pool that could not hold its whole turn."""
    eng = fresh_engine(kv_swap_budget=1024, pool_bytes=8 * 1708032, draft_tokens=0)
    prompt = _prompt(eng, 6, tokens=900)
    result = eng.generate("grows", prompt, max_tokens=1400)
    fed = result.stats.prompt_tokens + result.stats.generated_tokens - 1
    assert fed > 8 * 256  # more than the pool holds
    assert eng.swapper.swapped == 1
    eng.pool.blocks.check()


def test_agents_over_the_pool_all_decode_without_evicting_a_whole_agent(fresh_engine):
    """A pool of 10 blocks (4 agents of 1,100 tokens hold 20): each turn prefills in full,
    then keeps 2 blocks while it decodes, so all four run to the end."""
    eng = fresh_engine(kv_swap_budget=512, pool_bytes=10 * 1708032, max_batch=8)
    prompts = [(f"a{i}", _prompt(eng, 10 + i)) for i in range(4)]
    results = eng.generate_many(prompts, max_tokens=5)
    assert [r.stats.generated_tokens for r in results] == [5] * 4
    assert eng.swapper.swapped == 4
    assert eng.residency.evicted == 0  # no agent dropped whole to make room


def test_a_budget_the_engine_cannot_honour_is_refused_at_start(fresh_engine):
    with pytest.raises(InvalidRequestError, match="not format 2"):
        fresh_engine(kv_format=1, kv_swap_budget=512)
