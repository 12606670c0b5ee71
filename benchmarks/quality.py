"""Quality: what quantizing the KV cache costs the model, against an fp16 cache.

Texts (installed with Python, offline everywhere): Python's help() topics (``pydoc_data``,
keys in sorted order: English prose with code) and six standard-library modules (code); see
``kv_candidates.texts``.

* per context length C (default 2,048 and 8,192): the first ``tokens`` tokens of each text in
  windows of C tokens, C/2 apart. Each window (a *segment*) runs through the model in
  512-token chunks over a block pool of each format, as the engine runs a prefill (so every
  key and value a prediction sees went through the format), and its last C/2 predictions are
  scored (the first window:
  all of them), each with at least C/2 tokens of context. Reported per format: perplexity,
  its change against fp16 (and the spread over segments), mean KL divergence of the
  next-token distribution from fp16's and top-1 agreement with fp16.
* greedy agreement (not with ``--quick``): 20 passages of the first text after the scored
  tokens (512 tokens each) continued greedily for 200 tokens by ``Engine.generate_many``;
  agreement is the share of the 200 tokens before the continuation first differs from the
  fp16 one (``same_position_pct``: positions holding the same token).
* decode attention: one query token per agent, batch 4, over 4,096 cached tokens of the
  embedded geometry, through the pool's attention for the format (median ms over rounds
  that interleave the formats, averaged over the model's layers; format 2 includes rotating
  the queries and the output), and its ratio to format 1's 4-bit attention.

Formats: fp16, q8, q4, k8v4, the ablations k4v16 (only keys 4-bit) and k16v4 (only values),
and format 2 (docs/kv-format-v2.md: rotated per-channel keys, rotated values): q4.v2 (as
``Engine()`` stores it: 8-bit keys in the model's wide layers, ``model/wide_layers.py``),
q4.v2.flat (4-bit keys in every layer), k8v4.v2.
``--quick``: the first text, 4,096 tokens, 2,048-token context, no greedy runs (minutes).
``--attention-only``: the decode-attention times alone (a minute).
``--activations``: the model's 4-bit weights through agentkv's kernel (activations quantized
to int16 per 32) against the same weights dequantized to float32 (float activations), both
over an fp16 KV cache, scored as above at each context (default 2,048; ``--tokens`` default
8,192 here): perplexity of each, their change, KL and top-1 agreement of the kernel's
next-token distributions with the float ones (issue 20's check, minutes).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from .common import emit, median_ms, progress, timed
from .kv_candidates import texts

V1 = {"key_scheme": "token", "rotate": False}  # format 1 (agentkv.format.quant.V1)
FORMATS = {  # name: KVQuant arguments
    "fp16": {"key_bits": 16, "value_bits": 16, **V1},
    "q8": {"key_bits": 8, "value_bits": 8, **V1},
    "q4": {"key_bits": 4, "value_bits": 4, **V1},
    "k8v4": {"key_bits": 8, "value_bits": 4, **V1},
    "k4v16": {"key_bits": 4, "value_bits": 16, **V1},
    "k16v4": {"key_bits": 16, "value_bits": 4, **V1},
    "q4.v2": {"key_bits": 4, "value_bits": 4, "key_scheme": "channel", "rotate": True},
    "q4.v2.flat": {"key_bits": 4, "value_bits": 4, "key_scheme": "channel", "rotate": True},
    "k8v4.v2": {"key_bits": 8, "value_bits": 4, "key_scheme": "channel", "rotate": True},
}
FLAT = {"q4.v2.flat"}  # format 2 with 4-bit keys in every layer (no wide layers)


def quant_of(name: str, loaded=None):
    """The format ``name`` names; format 2 with keys under 8 bits takes the model's wide
    layers (as ``Engine()`` stores it) unless the name is in ``FLAT``."""
    from agentkv.format.quant import KVQuant
    from agentkv.model.wide_layers import with_wide_layers

    quant = KVQuant(**FORMATS[name])
    if loaded is None or name in FLAT:
        return quant
    return with_wide_layers(quant, loaded.model, loaded.tokenizer, loaded.spec)


CHUNK = 512
PROMPTS, PROMPT_TOKENS, CONTINUATION = 20, 512, 200
QUICK = {"tokens": 4096, "contexts": [2048], "texts": 1}


def _windows(total: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) of each window; targets are token indices."""
    out, start = [], 0
    while True:
        end = min(start + window, total)
        out.append((start, end, start + 1 if start == 0 else end - stride))
        if end == total:
            return out
        start += stride


