"""Save an agent again and again (synthetic KV in a real pool, real store), up to 40 times.

State k holds n_k tokens whose text, ids and KV depend only on the token positions, so any
state found on disk can be checked for consistency; its complete blocks go to shared block
files (the same positions give the same blocks, so later saves reuse earlier files and add
new ones as n grows). Prints ``saving k n`` before each save and ``saved k n`` after it;
with AGENTKV_CRASH_AT set, the process kills itself at that point of a save.
"""

import sys

import agentkv  # noqa: F401
from agentkv.store.agent_store import AgentStore, build_save_job

sys.path.insert(0, sys.argv[2])
from helpers import fill_table, pool_for, synthetic_spec, text_for_count  # noqa: E402

store = AgentStore(sys.argv[1], synthetic_spec(), "synthetic")
store.ensure_layout()
manifest, durable = store.read_manifest("crash")
start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
for k in range(start + 1, start + 41):
    n = 100 + (53 * k) % 1200
    ids, spans, text = text_for_count(n)
    pool = pool_for(store.spec, blocks=8)
    table = fill_table(pool, n, positional=True, ids=ids)
    hashes = [pool.blocks.records[b].hash for b in table.blocks]
    keep = 0
    for record, digest in zip(durable.blocks, hashes):
        if record.hash is None or digest is None or bytes.fromhex(record.hash) != digest:
            break
        keep += 1
    job = build_save_job(
        pool.arena,
        table,
        agent_id="crash",
        keep=keep,
        tokens=ids,
        spans=spans,
        text=text,
        messages=None,
    )
    print("saving", k, n, flush=True)
    _, durable = store.write(job, durable)
    print("saved", k, n, flush=True)
