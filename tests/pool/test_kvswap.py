"""KVSwap on the block pool (pool/swap.py, csrc/core/kvswap.*): an agent decoding with its
leading blocks evicted to their block files, read back group by group as its queries need
them. On the embedded model: a buffer that holds every evicted group gives the in-memory
bits; a row gives the same bits alone or batched with swapped and resident rows; the
chosen groups are the exact top groups where the projection is exact; a damaged or
truncated block file fails that row (NaN, a clear error naming the file), never another
row, never a wrong token."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import SCRIPTS, attention_atol, disk_reads

from agentkv import mlx_adapter
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.model import kvswap
from agentkv.pool import KVPool
from agentkv.pool.step import PagedStep
from agentkv.pool.swap import (
    GROUPS_PER_BLOCK,
    Projections,
    SwapState,
    _layer_offsets,
    plan_blocks,
    stored_keys,
)
from agentkv.store.block_files import SharedBlocks

PREFIX = 1086  # 4 full blocks + 62 tokens: the second decode step completes a channel group


@pytest.fixture(scope="module")
def setup(engine):
    """A pool of the engine's format with one prefilled table the tests fork."""
    loaded, quant = engine.runner.loaded, engine.pool.quant
    spec = loaded.spec
    pool = KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * BLOCK_TOKENS * 64)
    base = pool.new_table(pool.seed("kvswap-test"))
    ids = np.random.default_rng(5).integers(100, 30000, PREFIX).tolist()
    for c0 in range(0, PREFIX, 512):
        part = ids[c0 : c0 + 512]
        base.grow(len(part), pool.arena.copy_rows)
        step = PagedStep(pool.arena, spec, [base], len(part))
        loaded.model(mx.array([part]), cache=step.caches)
        pool.arena.settle()
        base.written(part)
    yield loaded, pool, base
    base.release()


def _identity(spec) -> Projections:
    """Exact projections: rank = head dim, A = B = I, no mean."""
    eye = mx.broadcast_to(mx.eye(spec.key_head_dim), (spec.kv_heads, *[spec.key_head_dim] * 2))
    zero = mx.zeros((spec.kv_heads, spec.key_head_dim))
    layers = spec.num_layers
    return Projections((eye,) * layers, (zero,) * layers, (eye,) * layers)


def _swapped(setup, directory, *, evict: int, staging: int, projections=None) -> SwapState:
    loaded, pool, base = setup
    table = base.fork()
    shared = SharedBlocks(directory, loaded.spec, pool.quant)
    with shared.writing():
        files = shared.ensure_pool_blocks(pool, table.blocks[:evict])
    return SwapState.evict(
        pool,
        table,
        files,
        projections or _identity(loaded.spec),
        query_heads=loaded.query_heads,
        staging=staging,
    )


def _step(setup, tables, swaps, tokens) -> np.ndarray:
    loaded, pool, _ = setup
    for table in tables:
        table.grow(1, pool.arena.copy_rows)
    step = PagedStep(pool.arena, loaded.spec, tables, 1, swaps=swaps)
    out = mlx_adapter.last_logits(loaded.model, mx.array([[t] for t in tokens]), step.caches)
    mx.eval(out)
    pool.arena.settle()
    for table, t in zip(tables, tokens):
        table.written([t])
    return np.array(out.reshape(len(tables), -1).astype(mx.float32))


def test_blocks_after_evicted_ones_chain_to_them(setup, tmp_path):
    """A swapped table's tail, shared with the table it was forked from, is copied at its
    first step: the copy names the evicted block before it as its parent (kept by the table
    while the block is only in its file), so the blocks it fills are sealed under the hashes
    their tokens and everything before them give, findable by other agents."""
    _, pool, base = setup
    swap = _swapped(setup, tmp_path, evict=4, staging=1)
    table = swap.table
    assert table.blocks[:4] == [-1] * 4 and table.evicted_hashes == [
        pool.blocks.records[b].hash for b in base.blocks[:4]
    ]
    _step(setup, [table], [swap], [23])
    assert table.blocks[4] != base.blocks[4]  # copied: base holds the shared tail
    assert table.parent_of(4) == pool.blocks.records[base.blocks[3]].hash
    assert pool.blocks.records[table.blocks[4]].parent == table.parent_of(4)
    swap.release()
    assert table.evicted_hashes == [] and table.blocks == []
    pool.blocks.check()


