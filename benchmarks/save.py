"""Save: what one turn writes on top of a long agent, and what it costs where.

An agent of ``tokens`` tokens (embedded model geometry, synthetic values) is
saved in full; then a turn adds ``turn`` tokens and is saved incrementally,
as the engine does: only the rewritten last partial block and the new
blocks, plus the manifest. ``pack_ms`` runs on the request thread (one copy of
the changed blocks); ``write_ms`` (write, fsync, atomic rename) runs on the
background writer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .common import emit, extend_table, progress, synthetic_table, timed


def run(tokens: int, turn: int, as_json: bool = False) -> list[dict]:
    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.format.quant import KVQuant
    from agentkv.model.load import load_model
    from agentkv.pool import KVPool
    from agentkv.store.agent_store import AgentStore, DurableState, build_save_job

    progress("save: loading the embedded model for its cache geometry...")
    spec = load_model().spec
    quant = KVQuant(4, 4, 64)
    per_token = spec.bytes_per_token(quant)
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-save-") as tmp:
        store = AgentStore(Path(tmp) / "kv", spec, "bench", quant)
        store.ensure_layout()
        total = tokens + turn
        pool = KVPool(
            spec, quant, pool_bytes=(total // BLOCK_TOKENS + 2) * BLOCK_TOKENS * per_token
        )
        ids = [int(t) for t in np.arange(total) % 1000 + 7]
        table = synthetic_table(pool, tokens, seed=1, ids=ids[:tokens])

        def job_for(n, keep):
            ends = np.arange(1, n + 1)
            return build_save_job(
                pool.arena,
                table,
                agent_id="save",
                keep=keep,
                tokens=ids[:n],
                spans=np.stack([ends - 1, ends], axis=1),
                text=b"x" * n,
                messages=None,
            )

        full_pack, job = timed(lambda: job_for(tokens, 0))
        full_write, (full, durable) = timed(lambda: store.write(job, DurableState()))
        extend_table(pool, table, ids[tokens:total], seed=2)
        keep = tokens // BLOCK_TOKENS  # the complete blocks already stored
        pack, job = timed(lambda: job_for(total, keep))
        write, (incremental, _) = timed(lambda: store.write(job, durable))
    rows = [
        {
            "save": f"full ({tokens} tokens)",
            "bytes_written": full.bytes_written,
            "blocks_written": full.blocks_written,
            "pack_ms": round(full_pack * 1000, 2),
            "write_ms": round(full_write * 1000, 2),
        },
        {
            "save": f"turn (+{turn} tokens)",
            "bytes_written": incremental.bytes_written,
            "blocks_written": incremental.blocks_written,
            "pack_ms": round(pack * 1000, 2),
            "write_ms": round(write * 1000, 2),
        },
    ]
    extra = {
        "block_bytes": per_token * BLOCK_TOKENS,
        "cache_bytes": per_token * total,
        "turn_bytes_in_blocks": round(incremental.bytes_written / (per_token * BLOCK_TOKENS), 2),
    }
    progress(
        f"save: a {turn}-token turn on {tokens} tokens wrote {incremental.bytes_written} bytes "
        f"({extra['turn_bytes_in_blocks']} blocks' worth) of a {extra['cache_bytes']}-byte cache"
    )
    emit("save", rows, as_json, extra)
    return rows
