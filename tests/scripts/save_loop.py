"""Save an agent over and over (synthetic KV, real store) until killed.

State k holds n_k tokens whose text, ids and KV depend only on the token
positions, so any state found on disk can be checked for consistency.
"""

import sys

import agentkv  # noqa: F401
from agentkv.store.agent_store import AgentStore, build_save_job

sys.path.insert(0, sys.argv[2])
from helpers import positional_caches, synthetic_spec, text_for_count  # noqa: E402

store = AgentStore(sys.argv[1], synthetic_spec(), "synthetic")
store.ensure_layout()
manifest, durable = store.read_manifest("crash")
previous = manifest.token_count if manifest else 0
k = 0
while True:
    k += 1
    n = 100 + (53 * k) % 1200
    ids, spans, text = text_for_count(n)
    first_block = previous // 256 if n >= previous else 0
    job = build_save_job(
        store.spec,
        "crash",
        positional_caches(store.spec, n),
        tokens=ids,
        spans=spans,
        text=text,
        messages=None,
        first_block=first_block,
    )
    _, durable = store.write(job, durable)
    previous = n
    print(k, n, flush=True)
