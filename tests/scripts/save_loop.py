"""Save an agent again and again (synthetic KV, real store), up to 40 times.

State k holds n_k tokens whose text, ids and KV depend only on the token
positions, so any state found on disk can be checked for consistency. Prints
``saving k n`` before each save and ``saved k n`` after it; with
AGENTKV_CRASH_AT set, the process kills itself at that point of a save.
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
start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
for k in range(start + 1, start + 41):
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
    print("saving", k, n, flush=True)
    _, durable = store.write(job, durable)
    previous = n
    print("saved", k, n, flush=True)
