"""Run by a llama-cpp-python venv's python (never agentkv's) for tests/model/
test_gguf_k_quants.py: ``quantize SRC DST FTYPE`` writes DST with llama.cpp's own quantizer
(FTYPE as llama.cpp names it: Q4_K_M, Q5_K_M, Q6_K, Q8_0; a quantized SRC is requantized);
``logits GGUF OUT.npy`` reads token ids (JSON) on stdin and saves llama.cpp's logits at
every position."""

from __future__ import annotations

import ctypes
import json
import sys

import llama_cpp
import numpy as np


def quantize(src: str, dst: str, ftype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {ftype}")


def logits(path: str, out: str) -> None:
    ids = json.loads(sys.stdin.read())
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))


if __name__ == "__main__":
    {"quantize": quantize, "logits": logits}[sys.argv[1]](*sys.argv[2:])
