"""AgentStore: one model's agents on disk — read, load into the pool, save, quarantine.

Identity is ``(model fingerprint, agent id)``: each fingerprint has its own
directory, so another model's caches are never even opened. Files are 0600,
directories 0700. Readers take a shared flock(2) on the agent's ``.lock``,
the writer an exclusive one, so a reader never sees segments vanish under it.
Complete blocks go to ``SharedBlocks`` (one file per chain hash, for every agent);
an agent's directory holds its manifest and a segment with its partial tail block.
A file that fails any check is never deleted or overwritten: the agent's whole
directory (or the one bad block file) is moved into ``quarantine/``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import _ext
from .._faults import crash_point
from ..agent_id import validate_agent_id
from ..errors import CacheFormatError, InvalidRequestError
from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant, native_layout
from ..format.spec import LayerKind, ModelCacheSpec
from ..kv.cache import AgentKVCache, window_start
from ..paths import FILE_MODE, atomic_write_bytes, atomic_write_text, fsync_dir, secure_mkdir
from .block_files import SharedBlocks
from .format import (
    GROUPS,
    MANIFEST_NAME,
    PLANES,
    SEGMENT_RE,
    Manifest,
    ManifestBlock,
    RemoteRecord,
    SegmentRecord,
    block_file_name,
    decode_manifest,
    encode_manifest,
    encode_segment_header,
    file_layout,
    is_shared_file,
    segment_name,
)

log = logging.getLogger("agentkv.store")

LOAD_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_MANIFEST_BYTES = 1 << 30
Signature = tuple[int, int, int] | None  # (inode, size, mtime_ns) of a manifest, None if absent


@contextmanager
def agent_lock(directory: Path, *, exclusive: bool, create: bool = True):
    """flock(2) on an agent directory's ``.lock``: exclusive for a save (or a migration),
    shared for a read; a read of an agent that does not exist takes none. ``create=False``:
    FileNotFoundError if the directory is gone (a migration never makes an agent)."""
    if exclusive and create:
        secure_mkdir(directory)
    elif not directory.exists():
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class StoreConflictError(Exception):
    """The agent's manifest changed on disk since this process last read or wrote it."""


class NewRegion(NamedTuple):
    """One block packed for a save: a region of ``SaveJob.packed``; or (``offset`` -1, no
    bytes) a block KVSwap evicted, which is a block file already (``file``, its region's
    ``checksum``) and must still be one."""

    offset: int
    length: int
    checksum: int
    tokens: int
    hash: bytes | None  # complete, sealed blocks go to shared block files
    parent: bytes | None
    ids: np.ndarray | None  # int32 [256] token ids of a hashed block
    layout: int = PLANES  # of its bytes: GROUPS for a block file, PLANES for a segment
    file: str | None = None  # the path of an evicted block's file


@dataclass
class SaveJob:
    """A finished turn to persist: the blocks after the first ``keep`` durable ones (as
    packed regions) plus the agent's whole text record."""

    agent_id: str
    keep: int  # blocks of the durable manifest that stay as they are
    packed: np.ndarray  # uint8, the regions of the new blocks back to back
    regions: list[NewRegion]
    quant: KVQuant
    chain_seed: bytes
    tokens: np.ndarray
    spans: np.ndarray
    text: bytes
    messages: list | None
    # The hex chain hashes the engine believes the first ``keep`` durable blocks have: a save
    # queued behind one that failed must not build on blocks that were never replaced.
    kept_hashes: tuple[str | None, ...] = ()
    tail: np.ndarray | None = None  # KV format 2: the keys of the channel group still filling
    prev: np.ndarray | None = None  # and those of the last completed one, where still held
    # The block files' lock a KVSwap agent took when it wrote block files no manifest names
    # yet (``SharedBlocks.hold``): the writer releases it once this job is done.
    hold: object | None = None
    nonce: str | None = None  # the agent's bytes are its own (``Manifest.nonce``)

    @property
    def nbytes(self) -> int:
        keys = sum(0 if a is None else a.nbytes for a in (self.tail, self.prev))
        return int(
            self.packed.nbytes + self.tokens.nbytes + self.spans.nbytes + len(self.text) + keys
        )


class BlockSource(NamedTuple):
    """Where one stored block of an agent is, ready for ``KVArena.read_regions``."""

    hash: bytes | None
    path: str
    size: int
    header_crc: int
    offset: int
    length: int
    checksum: int
    tokens: int


