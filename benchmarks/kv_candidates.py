"""Candidate 4-bit KV formats, measured side by side before one becomes the format.

Each candidate is simulated exactly: keys and values go through the candidate's quantize and
dequantize (in float32) as they enter the cache, and the model attends over what comes back.
A rotation by an orthonormal Hadamard matrix H is undone after dequantizing, which gives the
same scores as rotating the queries by H at attention (q.k is unchanged) and the same output
as multiplying the attention output by H^T once per head.

Per segment (``context`` tokens of a text, run in 512-token chunks), the last ``scored``
predictions are compared with the fp16-cache run of the same segment: perplexity, mean KL
divergence of the next-token distribution from fp16's, and top-1 agreement. Texts: Python's
help() topics (prose with code; what ``bench quality`` uses) and Python's standard library
source (code), both installed with Python.

A candidate is a key treatment and a value treatment:

* ``token``: affine per token, one scale and bias per group of ``group`` channels (today's
  format; mlx-lm's ``QuantizedKVCache``).
* ``channel``: affine per channel over each complete block of ``block`` tokens (KIVI); the block
  still filling stays in float16 until it is complete.
* ``rot``: rotate by H (per head) before quantizing per token.
* ``sinks``: the first ``sinks`` tokens kept in float16.
* ``token scales``: each key row divided by its float16 root mean square before its channel
  group is quantized (and multiplied back after): 2 bytes per row.
* ``k8 layers``: the keys of the named layers at 8 bits, the others as the candidate says.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .common import emit, progress

CHUNK = 512


@dataclass(frozen=True)
class Kind:
    """How one of keys or values is stored."""

    bits: int = 4  # 16: float16
    scheme: str = "token"  # token | channel
    group: int = 64  # channels per group (token scheme)
    block: int = 64  # tokens per scale (channel scheme)
    rotate: bool = False
    token_scales: bool = False  # channel scheme: rows divided by their RMS first

    def label(self) -> str:
        if self.bits == 16:
            return "fp16"
        if self.scheme == "channel":
            name = f"{self.bits}b channel/{self.block}t"
        else:
            name = f"{self.bits}b token/g{self.group}"
        return name + (" rot" if self.rotate else "") + (" tscale" if self.token_scales else "")

    def bytes_per_row(self, dim: int) -> float:
        if self.bits == 16:
            return 2.0 * dim
        # fp16 scale + bias per group of `group` channels or per channel per `block` tokens.
        per = self.group if self.scheme == "token" else self.block
        return dim * (self.bits / 8 + 4 / per) + 2 * self.token_scales


@dataclass(frozen=True)
class Candidate:
    name: str
    keys: Kind
    values: Kind
    sinks: int = 0  # leading tokens kept in float16
    k8_layers: tuple[int, ...] = ()  # layers whose keys are 8-bit (the same scheme)

    def for_layer(self, layer: int) -> Candidate:
        """What layer ``layer`` stores."""
        if layer not in self.k8_layers:
            return self
        return replace(self, keys=replace(self.keys, bits=8), k8_layers=())

    def bytes_per_token(self, layers: int, heads: int, dim: int) -> int:
        total = 0.0
        for layer in range(layers):
            c = self.for_layer(layer)
            total += heads * (c.keys.bytes_per_row(dim) + c.values.bytes_per_row(dim))
        return round(total)


FP16 = Kind(bits=16)
Q4 = Kind()
CANDIDATES = [
    Candidate("fp16", FP16, FP16),
    Candidate("q4 (today)", Q4, Q4),
    Candidate("q4 keys g32", Kind(group=32), Q4),
    Candidate("q4 rot keys", Kind(rotate=True), Q4),
    Candidate("q4 channel keys", Kind(scheme="channel"), Q4),
    Candidate("q4 channel keys + sinks", Kind(scheme="channel"), Q4, sinks=4),
    Candidate("q4 channel keys + rot values", Kind(scheme="channel"), Kind(rotate=True)),
    Candidate(
        "q4 channel keys + sinks + rot values", Kind(scheme="channel"), Kind(rotate=True), sinks=4
    ),
    Candidate(
        "q4 rot channel keys + sinks + rot values",
        Kind(scheme="channel", rotate=True),
        Kind(rotate=True),
        sinks=4,
    ),
    Candidate("k5 channel + sinks, v4 rot", Kind(bits=5, scheme="channel"), Kind(rotate=True), 4),
    Candidate("q4.v2 (format 2)", Kind(scheme="channel", rotate=True), Kind(rotate=True)),
    Candidate(
        "q4.v2 + token scales",
        Kind(scheme="channel", rotate=True, token_scales=True),
        Kind(rotate=True),
    ),
    Candidate(
        "q4.v2 + 8-bit keys in layers 18 19",
        Kind(scheme="channel", rotate=True),
        Kind(rotate=True),
        k8_layers=(18, 19),
    ),
    Candidate("k8v4 (today)", Kind(bits=8), Q4),
    Candidate("k8 v4 rot g32", Kind(bits=8), Kind(group=32, rotate=True)),
    Candidate("k8 v4 rot g32 + sinks", Kind(bits=8), Kind(group=32, rotate=True), sinks=4),
]


def _hadamard(x):
    import mlx.core as mx

    return mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))


def _fake_token(x, kind: Kind):
    import mlx.core as mx

    w, s, b = mx.quantize(x, group_size=kind.group, bits=kind.bits)
    return mx.dequantize(
        w, s.astype(mx.float16).astype(x.dtype), b.astype(mx.float16).astype(x.dtype),
        group_size=kind.group, bits=kind.bits,
    )  # fmt: skip


def _fake_channel(x, kind: Kind):
    """Affine per channel over each block of ``kind.block`` tokens: x [B, H, T, D]."""
    import mlx.core as mx

    b, h, t, d = x.shape
    if kind.token_scales:
        rows = mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True)).astype(mx.float16).astype(x.dtype)
        rows = mx.where(rows == 0, 1, rows)
        return _fake_channel(x / rows, replace(kind, token_scales=False)) * rows
    y = x.reshape(b, h, t // kind.block, kind.block, d)
    levels = (1 << kind.bits) - 1
    lo = y.min(axis=3, keepdims=True)
    scale = ((y.max(axis=3, keepdims=True) - lo) / levels).astype(mx.float16).astype(x.dtype)
    lo = lo.astype(mx.float16).astype(x.dtype)
    q = mx.clip(mx.round((y - lo) / mx.where(scale == 0, 1, scale)), 0, levels)
    return (q * scale + lo).reshape(b, h, t, d)


def fake_quantize(x, kind: Kind):
    """What ``x`` [B, H, T, D] reads back as after storing it as ``kind`` (channel scheme: T is
    a whole number of blocks)."""
    import mlx.core as mx

    if kind.bits == 16:
        return x.astype(mx.float16).astype(x.dtype)
    y = _hadamard(x) if kind.rotate else x
    if kind.scheme == "channel":
        y = _fake_channel(y, kind)
    else:
        y = _fake_token(y, kind)
    return _hadamard(y) if kind.rotate else y  # H is symmetric and orthonormal: H^-1 == H


class SimulatedCache:
    """An mlx-lm-compatible cache whose contents read back as the candidate stores them."""

    def __init__(self, candidate: Candidate):
        from mlx_lm.models.cache import create_attention_mask

        self._mask = create_attention_mask
        self.c = candidate
        self.keys = self.values = None  # stored (as read back)
        self.raw_keys = None  # the channel scheme's filling block, float16
        self.offset = 0

    def make_mask(self, *args, **kwargs):
        return self._mask(*args, offset=self.offset, **kwargs)

    def _store(self, x, kind: Kind, start: int):
        import mlx.core as mx

        sinks = max(0, min(self.c.sinks - start, x.shape[2]))
        head, rest = x[:, :, :sinks], x[:, :, sinks:]
        parts = []
        if sinks:
            parts.append(fake_quantize(head, FP16))
        if rest.shape[2]:
            parts.append(fake_quantize(rest, kind))
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        start = self.offset
        self.offset += keys.shape[2]
        values = self._store(values, self.c.values, start)
        self.values = values if self.values is None else mx.concatenate([self.values, values], 2)
        kind = self.c.keys
        if kind.scheme != "channel" or kind.bits == 16:
            keys = self._store(keys, kind, start)
            self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], 2)
            return self.keys, self.values
        # Channel scheme: complete blocks are quantized; the filling one stays float16.
        pending = keys if self.raw_keys is None else mx.concatenate([self.raw_keys, keys], 2)
        done_tokens = 0 if self.keys is None else self.keys.shape[2]
        whole = (pending.shape[2] // kind.block) * kind.block
        if whole:
            block = pending[:, :, :whole]
            stored = self._store_channel(block, kind, done_tokens)
            self.keys = stored if self.keys is None else mx.concatenate([self.keys, stored], 2)
        self.raw_keys = pending[:, :, whole:]
        tail = fake_quantize(self.raw_keys, FP16)
        full = tail if self.keys is None else mx.concatenate([self.keys, tail], 2)
        return full, self.values

    def _store_channel(self, block, kind: Kind, start: int):
        import mlx.core as mx

        sinks = max(0, min(self.c.sinks - start, block.shape[2]))
        if not sinks:
            return fake_quantize(block, kind)
        # The sinks are kept exact and left out of their block's scales (their rows are
        # stood in for by the first row after them while the scales are found).
        stand_in = mx.repeat(block[:, :, sinks : sinks + 1], sinks, axis=2)
        stored = fake_quantize(mx.concatenate([stand_in, block[:, :, sinks:]], axis=2), kind)
        return mx.concatenate([fake_quantize(block[:, :, :sinks], FP16), stored[:, :, sinks:]], 2)


def texts() -> dict[str, str]:
    from pydoc_data.topics import topics

    prose = "\n\n".join(topics[k].strip() for k in sorted(topics))
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py", "ast.py"]
    code = "\n\n".join((lib / n).read_text(encoding="utf-8") for n in names if (lib / n).exists())
    return {"prose (pydoc topics)": prose, "code (stdlib source)": code}


def _segment_logprobs(model, ids: list[int], candidate: Candidate, scored: int):
    """Log-probabilities of the last ``scored`` predictions of ``ids`` ([scored, vocab])."""
    import mlx.core as mx

    caches = [SimulatedCache(candidate.for_layer(i)) for i in range(len(model.layers))]
    first = len(ids) - 1 - scored  # the input position whose next token is scored first
    out = []
    for c0 in range(0, len(ids) - 1, CHUNK):
        c1 = min(c0 + CHUNK, len(ids) - 1)
        logits = model(mx.array([ids[c0:c1]]), cache=caches)
        lo = max(first, c0)
        if lo < c1:
            part = logits[0, lo - c0 :].astype(mx.float32)
            out.append(part - mx.logsumexp(part, axis=-1, keepdims=True))
        mx.eval(out, [(c.keys, c.values) for c in caches])
    return mx.concatenate(out, axis=0)


def run(
    *,
    context: list[int] | None = None,
    segments: int = 3,
    scored: int = 512,
    names: list[str] | None = None,
    as_json: bool = False,
    model: str | None = None,
    text_kinds: list[str] | None = None,
) -> list[dict]:
    import mlx.core as mx

    from agentkv.model.load import load_model

    contexts = context or [2048]
    unknown = [n for n in names or [] if n not in {c.name for c in CANDIDATES}]
    if unknown:
        raise ValueError(f"unknown candidates {unknown}; see benchmarks/kv_candidates.py")
    chosen = [c for c in CANDIDATES if names is None or c.name in names or c.name == "fp16"]
    loaded = load_model(model)
    spec = loaded.spec
    dims = (spec.num_layers, spec.kv_heads, spec.key_head_dim)
    rows = []
    for text_name, text in texts().items():
        if text_kinds and text_name.split()[0] not in text_kinds:
            continue
        ids_all = loaded.tokenizer.encode(text)
        for ctx in contexts:
            if scored >= ctx:
                raise ValueError(f"--scored {scored} must be below the context {ctx}")
            spacing = max(ctx, (len(ids_all) - ctx) // max(segments, 1))
            starts = [i * spacing for i in range(segments) if i * spacing + ctx <= len(ids_all)]
            if len(starts) < segments:
                raise ValueError(f"{text_name}: {len(ids_all)} tokens, too few for {segments}")
            per = {c.name: [] for c in chosen}
            for s_index, start in enumerate(starts):
                ids = ids_all[start : start + ctx]
                targets = mx.array(ids[len(ids) - scored :])
                ref = None
                for cand in chosen:
                    began = time.perf_counter()
                    lp = _segment_logprobs(loaded.model, ids, cand, scored)
                    nll = -mx.take_along_axis(lp, targets[:, None], axis=-1).mean()
                    if ref is None:
                        ref = lp
                    kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1).mean()
                    top1 = (mx.argmax(lp, -1) == mx.argmax(ref, -1)).astype(mx.float32).mean()
                    per[cand.name].append((float(nll), float(kl), float(top1)))
                    progress(
                        f"kv candidates: {text_name} ctx {ctx} segment {s_index + 1}: "
                        f"{cand.name}: ppl {math.exp(float(nll)):.3f} kl {float(kl):.4f} "
                        f"({time.perf_counter() - began:.0f} s)"
                    )
            base = [math.exp(n) for n, _, _ in per["fp16"]]
            for cand in chosen:
                nlls, kls, top1s = zip(*per[cand.name])
                ppls = [math.exp(n) for n in nlls]
                deltas = [100 * (p / b - 1) for p, b in zip(ppls, base)]
                mean_nll = sum(nlls) / len(nlls)
                base_nll = sum(n for n, _, _ in per["fp16"]) / len(base)
                rows.append(
                    {
                        "text": text_name,
                        "context": ctx,
                        "candidate": cand.name,
                        "bytes_per_token": cand.bytes_per_token(*dims),
                        "perplexity": round(math.exp(mean_nll), 4),
                        "ppl_delta_pct": round(100 * (math.exp(mean_nll - base_nll) - 1), 2),
                        "ppl_delta_min_pct": round(min(deltas), 2),
                        "ppl_delta_max_pct": round(max(deltas), 2),
                        "kl_mean": round(sum(kls) / len(kls), 5),
                        "top1_agreement": round(
                            sum(t for _, _, t in per[cand.name]) / len(ppls), 4
                        ),
                    }
                )
    emit(
        "kv-candidates",
        rows,
        as_json,
        {"segments": segments, "scored_per_segment": scored, "contexts": contexts},
    )
    return rows
