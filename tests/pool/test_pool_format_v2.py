"""KV format 2 in the pool (docs/kv-format-v2.md): keys rotated by H and quantized per channel
over each complete group of ``channel_tokens`` tokens, the group still filling kept in float16
in the table's tail slot; values rotated, quantized per token. Attention over it rotates the
queries and the output, and equals attention over what is stored."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import FUSED_ATOL, _kv_for, fill_table, synthetic_spec, table_arrays

from agentkv.format.quant import V1, V2, KVQuant, dequantize_tokens, hadamard
from agentkv.pool import KVPool
from agentkv.pool.arena import WritePlan
from agentkv.pool.step import PagedStep

V2Q = KVQuant(**V2)


def pool_for(spec, quant=V2Q, blocks=24):
    return KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * 256 * blocks)


def stored_keys(pool, table, layer: int) -> np.ndarray:
    """The table's keys as stored (rotated space, float32 [heads, n, dim]): complete groups
    dequantized from the arena, the rest from the tail."""
    n, ct = table.length, pool.arena.ct
    full = n // ct * ct
    parts = table_arrays(pool, table, n)[layer * 6 : layer * 6 + 3]
    keys = np.array(pool.quant.dequantize_keys(tuple(mx.array(p[:, :full]) for p in parts)))
    tail = pool.arena.read_tail(table.tail, n - full)[layer].astype(np.float32)
    return np.concatenate([keys, tail], axis=1)


def stored_values(pool, table, layer: int) -> np.ndarray:
    parts = table_arrays(pool, table)[layer * 6 + 3 : layer * 6 + 6]
    return np.array(dequantize_tokens(tuple(mx.array(p) for p in parts), 4, 64))


def test_complete_groups_are_quantized_per_channel_and_the_filling_group_kept_in_float16():
    spec = synthetic_spec(layers=2, heads=3)
    pool = pool_for(spec)
    table = fill_table(pool, 300, positional=True)  # chunks of 197 and 103: groups straddle
    arrays = table_arrays(pool, table)
    for layer in range(2):
        k, v = _kv_for(spec, layer, 0, 300, rng=None, positional=True)
        rotated = hadamard(k).astype(mx.float16)[0]  # [heads, 300, dim]
        words, scales, biases = V2Q.quantize_channels(rotated[:, :256])
        got = arrays[layer * 6 : layer * 6 + 3]
        for want, have in zip((words, scales, biases), got):
            np.testing.assert_array_equal(np.array(want), have[:, :256])
        tail = pool.arena.read_tail(table.tail, 300 - 256)[layer]
        np.testing.assert_array_equal(tail, np.array(rotated[:, 256:]))
        values = V2Q.quantize(hadamard(v), 4)
        for want, have in zip(values, arrays[layer * 6 + 3 : layer * 6 + 6]):
            np.testing.assert_array_equal(np.array(want[0]), have)
        # What is stored reads back close to the keys: 4 bits per channel of a sine.
        back = hadamard(mx.array(stored_keys(pool, table, layer)))
        assert float(mx.abs(back - k[0]).max()) < 0.15


def test_the_stored_bits_do_not_depend_on_how_tokens_arrive():
    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec)
    chunked = fill_table(pool, 150, positional=True)
    single = pool.new_table(pool.seed("one by one"))
    for start in range(150):
        single.grow(1, pool.arena.copy_rows)
        plan = WritePlan(pool.arena, [single], [start], 1)
        k, v = _kv_for(spec, 0, start, 1, rng=None, positional=True)
        pool.arena.append(0, k, v, plan)
        pool.arena.settle()
        single.written([chunked.token_ids()[start]])
    for a, b in zip(table_arrays(pool, chunked), table_arrays(pool, single)):
        np.testing.assert_array_equal(a[:, :128], b[:, :128])
    np.testing.assert_array_equal(
        pool.arena.read_tail(chunked.tail, 22), pool.arena.read_tail(single.tail, 22)
    )
    assert pool.arena.copies == 0


def reference_attention(pool, tables, queries, scale, floats=None):
    """Softmax attention of each row's queries (its last L positions) over its stored keys and
    values, in the model's space (H undone). ``floats``: per row, the float16 keys (rotated,
    as float32 [heads, k, dim]) of its last k positions, from the start of the group its first
    query is in: a query then reads its own group from them until its last token, as it
    would one token at a time; without them every complete group is read quantized."""
    out = []
    ct = pool.arena.ct
    for b, table in enumerate(tables):
        stored = stored_keys(pool, table, 0)
        values = np.array(hadamard(mx.array(stored_values(pool, table, 0))))
        q = np.array(queries[b])  # [Hq, L, D]
        heads, n = stored.shape[0], stored.shape[1]
        rep, L = q.shape[0] // heads, q.shape[1]
        rows = np.zeros((q.shape[0], L, values.shape[-1]), np.float32)
        for i in range(L):
            p = n - L + i
            seen = stored.copy()
            own = (p + 1) // ct * ct
            if floats is not None and own <= p:
                at = n - floats[b].shape[1]
                seen[:, own : p + 1] = floats[b][:, own - at : p + 1 - at]
            keys = np.array(hadamard(mx.array(seen)))
            for h in range(q.shape[0]):
                s = (keys[h // rep, : p + 1] @ q[h, i]) * scale
                w = np.exp(s - s.max())
                rows[h, i] = (w / w.sum()) @ values[h // rep, : p + 1]
        out.append(rows)
    return np.stack(out)


@pytest.mark.parametrize("count", [1, 5])
def test_a_nan_or_infinite_query_gives_nan_for_its_head_alone_and_a_zero_query_its_average(count):
    """The integer path (keys of whole channel groups, 4-bit values) scales each query by its
    largest element: a NaN or an infinity in a query makes that query head's output NaN, as
    float attention does, and nothing else; an all-zero query is the mean of what it sees."""
    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec)
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 200])]
    for t in tables:
        t.grow(count, pool.arena.copy_rows)
    rng = np.random.default_rng(11)
    k_new, v_new = (
        mx.array(rng.standard_normal((2, 2, count, 64)).astype(np.float32)) for _ in range(2)
    )
    q = rng.standard_normal((2, 4, count, 64)).astype(np.float32)
    q[0, 1, -1, 5] = np.nan
    q[1, 2, -1, 9] = np.inf
    q[1, 0] = 0.0
    cache = PagedStep(pool.arena, spec, tables, count).caches[0]
    keys, values = cache.update_and_fetch(k_new, v_new)
    out = cache.agentkv_attention(
        mx.array(q), keys, values, scale=0.125, mask=None if count == 1 else "causal"
    )
    mx.eval(out)
    pool.arena.settle()
    for t in tables:
        t.written(list(range(count)))
    got = np.array(out)
    bad = np.zeros(got.shape[:3], dtype=bool)
    bad[0, 1, -1] = bad[1, 2, -1] = True
    assert np.isnan(got[bad]).all()
    assert np.isfinite(got[~bad]).all()
    finite = np.where(np.isfinite(q), q, 0.0).astype(np.float32)
    want = reference_attention(pool, tables, mx.array(finite), 0.125)
    np.testing.assert_allclose(got[~bad], want[~bad], atol=FUSED_ATOL, rtol=1e-4)


@pytest.mark.parametrize("count", [1, 5])
def test_paged_attention_equals_attention_over_what_is_stored(count):
    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec)
    lengths = [300, 64, 127]  # a tail of 44, a group just complete, a tail of 63
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate(lengths)]
    for t in tables:
        t.grow(count, pool.arena.copy_rows)
    rng = np.random.default_rng(7)
    k_new = mx.array(rng.standard_normal((3, 2, count, 64)).astype(np.float32))
    v_new = mx.array(rng.standard_normal((3, 2, count, 64)).astype(np.float32))
    queries = mx.array(rng.standard_normal((3, 4, count, 64)).astype(np.float32))
    step = PagedStep(pool.arena, spec, tables, count)
    cache = step.caches[0]
    keys, values = cache.update_and_fetch(k_new, v_new)
    mask = None if count == 1 else "causal"
    out = cache.agentkv_attention(queries, keys, values, scale=0.125, mask=mask)
    mx.eval(out)
    pool.arena.settle()
    for t in tables:
        t.written(list(range(count)))
    want = reference_attention(pool, tables, queries, 0.125)
    np.testing.assert_allclose(np.array(out), want, atol=FUSED_ATOL, rtol=1e-4)
    assert pool.arena.copies == 0


def test_a_query_inside_a_group_its_step_completes_reads_that_group_in_float16():
    """A step of 70 tokens completes a group of each row ([256, 320) after 300, [64, 128)
    after 64 and 100): its queries before the group's last token read the group's keys as
    float16 (as one token at a time would), its last token and those after read it
    quantized. Every path follows that rule: the fused kernel, the MLX reference, and the
    GPU's two (the kernel body, compiled for the CPU, and the dense prefill path)."""
    from agentkv import kernels
    from agentkv.kernels import dense
    from agentkv.kernels.attention import paged_attention
    from agentkv.kernels.types import PagedQuery

    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec)
    count, ct = 70, pool.arena.ct
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 64, 100])]
    olds = [pool.arena.read_tail(t.tail, t.length % ct)[0] for t in tables]
    for t in tables:
        t.grow(count, pool.arena.copy_rows)
    rng = np.random.default_rng(17)
    k_new = mx.array(rng.standard_normal((3, 2, count, 64)).astype(np.float32))
    v_new = mx.array(rng.standard_normal((3, 2, count, 64)).astype(np.float32))
    queries = mx.array(rng.standard_normal((3, 4, count, 64)).astype(np.float32))
    step = PagedStep(pool.arena, spec, tables, count)
    cache = step.caches[0]
    keys, values = cache.update_and_fetch(k_new, v_new)
    paged = PagedQuery(
        tuple(keys), tuple(values), step.tables, step.lengths, 2, 256, 4, 4, 64, 0, None, 64,
        pool.arena.tails[0], step.plan.tail_slots, step.host, step.plan.done[0],
        step.plan.done_first,
    )  # fmt: skip
    q = hadamard(queries)  # what the cache's attention hands the kernels
    fused = hadamard(paged_attention(q, paged, scale=0.125))
    reference = hadamard(kernels.reference.paged_attention(q, paged, scale=0.125))
    with kernels.use_backend("cpu"):
        body = hadamard(kernels.paged_attention_body(q, paged, scale=0.125))
    assert dense.takes(q, paged)
    dense_out = hadamard(dense.paged_attention(q, paged, scale=0.125))
    mx.eval(fused, reference, body, dense_out)
    pool.arena.settle()
    for t in tables:
        t.written(list(range(count)))
    fresh = np.array(hadamard(k_new).astype(mx.float16)).astype(np.float32)
    floats = [np.concatenate([o.astype(np.float32), fresh[b]], axis=1) for b, o in enumerate(olds)]
    want = reference_attention(pool, tables, queries, 0.125, floats=floats)
    loose = reference_attention(pool, tables, queries, 0.125)  # every complete group quantized
    inside = np.abs(want - loose).max(axis=(1, 3)) > 1e-3  # [rows, queries] the rule moves
    assert inside[0, : 319 - 300].all() and not inside[0, 319 - 300 :].any()
    assert inside[1, :63].all() and not inside[1, 63:].any()
    assert inside[2, : 127 - 100].all() and not inside[2, 127 - 100 :].any()
    np.testing.assert_allclose(np.array(fused), want, atol=FUSED_ATOL, rtol=1e-4)
    np.testing.assert_allclose(np.array(reference), want, atol=2e-3, rtol=1e-3)
    # the GPU's paths in float: within float rounding of the rule (which moves each query it
    # covers by more than 1e-3)
    np.testing.assert_allclose(np.array(body), want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(dense_out), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="outside `done`"):  # the body never reads past it
        kernels.cpu.paged_attention(q, paged._replace(done=paged.done[: 2 * ct]), scale=0.125)


