"""``agentkv bench fleet --json`` at a small size: two real ``agentkv serve`` processes on a
local S3-compatible server (moto), every part run and checked by its own figures."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two servers started three times: about a minute on 2 cores


def test_bench_fleet_moves_races_and_survives_an_outage(python_env):
    pytest.importorskip("moto.server", reason="bench fleet's local store is moto[server]")
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "bench", "fleet", "--agents", "2",
         "--context", "600", "--race-agents", "2", "--race-turns", "8", "--json"],
        env=python_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    handoff, moved, race, outage = (result[k] for k in ("handoff", "bytes", "race", "outage"))
    assert handoff["all_warm_from_store"] and handoff["all_reused_in_full"]
    for row in result["rows"]:
        assert row["store_cache"] == row["disk_cache"] == "warm"
        assert row["store_reused"] == row["store_stored"] > 512
    assert moved["a_ratio"] <= 1.2 and moved["b_ratio"] <= 1.2 and moved["b_fetched"] > 0
    assert race["accepted"] + race["refused_409"] == 8 and race["other_errors"] == 0
    assert race["accepted"] >= 2 and race["agents_with_history_not_a_serial_order"] == 0
    assert outage["http_5xx"] == outage["other_errors"] == 0
    assert outage["turns_noted"] == 2 and outage["pending_uploads_after"] == 0
    assert result["verify"]["pulled"] == 2 and result["verify"]["verify_exit"] == 0
