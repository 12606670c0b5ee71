"""KV format 2's stored bits are a function of the tokens alone (docs/kv-format-v2.md): a
query reads its own channel group in float16 until the group is complete at it, and
quantized from the group's last token on, whatever step it arrives in. So the same tokens
fed in any chunks, one by one, or after another agent's shared prefix, hold the same bytes
in every block, tail and previous group, and give the same logits."""

import mlx.core as mx
import numpy as np
import pytest

from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.pool.step import PagedStep


def _stored(pool, table) -> list[np.ndarray]:
    """Every byte the table's tokens hold: each layer's components (keys of complete groups),
    the tail and the float16 keys of its last complete group."""
    arena = pool.arena
    complete = table.length // arena.ct * arena.ct
    out = []
    for layer in range(arena.spec.num_layers):
        for i, a in enumerate(arena.arrays[layer]):
            n = complete if i < arena.key_parts else table.length
            out.append(np.array(a[mx.array(arena.write_rows([table.blocks], [0], n))]))
    out.append(arena.read_tail(table.tail, table.length % arena.ct))
    out.append(arena.read_prev(table.tail))
    return out


def _feed(engine, ids, chunks, *, fused=True):
    """``ids`` through the model in steps of ``chunks`` tokens: (the bytes stored, the last
    step's logits of its last token)."""
    runner, pool = engine.runner, engine.pool
    table = pool.new_table(pool.seed(f"chunks-{id(chunks)}-{len(chunks)}-{chunks[0]}"))
    reservation = pool.reserve(len(ids) // BLOCK_TOKENS + 2)
    at, last = 0, None
    try:
        for size in chunks:
            part = ids[at : at + size]
            table.grow(len(part), pool.arena.copy_rows, reservation)
            step = PagedStep(pool.arena, runner.loaded.spec, [table], len(part), fused=fused)
            logits = runner.model(mx.array([part]), cache=step.caches)
            mx.eval(logits)
            pool.arena.settle()
            table.written(part)
            last = np.array(logits[0, -1])
            at += size
        assert at == len(ids)
        return _stored(pool, table), last
    finally:
        table.release()
        reservation.close()


def _random_chunks(rng, total, most):
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(min(rng.integers(1, most + 1), total - sum(sizes))))
    return sizes


@pytest.mark.parametrize("fused", [True, False], ids=["fused layer", "separate operations"])
def test_the_same_tokens_in_other_chunks_store_the_same_bits(engine, fused):
    """300 tokens at once, in random chunks (groups completing inside them, at their ends, in
    chunks of one), and token by token around the group boundaries: every byte and the
    logits equal, through the fused layer and through the separate operations (the
    attention kernel alone)."""
    rng = np.random.default_rng(41)
    ids = rng.integers(100, 30000, 300).tolist()
    want, logits = _feed(engine, ids, [300], fused=fused)
    chunkings = [
        _random_chunks(rng, 300, 150),
        _random_chunks(rng, 300, 40),
        [60, 1, 1, 1, 1, 1, 60, 5, 100, 70],  # one token at a time across the group at 64
    ]
    for chunks in chunkings:
        got, last = _feed(engine, ids, chunks, fused=fused)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(last, logits)
