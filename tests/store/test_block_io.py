"""Block regions through real segment files: packed from the pool (csrc/core/pool_io.cpp),
read back contiguous (gather_blocks, csrc/core/block_io.cpp) and into pool slots."""

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (
    fill_table,
    gather_segments,
    pool_for,
    synthetic_spec,
    table_arrays,
    write_segment,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import CacheFormatError
from agentkv.format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from agentkv.format.quant import V1, KVQuant


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 700),
    bits=st.sampled_from([(4, 4), (8, 4), (8, 8), (16, 16), (4, 16)]),
    group=st.sampled_from([32, 64]),
    heads=st.integers(1, 3),
    keep=st.floats(0.05, 1.0),
    layout=st.sampled_from([0, 1]),
)
def test_round_trip_is_exact(tmp_path_factory, tokens, bits, group, heads, keep, layout):
    """Either region layout (planes: segments; groups: block files of store version 3)."""
    tmp = tmp_path_factory.mktemp("rt")
    quant = KVQuant(*bits, group, **V1)
    spec = synthetic_spec(layers=2, heads=heads)
    pool = pool_for(spec, quant, blocks=8)
    table = fill_table(pool, tokens)
    segment, blocks = write_segment(tmp / "seg.safetensors", pool, table, 0, tokens, layout)
    load = max(1, int(tokens * keep))
    want = table_arrays(pool, table, load)
    contiguous = gather_segments(spec, quant, [segment], blocks, load, [(0, load + 7)] * 2)
    for w, g in zip(want, contiguous):
        assert np.array_equal(w, np.array(g)[0, :, :load])
    # ...and into other slots of a second pool, as a warm resume reads them
    other = pool_for(spec, quant, blocks=8)
    slots = list(range(7, 7 - len(blocks), -1))
    regions = [(0, o, ln, crc, t, slot) for (_, o, ln, crc, t), slot in zip(blocks, slots)]
    other.arena.read_regions([segment], regions)
    copy = SimpleNamespace(blocks=slots, length=tokens)  # the slots, read as a table would be
    for w, g in zip(table_arrays(pool, table), table_arrays(other, copy)):
        assert np.array_equal(w, g)


@pytest.mark.parametrize("layout", [0, 1])
def test_incremental_segments_and_sliding_window_start(tmp_path, layout):
    spec = synthetic_spec(layers=2, windows=[None, 300])
    pool = pool_for(spec)
    table = fill_table(pool, 900)
    seg1, blocks1 = write_segment(tmp_path / "s1.safetensors", pool, table, 0, 600, layout)
    seg2, blocks2 = write_segment(tmp_path / "s2.safetensors", pool, table, 2, 900, 1 - layout)
    blocks = blocks1[:2] + [(1, *b[1:]) for b in blocks2]
    first = (900 - 300) // BLOCK_TOKENS * BLOCK_TOKENS  # the window reaches back into block 2
    arrays = gather_segments(
        spec, KVQuant(**V1), [seg1, seg2], blocks, 900, [(0, 1024), (first, 512)]
    )
    per = 6
    want = table_arrays(pool, table)
    for w, g in zip(want[:per], arrays[:per]):
        assert np.array_equal(w, np.array(g)[0, :, :900])
    for w, g in zip(want[per:], arrays[per:]):
        assert np.array_equal(w[:, first:900], np.array(g)[0, :, : 900 - first])


def test_groups_layout_puts_each_layer_group_in_one_extent(tmp_path):
    """Store version 3's block files: per layer, each 64-token group is one extent holding
    every component's rows of the group, head by head (what KVSwap reads with one pread)."""
    spec = synthetic_spec(layers=3, heads=2)
    pool = pool_for(spec)
    table = fill_table(pool, 300)
    packed, records = pool.arena.pack(table.blocks[:2], [BLOCK_TOKENS, 44], [1, 1])
    arrays = table_arrays(pool, table)  # [layer * comps + comp]: [heads, tokens, row bytes]
    comps = len(arrays) // spec.num_layers
    for (_, offset, length, _, tokens), block in zip(records, range(2)):
        region = packed[offset : offset + length]
        at = 0
        for layer in range(spec.num_layers):
            for first in range(0, tokens, GROUP_TOKENS):
                rows = min(GROUP_TOKENS, tokens - first)
                t0 = block * BLOCK_TOKENS + first
                want = [
                    arrays[layer * comps + c].view(np.uint8)[h, t0 : t0 + rows].tobytes()
                    for c in range(comps)
                    for h in range(arrays[layer * comps + c].shape[0])
                ]
                extent = b"".join(want)
                assert region[at : at + len(extent)].tobytes() == extent
                at += len(extent)
        assert at == length


def test_corrupt_block_and_header_are_reported_with_the_file(tmp_path):
    spec = synthetic_spec()
    pool = pool_for(spec)
    path = tmp_path / "seg.safetensors"
    segment, blocks = write_segment(path, pool, fill_table(pool, 300), 0, 300)
    data = bytearray(path.read_bytes())
    data[blocks[1][1] + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="block 1 checksum mismatch") as info:
        gather_segments(spec, KVQuant(**V1), [segment], blocks, 300, [(0, 512)] * 2)
    assert info.value.path == str(path)
    regions = [(0, o, ln, crc, t, i) for i, (_, o, ln, crc, t) in enumerate(blocks)]
    with pytest.raises(CacheFormatError, match="block region 1 checksum mismatch"):
        pool.arena.read_regions([segment], regions)
    # A load of only the first block does not read block 1 at all.
    gather_segments(spec, KVQuant(**V1), [segment], blocks, 200, [(0, 256)] * 2)
    pool.arena.read_regions([segment], regions[:1])

    data[20] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="header checksum mismatch"):
        gather_segments(spec, KVQuant(**V1), [segment], blocks, 200, [(0, 256)] * 2)
    path.write_bytes(bytes(data[:1000]))
    with pytest.raises(CacheFormatError, match="truncated"):
        gather_segments(spec, KVQuant(**V1), [segment], blocks, 200, [(0, 256)] * 2)
    with pytest.raises(CacheFormatError, match="truncated"):
        pool.arena.read_regions([segment], regions[:1])
    path.write_bytes((10**12).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(CacheFormatError, match="header length"):
        ref = (str(path), len(data), segment[2], 0)
        gather_segments(spec, KVQuant(**V1), [ref], blocks, 200, [(0, 256)] * 2)


def test_bad_slots_and_files_are_refused_before_any_copy(tmp_path):
    spec = synthetic_spec()
    pool = pool_for(spec, blocks=4)
    segment, blocks = write_segment(tmp_path / "s.safetensors", pool, fill_table(pool, 300), 0, 300)
    good = (0, *blocks[0][1:], 0)
    with pytest.raises(ValueError, match="slot"):
        pool.arena.read_regions([segment], [good[:-1] + (4,)])
    with pytest.raises(ValueError, match="file"):
        pool.arena.read_regions([segment], [(1, *good[1:])])


def test_segments_are_plain_safetensors(tmp_path):
    from safetensors.numpy import load_file

    spec = synthetic_spec(heads=3)
    pool = pool_for(spec)
    table = fill_table(pool, 300)
    write_segment(tmp_path / "seg.safetensors", pool, table, 0, 300)
    tensors = load_file(tmp_path / "seg.safetensors")
    assert tensors["b000001.l001.v.w"].shape == (3, 300 - 256, 8)
    want = table_arrays(pool, table)[6 + 3]  # layer 1, v.w
    assert np.array_equal(tensors["b000001.l001.v.w"], want[:, 256:300])
