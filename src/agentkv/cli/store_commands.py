"""``agentkv cache push / pull / ls / gc --store s3://bucket/prefix``: agents moved between a
machine's cache directory and a fleet's object store by hand, and the store's unnamed files
collected (docs/fleet.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import AgentKVError
from ..store import inventory
from ..store.objects import ObjectStore
from ..store.remote import Moved, RemoteAgents, Transfer, collect, stored_models
from .output import human_bytes, table


def run_store_action(args, root: Path) -> int:
    objects = ObjectStore(args.store)
    action = {"push": _push, "pull": _pull, "ls": _ls, "gc": _gc}[args.cache_command]
    return action(args, root, objects)


def _ls(args, root: Path, objects: ObjectStore) -> int:
    del root
    rows = []
    for model in stored_models(objects):
        remote = RemoteAgents(objects, Path(model), threads=1)
        try:
            for agent_id in remote.agent_ids():
                head = remote.head(agent_id)
                if head is not None:
                    rows.append({"agent": agent_id, "fingerprint": model, "version": head.version})
        finally:
            remote.close()
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no agents in {objects.url}")
    else:
        table(["AGENT", "FINGERPRINT", "VERSION"], [list(r.values()) for r in rows])
    return 0


def _gc(args, root: Path, objects: ObjectStore) -> int:
    del root
    done = collect(objects, min_age_s=args.min_age * 60.0, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({
            "deleted": done.deleted, "bytes": done.nbytes, "dry_run": args.dry_run,
            "kept_young": done.kept_young, "named": done.named, "unreadable": done.unreadable,
        }, indent=2))  # fmt: skip
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for key in done.deleted:
        print(f"{verb} {objects.url}/{key}")
    for key in done.unreadable:
        print(f"kept the files of {key}'s agent: the manifest failed its checks", file=sys.stderr)
    print(
        f"{verb} {len(done.deleted)} files ({human_bytes(done.nbytes)}); kept {done.named} "
        f"named by a manifest and {done.kept_young} younger than {args.min_age} minutes"
    )
    return 0


def _push(args, root: Path, objects: ObjectStore) -> int:
    wanted = set(args.agents)
    jobs: dict[Path, list[str]] = {}
    for e in inventory.entries(root):
        if not wanted or e.agent_id in wanted:
            jobs.setdefault(e.model_dir, []).append(e.agent_id)
    missing = wanted - {a for ids in jobs.values() for a in ids}
    return _move(args, objects, jobs, missing, "push")


def _pull(args, root: Path, objects: ObjectStore) -> int:
    wanted = set(args.agents)
    jobs: dict[Path, list[str]] = {}
    for model in stored_models(objects):
        remote = RemoteAgents(objects, root / model, threads=1)
        try:
            ids = remote.agent_ids()
        finally:
            remote.close()
        jobs[root / model] = [a for a in ids if not wanted or a in wanted]
    missing = wanted - {a for ids in jobs.values() for a in ids}
    return _move(args, objects, jobs, missing, "pull")


def _move(args, objects, jobs: dict[Path, list[str]], missing: set[str], verb: str) -> int:
    """Push or pull each agent of ``jobs``; one line (or JSON record) each. Exit 1 if any
    was refused, damaged or absent."""
    results, failed = [], len(missing)
    for agent_id in sorted(missing):
        results.append({"agent": agent_id, "outcome": "not found", "error": None})
        where = "under the cache directory" if verb == "push" else f"in {objects.url}"
        _say(args, f"{agent_id}: no such agent {where}", err=True)
    for model_dir, ids in jobs.items():
        remote = RemoteAgents(objects, model_dir)
        try:
            for agent_id in ids:
                try:
                    done: Transfer = getattr(remote, verb)(agent_id, force=args.force)
                except AgentKVError as exc:
                    failed += 1
                    results.append({"agent": agent_id, "outcome": "refused", "error": str(exc)})
                    _say(args, f"{agent_id}: {exc}", err=True)
                    continue
                results.append(_record(done))
                _say(args, _line(done, verb, objects))
        finally:
            remote.close()
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if failed else 0


def _record(done: Transfer) -> dict:
    return {
        "agent": done.agent_id,
        "outcome": done.moved.name.lower(),
        "version": done.version,
        "bytes": done.nbytes,
        "error": None,
    }


def _line(done: Transfer, verb: str, objects: ObjectStore) -> str:
    if done.moved is Moved.SAME:
        return f"{done.agent_id}: up to date (version {done.version})"
    if done.moved is Moved.ABSENT:
        return f"{done.agent_id}: nothing to {verb}"
    where = f"to {objects.url}" if verb == "push" else f"from {objects.url}"
    return f"{verb}ed {done.agent_id} {where}: {human_bytes(done.nbytes)}, version {done.version}"


def _say(args, text: str, *, err: bool = False) -> None:
    if err or not args.json:
        print(text, file=sys.stderr if err else sys.stdout)
