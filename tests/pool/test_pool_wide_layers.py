"""Format 2 with wide layers (8-bit keys in chosen layers, ``KVQuant.wide_layers``): the
format itself, the pool's per-layer component widths, and block files through the C++
block I/O with a component list per layer."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    _kv_for,
    fill_table,
    gather_segments,
    pool_for,
    save_agent,
    synthetic_spec,
    table_arrays,
    write_segment,
)

from agentkv.errors import InvalidRequestError
from agentkv.format.quant import V1, KVQuant, hadamard
from agentkv.store.agent_store import AgentStore

GEOMETRY = dict(layers=30, heads=3, key_dim=64, value_dim=64)  # the embedded model
WIDE = KVQuant(wide_layers=(1,))  # 3 layers: 4-bit keys, 8-bit keys, 4-bit keys


def test_a_format_names_its_wide_layers_and_gives_each_layer_its_plain_format():
    q = KVQuant(wide_layers=[19, 18, 18])
    assert q.wide_layers == (18, 19)
    assert q.label == q.identity == "q4.v2+k8@18,19"
    assert q.layer(18) == q.layer(19) == KVQuant(8, 4) and q.layer(0) == KVQuant()
    assert q.layer(0).wide_layers == ()
    # 192 more bytes a token than 4-bit keys everywhere: 2 layers x 3 heads x (36 - 4) bytes
    assert KVQuant().bytes_per_token(**GEOMETRY) == 6_480
    assert q.bytes_per_token(**GEOMETRY) == 6_672
    assert KVQuant.from_dict(q.to_dict()) == q
    assert "wide_layers" not in KVQuant().to_dict()  # stores without them keep their records
    comps = q.layer_components(30, 3, 64, 64)
    assert [c.width for c in comps[18]][:3] == [16, 1, 1] and [c.width for c in comps[0]][:3] == [
        8,
        1,
        1,
    ]
    with pytest.raises(ValueError, match="components per layer"):
        q.components(3, 64, 64)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"key_bits": 8, "value_bits": 4, "wide_layers": (1,)}, "under 8 bits"),
        ({**V1, "wide_layers": (1,)}, "per-channel keys"),
        ({"wide_layers": (-1,)}, "layer indices"),
        ({"wide_layers": ("1",)}, "layer indices"),
        ({"wide_layers": (True,)}, "layer indices"),
        ({"wide_layers": 3}, "layer indices"),
    ],
)
def test_bad_wide_layers_are_refused(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        KVQuant(**options)


def test_a_wide_layer_past_the_model_is_refused():
    with pytest.raises(InvalidRequestError, match="past the model's 30 layers"):
        KVQuant(wide_layers=(30,)).bytes_per_token(**GEOMETRY)


def test_a_wide_layer_stores_8_bit_channel_keys_and_the_others_4_bit():
    spec = synthetic_spec(layers=3, heads=2)
    pool = pool_for(spec, WIDE)
    table = fill_table(pool, 300, positional=True)
    arrays = table_arrays(pool, table)
    per = len(pool.arena.components[0])
    for layer in range(3):
        k, _ = _kv_for(spec, layer, 0, 300, rng=None, positional=True)
        rotated = hadamard(k).astype(mx.float16)[0]
        want = KVQuant(8 if layer == 1 else 4, 4).quantize_channels(rotated[:, :256])
        got = arrays[layer * per : layer * per + 3]
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.array(w), g[:, :256])
        tail = pool.arena.read_tail(table.tail, 300 - 256)[layer]
        np.testing.assert_array_equal(tail, np.array(rotated[:, 256:]))
    assert arrays[per].shape[-1] == 16 and arrays[0].shape[-1] == 8  # k.w: 8 bits vs 4


def test_blocks_with_per_layer_widths_round_trip_through_files_exactly(tmp_path):
    spec = synthetic_spec(layers=3, heads=2)
    pool = pool_for(spec, WIDE)
    table = fill_table(pool, 600)
    segment, blocks = write_segment(tmp_path / "seg.safetensors", pool, table, 0, 600)
    assert segment[1] > spec.bytes_per_token(KVQuant()) * 600  # the 8-bit keys are in it
    contiguous = gather_segments(spec, WIDE, [segment], blocks, 450, [(0, 512)] * 3)
    for want, got in zip(table_arrays(pool, table, 450), contiguous):
        assert want.tobytes() == np.array(got)[0, :, :450].tobytes()
    other = pool_for(spec, WIDE)
    slots = list(range(9, 9 - len(blocks), -1))
    regions = [(0, o, ln, crc, t, slot) for (_, o, ln, crc, t), slot in zip(blocks, slots)]
    other.arena.read_regions([segment], regions)
    copy = SimpleNamespace(blocks=slots, length=600)
    for want, got in zip(table_arrays(pool, table), table_arrays(other, copy)):
        assert want.tobytes() == got.tobytes()  # bit for bit (rows never written included)


def test_an_agent_saved_with_wide_layers_loads_each_layer_in_its_own_format(tmp_path):
    spec = synthetic_spec(layers=3, heads=2)
    pool = pool_for(spec, WIDE)
    store = save_agent(tmp_path, pool, fill_table(pool, 300, positional=True))
    manifest, _ = store.read_manifest("a")
    assert manifest.quant == WIDE
    caches = store.load_caches(manifest, "a", 300)
    assert [c.quant for c in caches] == [KVQuant(), KVQuant(8, 4), KVQuant()]
    for layer, cache in enumerate(caches):
        keys, _ = cache.dequantized()
        k, _ = _kv_for(spec, layer, 0, 300, rng=None, positional=True)
        error = float(mx.abs(keys[0] - k[0]).max())
        assert error < (0.01 if layer == 1 else 0.15), (layer, error)  # 8 bits vs 4 bits


def test_a_store_of_another_format_reads_a_wide_layer_manifest_as_its_own_record(tmp_path):
    """The manifest names the format it was written in: a reader that keeps another one sees
    the difference (the engine converts), never reads the widths of its own format."""
    spec = synthetic_spec(layers=3, heads=2)
    pool = pool_for(spec, WIDE)
    save_agent(tmp_path, pool, fill_table(pool, 100))
    reader = AgentStore(tmp_path, spec, "synthetic", KVQuant())
    manifest, _ = reader.read_manifest("a")
    assert manifest.quant == WIDE != reader.quant
    assert manifest.block_bytes(256) == spec.bytes_per_token(WIDE) * 256