def test_plan_blocks_swaps_only_what_the_budget_cannot_hold():
    assert plan_blocks(8192, 1024) == (31, 3)  # the last block stays, 3 staging blocks
    assert plan_blocks(8192, 8192) is None  # the budget holds it all: exact attention
    assert plan_blocks(1000, 2048) is None
    assert plan_blocks(2048, 256) is None  # no room for a staging block
    assert plan_blocks(600, 512) == (2, 1)  # the smallest swap: 3 blocks held by 2
    assert plan_blocks(2000, 512) == (7, 1)


@pytest.mark.parametrize("predict_from", [None, 1])
def test_a_buffer_holding_every_evicted_group_gives_the_in_memory_bits(
    setup, tmp_path, predict_from
):
    """Four blocks evicted into four staging blocks: every group comes back in its place,
    so attention reads the same tokens in the same order (fused steps, and the step that
    completes a channel group, which runs the separate operations), whether each layer's
    groups are chosen by its own query or read ahead from the layer before's prediction."""
    loaded, pool, base = setup
    projections = dataclasses.replace(_identity(loaded.spec), predict_from=predict_from)
    swap = _swapped(setup, tmp_path, evict=4, staging=4, projections=projections)
    if predict_from is not None:
        swap.swapset.read_ahead_always = True  # the steps read ahead
        disk_reads(swap.files)  # from the storage, on the I/O thread
    plain = base.fork()
    tokens = [17]
    for _ in range(3):
        a = _step(setup, [plain], [None], tokens)
        b = _step(setup, [swap.table], [swap], tokens)
        np.testing.assert_array_equal(a, b)
        tokens = [int(a[0].argmax())]
    assert swap.error == ""
    stats = swap.stats()
    assert stats["misses"] + stats["fills"] == pool.spec.num_layers * 4 * GROUPS_PER_BLOCK
    assert stats["bytes_read"] > 0
    assert all(swap.swapset.slot_groups(layer) == list(range(16)) for layer in range(30))
    # the fused steps read layers 1.. ahead (the channel group's step runs the separate
    # operations, which predict nothing)
    assert (stats["predicted"] > 0) == (predict_from is not None)
    swap.release()
    plain.release()
    pool.blocks.check()


def test_a_swapped_row_gives_the_same_bits_alone_or_batched(setup, tmp_path):
    """Two swapped agents (1 staging block for 4 evicted ones: groups chosen by their
    queries) and a resident one, batched, against each alone."""
    _, pool, base = setup
    together = [_swapped(setup, tmp_path / f"t{i}", evict=4, staging=1) for i in range(2)]
    alone = [_swapped(setup, tmp_path / f"a{i}", evict=4, staging=1) for i in range(2)]
    resident = [base.fork(), base.fork()]
    tokens = [31, 32, 33]
    for _ in range(3):
        both = _step(setup, [s.table for s in together] + [resident[0]], [*together, None], tokens)
        each = [_step(setup, [s.table], [s], [t])[0] for s, t in zip(alone, tokens)]
        each.append(_step(setup, [resident[1]], [None], [tokens[2]])[0])
        np.testing.assert_array_equal(both, np.stack(each))
        tokens = [int(t) for t in both.argmax(axis=-1)]
    for s in together + alone:
        assert s.error == ""
        assert s.stats()["misses"] > 0  # groups came and went
        s.release()
    for t in resident:
        t.release()
    pool.blocks.check()


