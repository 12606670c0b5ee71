"""Quality: what quantizing the KV cache costs the embedded model.

Text: Python's own documentation as installed with it (``pydoc_data.topics``,
the help() topics, keys in sorted order, joined by blank lines): English prose
with code, offline on every machine that runs agentkv.

* perplexity: the first ``tokens`` tokens in windows of ``window`` tokens,
  ``stride`` apart. Each window is run through the model in 512-token chunks
  over an agentkv cache of the format measured (so every key and value a
  prediction sees went through that format), and only its last ``stride``
  predictions are scored (the first window: all of them), each with at least
  ``window - stride`` tokens of context.
* greedy agreement: 20 passages from further on in the same text (512 tokens
  each) are continued greedily for 200 tokens by ``Engine.generate_many`` with
  the cache in each format; agreement is the share of the 200 tokens before
  the continuation first differs from the float16 one, averaged over prompts
  (``same_position_pct``: the share of positions holding the same token).

Formats: fp16, 8-bit, 4-bit, keys 8-bit/values 4-bit (group size 64).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from .common import emit, progress

FORMATS = {"fp16": (16, 16), "q8": (8, 8), "q4": (4, 4), "k8v4": (8, 4)}
CHUNK = 512
PROMPTS, PROMPT_TOKENS, CONTINUATION = 20, 512, 200


def source_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def _windows(total: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) of each window; targets are token indices."""
    out, start = [], 0
    while True:
        end = min(start + window, total)
        out.append((start, end, start + 1 if start == 0 else end - stride))
        if end == total:
            return out
        start += stride


def perplexity(model, ids: list[int], quant, window: int, stride: int) -> tuple[float, int]:
    import mlx.core as mx
    import mlx.nn as nn

    from agentkv.kv.cache import AgentKVCache

    nll, scored = 0.0, 0
    for start, end, first in _windows(len(ids), window, stride):
        caches = [AgentKVCache(quant) for _ in model.layers]
        for c0 in range(start, end - 1, CHUNK):
            c1 = min(c0 + CHUNK, end - 1)
            logits = model(mx.array([ids[c0:c1]]), cache=caches)
            lo = max(first - 1, c0)  # the input position whose next token is `first`
            if lo >= c1:
                mx.eval([c.components for c in caches])
                continue
            targets = mx.array(ids[lo + 1 : c1 + 1])
            losses = nn.losses.cross_entropy(logits[0, lo - c0 :].astype(mx.float32), targets)
            nll += float(losses.sum())
            scored += c1 - lo
    return math.exp(nll / scored), scored


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


def run(
    tokens: int = 20480,
    window: int = 2048,
    stride: int = 1024,
    formats: list[str] | None = None,
    as_json: bool = False,
    model: str | None = None,
) -> list[dict]:
    from agentkv import Engine
    from agentkv.kv.quant import KVQuant

    if not 0 < stride <= window or window < 2:
        raise ValueError("need 0 < stride <= window and window >= 2")
    names = formats or list(FORMATS)
    if "fp16" not in names:
        names = ["fp16", *names]
    rows, reference = [], {}
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-quality-") as tmp:
        for name in names:
            kb, vb = FORMATS[name]
            with Engine(model=model, cache_dir=Path(tmp) / name, key_bits=kb, value_bits=vb) as eng:
                text = source_text()
                all_ids = [int(t) for t in eng.token_text.encode(text).ids]
                need = tokens + PROMPTS * PROMPT_TOKENS
                if len(all_ids) < need:
                    raise ValueError(f"the source text has {len(all_ids)} tokens, need {need}")
                ids = all_ids[:tokens]
                progress(f"quality: {name}: perplexity over {len(ids)} tokens...")
                began = time.perf_counter()
                ppl, scored = perplexity(eng.loaded.model, ids, KVQuant(kb, vb), window, stride)
                ppl_s = time.perf_counter() - began
                progress(f"quality: {name}: perplexity {ppl:.4f} ({ppl_s:.0f} s)")
                prompts = []
                for i in range(PROMPTS):
                    begin = tokens + i * PROMPT_TOKENS
                    prompts.append(
                        eng.loaded.tokenizer.decode(all_ids[begin : begin + PROMPT_TOKENS])
                    )
                progress(f"quality: {name}: {PROMPTS} greedy continuations...")
                results = eng.generate_many(
                    [(f"q{i}", p) for i, p in enumerate(prompts)], max_tokens=CONTINUATION
                )
                continuations = [r.tokens for r in results]
            if name == "fp16":
                reference = {"ppl": ppl, "continuations": continuations}
            pairs = [_agreement(c, r) for c, r in zip(continuations, reference["continuations"])]
            rows.append(
                {
                    "kv": name,
                    "perplexity": round(ppl, 4),
                    "ppl_delta_pct": round((ppl / reference["ppl"] - 1) * 100, 3),
                    "greedy_agreement": round(sum(p for p, _ in pairs) / len(pairs), 4),
                    "same_position_pct": round(100 * sum(s for _, s in pairs) / len(pairs), 2),
                    "scored_tokens": scored,
                    "seconds": round(ppl_s, 1),
                }
            )
    emit(
        "quality",
        rows,
        as_json,
        {
            "source": "pydoc_data.topics (Python's help() topics, sorted keys)",
            "tokens": tokens,
            "window": window,
            "stride": stride,
            "prompts": PROMPTS,
            "prompt_tokens": PROMPT_TOKENS,
            "continuation_tokens": CONTINUATION,
        },
    )
    return rows
