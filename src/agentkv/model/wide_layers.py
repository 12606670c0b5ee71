"""Which layers keep 8-bit keys in KV format 2 (its *wide layers*), chosen per model.

4-bit per-channel keys cost a model most of its quality loss in a few layers: in the embedded
model two of 30 layers hold over a quarter of the keys' error (layers 18 and 19 with the
float32 weights of then; benchmarks/RESULTS.md, 2026-11-23 @ 5c42bdc; with its 4-bit weights
the measure below picks 19 and 20), and 8-bit keys there cut the KL divergence at 8K tokens by
31% for 192 bytes a token. Which layers those are differs by model, so it is measured once per
model:

1. a float32 pass over a fixed calibration text (``CALIBRATION_TOKENS`` tokens from the
   end of Python's help() topics, a part the quality benchmark does not score);
2. in every layer, attention is computed over the exact keys (what the pass continues
   with) and, for the second half of the queries, over the keys as the format stores them
   (rotated, 4-bit per channel over each complete group, rotated back); the difference
   goes through the layer's output projection and is measured against the layer's input
   (the residual stream), mean squared, over those queries;
3. the ``wide_count(layers)`` layers with the largest error get 8-bit keys.

The result (every layer's error too) is kept in ``$AGENTKV_HOME/calibration/`` per model
fingerprint and format, so the pass runs once per model (about 30 s for the embedded model
on a 2-core VM; its result ships with the package, in ``calibrations/``, and a test
measures it again). A model whose layers or output projections cannot be found gets no
wide layers (logged).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ..format.quant import KVQuant, dequantize_channels, quantize_channels
from ..format.spec import ModelCacheSpec
from ..kernels.reference import causal_mask, float_attention
from ..paths import agentkv_home, atomic_write_text, secure_mkdir
from ..progress import ProgressBar

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 2048
MEASURE = "attention-output error / layer input, last half of 2048 help() tokens, v1"
_MEMO: dict[tuple[str, str], tuple[int, ...]] = {}


def wide_count(layers: int) -> int:
    """How many layers get 8-bit keys: one in 16 (2 of the embedded model's 30), at least 1."""
    return max(1, math.ceil(layers / 16))


def eligible(quant: KVQuant) -> bool:
    """Whether ``quant`` takes wide layers: per-channel keys under 8 bits."""
    return quant.channel_keys and quant.key_bits < 8


def with_wide_layers(quant: KVQuant, model, tokenizer, spec: ModelCacheSpec) -> KVQuant:
    """``quant`` with the model's wide layers (measured, or read back); ``quant`` itself
    where the format takes none or the model's layers cannot be measured."""
    if not eligible(quant) or quant.wide_layers:
        return quant
    base = replace(quant, wide_layers=())
    key = (spec.fingerprint, base.identity)
    if key not in _MEMO:
        _MEMO[key] = _remembered(spec, base) or _measure_and_keep(base, model, tokenizer, spec)
    wide = _MEMO[key]
    return replace(base, wide_layers=wide) if wide else base


SHIPPED = Path(__file__).parent / "calibrations"


def _name(spec: ModelCacheSpec, base: KVQuant) -> str:
    return f"{spec.fingerprint[:16]}-{base.identity.replace('/', '_')}.json"


def _path(spec: ModelCacheSpec, base: KVQuant) -> Path:
    return agentkv_home() / "calibration" / _name(spec, base)


def _remembered(spec: ModelCacheSpec, base: KVQuant) -> tuple[int, ...] | None:
    for path in (SHIPPED / _name(spec, base), _path(spec, base)):
        errors = read_errors(path, spec)
        if errors is not None:
            return choose(errors)
    return None


def read_errors(path: Path, spec: ModelCacheSpec) -> list[float] | None:
    """The per-layer errors a calibration file holds for ``spec``'s model (None: none, or
    not for this model and measure; an unreadable file is logged and ignored)."""
    try:
        record = json.loads(path.read_text())
        errors = [float(e) for e in record["errors"]]
        ok = (
            record["fingerprint"] == spec.fingerprint
            and record["measure"] == MEASURE
            and len(errors) == spec.num_layers
            and all(math.isfinite(e) and e >= 0 for e in errors)
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable calibration %s (%s); measuring again", path, exc)
        return None
    return errors if ok else None


def choose(errors: list[float]) -> tuple[int, ...]:
    """The ``wide_count`` layers with the largest errors, in layer order."""
    ranked = sorted(range(len(errors)), key=lambda i: -errors[i])
    return tuple(sorted(ranked[: wide_count(len(errors))]))


def _measure_and_keep(base: KVQuant, model, tokenizer, spec: ModelCacheSpec) -> tuple[int, ...]:
    try:
        errors = layer_errors(model, tokenizer, base)
    except _Unmeasurable as exc:
        log.warning("no wide layers for %s: %s", spec.model_type, exc)
        return ()
    wide = choose(errors)
    record = {
        "model_type": spec.model_type,
        "fingerprint": spec.fingerprint,
        "format": base.identity,
        "measure": MEASURE,
        "errors": errors,
        "wide_layers": list(wide),
    }
    path = _path(spec, base)
    try:
        secure_mkdir(path.parent)
        atomic_write_text(path, json.dumps(record, indent=1))
    except OSError as exc:  # a read-only home: measured again next time
        log.warning("could not keep the calibration at %s (%s)", path, exc)
    log.info("KV format 2: 8-bit keys in layers %s of %s", list(wide), spec.model_type)
    return wide


class _Unmeasurable(Exception):
    pass


def calibration_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics, reverse=True))


