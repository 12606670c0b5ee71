"""Chained block hashes: one hash names a block and certifies every token before it.

``seed = sha256("agentkv/block/v1" | model fingerprint | KV format | tenant salt | bits)``
``hash(block i) = sha256(hash(block i-1) | its 256 token ids as int32 little-endian)``,
with ``hash(block -1) = seed``. The same tokens under the same model, KV format and salt
always give the same hash (in any process, on any machine), so hashes name shared
blocks in memory and on disk. Never Python's ``hash()``.

A hash names bytes, not only tokens: the bytes a block stores are a function of its
tokens and everything before them, computed by one arithmetic (``bits_identity``: the
backend, and the version of its kernels, ``BITS_VERSIONS``), so the seed names that
arithmetic too and blocks computed by another are never taken for these. An agent whose
bytes are not the ones its tokens give here (converted from another KV format, stored by an
earlier agentkv or on another backend) hashes its blocks under a seed of its own
(``private_seed``): its forks share them, no one else does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..format.geometry import BLOCK_TOKENS

DOMAIN = b"agentkv/block/v1"
PRIVATE_DOMAIN = b"agentkv/private/v1"
# The version of each backend's arithmetic that computes stored bytes from tokens: bump a
# backend's with any change to its kernels that changes the bytes stored for the same tokens
# (or how a step reads what it stores), so blocks computed before the change are never
# shared with blocks computed after it. Metal and CUDA 2: a prefill query reads its own
# completed channel group in float16 there too (kernels/paged_attention.metal, dense.py);
# 3: the merge pass adds its parts in 4 running sums (paged_attention_merge.metal), and a
# team loads 2 keys at once at decode (the same order, but compiled anew); 4: the query, key
# and value projections are one matmul (``mlx_adapter.use_joint_projections``), whose keys
# and values MLX's kernels may sum in another order than three matmuls', and format 2's keys
# are roped by the store kernel (``mlx_adapter.use_gpu_prologue``), not MLX's RoPE; 5:
# Qwen3's and Gemma 3's heads are RMS-normed by the store kernel too
# (``mlx_adapter.head_norms``).
BITS_VERSIONS = {"cpu": 1, "metal": 5, "cuda": 5}
BACKENDS = tuple(BITS_VERSIONS)


def bits_identity(backend: str) -> str:
    """What computed a block's bytes: a backend and its kernels' version."""
    return f"{backend}/{BITS_VERSIONS[backend]}"


def chain_seed(
    fingerprint: str, kv_format: str, salt: str | None = None, bits: str | None = None
) -> bytes:
    """The parent hash of an agent's first block. ``bits`` (``bits_identity``) None: the
    seed of agentkv before it named the arithmetic (read, never written)."""
    h = hashlib.sha256(DOMAIN)
    parts = (fingerprint, kv_format, salt or "") + (() if bits is None else (bits,))
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(4, "little") + data)
    return h.digest()


def private_seed(seed: bytes, nonce: str) -> bytes:
    """The seed of an agent whose bytes are its own (module docstring): ``seed``, the one its
    salt gives, made its own by ``nonce``."""
    return hashlib.sha256(PRIVATE_DOMAIN + seed + nonce.encode("ascii")).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def chain(seed: bytes, tokens: Sequence[int]) -> list[bytes]:
    """Hashes of every complete block of ``tokens``."""
    ids = np.asarray(tokens, dtype="<i4")
    out, parent = [], seed
    for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hashlib.sha256(parent + ids[start : start + BLOCK_TOKENS].tobytes()).digest()
        out.append(parent)
    return out
