"""The engine's warm-up, and on a GPU the check that agentkv's kernels work there.

A GPU compiles each of agentkv's kernels at its first use, so the warm-up runs every kind a
turn runs (a prefill chunk long enough for the dense path, decode steps over more keys than
one part: docs/gpu-attention.md) on scratch blocks. Nothing has run them on Metal yet, so on
a GPU the warm-up also runs once more without them (MLX's own operations, which take the
same bytes in the pool) and compares the two: a compiler that refuses a kernel, or a kernel
that computes something else there, turns agentkv's kernels off for the process
(``gpu.refuse``) and the engine runs on MLX's operations, slower, after a warning
(``Engine._start``)."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np

from ..kernels import gpu

log = logging.getLogger("agentkv.engine")

TEXT = "Warm up the kernels."
# How far the kernels' warm-up may lie from MLX's operations' (``gap``: KL divergence of
# the next-token distributions, nats). Each run stores its own keys and values, the same
# bytes up to float rounding, which may move a quantized code by one and the next layers
# with it: on the CPU's emulation of the GPU path the gap was at most 0.005 at 4 bits and
# 0.075 at 2 bits (float32, float16 and bfloat16 weights; ``tolerance``), where a paged
# kernel that reads its neighbour KV head puts it at 18.
TOLERANCE_NATS = 0.1
_agreed: set[tuple] = set()  # (backend, model, format) whose kernels agreed this process


def warm_up(runner, pool, token_text, fed: list[int] | None = None, salt: str = "agentkv/warmup"):
    """Run the model on scratch blocks, which go back to the pool: a prompt and two decode
    steps; on a GPU a prompt of 120 tokens (a chunk for the dense path, then decode steps
    over more keys than one part of the paged kernel), and then one of a few tokens (the
    paged kernel with several queries a row) and a decode step over it (in one part). Fed
    ``fed`` (the tokens after each prompt), or its own greedy choices. The tokens fed and
    each step's log-probabilities (float32, on the host)."""
    prompts = [(TEXT, 2)]
    if mx.default_device() != mx.cpu:
        prompts = [(" ".join([TEXT] * 24), 2), (TEXT, 1)]
    tokens, steps = [], []
    for n, (text, decode) in enumerate(prompts):
        table = pool.new_table(pool.seed(salt if n == 0 else f"{salt}/{n}"))
        ids = token_text.encode(text).ids or [0]
        reservation = pool.reserve(min(pool.capacity, 2))
        try:
            logits = runner.forward([table], [ids], reservations=[reservation])
            for _ in range(decode):
                steps.append(np.array(_log_softmax(logits), copy=True))
                token = fed[len(tokens)] if fed is not None else int(np.argmax(steps[-1]))
                tokens.append(token)
                logits = runner.forward([table], [[token]], reservations=[reservation])
            steps.append(np.array(_log_softmax(logits), copy=True))
        finally:
            reservation.close()
            table.release()
    return tokens, steps


def tolerance(quant) -> float:
    """How far (``gap``, nats) the kernels' warm-up may lie from MLX's operations' for KV
    format ``quant``: ``TOLERANCE_NATS``, 5 times that below 4 bits."""
    bits = min(quant.key_bits, quant.value_bits)
    return TOLERANCE_NATS if bits >= 4 else 5 * TOLERANCE_NATS


def _log_softmax(logits: mx.array) -> mx.array:
    row = logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32)
    return row - mx.logsumexp(row)


def gap(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """How far two warm-ups' next-token distributions lie apart: the largest KL divergence
    (nats) of ``got``'s from ``want``'s over their steps; infinite where ``got`` is not
    finite (steps where ``want`` is not are left out: MLX's operations overflowed)."""
    widest = 0.0
    for g, w in zip(got, want):
        if not np.all(np.isfinite(w)):
            continue
        if not np.all(np.isfinite(g)):
            return float("inf")
        widest = max(widest, float(np.sum(np.exp(w) * (w - g))))
    return widest


def kernels_problem(runner, pool, token_text, key: tuple) -> str | None:
    """Warm up; on a GPU with agentkv's kernels on, once a process for ``key`` (the
    backend, the model and its KV format), warm up again without them and compare (within
    ``tolerance`` of the pool's format). What is wrong with the kernels on this GPU, in
    words (MLX's refusal, or the gap), or None."""
    t0 = time.perf_counter()
    try:
        fed, got = warm_up(runner, pool, token_text)
    except RuntimeError as exc:
        if (words := gpu.refusal(exc)) is None or not gpu.kernels_on():
            raise
        return f"this GPU's compiler refused one of agentkv's kernels ({words})"
    checks = mx.default_device() != mx.cpu and gpu.kernels_on() and key not in _agreed
    said = ""
    if checks:
        with gpu.without_kernels():
            _, want = warm_up(runner, pool, token_text, fed, salt="agentkv/warmup-check")
        if (apart := gap(got, want)) > (most := tolerance(pool.quant)):
            return (
                f"on this GPU agentkv's kernels gave next-token distributions {apart:.3f} nats "
                f"away from MLX's own operations' on the warm-up (KL divergence; at most "
                f"{most} expected)"
            )
        _agreed.add(key)
        said = f"; agentkv's kernels within {apart:.5f} nats of MLX's operations (KL)"
    log.info("agentkv: warm-up took %.0f ms%s", (time.perf_counter() - t0) * 1000, said)
    return None