def test_reading_ahead_gives_the_same_bits(setup, tmp_path):
    """A swapped agent reading ahead (every layer from 1, its block files' pages dropped
    before each step, so reads go to the storage and run on the I/O thread) against a twin
    that reads nothing ahead: the same logits, step by step, with groups chosen by the
    queries (1 staging block for 4 evicted ones)."""
    loaded, pool, _ = setup
    projections = dataclasses.replace(_identity(loaded.spec), predict_from=1)
    ahead = _swapped(setup, tmp_path / "ahead", evict=4, staging=1, projections=projections)
    ahead.swapset.read_ahead_always = True
    inline = _swapped(setup, tmp_path / "inline", evict=4, staging=1)
    tokens = [51]
    for _ in range(4):
        disk_reads(ahead.files)
        a = _step(setup, [ahead.table], [ahead], tokens)
        b = _step(setup, [inline.table], [inline], tokens)
        np.testing.assert_array_equal(a, b)
        tokens = [int(a[0].argmax())]
    stats = ahead.stats()
    assert ahead.error == "" and stats["predicted"] > 0 and stats["ahead_used"] > 0
    ahead.release()
    inline.release()
    pool.blocks.check()


def test_steps_read_ahead_only_while_reads_go_to_disk(setup, tmp_path):
    """Left to itself, a set reads ahead only while reads go to disk: a step reads ahead
    (finds reads ahead for its layers) only if a read of the step before, or of the four
    before it, missed the page cache, and every step right after one whose reads missed
    reads ahead. Checked step by step against what the set counted: warm steps (the files
    just written and flushed) and steps after the files were dropped from the page cache.
    Whether a read missed is RWF_NOWAIT's answer, so which steps miss depends on the
    storage (one that serves a dropped page within the call answers "cached"); the rule is
    held either way, and the run fails if no step at all could check its second half."""
    loaded, _, _ = setup
    projections = dataclasses.replace(_identity(loaded.spec), predict_from=1)
    swap = _swapped(setup, tmp_path, evict=4, staging=1, projections=projections)
    assert not swap.swapset.read_ahead_always
    for f in swap.files:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    tokens, steps = [23], []
    for drop in (False, False, True, True, True, True, False, False, False, False, False):
        if drop:
            disk_reads(swap.files)
        before = swap.stats()
        tokens = [int(_step(setup, [swap.table], [swap], tokens)[0].argmax())]
        after = swap.stats()
        steps.append(
            (after["disk_reads"] - before["disk_reads"], after["predicted"] - before["predicted"])
        )
    assert swap.error == ""
    checked = 0
    for i, (_, predicted) in enumerate(steps):
        missed_before = [m for m, _ in steps[max(0, i - 4) : i]]
        if not any(missed_before):
            assert predicted == 0, (i, steps)  # no miss lately: nothing read ahead
        if i > 0 and steps[i - 1][0] > 0:
            assert predicted > 0, (i, steps)  # the step before missed: this one reads ahead
            checked += 1
    assert checked or not any(m for m, _ in steps[:-1]), steps
    swap.release()


