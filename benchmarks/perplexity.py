"""Perplexity of a GGUF file's weights: agentkv's import of the file against llama.cpp on the
same file (llama-cpp-python in its own venv, ``peer_llama.py``), on the ``bench quality``
texts (``kv_candidates.texts``: prose, code).

Each text's first ``tokens`` tokens (agentkv's tokenizer of the file; both sides are given
the same ids, no BOS added) are cut into windows of ``window`` tokens; every window is
evaluated from its start, alone, and each of its next tokens after the first is scored. So
both sides score the same predictions with the same context. agentkv: the file imported with
its weights as shipped (``weights="quantized"``: agentkv's CPU matmul) and a float KV cache;
llama.cpp: its default (float16 KV), ``logits_all``. Both weigh the same model; llama.cpp's
arithmetic differs (int8 activations in its dot products). A third arm, ``exact``: the file's
weights dequantized to float32 in agentkv (the model both approximate). Reported per text and
over all: perplexity of each, agentkv's against llama.cpp's (``delta_pct``), and each against
the exact model's (``exact_delta_pct``, ``llama_cpp_exact_delta_pct``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from .common import emit, progress

# agentkv's arms: the file as the engine runs it, and its exact model (every weight the
# file's value, in float32: what both runs approximate)
ARMS = {"agentkv": "quantized", "exact": "float32"}


def run(
    model: str | None = None,
    tokens: int = 2048,
    window: int = 512,
    peer: str = "auto",
    as_json: bool = False,
) -> dict:
    import mlx.core as mx
    import numpy as np

    from agentkv.model.load import load_model

    from .compute import _model_file, _peer, peer_dir
    from .kv_candidates import texts

    gguf = _model_file(model)
    python = _peer(peer)
    if python is None:
        raise SystemExit(
            f"agentkv: error: bench perplexity needs llama.cpp: --peer install builds "
            f"llama-cpp-python into {peer_dir()} (minutes)"
        )
    progress(f"perplexity: importing {gguf.name}...")
    models = {arm: load_model(str(gguf), weights=w) for arm, w in ARMS.items()}
    windows: dict[str, list[list[int]]] = {}
    for name, text in texts().items():
        ids = models["agentkv"].tokenizer.encode(text)[:tokens]
        windows[name] = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    rows, totals = [], {arm: [0.0, 0] for arm in (*ARMS, "llama.cpp")}
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-ppl-") as tmp:
        for name, parts in windows.items():
            scores = {}
            for arm, loaded in models.items():
                progress(f"perplexity: {name}: {arm}...")
                scores[arm] = [0.0, 0]
                for ids in parts:
                    logits = loaded.model(mx.array([ids]))[0].astype(mx.float32)
                    nll, n = _nll(np.array(logits), ids)
                    scores[arm][0] += nll
                    scores[arm][1] += n
            progress(f"perplexity: {name}: llama.cpp...")
            scores["llama.cpp"] = _peer_nll(python, gguf, parts, window, Path(tmp))
            row = {"text": name, "tokens": sum(len(p) for p in parts)}
            row["scored"] = scores["agentkv"][1]
            for arm, (nll, n) in scores.items():
                row[f"{arm}_perplexity"] = round(math.exp(nll / n), 4)
                totals[arm][0] += nll
                totals[arm][1] += n
            row.update(_deltas(scores))
            rows.append(row)
            progress(f"perplexity: {name}: {json.dumps(row)}")
    extra = {"model": str(gguf), "window": window}
    for arm, (nll, n) in totals.items():
        extra[f"{arm.replace('.', '_')}_perplexity"] = round(math.exp(nll / n), 4)
    extra.update(_deltas(totals))
    emit("perplexity", rows, as_json, extra)
    return {"rows": rows, **extra}


def _deltas(scores: dict) -> dict:
    """agentkv's perplexity against llama.cpp's, and each against the exact model's."""
    return {
        "delta_pct": _delta(scores["agentkv"], scores["llama.cpp"]),
        "exact_delta_pct": _delta(scores["agentkv"], scores["exact"]),
        "llama_cpp_exact_delta_pct": _delta(scores["llama.cpp"], scores["exact"]),
    }


def _delta(ours, theirs) -> float:
    """One perplexity against another, in percent."""
    return round(100 * (math.exp(ours[0] / ours[1] - theirs[0] / theirs[1]) - 1), 3)


def _nll(logits, ids: list[int]) -> tuple[float, int]:
    """The summed negative log-likelihood of each next token of ``ids`` and how many."""
    import numpy as np

    lg = logits[: len(ids) - 1].astype(np.float64)
    top = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - top).sum(-1)) + top[:, 0]
    return float((lse - lg[np.arange(len(ids) - 1), ids[1:]]).sum()), len(ids) - 1


def _peer_nll(python: Path, gguf: Path, parts, window: int, tmp: Path) -> tuple[float, int]:
    job = {"kind": "nll", "model": str(gguf), "threads": os.cpu_count() or 1, "n_ctx": window}
    job["windows"] = parts
    script = Path(__file__).with_name("peer_llama.py")
    done = subprocess.run(
        [str(python), str(script)], input=json.dumps(job), capture_output=True, text=True,
        timeout=1800, cwd=tmp,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp arm failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    return out["nll"], out["scored"]
