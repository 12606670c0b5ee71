"""EngineConfig: the Engine's options as one frozen record, checked before any model loads;
``Engine(**options)`` and ``Engine(config=...)`` make the same engine."""

import dataclasses

import pytest
from helpers import tiny_llama_dir

from agentkv import Engine, EngineConfig, InvalidRequestError
from agentkv.engine import engine as engine_module


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "load_model", refuse)


def test_the_engine_keywords_are_the_config_fields_with_the_same_defaults():
    import inspect

    params = inspect.signature(Engine.__init__).parameters
    keywords = {name: p.default for name, p in params.items() if name not in ("self", "config")}
    assert keywords == {f.name: f.default for f in dataclasses.fields(EngineConfig)}


BAD_OPTIONS = [
    ({"kv_bits": 7}, "bits"),
    ({"group_size": 48}, "group size"),
    ({"prefill_chunk": 32}, "prefill_chunk"),
    ({"min_reuse_tokens": -1}, "min_reuse_tokens"),
    ({"max_batch": 0}, "max_batch"),
    ({"max_queue": 0}, "max_queue"),
    ({"schedule": "lifo"}, "schedule"),
    ({"kv_format": 3}, "kv_format"),
    ({"pool_bytes": 0}, "pool_bytes"),
    ({"pool_bytes": 1.5}, "pool_bytes"),
    ({"kv_wide_layers": "18,19"}, "layer indices"),
]


@pytest.mark.parametrize("options,match", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_options_are_refused_before_the_model_loads(no_model_load, options, match):
    with pytest.raises(InvalidRequestError, match=match):
        EngineConfig(**options)
    with pytest.raises(InvalidRequestError, match=match):
        Engine(**options)


def test_the_config_is_frozen_and_its_wide_layers_normalized():
    config = EngineConfig(kv_wide_layers=[19, 18, 18])
    assert config.kv_wide_layers == (18, 19)
    assert EngineConfig(kv_wide_layers=()).kv_wide_layers == ()
    assert EngineConfig().kv_wide_layers is None  # chosen per model
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kv_bits = 8


def test_an_engine_takes_a_config_or_options_not_both(no_model_load):
    with pytest.raises(InvalidRequestError, match="not both"):
        Engine(config=EngineConfig(), kv_bits=8)
    with pytest.raises(InvalidRequestError, match="must be an EngineConfig"):
        Engine(config={"kv_bits": 8})


def test_an_engine_from_a_config_equals_one_from_its_options(tmp_path):
    model = str(tiny_llama_dir(tmp_path / "tiny"))
    options = dict(model=model, kv_bits=8, max_batch=2, warmup=False, kv_wide_layers=())
    config = EngineConfig(cache_dir=tmp_path / "a", **options)
    with Engine(config=config) as a:
        assert a.config is config
        first = a.generate("x", "Hello there", max_tokens=4)
    with Engine(cache_dir=tmp_path / "b", **options) as b:
        assert b.config == dataclasses.replace(config, cache_dir=tmp_path / "b")
        assert b.quant == a.quant and b.quant.key_bits == b.quant.value_bits == 8
        assert b.generate("x", "Hello there", max_tokens=4).tokens == first.tokens
