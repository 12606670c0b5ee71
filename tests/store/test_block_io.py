"""pack_blocks / gather_blocks (csrc/core/block_io.cpp) through real segment files."""

import numpy as np
import pytest
from helpers import filled_caches, held_arrays, synthetic_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import _ext
from agentkv.errors import CacheFormatError
from agentkv.kv.quant import KVQuant
from agentkv.store.format import BLOCK_TOKENS, encode_segment_header


def write_segment(path, spec, caches, first_block, end_token):
    comps = spec.components(caches[0].quant)
    arrays = [x for c in caches for x in c.components]
    packed, records = _ext.pack_blocks(
        arrays,
        spec.num_layers,
        BLOCK_TOKENS,
        [(c.heads, c.width, c.dtype) for c in comps],
        first_block,
        end_token,
        [(c.start, c.capacity) for c in caches],
    )
    header, blocks = encode_segment_header(
        agent_id="a",
        fingerprint=spec.fingerprint,
        generation=1,
        layers=spec.num_layers,
        components=comps,
        first_block=first_block,
        packed=records,
    )
    path.write_bytes(header + packed.tobytes())
    refs = [(0, len(header) + off, ln, crc, t) for _, off, ln, crc, t in blocks]
    return (str(path), len(header) + packed.nbytes, _ext.crc32c(header[8:])), refs


def gather(spec, quant, segments, blocks, tokens, spans):
    comps = spec.components(quant)
    return _ext.gather_blocks(
        spec.num_layers,
        BLOCK_TOKENS,
        [(c.heads, c.width, c.dtype) for c in comps],
        segments,
        blocks,
        tokens,
        spans,
    )


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 700),
    bits=st.sampled_from([(4, 4), (8, 4), (8, 8), (16, 16), (4, 16)]),
    group=st.sampled_from([32, 64]),
    heads=st.integers(1, 3),
    keep=st.floats(0.05, 1.0),
)
def test_round_trip_is_exact(tmp_path_factory, tokens, bits, group, heads, keep):
    tmp = tmp_path_factory.mktemp("rt")
    quant = KVQuant(*bits, group)
    spec = synthetic_spec(layers=2, heads=heads)
    caches = filled_caches(spec, tokens, quant)
    segment, blocks = write_segment(tmp / "seg.safetensors", spec, caches, 0, tokens)
    load = max(1, int(tokens * keep))
    arrays = gather(spec, quant, [segment], blocks, load, [(0, load + 7)] * 2)
    per = len(spec.components(quant))
    for layer, cache in enumerate(caches):
        want = [a[:, :, :load] for a in held_arrays(cache)]
        got = [np.array(a)[:, :, :load] for a in arrays[layer * per : (layer + 1) * per]]
        for w, g in zip(want, got):
            assert np.array_equal(w, g)


def test_incremental_segments_and_sliding_window_start(tmp_path):
    spec = synthetic_spec(layers=2, windows=[None, 300])
    caches = filled_caches(spec, 900)
    seg1, blocks1 = write_segment(tmp_path / "s1.safetensors", spec, caches, 0, 600)
    seg2, blocks2 = write_segment(tmp_path / "s2.safetensors", spec, caches, 2, 900)
    blocks = blocks1[:2] + [(1, *b[1:]) for b in blocks2]
    first = (900 - 300) // BLOCK_TOKENS * BLOCK_TOKENS  # the window reaches back into block 2
    arrays = gather(spec, KVQuant(), [seg1, seg2], blocks, 900, [(0, 1024), (first, 512)])
    per = 6
    full = held_arrays(caches[0])
    for w, g in zip(full, arrays[:per]):
        assert np.array_equal(w, np.array(g)[:, :, :900])
    sliding = held_arrays(caches[1])
    for w, g in zip(sliding, arrays[per:]):
        assert np.array_equal(w[:, :, first:900], np.array(g)[:, :, : 900 - first])


def test_corrupt_block_and_header_are_reported_with_the_file(tmp_path):
    spec = synthetic_spec()
    caches = filled_caches(spec, 300)
    path = tmp_path / "seg.safetensors"
    segment, blocks = write_segment(path, spec, caches, 0, 300)
    data = bytearray(path.read_bytes())
    data[blocks[1][1] + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="block 1 checksum mismatch") as info:
        gather(spec, KVQuant(), [segment], blocks, 300, [(0, 512)] * 2)
    assert info.value.path == str(path)
    # A load of only the first block does not read block 1 at all.
    gather(spec, KVQuant(), [segment], blocks, 200, [(0, 256)] * 2)

    data[20] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="header checksum mismatch"):
        gather(spec, KVQuant(), [segment], blocks, 200, [(0, 256)] * 2)
    path.write_bytes(bytes(data[:1000]))
    with pytest.raises(CacheFormatError, match="truncated"):
        gather(spec, KVQuant(), [segment], blocks, 200, [(0, 256)] * 2)
    path.write_bytes((10**12).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(CacheFormatError, match="header length"):
        gather(spec, KVQuant(), [(str(path), len(data), segment[2])], blocks, 200, [(0, 256)] * 2)


def test_segments_are_plain_safetensors(tmp_path):
    from safetensors.numpy import load_file

    spec = synthetic_spec(heads=3)
    caches = filled_caches(spec, 300)
    write_segment(tmp_path / "seg.safetensors", spec, caches, 0, 300)
    tensors = load_file(tmp_path / "seg.safetensors")
    assert tensors["b000001.l001.v.w"].shape == (3, 300 - 256, 8)
    want = held_arrays(caches[1])[3][0, :, 256:300]  # layer 1, v.w
    assert np.array_equal(tensors["b000001.l001.v.w"], want)
