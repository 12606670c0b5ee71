"""Store version 3: block files move from planes to groups (``agentkv cache migrate``).

Store version 3 lays a block file's region out in groups (``csrc/core/block_io.h``): per
layer, one extent per 64-token group, which KVSwap reads with one ``pread``
(docs/kvswap.md). Version-2 block files (planes) stay readable and shareable as they are;
``migrate`` moves a store's agents to version-3 block files, crash-safe:

1. per agent, under the block files' lock (shared) and then its own lock (exclusive), the
   order a save takes them in: for each block its manifest names in a version-2 block
   file, the old file's bytes once they match the checksum the manifest records (a
   damaged old file is quarantined and the agent left as it was), laid out in groups, and
   the version-3 file holding those very bytes, found or written (``SharedBlocks.ensure``:
   a file of the same hash holding other bytes is not taken);
2. the manifest is switched (written, fsynced, renamed) to name the new files;
3. after every agent, the block files no manifest names (the old ones) are collected.

A crash anywhere leaves each agent its old manifest or its new one, each naming files that
exist; a file a killed run wrote is reused by the next run, or collected. Run it while no
server uses the cache directory: a server that later saves a migrated agent it holds finds
its manifest changed and refuses to overwrite it until it reloads the agent.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import _ext
from .._faults import crash_point
from ..errors import CacheFormatError
from ..format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from ..paths import atomic_write_bytes
from .agent_store import agent_lock
from .block_files import SharedBlocks, blocks_writing, collect_block_files
from .format import (
    GROUPS,
    MANIFEST_NAME,
    PLANES,
    STORE_VERSION,
    Manifest,
    ManifestBlock,
    SegmentRecord,
    block_file_name,
    block_file_version,
    decode_manifest,
    encode_manifest,
    is_shared_file,
)
from .inventory import model_dirs

log = logging.getLogger("agentkv.store")


@dataclass
class Migration:
    """What ``migrate`` did."""

    agents: int = 0  # agents whose manifests now name version-3 block files only
    switched: int = 0  # of them, those whose manifest this run switched
    written: int = 0  # version-3 block files written
    reused: int = 0  # version-3 block files found by hash (another agent's, or a killed run's)
    collected: int = 0  # block files no manifest names any more, deleted
    problems: list[str] = field(default_factory=list)  # agents left as they were, and why


def migrate(root: Path, *, progress: Callable[[str], None] | None = None) -> Migration:
    """Move every agent under the cache directory ``root`` to store-version-3 block files."""
    report = Migration()
    for model_dir in model_dirs(Path(root)):
        for agent_dir in sorted(p for p in (model_dir / "agents").iterdir() if p.is_dir()):
            if not (agent_dir / MANIFEST_NAME).exists():
                continue  # nothing stored (yet, or any more)
            try:
                switched = rewrite_agent(model_dir, agent_dir.name, STORE_VERSION, report)
            except FileNotFoundError:
                continue  # deleted meanwhile
            except (OSError, CacheFormatError, ValueError) as exc:
                report.problems.append(f"{model_dir.name}/{agent_dir.name}: {exc}")
                continue
            report.agents += 1
            report.switched += switched
            if progress is not None and switched:
                progress(f"migrated {model_dir.name}/{agent_dir.name}")
        try:
            report.collected += collect_block_files(model_dir)
        except OSError as exc:
            report.problems.append(f"{model_dir.name}: old block files not collected: {exc}")
    return report


def rewrite_agent(model_dir: Path, agent_id: str, version: int, report: Migration) -> bool:
    """Switch one agent's manifest to name block files of store ``version`` only (3; 2 turns
    a store back into what version 2 wrote, for tests); False if it named no other."""
    agent_dir = model_dir / "agents" / agent_id
    path = agent_dir / MANIFEST_NAME
    # The block files' lock first, then the agent's: the order a save takes them in.
    with blocks_writing(model_dir), agent_lock(agent_dir, exclusive=True, create=False):
        manifest = decode_manifest(path.read_bytes(), path)
        if manifest.agent_id != agent_id:
            raise CacheFormatError(path, f"manifest belongs to agent {manifest.agent_id!r}")
        moving = [
            b
            for b in manifest.blocks
            if is_shared_file(b.segment) and block_file_version(b.segment) != version
        ]
        if not moving:
            return False
        shared = SharedBlocks.of_manifest(model_dir, manifest)
        moved = {id(b): _block_file(shared, manifest, b, version, report) for b in moving}
        blocks = [b if id(b) not in moved else _named(b, moved[id(b)]) for b in manifest.blocks]
        segments = dict(manifest.segments)
        segments.update({s.name: SegmentRecord(s.size, s.header_crc) for s in moved.values()})
        used = {b.segment for b in blocks}
        segments = {name: r for name, r in segments.items() if name in used}
        shared.sync_dirs([s.name for s in moved.values()])
        remote = manifest.remote and manifest.remote.successor()  # new bytes: not the store's
        switched = dataclasses.replace(manifest, blocks=blocks, segments=segments, remote=remote)
        atomic_write_bytes(path, encode_manifest(switched), label="manifest")
        crash_point("manifest-migrated")
    return True


def _named(block: ManifestBlock, stored) -> ManifestBlock:
    return ManifestBlock(
        stored.name, stored.offset, stored.length, stored.checksum, block.tokens, block.hash
    )


def _block_file(shared: SharedBlocks, manifest: Manifest, block: ManifestBlock, version, report):
    """The block file of store ``version`` holding ``block``'s bytes (the file the manifest
    names, checked against the manifest's checksum, laid out again): found (``ensure``: a
    file of the hash holding other bytes is not taken), or written."""
    if block.hash is None or block.tokens != BLOCK_TOKENS:
        raise CacheFormatError(shared.path(block.segment), "a block file holds a complete block")
    digest = bytes.fromhex(block.hash)
    source = shared.find_file(block.segment, digest)  # its header, token ids and parent
    path = shared.path(block.segment)
    if source is None:
        raise CacheFormatError(path, "block file is missing or damaged")
    with open(path, "rb") as fh:
        fh.seek(block.offset)
        region = np.frombuffer(fh.read(block.length), dtype=np.uint8)
    if len(region) != block.length or _ext.block_checksum(region) != block.checksum:
        raise CacheFormatError(path, "block region does not match its checksum")
    layout = GROUPS if version >= 3 else PLANES
    converted = regroup(region, shared.components, BLOCK_TOKENS, layout)
    checksum = _ext.block_checksum(converted)
    there = {
        name
        for name in (block_file_name(digest, version, v) for v in (None, checksum))
        if shared.path(name).exists()
    }
    stored = shared.ensure(
        digest, source.parent, source.tokens, converted, checksum, version=version
    )
    if stored.name in there:
        report.reused += 1
    else:
        report.written += 1
    return stored


def regroup(region: np.ndarray, components, tokens: int, layout: int) -> np.ndarray:
    """One block region's bytes laid out again: from planes to groups (``layout`` GROUPS)
    or from groups to planes (PLANES); see ``csrc/core/block_io.h``."""
    region = np.asarray(region, dtype=np.uint8)
    out = np.empty_like(region)
    src_groups = layout == PLANES
    at = 0
    for comps in components:
        size = tokens * sum(c.heads * c.row_bytes for c in comps)
        planes_buf, groups_buf = (
            (out[at : at + size], region[at : at + size])
            if src_groups
            else (region[at : at + size], out[at : at + size])
        )
        planes, position = [], 0
        for c in comps:
            n = c.heads * tokens * c.row_bytes
            planes.append(planes_buf[position : position + n].reshape(c.heads, tokens, -1))
            position += n
        position = 0
        for first in range(0, tokens, GROUP_TOKENS):
            rows = min(GROUP_TOKENS, tokens - first)
            for c, plane in zip(comps, planes):
                n = c.heads * rows * c.row_bytes
                piece = groups_buf[position : position + n].reshape(c.heads, rows, -1)
                if src_groups:
                    plane[:, first : first + rows] = piece
                else:
                    piece[...] = plane[:, first : first + rows]
                position += n
        at += size
    return out
