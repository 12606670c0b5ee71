"""KVSwap's low-rank key projections, computed once per model (docs/kvswap.md).

KVSwap chooses which groups of an agent's evicted KV to read back from a low-rank copy of
their keys. The projection is per layer: the principal directions of the layer's keys as
the pool stores them (after RoPE, rotated by the Hadamard matrix), over a calibration text:

1. a prefill of ``CALIBRATION_TOKENS`` tokens of the wide layers' calibration text (the
   end of Python's help() topics, which the quality benchmark does not score) through a
   block pool of the KV format;
2. per layer and KV head, the stored keys of every token read back ``[T, dim]``, centred
   on their mean (a query's dot product with the mean is the same for every token, so it
   never changes which groups rank first) and decomposed (SVD);
3. the right singular vectors, best first, and the mean are kept; a rank ``r`` takes the
   first ``r`` of them.

Kept in ``$AGENTKV_HOME/calibration/`` per model fingerprint and KV format (one safetensors
file, written atomically): about 15 s on 2 CPU cores for the embedded model, once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..format.geometry import BLOCK_TOKENS, blocks_for
from ..format.quant import KVQuant, hadamard
from ..format.spec import ModelCacheSpec
from ..paths import agentkv_home, atomic_target, secure_mkdir
from ..pool.swap import Projections
from .wide_layers import calibration_text

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 4096
CHUNK = 512
DEFAULT_RANK = 32  # measured: docs/kvswap.md, "Choosing the rank"
# Reading ahead (``Engine(kv_swap_read_ahead=True)``): layers from this one on start their
# reads during the layer before, from a query predicted there (its input through this
# layer's norm and query projection); below it the prediction is poor (docs/kvswap.md,
# "Reading ahead").
PREDICT_FROM = 3
VERSION = "kvswap-projections-v3"
_MEMO: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def projections(
    model, tokenizer, spec: ModelCacheSpec, quant: KVQuant, rank: int, *, read_ahead: bool = False
) -> Projections:
    """The model's KVSwap projections for keys stored in ``quant``, cut to ``rank``
    (measured once, then read back); ``read_ahead``: layers from ``PREDICT_FROM`` on read
    ahead."""
    width = spec.key_head_dim
    if not 4 <= rank <= width or rank % 4:
        raise ValueError(f"a KVSwap rank must be a multiple of 4 in 4..{width}, not {rank}")
    key = _name(spec, quant)
    if key not in _MEMO:
        _MEMO[key] = _read(spec, quant) or _measure_and_keep(model, tokenizer, spec, quant)
    keys, queries, means = _MEMO[key]
    return Projections(
        tuple(mx.array(np.ascontiguousarray(v[..., :rank])) for v in keys),
        tuple(mx.array(m) for m in means),
        tuple(mx.array(np.ascontiguousarray(v[..., :rank])) for v in queries),
        predict_from=PREDICT_FROM if read_ahead else None,
    )


def _name(spec: ModelCacheSpec, quant: KVQuant) -> str:
    return f"{spec.fingerprint[:16]}-{quant.identity.replace('/', '_')}-{VERSION}.safetensors"


def _path(spec: ModelCacheSpec, quant: KVQuant) -> Path:
    return agentkv_home() / "calibration" / _name(spec, quant)


def _read(spec: ModelCacheSpec, quant: KVQuant) -> tuple[np.ndarray, np.ndarray] | None:
    path = _path(spec, quant)
    if not path.exists():
        return None
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        vectors, queries = np.array(arrays["keys"]), np.array(arrays["queries"])
        means = np.array(arrays["means"])
        layers, heads, d = spec.num_layers, spec.kv_heads, spec.key_head_dim
        ok = (
            meta.get("fingerprint") == spec.fingerprint
            and meta.get("format") == quant.identity
            and meta.get("version") == VERSION
            and vectors.shape == queries.shape == (layers, heads, d, d)
            and means.shape == (layers, heads, d)
            and all(np.isfinite(a).all() for a in (vectors, queries, means))
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        log.warning("ignoring the unreadable KVSwap calibration %s (%s)", path, exc)
        return None
    return (vectors, queries, means) if ok else None


def _measure_and_keep(model, tokenizer, spec: ModelCacheSpec, quant: KVQuant):
    keys, queries = layer_keys(model, tokenizer, spec, quant)
    out = [[], [], []]
    for k_layer, q_layer in zip(keys, queries):  # per layer: [heads, tokens, dim] each
        for part, arrays in zip(out, zip(*(bilinear(k, q) for k, q in zip(k_layer, q_layer)))):
            part.append(np.stack(arrays).astype(np.float32))
    out = tuple(np.stack(part) for part in out)
    path = _path(spec, quant)
    try:
        secure_mkdir(path.parent)
        with atomic_target(path, suffix=".tmp.safetensors") as tmp:
            mx.save_safetensors(
                str(tmp),
                {"keys": mx.array(out[0]), "queries": mx.array(out[1]), "means": mx.array(out[2])},
                metadata={
                    "fingerprint": spec.fingerprint,
                    "format": quant.identity,
                    "version": VERSION,
                },
            )
    except OSError as exc:  # a read-only home: measured again next time
        log.warning("could not keep the KVSwap calibration at %s (%s)", path, exc)
    return out


def _inverse_root(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C^(1/2), C^(-1/2)) of a covariance matrix, its tiny eigenvalues floored."""
    w, e = np.linalg.eigh(c)
    w = np.maximum(w, w.max() * 1e-6 + 1e-30)
    return (e * np.sqrt(w)) @ e.T, (e / np.sqrt(w)) @ e.T


