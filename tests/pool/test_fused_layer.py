"""The fused decoder layer (``_ext.decoder_layer``, csrc/decoder_layer.cpp): a Llama block of
the embedded model on a CPU step (decode or prefill) as one operation. It must give the same
bits as the block's separate operations (logits, and every byte it writes into the pool),
whether a step batches several agents or rows complete channel groups, and its KV writes
must match MLX's own (``mx.hadamard_transform``, ``mx.quantize``,
``quant.quantize_channels``)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import _ext, mlx_adapter
from agentkv.format import quant
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.kernels.attention import paths_used
from agentkv.pool.step import PagedStep


def _decode(runner, pool, tables, reservations, tokens, *, fused):
    """One decode step of every table (a token each); (logits [B, vocab], whether it fused)."""
    return _step(runner, pool, tables, reservations, [[t] for t in tokens], fused=fused)


def _step(runner, pool, tables, reservations, ids, *, fused):
    """One step of every table (``ids``: as many tokens each); (logits [B, vocab] of a
    decode step, [B, L, vocab] of a longer one; whether it fused)."""
    for table, reservation in zip(tables, reservations):
        table.grow(len(ids[0]), pool.arena.copy_rows, reservation)
    step = PagedStep(pool.arena, runner.loaded.spec, tables, len(ids[0]), fused=fused)
    logits = runner.model(mx.array(ids), cache=step.caches)
    mx.eval(logits)
    pool.arena.settle()
    for table, row in zip(tables, ids):
        table.written(row)
    return np.array(logits[:, -1, :] if len(ids[0]) == 1 else logits), step.fused


def _stored(pool, tables) -> list[np.ndarray]:
    """Every byte a table's tokens hold in the pool (each layer and component), its tail and
    its last complete group's float16 keys (the prevs)."""
    arena = pool.arena
    out = []
    for table in tables:
        complete = table.length // arena.ct * arena.ct  # the keys of complete groups
        for layer in range(arena.spec.num_layers):
            for i, a in enumerate(arena.arrays[layer]):
                n = complete if i < arena.key_parts else table.length
                out.append(np.array(a[mx.array(arena.write_rows([table.blocks], [0], n))]))
        out.append(arena.read_tail(table.tail, table.length % arena.ct))
        if table.prev_group is not None:
            out.append(arena.read_prev(table.tail))
    return out


