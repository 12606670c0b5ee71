"""Chained block hashes: one hash names a block and certifies every token before it.

``seed = sha256("agentkv/block/v1" | model fingerprint | KV format | tenant salt)``
``hash(block i) = sha256(hash(block i-1) | its 256 token ids as int32 little-endian)``,
with ``hash(block -1) = seed``. The same tokens under the same model, KV format and salt
always give the same hash (in any process, on any machine), so hashes name shared
blocks in memory and on disk. Never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..format.geometry import BLOCK_TOKENS

DOMAIN = b"agentkv/block/v1"


def chain_seed(fingerprint: str, kv_format: str, salt: str | None = None) -> bytes:
    """The parent hash of an agent's first block."""
    h = hashlib.sha256(DOMAIN)
    for part in (fingerprint, kv_format, salt or ""):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(4, "little") + data)
    return h.digest()


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
