"""Which layers keep 8-bit keys (``model/wide_layers.py``): measured per model at load,
remembered under ``$AGENTKV_HOME/calibration``, shipped for the embedded model, and what
``Engine(kv_wide_layers=...)`` makes of it."""

import json
import logging
from dataclasses import replace

import numpy as np
import pytest
from helpers import tiny_llama_dir

from agentkv.errors import InvalidRequestError
from agentkv.format.quant import V1, KVQuant
from agentkv.model import wide_layers
from agentkv.model.load import load_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An AGENTKV_HOME of the test's own, with no calibration remembered in this process."""
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path / "home"))
    wide_layers._MEMO.clear()
    yield tmp_path / "home"
    wide_layers._MEMO.clear()


@pytest.fixture
def tiny(tmp_path, home):
    """A 4-layer random-weight llama (one wide layer: ``wide_count(4)``)."""
    return load_model(str(tiny_llama_dir(tmp_path / "tiny", layers=4, seed=11)))


def test_the_count_grows_with_the_layers():
    assert [wide_layers.wide_count(n) for n in (1, 4, 16, 17, 30, 32, 48)] == [1, 1, 1, 2, 2, 2, 3]


def test_formats_that_take_no_wide_layers_are_returned_unchanged(tiny):
    spec = tiny.spec
    for quant in (KVQuant(8, 4), KVQuant(**V1), KVQuant(16, 16)):
        assert wide_layers.with_wide_layers(quant, tiny.model, tiny.tokenizer, spec) is quant
    chosen = KVQuant(wide_layers=(2,))
    assert wide_layers.with_wide_layers(chosen, tiny.model, tiny.tokenizer, spec) is chosen
    assert not wide_layers._MEMO  # nothing was measured


def test_a_measured_choice_is_kept_and_read_back(tiny, home):
    spec, base = tiny.spec, KVQuant()
    quant = wide_layers.with_wide_layers(base, tiny.model, tiny.tokenizer, spec)
    errors = wide_layers.layer_errors(tiny.model, tiny.tokenizer, base)
    assert len(quant.wide_layers) == 1
    assert quant.wide_layers == (int(np.argmax(errors)),)  # the layer its 4-bit keys hurt most
    path = home / "calibration" / wide_layers._name(spec, base)
    record = json.loads(path.read_text())
    assert record["fingerprint"] == spec.fingerprint and record["wide_layers"] == list(
        quant.wide_layers
    )
    np.testing.assert_allclose(record["errors"], errors, rtol=1e-4)
    # Read back (no second pass): a record that names other layers is what is used.
    record["errors"] = [0.0] * len(errors)
    record["errors"][3 if quant.wide_layers != (3,) else 0] = 1.0
    path.write_text(json.dumps(record))
    wide_layers._MEMO.clear()
    again = wide_layers.with_wide_layers(base, tiny.model, tiny.tokenizer, spec)
    assert again.wide_layers == (3 if quant.wide_layers != (3,) else 0,)


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: "{not json",
        lambda r: json.dumps({**r, "fingerprint": "0" * 64}),  # another model's
        lambda r: json.dumps({**r, "errors": r["errors"][:-1]}),  # too few layers
        lambda r: json.dumps({**r, "errors": [float("nan")] * len(r["errors"])}),
        lambda r: json.dumps({**r, "measure": "something else"}),
        lambda r: json.dumps({k: v for k, v in r.items() if k != "errors"}),
    ],
)
def test_a_bad_or_foreign_record_is_measured_again(tiny, home, damage, caplog):
    spec, base = tiny.spec, KVQuant()
    want = wide_layers.with_wide_layers(base, tiny.model, tiny.tokenizer, spec)
    path = home / "calibration" / wide_layers._name(spec, base)
    good = json.loads(path.read_text())
    path.write_text(damage(good))
    wide_layers._MEMO.clear()
    with caplog.at_level(logging.INFO, logger="agentkv.model.wide_layers"):
        got = wide_layers.with_wide_layers(base, tiny.model, tiny.tokenizer, spec)
    assert got == want
    assert "8-bit keys in layers" in caplog.text  # measured again, not read
    assert json.loads(path.read_text())["errors"] == pytest.approx(good["errors"], rel=1e-4)


