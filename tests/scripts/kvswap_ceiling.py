"""How well can any choice of whole groups of tokens (64, or G) do at KVSwap's 1/8 budget?
(benchmarks/RESULTS.md, 2026-11-26 @ 4836d21 and 2026-11-27 @ eab649a.) The embedded model with
float32 weights and float KV through mlx-lm's own cache; the `bench kvswap` texts at 8K:
prefill 8K - 128 tokens, then 128 teacher-forced steps per arm, each arm's decode attention
seeing the first group, the last block and `slots` chosen groups (11: `bench kvswap`'s 1/8),
chosen from exact keys:

  rule         agentkv's (per query head a softmax over the groups' best scores, summed)
  perhead      the same per KV head
  mass         each group's true attention mass (an oracle)
  perheadmass  the true mass per KV head (an oracle)
  tail         rule, plus each dropped group as its mean value at its exact log-sum-exp

Top-1 agreement with the model attending to everything, and perplexity. Slow (the float
prefill: ~5 minutes a text on 2 cores). argv: slots (11), arms (rule,mass), texts (2), group
size G (64; a finer G with slots * 64 / G keeps the same budget)."""

import sys

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
from mlx_lm.models.cache import KVCache

from agentkv.benchmarks.kv_candidates import texts
from agentkv.model.load import load_model

CONTEXT, DECODE, BLOCK = 8192, 128, 256
slots = int(sys.argv[1]) if len(sys.argv) > 1 else 11
arms = ["full"] + (sys.argv[2] if len(sys.argv) > 2 else "rule,mass").split(",")
count = int(sys.argv[3]) if len(sys.argv) > 3 else 2
G = int(sys.argv[4]) if len(sys.argv) > 4 else 64
loaded = load_model(weights="float32")
model, mode = loaded.model, {"arm": "full"}


def decode_attention(q, k, v, scale, arm):
    """q [1, H, 1, D]; k, v [1, KV, T, D]."""
    H, KV, T = q.shape[1], k.shape[1], k.shape[2]
    rep = H // KV
    kk, vv = mx.repeat(k, rep, axis=1)[0], mx.repeat(v, rep, axis=1)[0]
    s = ((q * scale) @ kk.transpose(0, 2, 1)[None])[0, :, 0, :]  # [H, T]
    if arm == "full":
        return (mx.softmax(s, axis=1)[:, None, :] @ vv).reshape(1, H, 1, -1)
    last = (T - 1) // BLOCK * BLOCK  # the last block stays; groups before it are evicted
    evicted = last // G
    sg = s[:, : evicted * G].reshape(H, evicted, G)
    if arm in ("mass", "perheadmass"):
        w = mx.softmax(s, axis=1)[:, : evicted * G].reshape(H, evicted, G).sum(axis=2)[:, 1:]
    else:
        w = mx.softmax(sg.max(axis=2)[:, 1:], axis=1)  # group 0 (the sinks) always stays
    keep = np.zeros((H, T), bool)
    keep[:, :G] = keep[:, last:] = True
    if arm.startswith("perhead"):
        per_kv = np.array(w.reshape(KV, rep, -1).sum(axis=1))
        for h in range(KV):
            for g in np.argsort(-per_kv[h])[:slots] + 1:
                keep[h * rep : (h + 1) * rep, g * G : (g + 1) * G] = True
    else:
        for g in np.argsort(-np.array(w.sum(axis=0)))[:slots] + 1:
            keep[:, g * G : (g + 1) * G] = True
    scores = mx.where(mx.array(keep), s, -mx.inf)
    if arm != "tail":
        return (mx.softmax(scores, axis=1)[:, None, :] @ vv).reshape(1, H, 1, -1)
    dropped = mx.array(~keep[0, : evicted * G].reshape(evicted, G).any(axis=1))
    means = mx.repeat(v[0, :, : evicted * G].reshape(KV, evicted, G, -1).mean(axis=2), rep, 0)
    lse = mx.where(dropped[None], mx.logsumexp(sg, axis=2), -mx.inf)
    p = mx.softmax(mx.concatenate([scores, lse], axis=1), axis=1)
    out = (p[:, None, :T] @ vv)[:, 0] + (p[:, None, T:] @ means)[:, 0]
    return out.reshape(1, H, 1, -1)


def attention(q, k, v, cache=None, scale=1.0, mask=None, **_):
    if q.shape[2] == 1:
        return decode_attention(q, k, v, scale, mode["arm"]).astype(q.dtype)
    L, T = q.shape[2], k.shape[2]  # a prefill chunk: causal, through BLAS
    rep = q.shape[1] // k.shape[1]
    s = (q * scale) @ mx.repeat(k, rep, axis=1).transpose(0, 1, 3, 2)
    s = mx.where(mx.arange(T)[None] <= mx.arange(L)[:, None] + (T - L), s, -mx.inf)
    return (mx.softmax(s, axis=-1) @ mx.repeat(v, rep, axis=1)).astype(q.dtype)


llama.scaled_dot_product_attention = attention
for name, text in list(texts().items())[:count]:
    ids = loaded.tokenizer.encode(text)[: CONTEXT + 1]
    prefix = len(ids) - 1 - DECODE
    base = [KVCache() for _ in model.layers]
    mode["arm"] = "full"
    for c0 in range(0, prefix, 512):
        model(mx.array([ids[c0 : min(c0 + 512, prefix)]]), cache=base)
        mx.eval([c.keys for c in base])
    caches = {}
    for arm in arms:
        caches[arm] = []
        for c in base:
            copy = KVCache()
            copy.keys, copy.values, copy.offset = mx.array(c.keys), mx.array(c.values), c.offset
            caches[arm].append(copy)
    agree, nll = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
    for i in range(DECODE):
        token, target = ids[prefix + i], ids[prefix + i + 1]
        best = -1  # the full arm's choice (it runs first)
        for arm in arms:
            mode["arm"] = arm
            logits = model(mx.array([[token]]), cache=caches[arm])[0, -1].astype(mx.float32)
            nll[arm] -= float((logits - mx.logsumexp(logits))[target])
            choice = int(mx.argmax(logits).item())
            best = choice if arm == "full" else best
            agree[arm] += choice == best
    full = np.exp(nll["full"] / DECODE)
    for arm in arms[1:]:
        top1, ppl = 100 * agree[arm] / DECODE, np.exp(nll[arm] / DECODE)
        print(f"{name}: {arm}: top-1 {top1:.1f}%, perplexity {ppl:.3f} (full {full:.3f})")