def _pool_for(spec, quant, tokens: int):
    from agentkv.format.geometry import BLOCK_TOKENS, blocks_for
    from agentkv.pool import KVPool

    blocks = blocks_for(tokens) + 2
    return KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * BLOCK_TOKENS * blocks)


def window_logprobs(model, spec, ids: list[int], quant, first: int):
    """Log-probabilities of the targets ``ids[first:]`` ([n, vocab]), the window run in
    chunks through a block pool of ``quant`` (the engine's prefill path)."""
    import mlx.core as mx

    from agentkv.pool.step import PagedStep

    pool = _pool_for(spec, quant, len(ids))
    table = pool.new_table(pool.seed())
    out = []
    for c0 in range(0, len(ids) - 1, CHUNK):
        c1 = min(c0 + CHUNK, len(ids) - 1)
        table.grow(c1 - c0, pool.arena.copy_rows)
        step = PagedStep(pool.arena, spec, [table], c1 - c0)
        logits = model(mx.array([ids[c0:c1]]), cache=step.caches)
        lo = max(first - 1, c0)  # the input position whose next token is `first`
        if lo < c1:
            part = logits[0, lo - c0 :].astype(mx.float32)
            out.append(part - mx.logsumexp(part, axis=-1, keepdims=True))
        mx.eval(out)
        pool.arena.settle()
        table.written(ids[c0:c1])
    table.release()
    return mx.concatenate(out, axis=0)


def compare(lp, ref, targets) -> tuple[float, float, float]:
    """(summed negative log-likelihood, summed KL from ``ref``, summed top-1 matches)."""
    import mlx.core as mx

    nll = -mx.take_along_axis(lp, targets[:, None], axis=-1).sum()
    kl = (mx.exp(ref) * (ref - lp)).sum()
    top1 = (mx.argmax(lp, -1) == mx.argmax(ref, -1)).sum()
    return float(nll), float(kl), float(top1)


BASELINE = "q4"  # decode attention is also given as a ratio to format 1's 4-bit attention


def decode_attention(quants: dict, *, layers: int = 30, rounds: int = 60) -> dict:
    """Per format name: one decode step's attention (``attention_step``), averaged over the
    model's ``layers`` (a format with wide layers attends over 8-bit keys in those), in ms;
    and its ratio to format 1's 4-bit attention. Every distinct layer format is timed once
    per round, the rounds interleaving them, so a busy machine slows all alike (medians)."""
    from agentkv.format.quant import KVQuant

    baseline = KVQuant(**FORMATS[BASELINE])
    kinds = {name: [q.layer(i) for i in range(layers)] for name, q in quants.items()}
    distinct = list(dict.fromkeys([baseline, *(k for ks in kinds.values() for k in ks)]))
    steps = {q: attention_step(q) for q in distinct}
    times: dict = {q: [] for q in distinct}
    for _ in range(rounds):
        for q, step in steps.items():
            times[q].append(timed(step)[0])
    median = {q: median_ms(t) for q, t in times.items()}
    out = {}
    for name, ks in kinds.items():
        ms = sum(median[k] for k in ks) / layers
        out[name] = {"ms": round(ms, 3), "vs_q4": round(ms / median[baseline], 3)}
    return out


