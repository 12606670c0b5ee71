"""Compute: the engine on the embedded model with float32 weights vs 4-bit weights as shipped.

The first part of ``agentkv bench compute`` (issue 20): one agent, a cold prompt of
``prompt_words`` words of the calibration text (plus a request for an essay) with
``max_tokens`` generated, then a hot turn that adds one short question. Per run and weights:
cold prefill tokens/s, decode tokens/s (both turns), the hot turn's time to first token, and
the model's resident weight bytes. The two weights alternate (float32, quantized, float32,
...), each in a fresh engine and cache directory; both arms prefill the same prompt (checked);
what each generates is its own (counted). llama.cpp beside them is still to come.
"""

from __future__ import annotations

import tempfile

from .common import emit, progress


def run(runs: int = 2, prompt_words: int = 350, max_tokens: int = 64, as_json: bool = False):
    rows = []
    for i in range(runs):
        for weights in ("float32", "quantized"):
            progress(f"compute: run {i + 1}/{runs}, {weights} weights...")
            rows.append(_run_once(weights, prompt_words, max_tokens))
    if len({row["prompt_tokens"] for row in rows}) != 1:
        raise AssertionError("the arms prefilled different prompts")
    emit("compute", rows, as_json, {"prompt_words": prompt_words, "max_tokens": max_tokens})
    return rows


def _run_once(weights: str, prompt_words: int, max_tokens: int) -> dict:
    from mlx.utils import tree_flatten

    from agentkv import Engine
    from agentkv.model.wide_layers import calibration_text

    text = " ".join(calibration_text().split()[:prompt_words])
    first = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"{text}\n\nWrite a long, detailed essay about the text."},
    ]
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-compute-") as tmp:
        with Engine(cache_dir=tmp, weights=weights) as eng:
            reply = eng.chat("bench", first, max_tokens=max_tokens, temperature=0.0)
            cold = reply.stats
            follow = first + [
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": "Now summarise that essay in two short sentences."},
            ]
            hot = eng.chat("bench", follow, max_tokens=max_tokens, temperature=0.0).stats
            params = tree_flatten(eng.loaded.model.parameters())
            weight_bytes = sum(v.nbytes for _, v in params)
    return {
        "weights": weights,
        "weight_mb": round(weight_bytes / 1e6, 1),
        "kv_format": cold.kv_format,
        "prompt_tokens": cold.prompt_tokens,
        "cold_prefill_tps": round(cold.prefill_tokens / (cold.prefill_ms / 1000), 1),
        "cold_generated": cold.generated_tokens,
        "cold_decode_tps": round(cold.decode_tps, 1),
        "hot_cache": f"{hot.cache}/{hot.match}",
        "hot_prefill_tokens": hot.prefill_tokens,
        "hot_ttft_ms": round(hot.ttft_ms, 1),
        "hot_generated": hot.generated_tokens,
        "hot_decode_tps": round(hot.decode_tps, 1),
    }
