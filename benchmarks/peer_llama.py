"""The llama.cpp arm of ``agentkv bench compute`` (and ``bench perplexity``'s, a job of
``kind`` "nll": ``_nll``), run by the peer's own Python (a venv with
llama-cpp-python, never agentkv's). Reads one JSON job on stdin, prints one JSON result.

The job: ``model`` (the GGUF file), ``threads``, ``kv`` ("f16": llama.cpp's default; "q4_0":
a q4_0 K and V cache with flash attention), ``n_ctx`` and the workload (texts). Every
measurement goes through ``Llama.generate``, which keeps the context's KV cache and reuses
the longest common prefix of the previous prompt (llama.cpp's prompt cache): a cold prompt
resets it first, a hot one does not. Greedy sampling; EOS does not end a generation here.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    import llama_cpp

    if job.get("kind") == "nll":
        return _nll(llama_cpp, job)

    options = {}
    if job["kv"] == "q4_0":
        options = {
            "type_k": llama_cpp.GGML_TYPE_Q4_0,
            "type_v": llama_cpp.GGML_TYPE_Q4_0,
            "flash_attn": True,
        }
    llm = _llama(llama_cpp, job, **options)

    def turn(text: str, tokens: int, *, cold: bool) -> dict:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        if cold:
            llm.reset()
        reused = _common_prefix(llm.input_ids[: llm.n_tokens].tolist(), ids) if not cold else 0
        start = time.perf_counter()
        first = last = None
        made = []
        # reset=True is what makes generate() look for a cached prefix (none after reset())
        for n, token in enumerate(llm.generate(ids, temp=0.0, reset=True), start=1):
            made.append(token)
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            if n >= tokens:
                break
        decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
        return {
            "text": text + llm.detokenize(made).decode("utf-8", errors="replace"),
            "prompt_tokens": len(ids),
            "reused_tokens": reused,
            "ttft_s": first - start,
            "generated": tokens,
            "decode_tps": decode,
        }

    work = job["work"]
    out = {
        "weight_bytes": int(llama_cpp.llama_model_size(llm.model)),
        "version": llama_cpp.__version__,
        "short": turn(work["short"], work["decode_tokens"], cold=True),
        "cold": [],
        "hot": [],
    }
    for i, text in enumerate(work["cold"]):
        longest = i == len(work["cold"]) - 1
        out["cold"].append(turn(text, work["decode_tokens"] if longest else 1, cold=True))
    history = out["cold"][-1]["text"]
    for suffix in work["hot"]:  # the history so far is in the context: a prefix match
        out["hot"].append(turn(history + suffix, 1, cold=False))
        history = out["hot"][-1]["text"]
    out["batch_context"] = turn(work["batch"][0], work["decode_tokens"], cold=True)
    json.dump(out, sys.stdout)


def _llama(llama_cpp, job: dict, **options):
    """The job's model on its threads, 512-token batches, quiet."""
    return llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
        **options,
    )


def _nll(llama_cpp, job: dict) -> None:
    """``bench perplexity``'s job: each of ``windows`` (token ids) evaluated from its start
    with logits at every position (llama.cpp's default float16 KV); the summed negative
    log-likelihood of each window's next tokens after its first, and how many."""
    import numpy as np

    llm = _llama(llama_cpp, job, logits_all=True)
    total, scored = 0.0, 0
    for ids in job["windows"]:
        llm.reset()
        llm.eval(ids)
        lg = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        top = lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg - top).sum(-1)) + top[:, 0]
        total += float((lse - lg[np.arange(len(ids) - 1), ids[1:]]).sum())
        scored += len(ids) - 1
    json.dump({"nll": total, "scored": scored, "version": llama_cpp.__version__}, sys.stdout)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