def _agents(engine, lengths, seed):
    runner, pool = engine.runner, engine.pool
    rng = np.random.default_rng(seed)
    tables, reservations = [], []
    for i, n in enumerate(lengths):
        table = pool.new_table(pool.seed(f"fused-{seed}-{i}-{len(tables)}-{id(tables)}"))
        reservation = pool.reserve(n // BLOCK_TOKENS + 3)
        ids = rng.integers(100, 30000, n).tolist()
        runner.forward([table], [ids], reservations=[reservation], logits=False)
        tables.append(table)
        reservations.append(reservation)
    return tables, reservations


def _release(tables, reservations):
    for table, reservation in zip(tables, reservations):
        table.release()
        reservation.close()


def test_the_fused_layer_gives_the_bits_of_the_separate_operations(engine):
    """Two copies of three agents (lengths 60, 129 and 250: channel groups complete at step 4
    of the first and step 6 of the third) decode 8 steps, batched, one copy through the
    fused layers and one through the separate operations: the same logits and bytes at
    every step, the steps where a group completes included."""
    runner, pool = engine.runner, engine.pool
    assert all(type(b).__name__ == "CPUFusedBlock" for b in runner.model.model.layers)
    lengths = [60, 129, 250]
    fused_tables, fused_res = _agents(engine, lengths, seed=1)
    plain_tables, plain_res = _agents(engine, lengths, seed=1)
    tokens = [11, 12, 13]
    before = paths_used()["fused_cpu"]
    fused_steps = 0
    for _ in range(8):
        a, fused = _decode(runner, pool, fused_tables, fused_res, tokens, fused=True)
        b, plain = _decode(runner, pool, plain_tables, plain_res, tokens, fused=False)
        assert not plain
        fused_steps += fused
        np.testing.assert_array_equal(a, b)
        tokens = [int(t) for t in a.argmax(axis=-1)]
    assert fused_steps == 8
    assert paths_used()["fused_cpu"] - before >= 8 * runner.loaded.spec.num_layers
    for x, y in zip(_stored(pool, fused_tables), _stored(pool, plain_tables)):
        np.testing.assert_array_equal(x, y)
    assert pool.arena.copies == 0  # the fused writes land in place
    _release(fused_tables, fused_res)
    _release(plain_tables, plain_res)


@pytest.mark.parametrize(
    ("lengths", "chunks"),
    [
        ([1], [63, 150, 106]),  # a whole group from the tail, then groups and a rest
        ([1664, 40], [106, 24, 1]),  # a hot turn's chunk; a row completing beside one not
        ([63, 200, 5], [1, 70, 130]),  # one token completing a group; several groups
    ],
)
def test_prefill_chunks_that_complete_channel_groups_fuse_with_the_same_bits(
    engine, lengths, chunks
):
    """Rows of these lengths take chunks of these sizes, batched, one copy fused and one
    through the separate operations: every chunk fuses, and its logits at every position
    and every byte written (complete groups' codes, tails, prevs) are the same."""
    runner, pool = engine.runner, engine.pool
    rng = np.random.default_rng(sum(lengths) + sum(chunks))
    fused_tables, fused_res = _agents(engine, lengths, seed=5)
    plain_tables, plain_res = _agents(engine, lengths, seed=5)
    for n in chunks:
        ids = rng.integers(100, 30000, (len(lengths), n)).tolist()
        a, fused = _step(runner, pool, fused_tables, fused_res, ids, fused=True)
        b, plain = _step(runner, pool, plain_tables, plain_res, ids, fused=False)
        assert fused and not plain
        np.testing.assert_array_equal(a, b)
    for x, y in zip(_stored(pool, fused_tables), _stored(pool, plain_tables), strict=True):
        np.testing.assert_array_equal(x, y)
    assert all(t.prev_group is not None for t in fused_tables)
    assert pool.arena.copies == 0
    _release(fused_tables, fused_res)
    _release(plain_tables, plain_res)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**16),
    shape=st.sampled_from(["normal", "constant", "zeros", "one_big", "tiny", "halves"]),
)
def test_the_channel_quantization_gives_the_formats_bits(bits, seed, shape):
    """The fused layer's per-channel key quantization (csrc/core/rows.cpp) against format 2's
    own (``quant.quantize_channels``, MLX operations): the same codes, scales and biases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 64)) * rng.uniform(1e-3, 300)
    if shape == "constant":
        x[:, 7] = x[0, 7]  # one channel constant: scale 0
    elif shape == "zeros":
        x[:] = 0
    elif shape == "one_big":
        x[5, 5] = 6e4
    elif shape == "tiny":
        x *= 1e-6  # subnormal float16
    elif shape == "halves":
        x = np.round(x) / 2  # codes exactly halfway: rint's ties to even
    keys = mx.array(x.astype(np.float16))
    got = _ext.quantize_channels(keys, bits)
    want = quant.quantize_channels(keys, bits, 64)
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(
            np.array(have).view(np.uint8), np.array(expected).view(np.uint8)
        )


def test_a_row_gets_the_same_bits_from_the_fused_layer_alone_or_batched(engine):
    runner, pool = engine.runner, engine.pool
    lengths = [70, 300]
    batched, batched_res = _agents(engine, lengths, seed=2)
    alone, alone_res = _agents(engine, lengths, seed=2)
    tokens = [21, 22]
    for _ in range(3):
        both, fused = _decode(runner, pool, batched, batched_res, tokens, fused=True)
        assert fused
        each = [
            _decode(runner, pool, [alone[i]], [alone_res[i]], [tokens[i]], fused=True)[0][0]
            for i in range(2)
        ]
        np.testing.assert_array_equal(both, np.stack(each))
        tokens = [int(t) for t in both.argmax(axis=-1)]
    _release(batched, batched_res)
    _release(alone, alone_res)


_rows = st.integers(1, 6)


@settings(max_examples=40, deadline=None)
@given(
    rows=_rows,
    n=st.sampled_from([1, 16, 32, 64, 128, 256]),
    seed=st.integers(0, 2**16),
    big=st.booleans(),
)
def test_the_rotation_gives_mlx_hadamard_bits(rows, n, seed, big):
    x = np.random.default_rng(seed).standard_normal((rows, 2, n)).astype(np.float32)
    x *= 1e30 if big else 1.0
    scale = 1 / math.sqrt(n)
    want = mx.hadamard_transform(mx.array(x), scale=scale)
    np.testing.assert_array_equal(np.array(_ext.hadamard_rows(mx.array(x), scale)), np.array(want))


def test_the_rotation_over_the_pool_gives_the_same_bits_for_many_and_strided_rows():
    """The prefill's rotation (format.quant.hadamard on CPU): rows spread over the thread
    pool in chunks, a transposed (strided) input, a lazy one; bad input refused."""
    x = mx.array(np.random.default_rng(7).standard_normal((3, 9, 101, 64)).astype(np.float32))
    for a in (x, x.transpose(0, 2, 1, 3), x * 2 + 1):
        want = mx.hadamard_transform(a, scale=0.125)
        assert mx.array_equal(_ext.hadamard_rows(a, 0.125), want)
        assert mx.array_equal(quant.hadamard(a), want)
    with pytest.raises(ValueError, match="power of two"):
        _ext.hadamard_rows(mx.zeros((4, 48)), 1.0)
    with pytest.raises(ValueError, match="float32"):
        _ext.hadamard_rows(mx.zeros((4, 64), dtype=mx.float16), 1.0)


@settings(max_examples=60, deadline=None)
@given(
    rows=_rows,
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**16),
    shape=st.sampled_from(["normal", "constant", "zeros", "one_big", "tiny"]),
)
def test_the_value_quantization_gives_mlx_quantize_bits(rows, bits, group, seed, shape):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 128)).astype(np.float32) * rng.uniform(0.01, 30)
    if shape == "constant":
        x[:] = x[0, 0]
    elif shape == "zeros":
        x[:] = 0
    elif shape == "one_big":
        x[:, 5] = 7e4
    elif shape == "tiny":
        x *= 1e-9
    w, s, b = mx.quantize(mx.array(x), group_size=group, bits=bits)
    got = _ext.quantize_rows(mx.array(x), bits, group)
    np.testing.assert_array_equal(np.array(got[0]), np.array(w))
    for have, want in zip(got[1:], (s, b)):
        np.testing.assert_array_equal(
            np.array(have).view(np.uint16), np.array(want.astype(mx.float16)).view(np.uint16)
        )


def test_bad_layer_arguments_are_clear_errors(engine):
    block = engine.runner.model.model.layers[0]
    args = dict(block.agentkv_fused.arguments)
    arena = engine.pool.arena
    x = mx.zeros((1, 1, 576))
    common = dict(
        keys=list(arena.keys(0)),
        values=list(arena.values(0)),
        tail=arena.tails[0],
        tables=mx.zeros((1, 1), dtype=mx.int32),
        lengths=mx.ones((1,), dtype=mx.int32),
        tail_slots=mx.zeros((1,), dtype=mx.int32),
        rows=mx.zeros((3,), dtype=mx.int32),
        tail_rows=mx.zeros((3,), dtype=mx.int32),
        key_bits=4,
        value_bits=4,
        group=64,
        channel_tokens=64,
        block_tokens=BLOCK_TOKENS,
        window=0,
        rotate=True,
    )
    with pytest.raises(ValueError, match="float32"):
        _ext.decoder_layer(x.astype(mx.float16), **args, **common)
    with pytest.raises(ValueError, match="int32"):
        _ext.decoder_layer(x, **args, **{**common, "rows": mx.zeros((2,), dtype=mx.int32)})
    with pytest.raises(ValueError, match="per-channel keys"):
        _ext.decoder_layer(x, **args, **{**common, "value_bits": 3})
    wrong = dict(args, linears=args["linears"][:-3])
    with pytest.raises(ValueError, match="seven quantized linears"):
        _ext.decoder_layer(x, **wrong, **common)
    # A write row past the arena: NaN out, nothing written.
    bad = {**common, "rows": mx.full((3,), arena.rows, dtype=mx.int32)}
    out = _ext.decoder_layer(x, **args, **bad)
    assert np.isnan(np.array(out)).all()
    # A key plan (a row completing a channel group): it goes with the prevs, its counts must
    # match it, and a group row past the arena gives NaN and writes nothing.
    prevs = arena.prevs[0]
    # gathered, group sources and rows, prev sources and rows, the row's first group
    counts = [0, 63, 64, 0, 64, 1]
    plan = np.concatenate(
        [np.arange(63), np.arange(64), np.arange(64), np.arange(64), np.arange(64), [0]]
    )
    completing = {**common, "tail_rows": None, "key_plan": mx.array(plan.astype(np.int32))}
    with pytest.raises(ValueError, match="key_plan"):
        _ext.decoder_layer(x, **args, **completing, key_counts=counts)
    with pytest.raises(ValueError, match="key_counts"):
        _ext.decoder_layer(x, **args, **completing, key_counts=counts[:5], prevs=prevs)
    with pytest.raises(ValueError, match="key_plan"):
        _ext.decoder_layer(x, **args, **completing, key_counts=[0, 63, 64, 0, 63, 1], prevs=prevs)
    plan[63 + 64 :][:64] = arena.rows  # group rows past the arena
    before = np.array(prevs)
    out = _ext.decoder_layer(
        x,
        **args,
        **{**completing, "key_plan": mx.array(plan.astype(np.int32))},
        key_counts=counts,
        prevs=prevs,
    )
    assert np.isnan(np.array(out)).all()
    np.testing.assert_array_equal(np.array(arena.prevs[0]), before)


def test_the_tied_head_on_the_last_position_alone_gives_the_whole_call_s_bits(engine):
    """The embedded model's tied 8-bit head on the last position only (what the engine asks
    for): the bits of the whole call's last row."""
    model = engine.runner.model
    ids = mx.array([list(range(300, 340)), list(range(500, 540))])
    assert model.args.tie_word_embeddings
    assert mx.array_equal(mlx_adapter.last_logits(model, ids, None), model(ids)[:, -1, :])


def test_a_failed_step_s_fused_writes_never_land(engine):
    """A step that fails after a fused layer was built: its writes are discarded, so a later
    settle cannot write into blocks that may belong to another agent by then."""
    runner, pool = engine.runner, engine.pool
    (table,), (reservation,) = _agents(engine, [30], seed=4)
    before = pool.arena.read_tail(table.tail, 31)  # row 30: whatever the slot held
    table.grow(1, pool.arena.copy_rows, reservation)
    step = PagedStep(pool.arena, runner.loaded.spec, [table], 1)
    h = runner.model.model.embed_tokens(mx.array([[7]]))
    runner.model.model.layers[0](h, None, step.caches[0])  # registers its pending write
    pool.arena.discard_writes()  # what Runner.forward does when the step raises
    pool.arena.settle()
    np.testing.assert_array_equal(pool.arena.read_tail(table.tail, 31), before)
    _release([table], [reservation])
