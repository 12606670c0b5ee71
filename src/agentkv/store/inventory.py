"""The KV store without a loaded model: list, show, verify and remove agents, and the shared
block files they name.

Used by ``agentkv cache ...``: every check ``AgentStore`` makes on load runs
here too (manifest record and arrays, segment headers parsed by the
safetensors library, every block's checksum), without loading any model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import _ext
from ..agent_id import validate_agent_id
from ..errors import CacheFormatError
from ..format.quant import native_layout
from .block_files import collect_block_files
from .format import (
    BLOCK_TOKENS,
    GROUPS,
    MANIFEST_NAME,
    Manifest,
    decode_manifest,
    file_layout,
    is_shared_file,
)


@dataclass(frozen=True)
class AgentEntry:
    model_dir: Path
    model_name: str
    agent_id: str
    manifest: Manifest | None
    problem: str | None
    disk_bytes: int

    @property
    def path(self) -> Path:
        return self.model_dir / "agents" / self.agent_id


def model_dirs(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(d for d in root.iterdir() if (d / "agents").is_dir())


def model_name(model_dir: Path) -> str:
    try:
        return json.loads((model_dir / "model.json").read_text())["model_name"]
    except (OSError, ValueError, KeyError):
        return "?"


def read_entry(model_dir: Path, agent_id: str) -> AgentEntry:
    directory = model_dir / "agents" / agent_id
    path = directory / MANIFEST_NAME
    manifest, problem = None, None
    try:
        manifest = decode_manifest(path.read_bytes(), path)
        if not manifest.model_fingerprint.startswith(model_dir.name):
            problem = "manifest's model fingerprint does not match its directory"
        elif manifest.agent_id != agent_id:
            problem = f"manifest belongs to agent {manifest.agent_id!r}"
    except OSError as exc:
        problem = f"cannot read {path}: {exc.strerror}"
    except CacheFormatError as exc:
        problem = exc.reason
    size = (
        sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
        if directory.exists()
        else 0
    )
    return AgentEntry(model_dir, model_name(model_dir), agent_id, manifest, problem, size)


def entries(root: Path, agent_id: str | None = None) -> list[AgentEntry]:
    if agent_id is not None:
        validate_agent_id(agent_id)
    out = []
    for model_dir in model_dirs(root):
        agents = model_dir / "agents"
        ids = [agent_id] if agent_id else sorted(p.name for p in agents.iterdir() if p.is_dir())
        out += [read_entry(model_dir, a) for a in ids if (agents / a).is_dir()]
    return out


def verify(entry: AgentEntry) -> str | None:
    """Deep check of one agent's files; None if sound, else what is wrong."""
    if entry.problem or entry.manifest is None:
        return entry.problem or "no manifest"
    from safetensors import SafetensorError, safe_open

    m = entry.manifest
    try:
        for name in m.segments:
            with safe_open(file_path(entry, name), framework="numpy") as f:
                f.keys()
    except (OSError, SafetensorError) as exc:
        return f"segment unreadable: {exc}"
    comps = m.components()
    names = sorted(m.segments)
    index = {n: i for i, n in enumerate(names)}
    segments = [
        (str(file_path(entry, n)), m.segments[n].size, m.segments[n].header_crc, file_layout(n))
        for n in names
    ]
    blocks = [(index[b.segment], b.offset, b.length, b.checksum, b.tokens) for b in m.blocks]
    layers = int(m.geometry["num_layers"])
    capacity = len(m.blocks) * BLOCK_TOKENS
    try:
        _ext.gather_blocks(
            layers,
            BLOCK_TOKENS,
            native_layout(comps),
            segments,
            blocks,
            m.token_count,
            [(0, capacity)] * layers,
        )
    except CacheFormatError as exc:
        return str(exc)
    return None


def file_path(entry: AgentEntry, name: str) -> Path:
    """A file the manifest names: a shared block file (model dir) or a segment (agent dir)."""
    return entry.model_dir / name if is_shared_file(name) else entry.path / name


def shared_blocks(entry: AgentEntry) -> int:
    """Blocks of the agent stored in shared block files (by chain hash)."""
    if entry.manifest is None:
        return 0
    return sum(1 for b in entry.manifest.blocks if is_shared_file(b.segment))


def block_files(model_dir: Path) -> tuple[int, int]:
    """(count, bytes) of the shared block files of one model."""
    sizes = _file_sizes((model_dir / "blocks").glob("*/*.safetensors"))
    return len(sizes), sum(sizes.values())


def old_block_files(model_dir: Path) -> int:
    """How many of the model's block files are of store version 2 (``agentkv cache
    migrate`` moves them to 3)."""
    return sum(
        1 for p in (model_dir / "blocks").glob("*/*.safetensors") if file_layout(p.name) != GROUPS
    )


@dataclass(frozen=True)
class Removal:
    """What ``remove`` deleted: the agent's own files, and the shared block files no agent
    named any more (those this agent alone named, and any an interrupted save left);
    ``blocks_kept``: the shared block files the agent named that stay, named by others."""

    agent_files: int
    agent_bytes: int
    block_files: int
    block_bytes: int
    blocks_kept: int

    @property
    def total_bytes(self) -> int:
        return self.agent_bytes + self.block_bytes


def remove(entry: AgentEntry) -> Removal:
    """Delete the agent's directory, then the shared block files no other agent names."""
    validate_agent_id(entry.agent_id)
    own = _file_sizes(entry.path.rglob("*"))
    blocks = _file_sizes((entry.model_dir / "blocks").glob("*/*"))
    named = _shared_files(entry)
    _ext.forget_mappings([str(p) for p in entry.path.iterdir()])
    shutil.rmtree(entry.path)
    collect_block_files(entry.model_dir)
    gone = {path: size for path, size in blocks.items() if not path.exists()}
    return Removal(
        agent_files=len(own),
        agent_bytes=sum(own.values()),
        block_files=len(gone),
        block_bytes=sum(gone.values()),
        blocks_kept=sum(1 for path in named if path in blocks and path not in gone),
    )


def _shared_files(entry: AgentEntry) -> set[Path]:
    blocks = entry.manifest.blocks if entry.manifest else ()
    return {entry.model_dir / b.segment for b in blocks if is_shared_file(b.segment)}


def _file_sizes(paths) -> dict[Path, int]:
    """Bytes of each regular file among ``paths`` (one that vanishes meanwhile is left out)."""
    sizes = {}
    for path in paths:
        try:
            if path.is_file():
                sizes[path] = path.stat().st_size
        except FileNotFoundError:
            continue
    return sizes