def attention_step(quant, *, batch: int = 4, tokens: int = 4096):
    """A function running one decode step's attention over ``tokens`` cached tokens per agent
    (embedded geometry: one layer, 3 KV heads, 9 query heads, head dim 64), through the
    pool's attention (a ``PagedStep`` layer, as the engine decodes: format 2 rotates the
    query and the output); run once (warm) before it is returned."""
    import mlx.core as mx

    from agentkv.format.spec import LayerKind, LayerSpec, ModelCacheSpec
    from agentkv.pool.arena import WritePlan
    from agentkv.pool.step import PagedStep

    heads, q_heads, dim = 3, 9, 64
    spec = ModelCacheSpec(
        "bench", 1, heads, dim, dim, (LayerSpec(LayerKind.FULL),), False, "float32", "bench"
    )
    pool = _pool_for(spec, quant, batch * (tokens + 256))
    tables = []
    for b in range(batch):
        table = pool.new_table(pool.seed(f"bench {b}"))
        table.grow(tokens + 1, pool.arena.copy_rows)
        plan = WritePlan(pool.arena, [table], [0], tokens)
        kv = mx.random.normal((2, 1, heads, tokens, dim))
        pool.arena.append(0, kv[0], kv[1], plan)
        pool.arena.settle()
        table.written([0] * tokens)
        tables.append(table)
    step = PagedStep(pool.arena, spec, tables, 1)
    cache = step.caches[0]
    q = mx.random.normal((batch, q_heads, 1, dim))
    new = mx.random.normal((2, batch, heads, 1, dim))
    keys, values = cache.update_and_fetch(new[0], new[1])
    mx.eval(q)
    pool.arena.settle()

    def attend():
        out = cache.agentkv_attention(q, keys, values, scale=dim**-0.5, mask=None)
        mx.eval(out)

    attend()
    return attend


def _attention_rows(quants: dict, spec, as_json: bool) -> list[dict]:
    progress("quality: decode attention only (batch 4 x 4,096 tokens)...")
    began = time.perf_counter()
    attention = decode_attention(quants, layers=spec.num_layers)
    rows = [
        {
            "kv": name,
            "format": quant.label,
            "bytes_per_token": spec.bytes_per_token(quant),
            "decode_attention_ms": attention[name]["ms"],
            "decode_attention_vs_q4": attention[name]["vs_q4"],
        }
        for name, quant in quants.items()
    ]
    emit("quality", rows, as_json, {"attention_only": True,
                                    "seconds": round(time.perf_counter() - began, 1)})  # fmt: skip
    return rows


def _greedy(model, quant, prompts: list[str]) -> list[list[int]]:
    from agentkv import Engine

    options = {
        "key_bits": quant.key_bits,
        "value_bits": quant.value_bits,
        "kv_wide_layers": quant.wide_layers,
    }
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-quality-") as tmp:
        with Engine(model=model, cache_dir=Path(tmp), kv_format=quant.version, **options) as eng:
            results = eng.generate_many(
                [(f"q{i}", p) for i, p in enumerate(prompts)], max_tokens=CONTINUATION
            )
    return [r.tokens for r in results]


def _agreement(ours: list[int], ref: list[int]) -> tuple[float, float]:
    """(leading tokens equal, positions equal), each as a share of the reference's length."""
    prefix = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        prefix += 1
    same = sum(a == b for a, b in zip(ours, ref))
    n = max(len(ref), 1)
    return prefix / n, same / n


