"""``agentkv bench kvswap --json``: a swapped agent against the same KV in memory, side by
side, on both texts, and agents over the pool batched against reloading them."""

import json
import subprocess
import sys


def test_bench_kvswap_runs_every_part(python_env):
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "kvswap", "--context", "1400",
         "--decode", "6", "--budget", "512", "--rank", "16", "--agents", "3",
         "--agent-decode", "2", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert (result["bench"], result["context"], result["budget"]) == ("kvswap", 1400, 512)
    prose, prose_ahead, cold, cold_ahead, code, code_ahead, agents = result["rows"]
    for row in (prose, prose_ahead, code, code_ahead):
        assert row["arm"] in ("swap", "swap, reading ahead") and row["rank"] == 16
        assert row["ram_tps"] > 0 and row["swap_tps"] > 0
        assert row["ppl_ram"] > 1 and row["ppl_swap"] > 1
        assert 0 <= row["top1_pct"] <= 100
        # 1 staging block and the last block resident of 6 blocks
        assert row["resident_kv_mb"] < 0.5 * row["all_kv_mb"]
        assert row["read_kb_per_token"] > 0 and 0 <= row["hit_pct"] <= 100
    for plain, ahead in ((prose, prose_ahead), (code, code_ahead)):
        # reading ahead never changes what is chosen: the same tokens, the same quality
        assert plain["ppl_swap"] == ahead["ppl_swap"] and plain["top1_pct"] == ahead["top1_pct"]
        assert plain["read_ahead_pct"] == 0 and plain["read_hidden_pct"] in (0, None)
    assert cold["arm"] == "swap, cold page cache" and cold["steps"] > 0
    assert cold["read_kb_per_token"] > 0  # every step's misses read from disk
    assert cold_ahead["arm"] == "swap, reading ahead, cold page cache"
    # Steps read ahead only after reads went to disk, in every arm that may; in the cold arm
    # (the files dropped from the page cache before every step) they do once reads went to
    # disk. Whether a read went to disk is RWF_NOWAIT's answer (storage that serves a dropped
    # page within the call counts as the page cache), so each arm is held to what it counted.
    for ahead in (prose_ahead, code_ahead, cold_ahead):
        assert ahead["disk_reads_per_token"] > 0 or ahead["read_ahead_pct"] == 0, ahead
    assert (cold_ahead["read_ahead_pct"] > 0) == (cold_ahead["disk_reads_per_token"] > 0)
    assert agents["swap_tps"] > 0 and agents["ram_tps"] > 0
    assert agents["whole_agent_evictions"] == 0
