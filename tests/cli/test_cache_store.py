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


def test_gc_deletes_only_old_files_no_manifest_names(tmp_path, s3_store, python_env):
    """``agentkv cache gc --store``: a killed upload's block file, the segment a later turn
    replaced and a deleted agent's segments go once older than the min age; every file a
    manifest names, the manifests, the model record and keys that are not agentkv's stay, and
    the agent left reads back whole. A manifest that fails its checks keeps its agent's files
    and every block file."""
    import time

    from agentkv.store.objects import ObjectStore
    from agentkv.store.remote import collect

    env = dict(python_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    push = ("--cache-dir", str(tmp_path / "a"), "push", "--store", s3_store)
    a = save_agents(tmp_path / "a", planner=700, coder=300)
    assert run(*push, env=env).returncode == 0
    objects = ObjectStore(s3_store)
    model = a.model_dir.name
    first = set(objects.keys(f"{model}/"))
    save_agents(tmp_path / "a", planner=900)  # a later turn: planner's segment replaced
    assert run(*push, env=env).returncode == 0
    objects.delete(f"{model}/agents/coder/{MANIFEST_NAME}")  # coder deleted from the store
    killed = f"{model}/blocks/ab/{'ab' * 32}.v3.safetensors"  # a killed upload's file
    objects.put(killed, b"partial")
    objects.put(f"{model}/notes.txt", b"not agentkv's")
    before = set(objects.keys(f"{model}/"))
    dry = run("gc", "--store", s3_store, "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["deleted"] == [] and report["kept_young"] >= 3 and report["named"] > 0
    assert set(objects.keys(f"{model}/")) == before  # min age 60 minutes: all young
    done = collect(objects, min_age_s=3600, now=time.time() + 7200)
    gone = set(done.deleted)
    assert killed in gone and f"{model}/notes.txt" not in gone
    assert any(k.startswith(f"{model}/agents/coder/seg-") for k in gone)
    replaced = {k for k in first - set(objects.keys(f"{model}/")) if "/planner/seg-" in k}
    assert replaced and replaced <= gone  # the segment planner's later turn replaced
    left = set(objects.keys(f"{model}/"))
    assert f"{model}/agents/planner/{MANIFEST_NAME}" in left and f"{model}/model.json" in left
    assert not any(k.startswith(f"{model}/agents/coder/") for k in left)
    pulled = run("--cache-dir", str(tmp_path / "b"), "pull", "planner", "--store", s3_store,
                 env=env)  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    verified = run("--cache-dir", str(tmp_path / "b"), "verify", env=env)
    assert verified.returncode == 0 and "1 agents checked, 0 bad" in verified.stdout
    # a manifest that fails its checks: its agent's files and every block file stay
    objects.put(f"{model}/agents/planner/{MANIFEST_NAME}", b"not a manifest")
    objects.put(killed, b"partial")
    kept = collect(objects, min_age_s=3600, now=time.time() + 7200)
    assert kept.unreadable == [f"{model}/agents/planner/{MANIFEST_NAME}"]
    assert kept.deleted == [] and killed in objects.keys(f"{model}/")