def layer_errors(model, tokenizer, quant: KVQuant) -> list[float]:
    """Every layer's attention-output error with ``quant``'s keys (module docstring)."""
    from ..mlx_adapter import cache_class, install_attention_dispatch

    KVCache = cache_class("KVCache")

    layers = _layer_list(model)
    projections = [getattr(getattr(layer, "self_attn", None), "o_proj", None) for layer in layers]
    if any(p is None for p in projections):
        raise _Unmeasurable("a layer has no self_attn.o_proj")
    tokens = tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS]
    first = len(tokens) // 2
    inputs = [None] * len(layers)
    errors = [None] * len(layers)

    class Recorder:  # a layer's input (the residual stream), then the layer itself
        def __init__(self, i, layer):
            self.i, self.layer = i, layer

        def __getattr__(self, name):  # what the model reads of its layers (use_sliding...)
            return getattr(self.layer, name)

        def __call__(self, x, *args, **kwargs):
            inputs[self.i] = (x[:, first:].astype(mx.float32) ** 2).sum(-1).mean()
            return self.layer(x, *args, **kwargs)

    class Probe(KVCache):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None, softcap=0.0):
            kw = {"scale": scale, "sinks": sinks, "softcap": softcap}
            exact = float_attention(queries, keys, values, mask=mask, **kw)
            # only the measured queries over the stored keys: each query's row is its own
            if isinstance(mask, str):  # "causal"
                late = causal_mask(len(tokens) - first, len(tokens))
            else:
                late = None if mask is None else mask[..., first:, :]
            approx = float_attention(
                queries[..., first:, :], _as_stored(keys, quant), values, mask=late, **kw
            )
            o_proj = projections[self.i]
            diff = o_proj(_heads_to_model(approx)) - o_proj(_heads_to_model(exact[..., first:, :]))
            errors[self.i] = (diff.astype(mx.float32) ** 2).sum(-1).mean()
            mx.eval(errors[self.i])
            bar.advance()
            return exact

    install_attention_dispatch()
    originals = list(layers)
    log.info("measuring which layers keep 8-bit keys (once per model, %d layers)", len(layers))
    what = "measuring which layers keep 8-bit keys (once per model)"
    try:
        with ProgressBar(len(layers), what, unit="layer") as bar:
            for i, layer in enumerate(originals):
                layers[i] = Recorder(i, layer)
            caches = [Probe(i) for i in range(len(originals))]
            mx.eval(model(mx.array(tokens)[None], cache=caches))
    finally:
        layers[:] = originals
    if any(e is None for e in errors) or any(x is None for x in inputs):
        raise _Unmeasurable("its layers do not all attend through mlx-lm's attention")
    return [float(e) / max(float(x), 1e-30) for e, x in zip(errors, inputs)]


def _layer_list(model) -> list:
    """The list the model's forward pass iterates (``model.layers`` may be a slice of it:
    mlx-lm's pipeline-parallel models)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise _Unmeasurable("it has no list of layers")
    inner = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(inner, list) and len(inner) == len(layers):
        if all(a is b for a, b in zip(inner, layers)):
            return inner
    return layers


def _heads_to_model(x: mx.array) -> mx.array:
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def _as_stored(keys: mx.array, quant: KVQuant) -> mx.array:
    """Keys as format 2 reads them: complete channel groups rotated, quantized, read back
    and rotated back; the group still filling exact (the pool keeps it in float16)."""
    ct = quant.channel_tokens
    full = keys.shape[-2] // ct * ct
    if not full:
        return keys
    head = quant.rotated(keys[..., :full, :].astype(mx.float32))
    parts = quantize_channels(head, quant.key_bits, ct)
    head = quant.rotated(dequantize_channels(*parts, quant.key_bits, ct)).astype(keys.dtype)
    return mx.concatenate([head, keys[..., full:, :]], axis=-2)
