"""Rankings of a synthetic KVSwapSet (random low-rank keys and queries), printed as JSON:
tests/pool/test_kvswap.py runs this on each scoring path (AGENTKV_CPU=portable or not) and
compares. argv[1]: a scratch directory."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from agentkv import _ext

scratch = Path(sys.argv[1])
dummy = scratch / "block.bin"
dummy.write_bytes(b"\0" * 4096)
rng = np.random.default_rng(11)
out = []
for q_heads, kv_heads, rank in ((9, 3, 32), (16, 2, 16), (6, 3, 64)):
    blocks, layers, dim = 5, 2, 64
    swapset = _ext.KVSwapSet(
        layers, kv_heads, q_heads, dim, 256, 64, rank, 4, 3, dim**-0.5,
        [str(dummy)] * blocks, [0] * (blocks * layers), [32] * layers, 1,
        [0] * (blocks * layers * 4),
    )  # fmt: skip
    for layer in range(layers):
        projection = rng.normal(0, 1, (kv_heads, dim, rank)).astype(np.float32)
        keys = rng.integers(-127, 128, (blocks, kv_heads, rank, 256)).astype(np.int8)
        scales = rng.uniform(0.01, 0.1, (blocks, kv_heads, 4)).astype(np.float32)
        swapset.set_layer(layer, mx.array(projection), mx.array(keys), mx.array(scales))
        for _ in range(8):
            q = rng.normal(0, 1, (q_heads, dim)).astype(np.float32)
            out.append(swapset.ranked(layer, mx.array(q)))
print(json.dumps(out))