def test_the_engine_takes_the_choice_none_or_named_layers(tmp_path, tiny):
    from agentkv import Engine

    model = str(tmp_path / "tiny")
    with Engine(model=model, cache_dir=tmp_path / "a", warmup=False) as eng:
        assert eng.quant.label.startswith("q4.v2+k8@") and len(eng.quant.wide_layers) == 1
        auto, auto_bytes = eng.quant, eng.bytes_per_token
    with Engine(model=model, cache_dir=tmp_path / "b", warmup=False, kv_wide_layers=()) as eng:
        assert eng.quant == replace(auto, wide_layers=()) and eng.quant.label == "q4.v2"
        flat_bytes = eng.bytes_per_token
    with Engine(model=model, cache_dir=tmp_path / "c", warmup=False, kv_wide_layers=[3, 0]) as e:
        assert e.quant.wide_layers == (0, 3) and e.quant.label == "q4.v2+k8@0,3"
        # each wide layer: 1 KV head x 64 channels x 4 more bits a token
        assert e.bytes_per_token - auto_bytes == auto_bytes - flat_bytes == 32
    with pytest.raises(InvalidRequestError, match="past the model's 4 layers"):
        Engine(model=model, cache_dir=tmp_path / "d", warmup=False, kv_wide_layers=[4])
    with pytest.raises(InvalidRequestError, match="under 8 bits"):
        Engine(model=model, cache_dir=tmp_path / "e", key_bits=8, kv_wide_layers=[1])
    for bad in (3, "18,19", [1.5]):  # refused before the model loads
        with pytest.raises(InvalidRequestError, match="layer indices"):
            Engine(model=model, cache_dir=tmp_path / "f", kv_wide_layers=bad)


@pytest.mark.slow
def test_the_shipped_calibration_of_the_embedded_model_is_what_the_measure_gives(engine):
    """The embedded model's record ships with the package (no 20 s pass on first use); the
    measure, run again here, finds the same layers."""
    loaded = engine.loaded
    base = replace(engine.quant, wide_layers=())
    shipped = wide_layers.read_errors(
        wide_layers.SHIPPED / wide_layers._name(loaded.spec, base), loaded.spec
    )
    assert shipped is not None and engine.quant.wide_layers == wide_layers.choose(shipped)
    assert engine.quant.wide_layers == (19, 20)  # 4-bit weights as shipped; float32: 18, 19
    measured = wide_layers.layer_errors(loaded.model, loaded.tokenizer, base)
    # Within 5%: the record was measured on an Intel Xeon; on an AMD EPYC (2026-11-28) two of
    # the 30 layers came out 2.1% and 2.4% apart. Floats that differ in their last bits
    # between the machines (likely OpenBLAS's per-CPU kernels; not traced further) round a few
    # 4-bit codes the other way, and this error measures those codes.
    np.testing.assert_allclose(measured, shipped, rtol=0.05)
    # Layer 20 is within 1% of 18 on this measure: the chosen pair is among the top three.
    top3 = set(np.argsort(measured)[-3:].tolist())
    assert set(engine.quant.wide_layers) <= top3


def test_make_prompt_cache_gives_each_layer_the_engine_s_format(tiny):
    from agentkv import make_prompt_cache

    caches = make_prompt_cache(tiny)
    want = wide_layers.with_wide_layers(KVQuant(), tiny.model, tiny.tokenizer, tiny.spec)
    assert [c.quant for c in caches] == [want.layer(i) for i in range(4)]
    assert sum(c.quant.key_bits == 8 for c in caches) == 1
    flat = make_prompt_cache(tiny, KVQuant())
    assert [c.quant for c in flat] == [KVQuant()] * 4
    with pytest.raises(InvalidRequestError, match="past the model's 4 layers"):
        make_prompt_cache(tiny, KVQuant(wide_layers=(9,)))
