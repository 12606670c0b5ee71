"""The pool's arenas: memory is committed as blocks fill and handed back when they are freed;
block copies are bit-exact; writes never move an arena's buffer."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
from helpers import TESTS, fill_table, synthetic_spec, table_arrays

from agentkv.format.quant import V1, KVQuant
from agentkv.pool import KVPool

RSS_SCRIPT = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import agentkv
import mlx.core as mx
from helpers import fill_table, synthetic_spec
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.format.quant import V1, KVQuant
from agentkv.pool import KVPool

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

spec = synthetic_spec(layers=8, heads=4, dim=128)
quant = KVQuant(**V1)
fill_table(KVPool(spec, quant, pool_bytes=64 << 20), 300)  # warm MLX up outside the measure
gc.collect()
out = {"block": spec.bytes_per_token(quant) * BLOCK_TOKENS, "before": rss()}
pool = KVPool(spec, quant, pool_bytes=2 << 30, release_slack_bytes=0)  # 2 GiB reserved
out["capacity"] = pool.capacity
out["created"] = rss()
tables = [fill_table(pool, 10 * BLOCK_TOKENS, seed=i) for i in range(4)]  # 40 blocks
out["filled"] = rss()
for table in tables:
    table.release()
out["cached"] = pool.blocks.cached_count
out["cached_resident"] = pool.resident_bytes()
out["dropped"] = pool.blocks.drop_cached()
gc.collect()
out["released"] = rss()
out["resident_after"] = pool.resident_bytes()
print(json.dumps(out))
"""


def test_resident_memory_follows_the_blocks_in_use_not_the_budget(python_env):
    """Measured in a fresh process, where nothing else moves the resident set."""
    child = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(TESTS)],
        env=python_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    m = json.loads(child.stdout)
    block = m["block"]  # 1.2 MiB
    assert m["capacity"] > 1500
    assert m["created"] - m["before"] < 16 << 20  # 2 GiB reserved, nothing committed
    assert m["filled"] - m["created"] > 30 * block  # committed as the 40 blocks filled
    # Their complete blocks stay cached (findable by hash) until needed, or dropped:
    assert m["cached"] == 40 and m["cached_resident"] == 40 * block and m["dropped"] == 40
    assert m["filled"] - m["released"] > 30 * block  # handed back to the OS
    assert m["resident_after"] == 0


def test_copying_the_first_rows_of_a_block_is_bit_exact():
    spec = synthetic_spec(layers=2, heads=3)
    pool = KVPool(
        spec, KVQuant(8, 4, **V1), pool_bytes=spec.bytes_per_token(KVQuant(8, 4, **V1)) * 256 * 8
    )
    table = fill_table(pool, 200)
    twin = pool.new_table(pool.seed())
    block = pool.blocks.allocate()
    pool.arena.copy_rows(table.blocks[0], block, 128)
    twin.blocks, twin.length = [block], 128
    for a, b in zip(table_arrays(pool, table, 128), table_arrays(pool, twin)):
        assert np.array_equal(a, b)


def test_writes_happen_in_place():
    spec = synthetic_spec(layers=2, heads=2)
    pool = KVPool(spec, KVQuant(**V1), pool_bytes=spec.bytes_per_token(KVQuant(**V1)) * 256 * 8)
    for i in range(3):
        fill_table(pool, 300, seed=i)
    assert pool.arena.copies == 0
    stray = pool.arena.arrays[0][0][:4]  # a view kept somewhere: the next write must copy
    mx.eval(stray)
    fill_table(pool, 10, seed=9)
    assert pool.arena.copies == 1  # and the copy is counted, not silent


def test_a_block_that_gave_back_its_sliding_rows_gets_them_again_when_sealed_anew():
    """Agent A has moved past a shared block's window (its sliding rows were handed back);
    agent W computes the same block again: sealing finds A's copy and restores its sliding
    rows from W's, so W attends over real rows; the full layers' rows stay A's."""
    spec = synthetic_spec(layers=2, heads=2, windows=[None, 128])
    pool = KVPool(spec, KVQuant(**V1), pool_bytes=spec.bytes_per_token(KVQuant(**V1)) * 256 * 8)
    a = fill_table(pool, 300, seed=1)
    first = a.blocks[0]
    a.release_window(1)  # block 0 left A's window: its sliding rows go back
    assert not pool.blocks.records[first].window_rows
    before = table_arrays(pool, a, 256)
    ids = pool.blocks.records[first].tokens
    alone = KVPool(spec, KVQuant(**V1), pool_bytes=spec.bytes_per_token(KVQuant(**V1)) * 256 * 8)
    computed = table_arrays(alone, fill_table(alone, 256, seed=2, ids=ids))  # W's own rows
    w = fill_table(pool, 256, seed=2, ids=ids)  # sealed once full: A's copy is kept
    assert w.blocks == [first] and pool.blocks.records[first].window_rows
    after = table_arrays(pool, w, 256)
    components = len(pool.arena.components[0])
    for i, (old, new, mine) in enumerate(zip(before, after, computed)):
        if i < components:  # layer 0 (full attention): A's rows, untouched
            assert np.array_equal(new, old)
        else:  # layer 1 (sliding): W's rows, restored into the kept block
            assert np.array_equal(new, mine)
    assert pool.arena.copies == 0