def _exact_ranking(keys: np.ndarray, q: np.ndarray, scale: float, groups: int) -> np.ndarray:
    """Per query head, the softmax over groups 1.. of each group's best q.k, summed."""
    per = q.shape[0] // keys.shape[0]
    total = np.zeros(groups)
    for h in range(q.shape[0]):
        s = keys[h // per] @ (q[h] * scale)  # [tokens]
        best = s.reshape(groups, -1).max(axis=1)[1:]
        p = np.exp(best - best.max())
        total[1:] += p / p.sum()
    return total


def test_the_chosen_groups_are_the_exact_top_groups(setup, tmp_path):
    """With exact projections the predictor ranks groups as the exact scores do (queries
    drawn around chosen keys, so the top groups mostly stand apart from the rest; cases with
    a near tie at the cut are skipped)."""
    loaded, pool, base = setup
    spec = loaded.spec
    swap = _swapped(setup, tmp_path, evict=4, staging=1)
    rng = np.random.default_rng(0)
    groups = 4 * GROUPS_PER_BLOCK
    scale = spec.key_head_dim**-0.5
    checked = 0
    for layer in (0, 7, 19):
        keys = np.array(stored_keys(pool, layer, base.blocks[:4]))  # the fork's evicted ones
        for _ in range(4):
            planted = rng.choice(np.arange(1, groups), size=3, replace=False)
            q = np.zeros((loaded.query_heads, spec.key_head_dim), dtype=np.float32)
            per = loaded.query_heads // spec.kv_heads
            for h in range(loaded.query_heads):
                g = planted[h % 3]
                token = g * 64 + rng.integers(0, 64)
                q[h] = 3 * keys[h // per, token] + rng.normal(0, 0.1, spec.key_head_dim)
            exact = _exact_ranking(keys, q, scale, groups)
            order = np.argsort(-exact)
            if exact[order[2]] - exact[order[3]] < 0.2:
                continue  # a near tie at the cut: int8 low-rank keys may break it either way
            got = swap.swapset.ranked(layer, mx.array(q))
            assert set(got[:3]) == set(order[:3].tolist())
            checked += 1
    assert checked >= 6
    swap.release()


def _flip_bytes(path, offset: int, length: int) -> None:
    """Damage ``length`` bytes of a file (every byte flipped), as the disk might; written
    through (fsync), so the page cache can drop them."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        data = bytearray(fh.read(length))
        fh.seek(offset)
        fh.write(bytes(b ^ 0x5A for b in data))
        fh.flush()
        os.fsync(fh.fileno())


def _stage(setup, swap, layer: int, q: np.ndarray) -> np.ndarray:
    """Stage ``swap``'s groups for ``layer`` alone (``_ext.kvswap_stage``, as a step does
    before the paged attention); returns the queries it hands on (NaN: the reads failed)."""
    from agentkv import _ext

    _, pool, _ = setup
    arena = pool.arena
    out = _ext.kvswap_stage(
        mx.array(q[None, :, None, :]),
        list(arena.keys(layer)),
        list(arena.values(layer)),
        mx.array([swap.attention_row()], dtype=mx.int32),
        [swap.swapset],
        [0],
        layer,
    )
    mx.eval(out)
    return np.array(out)


def _staged_rows(setup, swap, layer: int) -> list[np.ndarray]:
    """The bytes of ``layer``'s staging blocks, each component's rows of each slot in slot
    order."""
    loaded, pool, _ = setup
    heads = loaded.spec.kv_heads
    out = []
    for part in (*pool.arena.keys(layer), *pool.arena.values(layer)):
        rows = np.array(part).reshape(-1, heads, BLOCK_TOKENS, part.shape[-1])
        out.append(rows[swap.staging])
    return out


@pytest.mark.parametrize("cold", [False, True])
def test_reading_ahead_never_changes_what_a_layer_stages(setup, tmp_path, cold):
    """A layer's groups read ahead from a predicted query, then staged with the layer's own
    query: the same slots and the same bytes as a twin that reads nothing ahead, whether the
    prediction was right (the same query: every group read ahead is used) or wrong (another
    query: the layer reads what it lacks itself). With the block files' pages dropped
    first, the reads ahead run on the I/O thread; else they are copied at once."""
    loaded, _, _ = setup
    spec = loaded.spec
    ahead = _swapped(setup, tmp_path / "ahead", evict=4, staging=1)
    ahead.swapset.predict_from = 1
    inline = _swapped(setup, tmp_path / "inline", evict=4, staging=1)
    rng = np.random.default_rng(3)
    for layer in (2, 7, 19):
        for trial in range(4):
            q = rng.normal(0, 1, (loaded.query_heads, spec.key_head_dim)).astype(np.float32)
            predicted = q if trial % 2 else rng.normal(0, 1, q.shape).astype(np.float32)
            if cold:
                disk_reads(ahead.files)
            assert ahead.swapset.predict(layer, mx.array(predicted))
            assert np.array_equal(_stage(setup, ahead, layer, q), q[None, :, None, :])
            assert np.array_equal(_stage(setup, inline, layer, q), q[None, :, None, :])
            assert ahead.swapset.slot_groups(layer) == inline.swapset.slot_groups(layer)
            for a, b in zip(_staged_rows(setup, ahead, layer), _staged_rows(setup, inline, layer)):
                np.testing.assert_array_equal(a, b)
    stats, alone = ahead.swapset.stats, inline.swapset.stats
    assert stats["predicted"] == 12 and alone["predicted"] == 0
    assert 0 < stats["ahead_used"] < stats["read_ahead"]  # right and wrong predictions
    for key in ("hits", "misses", "fills"):
        assert stats[key] == alone[key]
    assert not ahead.swapset.predict(0, mx.array(q))  # below predict_from: nothing started
    with pytest.raises(ValueError, match="Hq, D"):
        ahead.swapset.predict(3, mx.array(q[:2]))
    ahead.release()
    inline.release()


@pytest.mark.parametrize("cold", [False, True])
def test_a_damaged_group_read_ahead_fails_its_row_when_staged(setup, tmp_path, cold):
    """A block file damaged after the swap, read ahead (warm: at once; cold: on the I/O
    thread): nothing fails at the prediction; the stage that takes the reads fails the row
    (NaN) with an error naming the file, and the set stays failed."""
    loaded, _, _ = setup
    swap = _swapped(setup, tmp_path, evict=4, staging=1)
    swap.swapset.predict_from = 1
    for f in swap.files:
        _flip_bytes(f.path, f.offset, f.length)
    if cold:
        disk_reads(swap.files)
    q = np.ones((loaded.query_heads, loaded.spec.key_head_dim), dtype=np.float32)
    assert swap.swapset.predict(5, mx.array(q))
    assert np.isnan(_stage(setup, swap, 5, q)).all()
    assert "do not match their checksum" in swap.error
    assert any(f.path in swap.error for f in swap.files)
    assert not swap.swapset.predict(6, mx.array(q))  # a failed set starts nothing more
    swap.release()


@pytest.mark.parametrize("cold", [False, True])
def test_a_damaged_group_read_ahead_but_not_chosen_fails_nothing(setup, tmp_path, cold):
    """One group's extent damaged, a group the predicted query reads ahead and the layer's
    own query does not choose: the stage succeeds (the bad bytes are never used); staging
    a query that chooses that group then fails the row, naming the file."""
    loaded, pool, _ = setup
    spec = loaded.spec
    swap = _swapped(setup, tmp_path, evict=4, staging=1)  # the sinks' slot and 3 more
    swap.swapset.predict_from = 1
    layer, rng = 5, np.random.default_rng(11)
    shape = (loaded.query_heads, spec.key_head_dim)
    for _ in range(100):  # a predicted query whose 3 best groups differ from the real one's
        q_pred, q_real = (rng.normal(0, 1, shape).astype(np.float32) for _ in range(2))
        pred = swap.swapset.ranked(layer, mx.array(q_pred))[:3]
        real = swap.swapset.ranked(layer, mx.array(q_real))[:3]
        only = sorted(set(pred) - set(real))
        if only:
            break
    block, in_block = divmod(only[0], GROUPS_PER_BLOCK)
    extent = sum(c.heads * 64 * c.row_bytes for c in pool.arena.components[layer])
    first = _layer_offsets(pool.arena.components, [swap.files[block]])[layer]
    _flip_bytes(swap.files[block].path, first + in_block * extent, extent)
    if cold:
        disk_reads(swap.files)
    assert swap.swapset.predict(layer, mx.array(q_pred))
    assert np.array_equal(_stage(setup, swap, layer, q_real), q_real[None, :, None, :])
    stats = swap.swapset.stats
    assert swap.error == "" and stats["ahead_used"] < stats["read_ahead"]
    assert np.isnan(_stage(setup, swap, layer, q_pred)).all()
    assert "do not match their checksum" in swap.error and swap.files[block].path in swap.error
    swap.release()


def test_a_damaged_block_file_fails_only_its_row(setup, tmp_path):
    """One agent's block files damaged after it swapped (bytes flipped), another's
    truncated: each of those rows gets NaN and an error naming its file; the third swapped
    agent in the same batch gets the bits it gets alone."""
    _, pool, _ = setup
    damaged = _swapped(setup, tmp_path / "d", evict=4, staging=1)
    short = _swapped(setup, tmp_path / "s", evict=4, staging=1)
    sound = _swapped(setup, tmp_path / "ok", evict=4, staging=1)
    sound_alone = _swapped(setup, tmp_path / "ok2", evict=4, staging=1)
    for f in damaged.files:
        _flip_bytes(f.path, f.offset, f.length)
    for f in short.files:
        with open(f.path, "r+b") as fh:
            fh.truncate(f.offset + 100)
    rows = [damaged, short, sound]
    out = _step(setup, [s.table for s in rows], rows, [41, 42, 43])
    want = _step(setup, [sound_alone.table], [sound_alone], [43])
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()
    np.testing.assert_array_equal(out[2], want[0])
    assert "do not match their checksum" in damaged.error
    assert any(f.path in damaged.error for f in damaged.files)
    assert "shorter than its layout" in short.error
    assert sound.error == ""
    for s in rows + [sound_alone]:
        s.release()
    pool.blocks.check()


def test_a_missing_block_file_is_refused_when_swapping(setup, tmp_path):
    loaded, pool, base = setup
    table = base.fork()
    shared = SharedBlocks(tmp_path, loaded.spec, pool.quant)
    with shared.writing():
        files = shared.ensure_pool_blocks(pool, table.blocks[:4])
    Path(files[2].path).unlink()
    with pytest.raises(RuntimeError, match="cannot open block file"):
        SwapState.evict(
            pool, table, files, _identity(loaded.spec), query_heads=loaded.query_heads, staging=1
        )
    assert table.blocks[0] >= 0  # nothing evicted
    table.release()
    pool.blocks.check()


def test_a_rank_the_scoring_cannot_take_is_refused(setup):
    loaded, pool, _ = setup
    for rank in (30, 2, 65):
        with pytest.raises(ValueError, match="multiple of 4"):
            kvswap.projections(loaded.model, loaded.tokenizer, loaded.spec, pool.quant, rank)


def test_the_projections_are_measured_once_and_kept(setup, monkeypatch, caplog):
    loaded, pool, _ = setup
    spec, quant = loaded.spec, pool.quant
    monkeypatch.setattr(kvswap, "CALIBRATION_TOKENS", 512)
    monkeypatch.setattr(kvswap, "_MEMO", {})
    p = kvswap.projections(loaded.model, loaded.tokenizer, spec, quant, 8)
    assert len(p.matrices) == spec.num_layers and p.rank == 8
    assert p.matrices[0].shape == (spec.kv_heads, spec.key_head_dim, 8)
    path = kvswap._path(spec, quant)
    assert path.exists()
    # Read back, not measured again.
    monkeypatch.setattr(kvswap, "_MEMO", {})
    monkeypatch.setattr(kvswap, "layer_keys", lambda *a: pytest.fail("measured again"))
    q = kvswap.projections(loaded.model, loaded.tokenizer, spec, quant, 8)
    np.testing.assert_array_equal(np.array(q.matrices[3]), np.array(p.matrices[3]))
    # The bilinear form at full rank is exact: (q B).((k - mean) A) == q.(k - mean).
    full = kvswap.projections(loaded.model, loaded.tokenizer, spec, quant, spec.key_head_dim)
    rng = np.random.default_rng(1)
    k, qv = rng.normal(size=(2, spec.key_head_dim)).astype(np.float32)
    a, b = np.array(full.matrices[5][1]), np.array(full.queries[5][1])
    mean = np.array(full.means[5][1])
    assert math.isclose(float((qv @ b) @ ((k - mean) @ a)), float(qv @ (k - mean)), rel_tol=1e-3)
    # A damaged file is ignored (logged) and measured again.
    path.write_bytes(b"not safetensors")
    monkeypatch.setattr(kvswap, "_MEMO", {})
    calls = []
    monkeypatch.setattr(kvswap, "layer_keys", lambda *a: calls.append(1) or pytest.fail("x"))
    with pytest.raises(pytest.fail.Exception):
        kvswap.projections(loaded.model, loaded.tokenizer, spec, quant, 8)
    assert calls and "ignoring the unreadable KVSwap calibration" in caplog.text


def test_the_kernel_body_reads_a_swapped_row_as_the_fused_kernel_does(setup, tmp_path):
    """A swapped row's attention table (staging blocks, then resident ones) is an ordinary
    block table: kernels/paged_attention.metal's body, compiled for the CPU, reads it as the
    fused kernel does (the body Metal and CUDA run)."""
    from agentkv import kernels
    from agentkv.kernels import PagedQuery, cpu

    loaded, pool, _ = setup
    swap = _swapped(setup, tmp_path, evict=4, staging=1)
    _step(setup, [swap.table], [swap], [51])  # stages every layer's groups
    arena, spec = pool.arena, loaded.spec
    row = swap.attention_row()
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((1, loaded.query_heads, 1, spec.key_head_dim)), mx.float32)
    for layer in (0, 19):
        quant = arena.layer_quants[layer]
        paged = PagedQuery(
            arena.keys(layer),
            arena.values(layer),
            mx.array([row], dtype=mx.int32),
            mx.array([swap.attention_length(swap.table.length)], dtype=mx.int32),
            spec.kv_heads,
            BLOCK_TOKENS,
            quant.key_bits,
            quant.value_bits,
            quant.group_size,
            0,
            None,
            channel_tokens=quant.channel_tokens,
            tail=arena.tails[layer],
            tail_slots=mx.array([swap.table.tail], dtype=mx.int32),
        )
        ours = cpu.fused_paged_attention(q, paged, scale=0.125)
        with kernels.use_backend("cpu"):
            body = kernels.paged_attention_body(q, paged, scale=0.125)
        atol = attention_atol(quant)
        np.testing.assert_allclose(np.array(body), np.array(ours), rtol=3e-4, atol=atol)
    swap.release()


def test_a_swapped_table_grows_and_seals_blocks_as_it_decodes(setup, tmp_path):
    """Decoding across a block boundary: the block it filled is sealed (hashed), the next
    one allocated; then the filled block is evicted too (its own block file), and decoding
    goes on reading it back; the pool's books stay right."""
    loaded, pool, base = setup
    table = pool.new_table(pool.seed("kvswap-grow"))
    ids = np.random.default_rng(9).integers(100, 30000, 1022).tolist()
    for c0 in range(0, len(ids), 512):
        part = ids[c0 : c0 + 512]
        table.grow(len(part), pool.arena.copy_rows)
        step = PagedStep(pool.arena, loaded.spec, [table], len(part))
        loaded.model(mx.array([part]), cache=step.caches)
        pool.arena.settle()
        table.written(part)
    shared = SharedBlocks(tmp_path, loaded.spec, pool.quant)
    with shared.writing():
        files = shared.ensure_pool_blocks(pool, table.blocks[:3])
    swap = SwapState.evict(
        pool, table, files, _identity(loaded.spec), query_heads=loaded.query_heads, staging=1
    )
    for token in (61, 62, 63, 64):
        out = _step(setup, [table], [swap], [token])
        assert np.isfinite(out).all()
    assert table.length == 1026 and len(table.blocks) == 5
    assert table.blocks[:3] == [-1, -1, -1]
    filled = table.blocks[3]
    assert pool.blocks.records[filled].hash is not None  # filled at 1024: sealed
    assert swap.attention_length(table.length) == 256 + 1026 - 3 * 256
    # The block it filled joins the evicted ones, read back from its own file from now on.
    assert swap.next_evictable() == filled
    digest = pool.blocks.records[filled].hash
    with shared.writing():
        (file,) = shared.ensure_pool_blocks(pool, [filled])
    swap.evict_next(file)
    assert swap.evicted == 4 and table.blocks[:4] == [-1] * 4 and swap.next_evictable() is None
    assert swap.records[-1][0] == digest  # a save names it by its hash
    assert swap.attention_length(table.length) == 256 + 1026 - 4 * 256
    before = swap.stats()["misses"] + swap.stats()["fills"]
    for token in (65, 66):
        assert np.isfinite(_step(setup, [table], [swap], [token])).all()
    assert swap.error == "" and swap.stats()["misses"] + swap.stats()["fills"] >= before
    swap.release()
    pool.blocks.check()


def test_every_scoring_path_ranks_the_same(tmp_path, python_env):
    """The scoring sums are integers on every path (AVX-512 VNNI, the compiler's vector
    loops, portable C++), so the rankings are the same bits."""
    script = str(SCRIPTS / "kvswap_ranking.py")
    runs = []
    for cpu in ("native", "portable"):
        env = {**python_env, "AGENTKV_CPU": cpu}
        run = subprocess.run(
            [sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        runs.append(json.loads(run.stdout))
    assert len(runs[0]) == 48 and runs[0] == runs[1]
    assert len({tuple(r[:3]) for r in runs[0]}) > 10  # the queries choose different groups