@dataclass
class WrittenPart:
    """What one step of a save wrote: the manifest entries naming it, and the bytes it
    added on disk (a block file already stored adds none)."""

    blocks: list[ManifestBlock]
    segments: dict[str, SegmentRecord]
    bytes_written: int


@dataclass
class DurableState:
    """What the store knows is on disk for one agent."""

    signature: Signature = None
    generation: int = 0
    blocks: list[ManifestBlock] = field(default_factory=list)
    segments: dict[str, SegmentRecord] = field(default_factory=dict)
    # where the agent stands with a fleet's object store (docs/fleet.md); None: never in one
    remote: RemoteRecord | None = None


@dataclass(frozen=True)
class SaveReport:
    agent_id: str
    generation: int
    bytes_written: int
    blocks_written: int
    seconds: float


class AgentStore:
    def __init__(
        self, root: Path, spec: ModelCacheSpec, model_name: str, quant: KVQuant | None = None
    ):
        self.root = Path(root)
        self.spec = spec
        self.model_name = model_name
        self.quant = quant or KVQuant()
        self.model_dir = self.root / spec.fingerprint[:16]
        self.agents_dir = self.model_dir / "agents"
        self.quarantine_dir = self.model_dir / "quarantine"
        self.shared = SharedBlocks(self.model_dir, spec, self.quant)
        # give every save a version record (docs/fleet.md): set where a fleet's store is used
        self.track_versions = False

    def ensure_layout(self) -> None:
        secure_mkdir(self.agents_dir)
        info = self.model_dir / "model.json"
        if not info.exists():
            record = {
                "fingerprint": self.spec.fingerprint,
                "model_name": self.model_name,
                "spec": self.spec.to_dict(),
            }
            atomic_write_text(info, json.dumps(record, indent=2))

    def agent_dir(self, agent_id: str) -> Path:
        return self.agents_dir / validate_agent_id(agent_id)

    def manifest_path(self, agent_id: str) -> Path:
        return self.agent_dir(agent_id) / MANIFEST_NAME

    def _locked(self, agent_id: str, *, exclusive: bool):
        return agent_lock(self.agent_dir(agent_id), exclusive=exclusive)

    @staticmethod
    def _signature(path: Path) -> Signature:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    # -- reading ----------------------------------------------------------------

    def read_manifest(self, agent_id: str) -> tuple[Manifest | None, DurableState]:
        """The agent's manifest (None if it has none) and the durable state it describes.

        Raises CacheFormatError if the manifest exists but fails any check.
        """
        path = self.manifest_path(agent_id)
        with self._locked(agent_id, exclusive=False):
            signature = self._signature(path)
            if signature is None:
                return None, DurableState()
            if signature[1] > MAX_MANIFEST_BYTES:
                raise CacheFormatError(path, f"manifest is {signature[1]} bytes, too large")
            manifest = decode_manifest(path.read_bytes(), path)
        self._check_identity(manifest, agent_id, path)
        durable = DurableState(
            signature,
            manifest.generation,
            list(manifest.blocks),
            dict(manifest.segments),
            manifest.remote,
        )
        return manifest, durable

    def _check_identity(self, m: Manifest, agent_id: str, path: Path) -> None:
        if m.agent_id != agent_id:
            raise CacheFormatError(path, f"manifest belongs to agent {m.agent_id!r}")
        if m.model_fingerprint != self.spec.fingerprint:
            raise CacheFormatError(path, "model fingerprint does not match the loaded model")
        if m.geometry != self.spec.geometry():
            raise CacheFormatError(path, "cache geometry does not match the loaded model")

    def file_path(self, agent_id: str, name: str) -> Path:
        """A file a manifest names: a shared block file or one of the agent's segments."""
        return self.model_dir / name if is_shared_file(name) else self.agent_dir(agent_id) / name

    def block_sources(self, manifest: Manifest, agent_id: str, count: int) -> list[BlockSource]:
        """Where the agent's first ``count`` blocks are stored."""
        out = []
        for b in manifest.blocks[:count]:
            seg = manifest.segments[b.segment]
            out.append(
                BlockSource(
                    bytes.fromhex(b.hash) if b.hash else None,
                    str(self.file_path(agent_id, b.segment)),
                    seg.size,
                    seg.header_crc,
                    b.offset,
                    b.length,
                    b.checksum,
                    b.tokens,
                )
            )
        return out

    def read_into(self, arena, agent_id: str | None, items: list[tuple[BlockSource, int]]) -> None:
        """Copy stored blocks into pool slots ``[(source, slot)]`` (verified; CacheFormatError
        names the file at fault). ``agent_id``: whose segments these are (None: shared only)."""
        if not items:
            return
        files: dict[str, int] = {}
        refs, regions = [], []
        for src, slot in items:
            if src.path not in files:
                files[src.path] = len(refs)
                refs.append((src.path, src.size, src.header_crc, file_layout(src.path)))
            regions.append(
                (files[src.path], src.offset, src.length, src.checksum, src.tokens, slot)
            )
        if agent_id is None:
            arena.read_regions(refs, regions)
            return
        with self._locked(agent_id, exclusive=False):
            arena.read_regions(refs, regions)

    def find_shared(self, digest: bytes) -> tuple[BlockSource, tuple[int, ...]] | None:
        """A stored complete block with this hash (another agent's), if one is sound, and
        the token ids it holds."""
        found = self.shared.find(digest)
        if found is None:
            return None
        return BlockSource(
            digest,
            str(self.shared.path(found.name)),
            found.size,
            found.header_crc,
            found.offset,
            found.length,
            found.checksum,
            BLOCK_TOKENS,
        ), found.tokens

    def layer_first_tokens(self, tokens: int) -> list[int]:
        """Where each layer's loaded rows start: 0, or the block a sliding window reaches."""
        return [window_start(tokens, layer.window) for layer in self.spec.layers]

    def load_caches(self, manifest: Manifest, agent_id: str, tokens: int) -> list[AgentKVCache]:
        """Tokens [0, tokens) of the agent's blocks as contiguous per-layer caches in the
        agent's stored KV format (mmap, one copy, checked): for mlx-lm interop and tests.
        KV format 2: every stored token is read (its tail describes the last ones), then the
        caches are trimmed to ``tokens``."""
        wanted = tokens
        if manifest.quant.channel_keys:
            tokens = manifest.token_count
        comps = manifest.components()
        names = sorted({b.segment for b in manifest.blocks})
        index = {name: i for i, name in enumerate(names)}
        segments = [
            (
                str(self.file_path(agent_id, n)),
                manifest.segments[n].size,
                manifest.segments[n].header_crc,
                file_layout(n),
            )
            for n in names
        ]
        blocks = [
            (index[b.segment], b.offset, b.length, b.checksum, b.tokens) for b in manifest.blocks
        ]
        firsts = self.layer_first_tokens(tokens)
        spans = [(f, _capacity(tokens - f)) for f in firsts]
        with self._locked(agent_id, exclusive=False):
            arrays = _ext.gather_blocks(
                self.spec.num_layers,
                BLOCK_TOKENS,
                native_layout(comps),
                segments,
                blocks,
                tokens,
                spans,
                LOAD_THREADS,
            )
        per_layer = len(comps[0])
        caches = [
            AgentKVCache.from_components(
                manifest.quant.layer(i),
                arrays[i * per_layer : (i + 1) * per_layer],
                offset=tokens,
                start=firsts[i],
                window=layer.window if layer.kind is LayerKind.SLIDING else None,
                tail=None if manifest.tail is None else mx.array(manifest.tail[i][None]),
            )
            for i, layer in enumerate(self.spec.layers)
        ]
        for cache in caches:
            cache.trim(tokens - wanted)
        return caches

    # -- writing ----------------------------------------------------------------

    def write(self, job: SaveJob, durable: DurableState) -> tuple[SaveReport, DurableState]:
        """Persist ``job`` on top of ``durable``; crash-safe, never overwrites a newer state.

        Order: new complete blocks as shared block files (skipping those already stored),
        the tail in a new private segment, fsync both directories, then the manifest
        switch; the shared-blocks lock is held from the first block file to the switch.
        """
        started = time.perf_counter()
        sealed, private = _split_sealed(job.regions)
        path = self.manifest_path(job.agent_id)
        generation = durable.generation + 1
        with self.shared.writing(), self._locked(job.agent_id, exclusive=True):
            blocks = self._kept_blocks(job, durable, path)
            segments = {b.segment: durable.segments[b.segment] for b in blocks}
            written = 0
            parts = (self._write_shared(job, sealed), self._write_segment(job, private, generation))
            for part in parts:
                blocks += part.blocks
                segments |= part.segments
                written += part.bytes_written
            remote = self._next_record(durable)
            written += self._switch_manifest(job, generation, blocks, segments, remote)
            self._collect_garbage(path.parent, segments)
            new_state = DurableState(self._signature(path), generation, blocks, segments, remote)
        report = SaveReport(
            job.agent_id, generation, written, len(job.regions), time.perf_counter() - started
        )
        return report, new_state

    def _next_record(self, durable: DurableState) -> RemoteRecord | None:
        """The store record of a new save: on top of the durable one's; a first one where
        the agents live in an object store too (``track_versions``)."""
        if durable.remote is not None:
            return durable.remote.successor()
        return RemoteRecord.first() if self.track_versions else None

    def _kept_blocks(self, job: SaveJob, durable: DurableState, path: Path) -> list[ManifestBlock]:
        """The durable blocks the save keeps, once the disk is known to hold what the
        engine believes it does (raises StoreConflictError if not)."""
        if self._signature(path) != durable.signature:
            raise StoreConflictError(
                f"{path} changed on disk since this process read it (another agentkv "
                "process is using this agent); not overwriting it"
            )
        base = durable.blocks[: job.keep]
        if len(base) != job.keep:
            raise StoreConflictError(f"{path}: blocks before {job.keep} are not durable")
        if job.kept_hashes and tuple(b.hash for b in base) != job.kept_hashes:
            raise StoreConflictError(
                f"{path}: the stored blocks before {job.keep} are not the ones this save "
                "builds on (an earlier save failed); the next save writes them all"
            )
        return list(base)

    def _write_shared(self, job: SaveJob, regions: list[NewRegion]) -> WrittenPart:
        """Complete blocks as shared block files (those not stored yet), their directories
        fsynced."""
        part = WrittenPart([], {}, 0)
        for r in regions:
            names = {block_file_name(r.hash, 3, variant) for variant in (None, r.checksum)}
            existed = {name for name in names if (self.model_dir / name).exists()}
            if r.offset < 0:  # evicted by KVSwap: its block file is all there is
                name = str(Path(r.file).relative_to(self.model_dir))
                stored = self.shared.find_file(name, r.hash)
                if stored is None or stored.checksum != r.checksum:
                    raise StoreConflictError(
                        f"the block file of {r.hash.hex()[:16]}, evicted while the agent "
                        "decoded, is gone or damaged; the agent cannot be saved whole"
                    )
            else:
                if r.layout != GROUPS:
                    raise ValueError("a block file's region is packed in groups")
                region = memoryview(job.packed)[r.offset : r.offset + r.length]
                stored = self.shared.ensure(r.hash, r.parent, r.ids, region, r.checksum)
            part.segments[stored.name] = SegmentRecord(stored.size, stored.header_crc)
            part.blocks.append(
                ManifestBlock(
                    stored.name,
                    stored.offset,
                    stored.length,
                    stored.checksum,
                    r.tokens,
                    r.hash.hex(),
                )
            )
            part.bytes_written += 0 if stored.name in existed else stored.size
        self.shared.sync_dirs(part.segments)
        return part

    def _write_segment(
        self, job: SaveJob, regions: list[NewRegion], generation: int
    ) -> WrittenPart:
        """The trailing unsealed blocks as a new private segment of the agent (fsynced, its
        directory too); nothing if there are none."""
        if not regions:
            return WrittenPart([], {}, 0)
        if any(r.layout != PLANES for r in regions):
            raise ValueError("a segment's regions are packed in planes")
        name = segment_name(generation)
        body = np.concatenate([job.packed[r.offset : r.offset + r.length] for r in regions])
        packed, at = [], 0
        for r in regions:
            packed.append((0, at, r.length, r.checksum, r.tokens))
            at += r.length
        header, records = encode_segment_header(
            agent_id=job.agent_id,
            fingerprint=self.spec.fingerprint,
            generation=generation,
            components=self.spec.components(job.quant),
            first_block=job.keep + len(job.regions) - len(regions),
            packed=packed,
        )
        path = self.agent_dir(job.agent_id) / name
        atomic_write_bytes(path, header, body, label="segment")
        data_start = len(header)
        segment = SegmentRecord(data_start + body.nbytes, _ext.crc32c(header[8:]))
        blocks = [
            ManifestBlock(name, data_start + off, ln, crc, t) for _, off, ln, crc, t in records
        ]
        return WrittenPart(blocks, {name: segment}, segment.size)

    def _switch_manifest(
        self,
        job: SaveJob,
        generation: int,
        blocks: list[ManifestBlock],
        segments: dict[str, SegmentRecord],
        remote: RemoteRecord | None,
    ) -> int:
        """Write the new manifest over the old one (the save's switch point); its size."""
        manifest = Manifest(
            agent_id=job.agent_id,
            model_fingerprint=self.spec.fingerprint,
            model_name=self.model_name,
            geometry=self.spec.geometry(),
            quant=job.quant,
            generation=generation,
            tokens=job.tokens,
            spans=job.spans,
            text=job.text,
            blocks=blocks,
            segments=segments,
            messages=job.messages,
            updated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            chain_seed=job.chain_seed.hex(),
            tail=job.tail,
            prev=job.prev,
            nonce=job.nonce,
            remote=remote,
        )
        data = encode_manifest(manifest)
        atomic_write_bytes(self.manifest_path(job.agent_id), data, label="manifest")
        crash_point("manifest-switched")
        return len(data)

    def collect_blocks(self) -> int:
        """Delete shared block files that no manifest names (agents' and quarantined ones);
        nothing if a manifest cannot be read (it may name files still needed), nor while a
        save or a swapped agent holds the block files' lock (a later collection gets them:
        a server never waits on another turn for this)."""
        try:
            return self.shared.collect(wait=False)
        except OSError as exc:
            log.warning("agentkv: not collecting unused block files this time: %s", exc)
            return 0

    @staticmethod
    def _collect_garbage(directory: Path, live: dict) -> None:
        dead = [
            entry
            for entry in directory.iterdir()
            if (SEGMENT_RE.match(entry.name) and entry.name not in live)
            or entry.name.endswith(".tmp")
        ]
        _ext.forget_mappings([str(entry) for entry in dead])
        for entry in dead:
            entry.unlink(missing_ok=True)
            crash_point("garbage-removed")

    # -- management -------------------------------------------------------------

    def quarantine(self, agent_id: str, reason: str) -> Path | None:
        """Move the agent's directory aside (kept, never deleted); the agent starts cold."""
        directory = self.agent_dir(agent_id)
        if not directory.exists():
            return None
        secure_mkdir(self.quarantine_dir)
        _ext.forget_mappings([str(p) for p in directory.iterdir()])
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.quarantine_dir / f"{agent_id}.{stamp}"
        os.rename(directory, target)
        atomic_write_text(target / "QUARANTINE_REASON.txt", reason + "\n")
        log.warning("agentkv: quarantined agent %r to %s: %s", agent_id, target, reason)
        return target

    def copy_agent(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src``'s durable state: its segments hard-linked (they are
        immutable), its shared block files named again (held against collection meanwhile)."""
        target = self.agent_dir(dst)
        if (target / MANIFEST_NAME).exists():
            raise InvalidRequestError(f"agent {dst!r} already has a stored state")
        manifest, _ = self.read_manifest(src)
        if manifest is None:
            raise InvalidRequestError(f"agent {src!r} has no stored state")
        source = self.agent_dir(src)
        with (
            self.shared.writing(),
            self._locked(src, exclusive=False),
            self._locked(dst, exclusive=True),
        ):
            for name in manifest.segments:
                if is_shared_file(name):
                    if not (self.model_dir / name).exists():
                        raise CacheFormatError(self.model_dir / name, "a shared block is missing")
                    continue
                try:
                    os.link(source / name, target / name)
                except OSError:
                    shutil.copy2(source / name, target / name)
            fsync_dir(target)
            manifest.agent_id = dst
            manifest.remote = None  # a new agent: not in any object store yet
            atomic_write_bytes(target / MANIFEST_NAME, encode_manifest(manifest), label="manifest")

    def delete(self, agent_id: str) -> bool:
        directory = self.agent_dir(agent_id)
        if not directory.exists():
            return False
        with self._locked(agent_id, exclusive=True):
            _ext.forget_mappings([str(p) for p in directory.iterdir()])
            shutil.rmtree(directory)
        return True

    def agent_ids(self) -> list[str]:
        if not self.agents_dir.exists():
            return []
        return sorted(p.name for p in self.agents_dir.iterdir() if (p / MANIFEST_NAME).exists())

    def disk_bytes(self, agent_id: str) -> int:
        directory = self.agent_dir(agent_id)
        if not directory.exists():
            return 0
        total = 0
        try:
            entries = list(directory.iterdir())
        except FileNotFoundError:  # deleted meanwhile
            return 0
        for path in entries:
            try:  # the writer may remove a replaced segment meanwhile
                if path.is_file():
                    total += path.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def other_fingerprints(self, agent_id: str) -> list[str]:
        """Fingerprint directories of *other* models that hold this agent."""
        validate_agent_id(agent_id)
        if not self.root.exists():
            return []
        return sorted(
            d.name
            for d in self.root.iterdir()
            if d != self.model_dir and (d / "agents" / agent_id / MANIFEST_NAME).exists()
        )


def build_save_job(
    arena,
    table,
    *,
    agent_id: str,
    keep: int,
    tokens,
    spans,
    text: bytes,
    messages: list | None,
    evicted: list | None = None,
    evicted_files: list | None = None,
) -> SaveJob:
    """Pack the table's blocks from ``keep`` on (one copy each, checksummed) for a save.
    ``evicted``: (hash, parent, token ids) of the table's first blocks where KVSwap evicted
    them (``table.blocks`` holds -1 there), ``evicted_files`` the block files KVSwap read
    them from: named as they are, never packed."""
    pool = table.pool
    evicted = evicted or []
    slots = table.blocks[keep:]
    counts = [
        min(BLOCK_TOKENS, table.length - (keep + i) * BLOCK_TOKENS) for i in range(len(slots))
    ]
    resident = [i for i, slot in enumerate(slots) if slot >= 0]
    # A sealed block the table holds only part of (a turn trimmed back into it) is stored as
    # the agent's own partial block (planes, in its segment), never under the full block's
    # hash; a complete sealed block goes to its block file (groups).
    hashed = [
        slot >= 0 and pool.records[slot].hash is not None and count == BLOCK_TOKENS
        for slot, count in zip(slots, counts)
    ]
    packed, packed_records = (
        arena.pack(
            [slots[i] for i in resident],
            [counts[i] for i in resident],
            [GROUPS if hashed[i] else PLANES for i in resident],
        )
        if resident
        else (b"", [])
    )
    records = [None] * len(slots)
    for i, record in zip(resident, packed_records):
        records[i] = record
    tail = prev = None
    if arena.ct:
        if len(tokens) != table.length:
            raise ValueError("a save of per-channel keys needs the table's every token")
        tail = arena.read_tail(table.tail, table.length % arena.ct) if table.length else None
        last_group = (table.length // arena.ct - 1) * arena.ct
        if last_group >= 0 and table.prev_group == last_group:
            prev = arena.read_prev(table.tail)
    regions = []
    for i, (slot, packed_record) in enumerate(zip(slots, records)):
        if slot < 0:
            digest, parent, ids = evicted[keep + i]
            file = evicted_files[keep + i]
            ids = np.asarray(ids, np.int32)
            regions.append(
                NewRegion(
                    -1, 0, file.checksum, BLOCK_TOKENS, digest, parent, ids, GROUPS, file.path
                )
            )
            continue
        _, offset, length, checksum, count = packed_record
        record = pool.records[slot]
        regions.append(
            NewRegion(
                offset,
                length,
                checksum,
                count,
                record.hash if hashed[i] else None,
                record.parent if hashed[i] else None,
                np.asarray(record.tokens, dtype=np.int32) if hashed[i] else None,
                GROUPS if hashed[i] else PLANES,
            )
        )
    return SaveJob(
        agent_id,
        keep,
        packed,
        regions,
        arena.quant,
        table.seed,
        np.asarray(tokens, dtype=np.int32),
        np.asarray(spans, dtype=np.int32),
        bytes(text),
        messages,
        tuple(
            (evicted[i][0].hex() if b < 0 else pool.records[b].hash.hex())
            if b < 0 or pool.records[b].hash
            else None
            for i, b in enumerate(table.blocks[:keep])
        ),
        tail,
        prev,
        nonce=table.nonce,
    )


def _capacity(rows: int) -> int:
    """Rows allocated for a loaded layer: rounded up to a block, plus one spare block."""
    return (rows + BLOCK_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS + BLOCK_TOKENS


def _split_sealed(regions: list[NewRegion]) -> tuple[list[NewRegion], list[NewRegion]]:
    """A save's complete (hashed) blocks, then its unsealed ones, which must come last."""
    first = next((i for i, r in enumerate(regions) if r.hash is None), len(regions))
    if any(r.hash is not None for r in regions[first:]):
        raise ValueError("only the trailing blocks of a save may be unsealed")
    return regions[:first], regions[first:]