def bilinear(keys: np.ndarray, queries: np.ndarray):
    """Projections A (keys) and B (queries), best direction first, and the keys' mean, such
    that q.k is approximated best by (q B_r).((k - mean) A_r) at every rank r for queries
    and keys distributed like these: with C_k the keys' covariance and C_q the queries'
    second moment, S = C_q^(1/2) C_k^(1/2) = U diag(s) V^T gives A = C_k^(-1/2) V and
    B = C_q^(-1/2) U diag(s)."""
    mean = keys.mean(axis=0)
    centred = (keys - mean).astype(np.float64)
    ck = centred.T @ centred / len(centred)
    cq = queries.astype(np.float64).T @ queries / len(queries)
    ck_root, ck_inv = _inverse_root(ck)
    cq_root, cq_inv = _inverse_root(cq)
    u, s, vt = np.linalg.svd(cq_root @ ck_root)
    return ck_inv @ vt.T, cq_inv @ u * s, mean


def layer_keys(model, tokenizer, spec: ModelCacheSpec, quant: KVQuant):
    """Every layer's keys over the calibration text as the pool stores and KVSwap projects
    them (after RoPE, rotated, read back from ``quant``; float32 [heads, tokens, dim]) and
    its queries as attention meets them (rotated alike; per KV head, its query heads'
    queries one after another [heads, tokens * group, dim])."""
    from ..pool import KVPool
    from ..pool.step import PagedStep
    from ..pool.swap import stored_keys

    tokens = tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS]
    tokens = tokens[: len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS]
    if not tokens:
        raise ValueError("KVSwap: the calibration text is shorter than a block")
    blocks = blocks_for(len(tokens)) + 1
    pool = KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * BLOCK_TOKENS * blocks)
    table = pool.new_table(pool.seed("kvswap-calibration"))
    seen: list[list[np.ndarray]] = [[] for _ in range(spec.num_layers)]
    try:
        for c0 in range(0, len(tokens), CHUNK):
            chunk = tokens[c0 : c0 + CHUNK]
            table.grow(len(chunk), pool.arena.copy_rows)
            # the separate operations: the fused layer's attention records no query
            step = PagedStep(pool.arena, spec, [table], len(chunk), fused=False)
            for cache in step.caches:
                cache.agentkv_attention = _recording(cache, seen[cache.layer])
            model(mx.array([chunk]), cache=step.caches)
            pool.arena.settle()
            table.written(chunk)
        keys = [
            np.array(stored_keys(pool, layer, table.blocks)) for layer in range(spec.num_layers)
        ]
    finally:
        table.release()
    heads = spec.kv_heads
    queries = []
    for chunks in seen:  # [Hq, L, d] per chunk -> [Hkv, group * T, d]
        q = np.concatenate(chunks, axis=1)
        queries.append(q.reshape(heads, -1, q.shape[-1]))
    return keys, queries


def _recording(cache, into: list):
    """The cache's attention, recording its rotated queries first."""
    attend = cache.agentkv_attention

    def recorded(queries, keys, values, *, scale, mask, sinks=None):
        q = hadamard(queries[0].astype(mx.float32)) if cache.quant.rotate else queries[0]
        into.append(np.array(q))
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    return recorded
