"""Paged attention over the pool — the fused CPU kernel, the kernel body of
kernels/paged_attention.metal compiled for CPU, and the pure-MLX reference — on jagged
batches of block tables: they agree, the fused kernel gives the same bits as over a
contiguous cache, and a row gives the same bits alone or batched."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    FLOAT_ATOL,
    FUSED_ATOL,
    attention_atol,
    format_2_batch,
    jagged_batch,
    table_arrays,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import _ext, kernels
from agentkv.format.quant import V1, KVQuant, hadamard
from agentkv.kernels import attention, cpu, dense
from agentkv.kernels.types import MAX_SPLITS, SPLIT_KEYS, HostIndex

formats = st.sampled_from([(4, 4, 64), (4, 4, 32), (8, 4, 64), (8, 8, 64), (2, 2, 32)])


def fused(q, paged, scale=0.125):
    return cpu.fused_paged_attention(q, paged, scale=scale)


def close(a, b, atol=FLOAT_ATOL):
    """Within ``atol`` (helpers.attention_atol: the fused kernel's integer paths are looser
    than float rounding; the kernel body, the dense path and the reference run in float)."""
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=3e-4, atol=atol)


@settings(max_examples=15, deadline=None)
@given(
    fmt=formats,
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=4),
    queries=st.sampled_from([1, 3, 17]),
    rep=st.sampled_from([1, 2, 3]),  # query heads per KV head: the kernel folds 1-4 at once
    window=st.sampled_from([0, 100]),
    sinks=st.booleans(),
)
def test_fused_kernel_body_and_reference_agree(fmt, lengths, queries, rep, window, sinks):
    lengths = [max(n, queries) for n in lengths]
    pool, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), lengths, queries=queries, q_heads=2 * rep)
    sink_values = mx.array(np.linspace(-1, 1, 2 * rep).astype(np.float32)) if sinks else None
    paged = paged._replace(window=window, sinks=sink_values)
    ours = fused(q, paged)
    reference = kernels.reference.paged_attention(q, paged, scale=0.125)
    with kernels.use_backend("cpu"):
        body = kernels.paged_attention_body(q, paged, scale=0.125)
    close(ours, reference, attention_atol(KVQuant(*fmt, **V1)))
    close(body, reference)


def test_fused_paged_equals_fused_contiguous_bit_for_bit():
    quant = KVQuant(**V1)
    lengths = [300, 17, 600]
    pool, tables, q, paged = jagged_batch(quant, lengths, queries=5)
    ours = fused(q, paged)
    for b, table in enumerate(tables):
        arrays = [mx.array(a[None]) for a in table_arrays(pool, table)]
        contiguous = _ext.quantized_attention(
            q[b : b + 1], arrays[:3], arrays[3:], 0.125, 4, 4, 64, 0, None, None
        )
        assert mx.array_equal(ours[b : b + 1], contiguous)


def test_a_row_gives_the_same_bits_alone_or_batched():
    quant = KVQuant(8, 4, **V1)
    lengths = [513, 40, 256, 1]
    pool, tables, q, paged = jagged_batch(quant, lengths)
    together = fused(q, paged)
    for b in range(len(lengths)):
        alone = paged._replace(tables=paged.tables[b : b + 1], lengths=paged.lengths[b : b + 1])
        assert mx.array_equal(together[b : b + 1], fused(q[b : b + 1], alone))


@pytest.mark.parametrize("fmt", [(4, 4, 64), (8, 4, 64), (4, 4, 32)])
def test_a_nan_or_infinite_query_gives_nan_for_its_head_alone(fmt):
    """Format 1 (float keys; 4-bit values in groups of 64 as integers, or of 32 as floats):
    a NaN or an infinity in a query makes that query head's output NaN, as the reference
    does, and leaves every other head's as it was."""
    pool, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), [700, 90], queries=3)
    clean = fused(q, paged)
    bad = np.array(q)
    bad[0, 1, 2, 7] = np.nan
    bad[1, 3, 0, 0] = -np.inf
    out = np.array(fused(mx.array(bad), paged))
    hit = np.zeros(out.shape[:3], dtype=bool)
    hit[0, 1, 2] = hit[1, 3, 0] = True
    assert np.isnan(out[hit]).all()
    np.testing.assert_array_equal(out[~hit], np.array(clean)[~hit])