def test_a_row_gives_the_same_bits_alone_or_batched():
    spec = synthetic_spec(layers=1, heads=2)
    outs = {}
    for batched in (True, False):
        pool = pool_for(spec)
        tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 70])]
        rng = np.random.default_rng(3)
        k = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float32))
        v = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float32))
        q = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float32))
        for t in tables:
            t.grow(1, pool.arena.copy_rows)
        groups = [list(range(2))] if batched else [[0], [1]]
        res = []
        for rows in groups:
            step = PagedStep(pool.arena, spec, [tables[i] for i in rows], 1)
            cache = step.caches[0]
            kk, vv = cache.update_and_fetch(k[rows[0] : rows[-1] + 1], v[rows[0] : rows[-1] + 1])
            res.append(
                cache.agentkv_attention(q[rows[0] : rows[-1] + 1], kk, vv, scale=0.1, mask=None)
            )
        outs[batched] = np.array(mx.concatenate(res))
    np.testing.assert_array_equal(outs[True], outs[False])


@pytest.mark.parametrize("channel_tokens", [32, 64])
def test_a_query_gives_the_same_bits_whatever_chunk_it_arrives_in(channel_tokens):
    """Position 31 in a 32-token chunk after 16 tokens, or alone after 31: keys 0-31 hold the
    same bits either way, and so must its attention (whether the kernel folds a tile's key
    scales into the query depends on the tile's start and the row, never on the chunk)."""
    spec = synthetic_spec(layers=1, heads=2)
    quant = KVQuant(**V2, group_size=channel_tokens, channel_tokens=channel_tokens)
    rng = np.random.default_rng(5)
    q_star = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    outs = []
    for before, count, at in ((16, 32, 15), (31, 1, 0)):
        pool = pool_for(spec, quant)
        table = fill_table(pool, before, positional=True)
        table.grow(count, pool.arena.copy_rows)
        k, v = _kv_for(spec, 0, before, count, rng=rng, positional=True)
        q = rng.standard_normal((1, 4, count, 64)).astype(np.float32)
        q[:, :, at] = q_star[:, :, 0]
        step = PagedStep(pool.arena, spec, [table], count)
        cache = step.caches[0]
        keys, values = cache.update_and_fetch(k, v)
        mask = None if count == 1 else "causal"
        out = cache.agentkv_attention(mx.array(q), keys, values, scale=0.125, mask=mask)
        outs.append(np.array(out[:, :, at]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_fork_copies_the_tail_trim_refills_it_and_release_returns_it():
    spec = synthetic_spec(layers=2, heads=2)
    pool = pool_for(spec)
    free = len(pool.arena._free_tails)
    table = fill_table(pool, 300, positional=True)  # chunks of 197, 103: the last group [192, 256)
    twin = table.fork()
    assert twin.tail != table.tail and twin.prev_group == table.prev_group == 192
    np.testing.assert_array_equal(
        pool.arena.read_tail(table.tail, 44), pool.arena.read_tail(twin.tail, 44)
    )
    before = [stored_keys(pool, table, layer) for layer in range(2)]
    # Into the group [128, 192): its float16 keys are gone, so the trim is refused and
    # exact_keep says to cut at the group's start (the caller feeds the rest again).
    assert twin.exact_keep(150) == 128
    with pytest.raises(ValueError, match="exact keys"):
        twin.trim(150)
    twin.trim(210)  # inside [192, 256), the last complete group: its first 18 keys, exactly
    tail = pool.arena.read_tail(twin.tail, 18)
    for layer in range(2):
        k, _ = _kv_for(spec, layer, 0, 300, rng=None, positional=True)
        want = np.array(hadamard(k)[0, :, 192:210].astype(mx.float16))
        np.testing.assert_array_equal(tail[layer], want)
    # The twin grows on from there: the group is quantized again from the same keys.
    fill_table(pool, 300, positional=True, table=twin)
    for layer in range(2):
        np.testing.assert_array_equal(stored_keys(pool, twin, layer), before[layer])
    table.release()
    twin.release()
    assert len(pool.arena._free_tails) == free


def test_tails_grow_past_the_first_slots_without_moving_live_data():
    spec = synthetic_spec(layers=1, heads=1)
    pool = pool_for(spec, blocks=40)
    tables = [fill_table(pool, 70, seed=i) for i in range(20)]  # more than 16 first slots
    tails = [pool.arena.read_tail(t.tail, 6) for t in tables]
    more = [fill_table(pool, 70, seed=100 + i) for i in range(5)]
    for t, before in zip(tables, tails):
        np.testing.assert_array_equal(pool.arena.read_tail(t.tail, 6), before)
    assert len({t.tail for t in tables + more}) == 25


def test_format_2_is_refused_where_it_cannot_run():
    from agentkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="per-channel keys take 2, 4 or 8 bits"):
        KVQuant(5, 4, key_scheme="channel")
    with pytest.raises(InvalidRequestError, match="not a power of two"):
        KVQuant(**V2, group_size=32, channel_tokens=32).check_head_dims(96, 96)
    with pytest.raises(InvalidRequestError, match="channel groups"):
        KVQuant(**V2, group_size=32, channel_tokens=64).check_head_dims(32, 32)
    # Head dim 32: the same bytes as format 1 (16 B of words + 4 B of scale and bias each).
    small = KVQuant(**V2, group_size=32, channel_tokens=32)
    assert (
        small.bytes_per_token(1, 1, 32, 32)
        == KVQuant(group_size=32).bytes_per_token(1, 1, 32, 32)
        == 40
    )
    assert KVQuant(**V2).label == "q4.v2" and KVQuant(**V1).label == "q4"
    assert KVQuant.from_dict({"key_bits": 4, "value_bits": 4, "group_size": 64}) == KVQuant(**V1)


@pytest.mark.parametrize("window,q_heads", [(0, 4), (100, 4), (0, 6), (100, 2)])
def test_the_kernel_body_and_the_reference_read_format_2_as_the_fused_kernel_does(window, q_heads):
    """kernels/paged_attention.metal (compiled for CPU through the shim: the Metal and CUDA
    body) and the MLX reference, against the fused CPU kernel, on tables with tails."""
    from helpers import format_2_batch

    from agentkv import kernels
    from agentkv.kernels.attention import paged_attention

    _, q, paged = format_2_batch(window, q_heads)
    assert paged.quant() == V2Q
    fused = paged_attention(q, paged, scale=0.125)
    with kernels.use_backend("cpu"):
        body = kernels.paged_attention_body(q, paged, scale=0.125)
    reference = kernels.reference.paged_attention(q, paged, scale=0.125)
    np.testing.assert_allclose(np.array(body), np.array(fused), atol=FUSED_ATOL, rtol=1e-4)
    np.testing.assert_allclose(np.array(reference), np.array(fused), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("tokens", [256, 300])  # no keys in the tail; 44 in it
def test_the_tail_is_saved_with_the_manifest_and_read_back_bit_exact(tmp_path, tokens):
    from helpers import save_agent

    spec = synthetic_spec(layers=2, heads=2)
    pool = pool_for(spec)
    table = fill_table(pool, tokens, positional=True)
    store = save_agent(tmp_path, pool, table)
    manifest, _ = store.read_manifest("a")
    assert manifest.quant == V2Q and manifest.tail.shape == (2, 2, tokens % 64, 64)
    np.testing.assert_array_equal(manifest.tail, pool.arena.read_tail(table.tail, tokens % 64))
    caches = store.load_caches(manifest, "a", tokens)
    for layer, cache in enumerate(caches):
        keys, _ = cache.dequantized()  # in the model's space, read through float16
        want = hadamard(mx.array(stored_keys(pool, table, layer)))
        np.testing.assert_allclose(np.array(keys[0]), np.array(want), atol=2e-3)


def test_a_trim_back_into_the_last_completed_group_restores_its_keys_exactly():
    """A reply cancelled after its tokens completed a group: the kept keys come back from the
    float16 copy of that group, bit for bit what a table that never went past them holds."""
    spec = synthetic_spec(layers=2, heads=2)
    pool = pool_for(spec)
    table = fill_table(pool, 120, positional=True)  # group [64, 128) still filling
    fill_table(pool, 140, positional=True, table=table)  # completes it
    table.trim(120)
    short = fill_table(pool, 120, positional=True)
    np.testing.assert_array_equal(
        pool.arena.read_tail(table.tail, 56), pool.arena.read_tail(short.tail, 56)
    )
    assert table.prev_group is None
    # Deeper, into [0, 64): not kept in float16, so no exact cut keeps token 50.
    assert table.exact_keep(50) == 0 and table.exact_keep(64) == 64
    with pytest.raises(ValueError, match="keep 0 and feed the rest again"):
        table.trim(50)