def activations(
    tokens: int = 8192,
    contexts: list[int] | None = None,
    *,
    as_json: bool = False,
    model: str | None = None,
    text_kinds: list[str] | None = None,
) -> list[dict]:
    """The same weights with int16 activations (agentkv's kernel) vs float activations
    (dequantized to float32), an fp16 KV cache for both (module docstring)."""
    import mlx.core as mx

    from agentkv.model.load import CPU_QMM_ID, load_model

    contexts = contexts or [2048]
    if any(c < 4 or c % 2 for c in contexts):
        raise ValueError("context lengths must be even and at least 4")
    kernel = load_model(model, weights="quantized")
    if not kernel.spec.weights_id.endswith(CPU_QMM_ID):
        raise ValueError("the model has no layer on agentkv's quantized kernel here")
    floats = load_model(model, weights="float32")
    quant = quant_of("fp16", kernel)
    sources = list(texts().items())
    if text_kinds:
        sources = [(n, t) for n, t in sources if n.split()[0] in text_kinds]
    rows = []
    for text_name, text in sources:
        ids = kernel.tokenizer.encode(text)[:tokens]
        for context in contexts:
            windows = _windows(len(ids), context, context // 2)
            ours, ref = [], []
            for w, (start, end, first) in enumerate(windows):
                progress(
                    f"quality: activations, {text_name}, context {context}: segment {w + 1} of "
                    f"{len(windows)}"
                )
                window = ids[start:end]
                skip = first - start
                targets = mx.array(window[skip:])
                lp_float = window_logprobs(floats.model, floats.spec, window, quant, skip)
                lp_kernel = window_logprobs(kernel.model, kernel.spec, window, quant, skip)
                ref.append((*compare(lp_float, lp_float, targets), len(window) - skip))
                ours.append((*compare(lp_kernel, lp_float, targets), len(window) - skip))
            scored = sum(x[3] for x in ours)
            nll_ours, nll_ref = sum(x[0] for x in ours), sum(x[0] for x in ref)
            rows.append(
                {
                    "text": text_name,
                    "context": context,
                    "kv": "fp16",
                    "perplexity_float_activations": round(math.exp(nll_ref / scored), 4),
                    "perplexity_int16_activations": round(math.exp(nll_ours / scored), 4),
                    "ppl_delta_pct": round(100 * (math.exp((nll_ours - nll_ref) / scored) - 1), 3),
                    "kl_mean": round(sum(x[1] for x in ours) / scored, 6),
                    "top1_agreement": round(sum(x[2] for x in ours) / scored, 4),
                    "segments": len(windows),
                    "scored_tokens": scored,
                }
            )
            progress(
                f"quality: activations, {text_name} {context}: ppl {rows[-1]['ppl_delta_pct']:+}%,"
                f" top-1 {rows[-1]['top1_agreement']:.2%}"
            )
    emit("quality-activations", rows, as_json, {"weights": kernel.spec.weights_id})
    return rows


def run(
    tokens: int = 20480,
    contexts: list[int] | None = None,
    formats: list[str] | None = None,
    *,
    quick: bool = False,
    as_json: bool = False,
    model: str | None = None,
    text_kinds: list[str] | None = None,
    greedy: bool = True,
    attention_only: bool = False,
) -> list[dict]:
    import mlx.core as mx

    from agentkv.model.load import load_model

    unknown = [f for f in formats or [] if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    contexts = contexts or ([2048] if quick else [2048, 8192])
    if quick:
        tokens = min(tokens, QUICK["tokens"])
    if any(c < 4 or c % 2 for c in contexts):
        raise ValueError("context lengths must be even and at least 4")
    names = [n for n in (formats or list(FORMATS)) if n != "fp16"]
    names = ["fp16", *names]
    loaded = load_model(model)
    spec = loaded.spec
    quants = {name: quant_of(name, loaded) for name in names}
    if attention_only:
        return _attention_rows(quants, spec, as_json)
    sources = list(texts().items())
    if text_kinds:  # "prose" / "code": the first word of each text's name
        sources = [(n, t) for n, t in sources if n.split()[0] in text_kinds]
    sources = sources[: QUICK["texts"] if quick else None]
    greedy = greedy and not quick
    greedy_prompts: list[str] = []
    rows = []
    began_all = time.perf_counter()
    for text_name, text in sources:
        all_ids = loaded.tokenizer.encode(text)
        need = tokens + (0 if not greedy or greedy_prompts else PROMPTS * PROMPT_TOKENS)
        if len(all_ids) < need:
            raise ValueError(f"{text_name}: {len(all_ids)} tokens, need {need}")
        if greedy and not greedy_prompts:
            greedy_prompts = [
                loaded.tokenizer.decode(all_ids[b : b + PROMPT_TOKENS])
                for b in range(tokens, tokens + PROMPTS * PROMPT_TOKENS, PROMPT_TOKENS)
            ]
        ids = all_ids[:tokens]
        for context in contexts:
            windows = _windows(len(ids), context, context // 2)
            # per format: [(nll, kl, top1, scored)] per window
            per: dict[str, list[tuple[float, float, float, int]]] = {n: [] for n in names}
            for w, (start, end, first) in enumerate(windows):
                progress(
                    f"quality: {text_name}, context {context}: segment {w + 1} of {len(windows)}"
                )
                window = ids[start:end]
                skip = first - start  # targets before it are not scored
                targets = mx.array(window[skip:])
                ref = None
                for name in names:
                    lp = window_logprobs(loaded.model, spec, window, quants[name], skip)
                    ref = lp if ref is None else ref
                    per[name].append((*compare(lp, ref, targets), len(window) - skip))
                del ref
            base = per["fp16"]
            for name in names:
                nll = sum(x[0] for x in per[name])
                scored = sum(x[3] for x in per[name])
                deltas = [
                    100 * (math.exp((a[0] - b[0]) / a[3]) - 1) for a, b in zip(per[name], base)
                ]
                rows.append(
                    {
                        "text": text_name,
                        "context": context,
                        "kv": name,
                        "format": quants[name].label,
                        "bytes_per_token": spec.bytes_per_token(quants[name]),
                        "perplexity": round(math.exp(nll / scored), 4),
                        "ppl_delta_pct": round(
                            100 * (math.exp((nll - sum(x[0] for x in base)) / scored) - 1), 3
                        ),
                        "ppl_delta_min_pct": round(min(deltas), 2),
                        "ppl_delta_max_pct": round(max(deltas), 2),
                        "kl_mean": round(sum(x[1] for x in per[name]) / scored, 5),
                        "top1_agreement": round(sum(x[2] for x in per[name]) / scored, 4),
                        "segments": len(windows),
                        "scored_tokens": scored,
                    }
                )
    progress("quality: decode attention (batch 4 x 4,096 tokens)...")
    attention = decode_attention(quants, layers=spec.num_layers)
    for row in rows:
        row["decode_attention_ms"] = attention[row["kv"]]["ms"]
        row["decode_attention_vs_q4"] = attention[row["kv"]]["vs_q4"]
    greedy = None
    if greedy_prompts:
        continuations = {}
        for name in names:
            progress(f"quality: {name}: {PROMPTS} greedy continuations...")
            continuations[name] = _greedy(model, quants[name], greedy_prompts)
        greedy = {"text": sources[0][0], "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
                  "continuation_tokens": CONTINUATION, "rows": []}  # fmt: skip
        for name in names:
            pairs = [_agreement(c, r) for c, r in zip(continuations[name], continuations["fp16"])]
            greedy["rows"].append(
                {
                    "kv": name,
                    "greedy_agreement": round(sum(p for p, _ in pairs) / len(pairs), 4),
                    "same_position_pct": round(100 * sum(s for _, s in pairs) / len(pairs), 2),
                }
            )
    emit(
        "quality",
        rows,
        as_json,
        {
            "texts": [name for name, _ in sources],
            "tokens_per_text": tokens,
            "contexts": contexts,
            "quick": quick,
            "greedy": greedy,
            "seconds": round(time.perf_counter() - began_all, 1),
        },
    )
    return rows