@pytest.mark.parametrize("fmt", [(16, 16, 64), (4, 16, 64), (16, 8, 32)])
def test_float16_kinds_run_through_the_fused_kernel_and_the_body(fmt):
    """kv_bits=16 (and mixed widths): the GPU path reads them through the same body."""
    pool, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), [300, 70], queries=2, q_heads=8)
    reference = kernels.reference.paged_attention(q, paged, scale=0.125)
    close(fused(q, paged), reference, attention_atol(KVQuant(*fmt, **V1)))
    with kernels.use_backend("cpu"):
        close(kernels.paged_attention_body(q, paged, scale=0.125), reference)


# (format, head dim, query heads, queries): every lane count (KL 8, 16, 32), a head dim whose
# lanes straddle words (96: 6 channels a lane), 8 query vectors a threadgroup, several tiles
SHAPES = [
    ((4, 4, 64), 128, 8, 1),
    ((8, 4, 64), 256, 4, 2),
    ((4, 4, 32), 96, 16, 3),
    ((2, 2, 32), 128, 2, 5),
]


@pytest.mark.parametrize("fmt,dim,q_heads,queries", SHAPES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_the_body_agrees_with_the_reference_however_the_keys_are_split(
    fmt, dim, q_heads, queries, splits
):
    """Pass 1 alone (1 split) and pass 1 then the merge pass (more splits, some of them
    empty for the short rows), in the launch shapes of the GPU (kernels/types.py)."""
    lengths = [1030, queries, 257]
    _, _, q, paged = jagged_batch(
        KVQuant(*fmt, **V1), lengths, queries=queries, q_heads=q_heads, dim=dim
    )
    sinks = mx.array(np.linspace(-1, 1, q_heads).astype(np.float32))
    paged = paged._replace(sinks=sinks, window=300 if splits == 3 else 0)
    launch = paged.launch(q, splits=splits)
    assert launch.lanes_per_key == max(4, 1 << (dim // 8 - 1).bit_length())
    body = cpu.paged_attention(q, paged, scale=0.125, launch=launch)
    close(body, kernels.reference.paged_attention(q, paged, scale=0.125))


@pytest.mark.parametrize("fmt,dim,q_heads,queries", [*SHAPES, ((16, 16, 64), 64, 6, 1)])
def test_keys_in_flight_change_no_bit(fmt, dim, q_heads, queries):
    """KU (``Launch.keys_in_flight``: keys a team loads before it scores the first, so their
    loads overlap on a GPU) takes each team's keys in the same order: 1, 2 and 4 give the same
    bits, with sinks and a window, in one part and through the merge pass, and with format 2's
    tails and its rotation inside the kernel."""
    lengths = [1030, queries, 257]
    _, _, q, paged = jagged_batch(
        KVQuant(*fmt, **V1), lengths, queries=queries, q_heads=q_heads, dim=dim
    )
    sinks = mx.array(np.linspace(-1, 1, q_heads).astype(np.float32))
    cases = [paged._replace(sinks=sinks, window=300), paged]
    _, q2, paged2 = format_2_batch(100)
    for p, x in [*((c, q) for c in cases), (paged2, q2), (paged2._replace(rotate=True), q2)]:
        for splits in (1, 3):
            base = p.launch(x, splits=splits, keys_in_flight=1)
            want = cpu.paged_attention(x, p, scale=0.125, launch=base)
            for ku in (2, 4):
                launch = base._replace(keys_in_flight=ku)
                assert mx.array_equal(cpu.paged_attention(x, p, scale=0.125, launch=launch), want)
    # decode shapes (at most 4 query vectors a threadgroup) load 2 keys at once, wider ones 1
    assert paged.launch(q[:, :, :1]).keys_in_flight == (2 if q_heads <= 4 * 2 else 1)
    with pytest.raises(ValueError, match="bad dims"):
        cpu.paged_attention(q, paged, scale=0.125, launch=base._replace(keys_in_flight=3))


def test_the_launch_parts_each_row_by_its_own_keys():
    """SPLIT_KEYS keys a part, MAX_SPLITS at most, from the host's lengths (no device read)."""
    _, _, q, paged = jagged_batch(KVQuant(**V1), [40], q_heads=4)
    assert paged.launch(q).splits == 1  # 40 keys: one part
    host = HostIndex(np.zeros((1, 128), np.int32), np.array([32768], np.int32))
    wide = paged._replace(host=host).launch(q)
    assert (wide.splits, wide.split_keys, wide.vectors) == (MAX_SPLITS, SPLIT_KEYS, 2)
    host = host._replace(lengths=np.array([1000], np.int32))
    assert paged._replace(host=host).launch(q).splits == -(-1000 // SPLIT_KEYS)
    assert paged._replace(host=host, window=100).launch(q).splits == -(-100 // SPLIT_KEYS)


@pytest.mark.parametrize("fmt", [(4, 4, 64), (16, 16, 64)])
def test_the_body_gives_a_row_the_same_bits_alone_or_batched(fmt):
    """A row's parts of the keys depend on its own length only, so a batch with longer or
    shorter rows changes none of its bits (what batch == alone needs on a GPU)."""
    lengths = [5000, 40, 700, 1]
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), lengths, q_heads=6, queries=1)
    together = cpu.paged_attention(q, paged, scale=0.125)
    assert paged.launch(q).splits > 1
    for b in range(len(lengths)):
        host = HostIndex(paged.host.tables[b : b + 1], paged.host.lengths[b : b + 1])
        alone = paged._replace(
            tables=paged.tables[b : b + 1], lengths=paged.lengths[b : b + 1], host=host
        )
        assert mx.array_equal(
            together[b : b + 1], cpu.paged_attention(q[b : b + 1], alone, scale=0.125)
        )


def test_the_dispatch_takes_the_fused_path_on_cpu_and_the_reference_when_asked(monkeypatch):
    pool, _, q, paged = jagged_batch(KVQuant(**V1), [300, 9])
    before = attention.paths_used()
    fast = attention.paged_attention(q, paged, scale=0.125)
    monkeypatch.setenv(attention.ENV, "reference")
    slow = attention.paged_attention(q, paged, scale=0.125)
    now = attention.paths_used()
    assert {k: now[k] - before[k] for k in now} == {
        attention.FUSED: 1,
        attention.KERNEL: 0,
        attention.DENSE: 0,
        attention.REFERENCE: 1,
    }
    close(fast, slow, attention_atol(KVQuant(**V1)))


def test_a_table_naming_a_block_outside_the_arenas_never_reads_it():
    pool, _, q, paged = jagged_batch(KVQuant(**V1), [300])
    bad = mx.array(np.array([[0, pool.capacity + 5]], dtype=np.int32))
    out = fused(q, paged._replace(tables=bad))
    assert bool(mx.all(mx.isnan(out)).item())  # refused, not read out of bounds
    with kernels.use_backend("cpu"), pytest.raises(ValueError, match="outside the arenas"):
        kernels.paged_attention_body(q, paged._replace(tables=bad), scale=0.125)


IMPLEMENTATIONS_CHECK = """
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np, mlx.core as mx
import agentkv
from agentkv import _ext
from agentkv.format.quant import V1, V2, KVQuant
from agentkv.pool.step import PagedStep
from helpers import fill_table, pool_for, synthetic_spec
from test_paged_attention import fused, jagged_batch
out = []
# format 1: 1, 3 and 17 queries, 1-3 query heads per KV head, windows and sinks, partial tiles
for fmt, queries, rep, window in (((4, 4, 64), 1, 3, 0), ((8, 4, 64), 3, 2, 100),
                                   ((2, 2, 32), 17, 1, 0), ((4, 4, 32), 17, 3, 50)):
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), [700, 17, 130], queries=queries,
                                  q_heads=2 * rep, seed=queries)
    sinks = mx.array(np.linspace(-1, 1, 2 * rep).astype(np.float32))
    out.append(np.array(fused(q, paged._replace(window=window, sinks=sinks))))
# format 2 through the pool: tails, whole and partial channel groups, 1, 5, 17 and 45 new
# tokens (several blocks of queries fold a tile: AVX-512 lays its codes out once; 45 over
# head dim 128: two value groups, tiles the new tokens cut short, blocks of fewer keys)
for count, dim in ((1, 64), (5, 64), (17, 64), (45, 128)):
    spec = synthetic_spec(layers=1, heads=2, dim=dim)
    pool = pool_for(spec, KVQuant(**V2))
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 64, 127])]
    for t in tables:
        t.grow(count, pool.arena.copy_rows)
    rng = np.random.default_rng(count)
    k, v, q = (mx.array(rng.standard_normal((3, h, count, dim)).astype(np.float32))
               for h in (2, 2, 6))
    cache = PagedStep(pool.arena, spec, tables, count).caches[0]
    keys, values = cache.update_and_fetch(k, v)
    out.append(np.array(cache.agentkv_attention(q, keys, values, scale=0.125,
                                                 mask=None if count == 1 else "causal")))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print(_ext.build_info()["attention"])
"""


def test_every_attention_implementation_gives_the_same_bits(tmp_path):
    """AVX-512 (where the CPU has it), AVX2 and the portable lanes: the same bits on formats 1
    and 2, 1-45 queries, 1-3 query heads per KV head, windows and sinks, tiles laid out once
    for many queries (head dims 64 and 128)."""
    results = {}
    envs = {
        "default": {},
        "avx2": {"AGENTKV_ATTENTION_IMPL": "avx2"},
        "portable": {"AGENTKV_ATTENTION_IMPL": "portable"},
    }
    tests_dir = str(Path(__file__).resolve().parents[1])
    for name, env in envs.items():
        path = tmp_path / f"{name}.npy"
        run = subprocess.run(
            [sys.executable, "-c", IMPLEMENTATIONS_CHECK, str(path), tests_dir],
            env={**os.environ, **env},
            cwd=str(Path(__file__).parent),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        results[name] = (run.stdout.strip(), np.load(path))
    assert results["portable"][0] == "portable"
    assert results["default"][0] in ("avx512-vnni", "avx512", "avx2-fma-f16c", "portable")
    assert results["avx2"][0] in ("avx2-fma-f16c", "portable")
    assert np.isfinite(results["portable"][1]).all()
    np.testing.assert_array_equal(results["default"][1], results["portable"][1])
    np.testing.assert_array_equal(results["avx2"][1], results["portable"][1])


@pytest.mark.parametrize("fmt", [(4, 4, 64), (8, 4, 32), (16, 16, 64)])
@pytest.mark.parametrize("window,sinks", [(0, False), (100, True), (700, False)])
def test_the_dense_prefill_path_agrees_with_the_reference(fmt, window, sinks):
    """What a GPU runs for prefill chunks (kernels/dense.py), here on the CPU: rows gathered
    from the host's tables, dequantized once, through mx.fast.scaled_dot_product_attention."""
    queries = dense.DENSE_QUERIES + 3
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), [900, queries, 300], queries=queries)
    sink_values = mx.array(np.linspace(-1, 1, 4).astype(np.float32)) if sinks else None
    paged = paged._replace(window=window, sinks=sink_values)
    assert dense.takes(q, paged)
    close(dense.paged_attention(q, paged, scale=0.125), reference(q, paged))


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("new", [20, 70, 130])
def test_the_dense_paths_mask_is_made_on_the_device_and_says_the_rule(monkeypatch, window, new):
    """The dense prefill path's mask (causal, the window, format 2's own-group rule), made by
    MLX operations from no host data (an L x keys array from the host is ~140 MB for a chunk
    of 2048 at 32K), is what the rule says, stated here in NumPy, for chunks that complete no
    group, one and two, in float16 and float32; and the whole path (its rows, tails, mask)
    makes no array from host data."""
    _, q, paged = format_2_batch(window, new=new)
    paged = paged._replace(host=paged.host._replace(memo=None))
    L, ct = q.shape[2], paged.channel_tokens
    made = []
    real = mx.array
    monkeypatch.setattr(mx, "array", lambda *a, **k: made.append(1) or real(*a, **k))
    for b in range(q.shape[0]):
        n = int(paged.host.lengths[b])
        first = (max(0, n - L - window + 1) if window else 0) // ct * ct
        own = dense._own_groups(paged, b, n, L)
        p = np.arange(n - L, n)[:, None]
        t = np.arange(first, n)[None, :]
        pick = True
        if own is not None:
            done_from, complete, _ = own
            t = np.concatenate([t, np.arange(done_from, complete)[None, :]], axis=1)
            group = p // ct * ct
            inside = (group >= done_from) & (group < complete) & (p < group + ct - 1)
            copy = np.arange(t.shape[1])[None, :] >= n - first
            pick = np.where((t // ct * ct == group) & inside, copy, ~copy)
        visible = (t <= p) & pick & ((p - t < window) if window else True)
        for dtype in (mx.float16, mx.float32):
            mask = dense._mask(paged, b, first, n, L, own, dtype)
            assert mask.dtype == dtype
            np.testing.assert_array_equal(np.array(mask), np.where(visible, 0.0, -np.inf))
    out = dense.paged_attention(q, paged._replace(host=paged.host._replace(memo={})), scale=0.125)
    mx.eval(out)
    assert not made
    np.testing.assert_allclose(np.array(out), np.array(reference(q, paged)), atol=2e-3)


def test_the_dense_paths_mask_of_a_sliding_layer_is_not_a_global_layers():
    """A model's sliding-window and global layers share a step's memo: where a row's window
    reaches its first token, both ask for a mask from the same ``first`` (0), and each must
    get its own (the memo's key names the window)."""
    _, q, paged = format_2_batch(0, new=70)
    memo = {}
    paged = paged._replace(host=paged.host._replace(memo=memo))
    sliding = paged._replace(window=30)
    L, n = q.shape[2], int(paged.host.lengths[3])  # 75 tokens: first = 0 for both
    assert max(0, n - L - sliding.window + 1) == 0
    own = dense._own_groups(paged, 3, n, L)
    full = np.array(dense._mask(paged, 3, 0, n, L, own, mx.float32))
    window = np.array(dense._mask(sliding, 3, 0, n, L, own, mx.float32))
    assert np.isinf(window).sum() > np.isinf(full).sum()
    fresh = np.array(dense._mask(sliding, 3, 0, n, L, own, mx.float32))
    np.testing.assert_array_equal(window, fresh)


@pytest.mark.parametrize("window", [0, 100])
def test_the_dense_prefill_path_reads_format_2_tails(window):
    _, q, paged = format_2_batch(window, new=dense.DENSE_QUERIES + 2)
    assert dense.takes(q, paged)
    out = dense.paged_attention(q, paged, scale=0.125)
    np.testing.assert_allclose(np.array(out), np.array(reference(q, paged)), atol=2e-3)


def reference(q, paged):
    return kernels.reference.paged_attention(q, paged, scale=0.125)


@pytest.mark.parametrize("dim,q_heads,queries", [(32, 4, 1), (64, 6, 3), (128, 4, 1), (256, 2, 2)])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_body_rotates_queries_and_output_inside_itself(dim, q_heads, queries, splits):
    """Format 2's rotation inside the kernel (``PagedQuery.rotate``: the query's Walsh-Hadamard
    transform by butterflies in a lane and across its team, the output's from threadgroup
    memory) gives what rotating around it gives: H . body(H q), H from MLX's transform, in
    pass 1 alone and through the merge pass. On a GPU that is two operations a layer fewer."""
    _, _, q, paged = jagged_batch(KVQuant(4, 4, 32, **V1), [700, queries, 300], queries=queries,
                                  q_heads=q_heads, dim=dim)  # fmt: skip
    launch = paged.launch(q, splits=splits)
    inside = paged._replace(rotate=True)
    assert inside.rotates_inside(q, launch) and inside.rotates_inside(q)  # with or without
    body = cpu.paged_attention(q, inside, scale=0.125, launch=launch)
    around = hadamard(cpu.paged_attention(hadamard(q), paged, scale=0.125, launch=launch))
    close(body, around, atol=2e-5)
    assert not mx.allclose(body, cpu.paged_attention(q, paged, scale=0.125, launch=launch))


def test_a_rotating_format_reads_the_same_through_every_entry_point():
    """Format 2 in a pool step: the body rotating inside itself gives the body rotated around
    it; the entry point (``paged_attention_body``) and the dispatch (here the fused CPU
    kernel, rotated around) agree with it, the reference within its format-2 tolerance. A
    launch whose lanes do not hold 8 channels each cannot rotate inside: the extension
    refuses it."""
    _, q, paged = format_2_batch()
    inside = paged._replace(rotate=True)
    body = cpu.paged_attention(q, inside, scale=0.125)
    close(body, hadamard(cpu.paged_attention(hadamard(q), paged, scale=0.125)), atol=2e-5)
    close(kernels.paged_attention_body(q, inside, scale=0.125), body, atol=2e-5)
    close(attention.paged_attention(q, inside, scale=0.125), body, atol=FUSED_ATOL)
    want = hadamard(kernels.reference.paged_attention(hadamard(q), paged, scale=0.125))
    np.testing.assert_allclose(np.array(body), np.array(want), atol=2e-3, rtol=1e-3)
    wide = paged.launch(q)._replace(lanes_per_key=16)  # 4 channels a lane
    assert not inside.rotates_inside(q, wide)
    with pytest.raises(ValueError, match="bad dims"):
        cpu.paged_attention(q, inside, scale=0.125, launch=wide)


@pytest.mark.parametrize("quant", [KVQuant(**V1), KVQuant(8, 4, 32, **V1), "format 2"])
def test_a_soft_cap_is_taken_by_every_path(quant):
    """Gemma 2's soft cap (``PagedQuery.softcap``: each score s becomes c * tanh(s / c) before
    the softmax) on the fused CPU kernel, the GPU body compiled for the CPU (one part and
    several) and the dense prefill path: each agrees with the reference's cap; the fused
    kernel gives a row the same bits alone or batched; and the cap
    moves the output far more than the paths differ."""
    queries = dense.DENSE_QUERIES + 1
    if quant == "format 2":
        _, q, paged = format_2_batch(100, new=queries)
        atol = 2e-3
    else:
        _, _, q, paged = jagged_batch(quant, [700, queries, 260], queries=queries, q_heads=4)
        atol = attention_atol(quant)
    q = q * 4.0  # scores of ~+-10: a cap of 3 bites
    capped = paged._replace(softcap=3.0)
    want = reference(q, capped)
    assert float(mx.abs(want - reference(q, paged)).max()) > 50 * atol
    close(fused(q, capped), want, atol)
    with kernels.use_backend("cpu"):
        close(kernels.paged_attention_body(q, capped, scale=0.125), want, atol)
        parts = capped.launch(q, splits=3)
        close(cpu.paged_attention(q, capped, scale=0.125, launch=parts), want, atol)
    assert dense.takes(q, capped)
    close(dense.paged_attention(q, capped, scale=0.125), want, atol)
    alone = [fused(q[b : b + 1], capped._replace(
        tables=capped.tables[b : b + 1], lengths=capped.lengths[b : b + 1],
        tail_slots=capped.tail_slots[b : b + 1] if capped.tail_slots is not None else None,
        done_first=capped.done_first[b : b + 1] if capped.done_first is not None else None,
        host=None)) for b in range(q.shape[0])]  # fmt: skip
    assert mx.array_equal(mx.concatenate(alone), fused(q, capped))
