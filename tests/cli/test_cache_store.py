"""``agentkv cache push / pull / ls --store``, as a real subprocess, against a real
S3-compatible server (moto on 127.0.0.1): agents saved on one machine's cache directory
move through the store to another's, byte for byte, and a copy that would lose turns is
refused."""

import json
import os
import subprocess
import sys

from helpers import fill_table, pool_for, synthetic_spec, text_for

from agentkv.store.agent_store import AgentStore, build_save_job
from agentkv.store.format import MANIFEST_NAME


def run(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", "cache", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def save_agents(root, **tokens):
    store = AgentStore(root, synthetic_spec(), "synthetic")
    store.ensure_layout()
    pool = pool_for(store.spec)
    for i, (agent, n) in enumerate(tokens.items()):
        ids, spans, text = text_for(n, seed=i)
        table = fill_table(pool, n, seed=i)
        job = build_save_job(
            pool.arena, table, agent_id=agent, keep=0, tokens=table.token_ids()[:n],
            spans=spans, text=text, messages=None,
        )  # fmt: skip
        store.write(job, store.read_manifest(agent)[1])  # a new turn on top of what is there
    return store


def test_push_ls_pull_move_agents_between_cache_dirs(tmp_path, s3_store, python_env):
    env = dict(python_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    a = save_agents(tmp_path / "a", planner=700, coder=300)
    pushed = run("--cache-dir", str(tmp_path / "a"), "push", "--store", s3_store, "--json", env=env)
    assert pushed.returncode == 0, pushed.stderr
    records = {r["agent"]: r for r in json.loads(pushed.stdout)}
    assert {r["outcome"] for r in records.values()} == {"moved"}
    again = run("--cache-dir", str(tmp_path / "a"), "push", "--store", s3_store, env=env)
    assert again.returncode == 0 and again.stdout.count("up to date") == 2
    listed = run("ls", "--store", s3_store, "--json", env=env)
    assert {(r["agent"], r["version"]) for r in json.loads(listed.stdout)} == {
        (name, r["version"]) for name, r in records.items()
    }
    pulled = run(
        "--cache-dir", str(tmp_path / "b"), "pull", "planner", "--store", s3_store, env=env
    )
    assert pulled.returncode == 0, pulled.stderr
    assert f"pulled planner from {s3_store}" in pulled.stdout
    b_dir = tmp_path / "b" / a.model_dir.name
    assert (b_dir / "agents" / "planner" / MANIFEST_NAME).read_bytes() == (
        a.agent_dir("planner") / MANIFEST_NAME
    ).read_bytes()
    assert not (b_dir / "agents" / "coder").exists()
    verified = run("--cache-dir", str(tmp_path / "b"), "verify", env=env)
    assert verified.returncode == 0 and "1 agents checked, 0 bad" in verified.stdout
    # b's copy gains a turn the store lacks; a's copy is pushed over the version b came from
    save_agents(tmp_path / "b", planner=900)  # a new local state of planner on b
    refused = run(
        "--cache-dir", str(tmp_path / "b"), "pull", "planner", "--store", s3_store, env=env
    )
    assert refused.returncode == 1 and "turns the store" in refused.stderr
    missing = run(
        "--cache-dir", str(tmp_path / "b"), "pull", "nobody", "--store", s3_store, env=env
    )
    assert missing.returncode == 1 and "no such agent" in missing.stderr


def test_a_bad_store_url_is_a_clear_error(tmp_path, python_env):
    out = run("ls", "--store", str(tmp_path), env=python_env)
    assert out.returncode == 2 and "s3://bucket/prefix" in out.stderr


def test_a_push_or_pull_killed_part_way_leaves_no_manifest_naming_a_missing_file(
    tmp_path, s3_store, python_env
):
    env = dict(python_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    a = save_agents(tmp_path / "a", planner=700)
    push = ("--cache-dir", str(tmp_path / "a"), "push", "--store", s3_store)
    killed = run(*push, env={**env, "AGENTKV_CRASH_AT": "store-file-uploaded:2"})
    assert killed.returncode == -9  # SIGKILL after two of its files went up
    listed = run("ls", "--store", s3_store, "--json", env=env)
    assert json.loads(listed.stdout) == []  # files, but no manifest naming them
    assert run(*push, env=env).returncode == 0
    pull = ("--cache-dir", str(tmp_path / "b"), "pull", "--store", s3_store)
    killed = run(*pull, env={**env, "AGENTKV_CRASH_AT": "fetched-files-installed:1"})
    assert killed.returncode == -9  # block files and segment written, the manifest not yet
    b_agent = tmp_path / "b" / a.model_dir.name / "agents" / "planner"
    assert not (b_agent / MANIFEST_NAME).exists()
    assert run(*pull, env=env).returncode == 0
    assert (b_agent / MANIFEST_NAME).read_bytes() == (
        a.agent_dir("planner") / MANIFEST_NAME
    ).read_bytes()
    verified = run("--cache-dir", str(tmp_path / "b"), "verify", env=env)
    assert verified.returncode == 0 and "1 agents checked, 0 bad" in verified.stdout
