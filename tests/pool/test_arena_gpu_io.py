"""The arena's block I/O as it runs on a GPU (pool/arena.py): through MLX operations and
staging copies, so the host never holds a pointer into an arena (MLX's CUDA backend would
move it to unified memory for good). Here on the CPU, the GPU branches (``_lazy`` off) give
the bytes the extension's direct paths give."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import fill_table, pool_for, synthetic_spec, write_segment

from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.format.quant import V1, V2, KVQuant


def as_gpu(pool):
    """The pool's arena taking its GPU branches from now on."""
    pool.arena._lazy = False
    pool.arena._addresses = None
    return pool


def snapshot(pool) -> list[np.ndarray]:
    arena = pool.arena
    mx.eval(arena._flat(), arena.tails, arena.prevs)
    return [np.array(a) for a in arena._flat() + arena.tails + arena.prevs]


def pool_pair(quant):
    """Two pools holding the same agents, the second taking the GPU branches."""
    spec = synthetic_spec(layers=2, heads=2, windows=[None, 512])  # a sliding layer too
    cpu, gpu = pool_for(spec, quant), pool_for(spec, quant)
    for pool in (cpu, gpu):
        fill_table(pool, 700, seed=1)
        fill_table(pool, 300, seed=2)
    return cpu, as_gpu(gpu)


@pytest.fixture(params=[KVQuant(**V1), KVQuant(**V2), KVQuant(8, 16, **V1)], ids=str)
def pools(request):
    return pool_pair(request.param)


def test_pack_gives_the_same_regions(pools):
    cpu, gpu = pools
    slots, tokens, layouts = [0, 2, 3, 1], [256, 188, 256, 256], [0, 1, 0, 1]
    a, b = cpu.arena.pack(slots, tokens, layouts), gpu.arena.pack(slots, tokens, layouts)
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0])) and a[1] == b[1]


def test_read_regions_and_copy_rows_give_the_same_arenas(pools, tmp_path):
    cpu, gpu = pools
    table = cpu.new_table(cpu.seed())
    table.blocks, table.length = [0, 1, 2], 700  # the first agent's blocks
    segment, refs = write_segment(tmp_path / "segment", cpu, table, 0, 700)
    for pool in (cpu, gpu):
        regions = [(*ref, slot) for ref, slot in zip(refs, [5, 6, 7])]
        pool.arena.read_regions([segment], regions)
        pool.arena.copy_rows(3, 8, 77)
        pool.arena.copy_window_rows(0, 9)  # the sliding layer's rows alone
    arenas = len(cpu.arena._flat())
    components = arenas // 2
    for i, (a, b) in enumerate(zip(snapshot(cpu)[:arenas], snapshot(gpu)[:arenas])):
        for block in range(5, 10) if i >= components else range(5, 9):
            n = {7: 700 - 512, 8: 77}.get(block, BLOCK_TOKENS)
            for head in range(2):
                first = (block * 2 + head) * BLOCK_TOKENS
                assert np.array_equal(a[first : first + n], b[first : first + n])


def test_tails_read_and_write_through_copies():
    cpu, gpu = pool_pair(KVQuant(**V2))  # per-channel keys: the format with tails
    for pool in (cpu, gpu):
        arena = pool.arena
        keys = arena.read_tail(0, 700 % arena.ct)
        prev = arena.read_prev(0)
        arena.write_tail(3, keys)
        arena.write_prev(3, prev[::-1].copy())
    assert np.array_equal(cpu.arena.read_tail(3, 700 % 64), gpu.arena.read_tail(3, 700 % 64))
    assert np.array_equal(cpu.arena.read_prev(3), gpu.arena.read_prev(3))
    assert np.array_equal(cpu.arena.read_tail(0, 700 % 64), gpu.arena.read_tail(0, 700 % 64))


def test_the_host_reads_one_buffer_a_save():
    """``one_buffer``: the parts a save or a tail read hands the host are views of one
    evaluated buffer, 16-byte aligned, with the parts' values, dtypes and shapes; so on a GPU
    the host's read moves one buffer, not one per layer and component. ``host_buffers``: the
    staging arrays of a reload, zeroed views of one array made from host data."""
    from agentkv import _ext
    from agentkv.pool.arena import host_buffers, one_buffer

    parts = [
        mx.arange(15, dtype=mx.uint32).reshape(3, 5),
        mx.arange(7, dtype=mx.float16).reshape(7, 1),  # 14 bytes: the next one is padded
        mx.arange(12, dtype=mx.uint16).reshape(2, 6),
    ]
    out = one_buffer(parts)
    addresses = [_ext.data_address(a) for a in out]
    assert [b - addresses[0] for b in addresses] == [0, 64, 80]
    for a, b in zip(out, parts):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.array(a), np.array(b))
    staging = host_buffers([((4, 3), mx.uint32), ((5,), mx.float16), ((2, 2), mx.uint16)])
    addresses = [_ext.data_address(a) for a in staging]
    assert [b - addresses[0] for b in addresses] == [0, 48, 64]
    assert [a.shape for a in staging] == [(4, 3), (5,), (2, 2)]
    assert all(not np.array(a).any() for a in staging)
