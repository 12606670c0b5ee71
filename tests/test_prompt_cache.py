"""agentkv.save_prompt_cache / load_prompt_cache against mlx-lm's own, both directions."""

import mlx.core as mx
import pytest
from helpers import positional_caches, synthetic_spec
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

import agentkv
from agentkv.errors import CacheFormatError, InvalidRequestError
from agentkv.format.quant import V1, KVQuant


@pytest.fixture(scope="module")
def prefilled(engine):
    """mlx-lm caches of each kind, filled by the real model."""
    model, tok = engine.loaded.model, engine.loaded.tokenizer
    ids = mx.array([tok.encode("The archive keeps every record of the harbour town. " * 6)])
    quantized = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    plain = [KVCache() for _ in model.layers]
    for caches in (quantized, plain):
        model(ids, cache=caches)
        mx.eval([c.state for c in caches])
    return model, quantized, plain


def same_state(a, b):
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array):
        return a.shape == b.shape and mx.array_equal(a, b).item()
    return a == b


def test_files_written_by_mlx_lm_load_identically(prefilled, tmp_path):
    _, quantized, plain = prefilled
    path = str(tmp_path / "mixed.safetensors")
    mlx_lm_save(path, quantized[:15] + plain[15:], {"agent": "planner", "turn": "3"})
    ours, meta = agentkv.load_prompt_cache(path, return_metadata=True)
    theirs, their_meta = mlx_lm_load(path, return_metadata=True)
    assert meta == their_meta == {"agent": "planner", "turn": "3"}
    assert [type(c) for c in ours] == [type(c) for c in theirs]
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset
        for x, y in zip(
            a.keys_and_values() if hasattr(a, "keys_and_values") else a.state,
            b.keys_and_values() if hasattr(b, "keys_and_values") else b.state,
        ):
            assert same_state(x, y)


def test_one_more_step_after_either_load_is_identical(prefilled, tmp_path):
    model, quantized, _ = prefilled
    path = str(tmp_path / "q.safetensors")
    mlx_lm_save(path, quantized)
    token = mx.array([[42]])
    a = model(token, cache=agentkv.load_prompt_cache(path))
    b = model(token, cache=mlx_lm_load(path))
    assert mx.array_equal(a, b).item()


def test_a_full_cache_gets_a_spare_step(tmp_path):
    cache = QuantizedKVCache(group_size=64, bits=4)
    x = mx.random.normal((1, 2, 256, 64))
    cache.update_and_fetch(x, x)
    assert cache.offset == cache.keys[0].shape[2] == 256  # full: mlx-lm would copy next step
    path = str(tmp_path / "full.safetensors")
    mlx_lm_save(path, [cache])
    loaded = agentkv.load_prompt_cache(path)[0]
    assert loaded.offset == 256 and loaded.keys[0].shape[2] == 512
    loaded.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert loaded.keys[0].shape[2] == 512  # written in place, no regrowth
    theirs = mlx_lm_load(path)[0]
    for a, b in zip(loaded.keys, theirs.keys):
        assert mx.array_equal(a[..., :256, :], b).item()


def test_agentkv_caches_saved_here_load_in_mlx_lm(tmp_path):
    spec = synthetic_spec(layers=2, heads=2)
    for quant, cls in (
        (KVQuant(4, 4, **V1), QuantizedKVCache),
        (KVQuant(8, 8, **V1), QuantizedKVCache),
        (KVQuant(16, 16, **V1), KVCache),
    ):
        caches = positional_caches(spec, 300, quant)
        path = tmp_path / f"{quant.label}.safetensors"
        agentkv.save_prompt_cache(str(path), caches, {"k": "v"})
        loaded, meta = mlx_lm_load(str(path), return_metadata=True)
        assert meta == {"k": "v"} and all(type(c) is cls for c in loaded)
        for ours, theirs in zip(caches, loaded):
            keys, values = ours.keys_and_values()
            their_keys = theirs.keys if isinstance(theirs.keys, (list, tuple)) else (theirs.keys,)
            assert theirs.offset == 300
            for x, y in zip(keys, their_keys):
                assert mx.array_equal(x, y).item()
    assert not list(tmp_path.glob(".*tmp*"))


def test_what_mlx_lm_cannot_hold_is_refused_and_bad_files_are_named(tmp_path):
    spec = synthetic_spec(layers=1, heads=2)
    with pytest.raises(InvalidRequestError, match="one bit width"):
        mixed = positional_caches(spec, 10, KVQuant(8, 4, **V1))
        agentkv.save_prompt_cache(str(tmp_path / "mixed"), mixed)
    assert not list(tmp_path.iterdir())
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CacheFormatError, match="bad.safetensors"):
        agentkv.load_prompt_cache(str(bad))
    small = KVCache()
    small.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
    mlx_lm_save(str(tmp_path / "ok.safetensors"), [small])
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheFormatError):
        agentkv.load_prompt_cache(str(tmp_path / "cut.safetensors"))
