"""AgentStore: one model's agents on disk — read, load, save, quarantine, list.

Identity is ``(model fingerprint, agent id)``: each fingerprint has its own
directory, so another model's caches are never even opened. Files are 0600,
directories 0700. Readers take a shared flock(2) on the agent's ``.lock``,
the writer an exclusive one, so a reader never sees segments vanish under it.
A file that fails any check is never deleted or overwritten: the agent's whole
directory is renamed into ``quarantine/`` and the agent starts cold.
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

import numpy as np

from .. import _ext
from .._faults import crash_point
from ..agent_id import validate_agent_id
from ..errors import CacheFormatError, InvalidRequestError
from ..kv.cache import STEP, AgentKVCache, window_start
from ..kv.quant import KVQuant
from ..model.spec import LayerKind, ModelCacheSpec
from ..paths import FILE_MODE, atomic_write_bytes, atomic_write_text, fsync_dir, secure_mkdir
from .format import (
    BLOCK_TOKENS,
    MANIFEST_NAME,
    SEGMENT_RE,
    BlockRecord,
    Manifest,
    SegmentRecord,
    decode_manifest,
    encode_manifest,
    encode_segment_header,
    segment_name,
)

log = logging.getLogger("agentkv.store")

LOAD_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_MANIFEST_BYTES = 1 << 30
Signature = tuple[int, int, int] | None  # (inode, size, mtime_ns) of a manifest, None if absent


class StoreConflictError(Exception):
    """The agent's manifest changed on disk since this process last read or wrote it."""


@dataclass
class SaveJob:
    """A finished turn to persist: new block regions plus the agent's whole text record."""

    agent_id: str
    first_block: int  # blocks before this one are already durable
    packed: np.ndarray  # uint8, the block regions laid out by pack_blocks
    packed_blocks: list[tuple]  # (0, offset, length, checksum, tokens) per region
    quant: KVQuant
    tokens: np.ndarray
    spans: np.ndarray
    text: bytes
    messages: list | None

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.tokens.nbytes + self.spans.nbytes + len(self.text))


@dataclass
class DurableState:
    """What the store knows is on disk for one agent."""

    signature: Signature = None
    generation: int = 0
    blocks: list[BlockRecord] = field(default_factory=list)
    segments: dict[str, SegmentRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveReport:
    agent_id: str
    generation: int
    bytes_written: int
    blocks_written: int
    seconds: float


class AgentStore:
    def __init__(self, root: Path, spec: ModelCacheSpec, model_name: str):
        self.root = Path(root)
        self.spec = spec
        self.model_name = model_name
        self.model_dir = self.root / spec.fingerprint[:16]
        self.agents_dir = self.model_dir / "agents"
        self.quarantine_dir = self.model_dir / "quarantine"

    # -- layout -----------------------------------------------------------------

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

    @contextmanager
    def _locked(self, agent_id: str, *, exclusive: bool):
        directory = self.agent_dir(agent_id)
        if exclusive:
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
            signature, manifest.generation, list(manifest.blocks), dict(manifest.segments)
        )
        return manifest, durable

    def _check_identity(self, m: Manifest, agent_id: str, path: Path) -> None:
        if m.agent_id != agent_id:
            raise CacheFormatError(path, f"manifest belongs to agent {m.agent_id!r}")
        if m.model_fingerprint != self.spec.fingerprint:
            raise CacheFormatError(path, "model fingerprint does not match the loaded model")
        if m.geometry != self.spec.geometry():
            raise CacheFormatError(path, "cache geometry does not match the loaded model")

    def layer_first_tokens(self, tokens: int) -> list[int]:
        """Where each layer's loaded rows start: 0, or the block a sliding window reaches."""
        return [window_start(tokens, layer.window) for layer in self.spec.layers]

    def load_caches(self, manifest: Manifest, agent_id: str, tokens: int) -> list[AgentKVCache]:
        """Load tokens [0, tokens) of the agent's KV blocks (mmap, one copy, checked)."""
        comps = manifest.components()
        names = sorted({b.segment for b in manifest.blocks})
        index = {name: i for i, name in enumerate(names)}
        directory = self.agent_dir(agent_id)
        segments = [
            (str(directory / n), manifest.segments[n].size, manifest.segments[n].header_crc)
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
                [(c.heads, c.width, c.dtype) for c in comps],
                segments,
                blocks,
                tokens,
                spans,
                LOAD_THREADS,
            )
        per_layer = len(comps)
        return [
            AgentKVCache.from_components(
                manifest.quant,
                arrays[i * per_layer : (i + 1) * per_layer],
                offset=tokens,
                start=firsts[i],
                window=layer.window if layer.kind is LayerKind.SLIDING else None,
            )
            for i, layer in enumerate(self.spec.layers)
        ]

    # -- writing ----------------------------------------------------------------

    def write(self, job: SaveJob, durable: DurableState) -> tuple[SaveReport, DurableState]:
        """Persist ``job`` on top of ``durable``; crash-safe, never overwrites a newer state."""
        started = time.perf_counter()
        directory = self.agent_dir(job.agent_id)
        path = directory / MANIFEST_NAME
        with self._locked(job.agent_id, exclusive=True):
            if self._signature(path) != durable.signature:
                raise StoreConflictError(
                    f"{path} changed on disk since this process read it (another agentkv "
                    "process is using this agent); not overwriting it"
                )
            base = durable.blocks[: job.first_block]
            if len(base) != job.first_block:
                raise StoreConflictError(f"{path}: blocks before {job.first_block} are not durable")
            generation = durable.generation + 1
            segments = {b.segment: durable.segments[b.segment] for b in base}
            blocks = list(base)
            written = 0
            if job.packed_blocks:
                name = segment_name(generation)
                header, records = encode_segment_header(
                    agent_id=job.agent_id,
                    fingerprint=self.spec.fingerprint,
                    generation=generation,
                    layers=self.spec.num_layers,
                    components=self.spec.components(job.quant),
                    first_block=job.first_block,
                    packed=job.packed_blocks,
                )
                _write_durably(directory / name, header, job.packed)
                crash_point("segment-renamed")
                fsync_dir(directory)
                data_start = len(header)
                segments[name] = SegmentRecord(
                    data_start + job.packed.nbytes, _ext.crc32c(header[8:])
                )
                blocks += [
                    BlockRecord(name, data_start + off, ln, crc, t)
                    for _, off, ln, crc, t in records
                ]
                written += data_start + job.packed.nbytes
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
            )
            data = encode_manifest(manifest)
            atomic_write_bytes(path, data)
            written += len(data)
            crash_point("manifest-switched")
            self._collect_garbage(directory, segments)
            new_state = DurableState(self._signature(path), generation, blocks, segments)
        report = SaveReport(
            job.agent_id, generation, written, len(job.packed_blocks), time.perf_counter() - started
        )
        return report, new_state

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
        """Make ``dst`` a copy of ``src``'s durable state (segments are hard-linked: immutable)."""
        target = self.agent_dir(dst)
        if (target / MANIFEST_NAME).exists():
            raise InvalidRequestError(f"agent {dst!r} already has a stored state")
        manifest, _ = self.read_manifest(src)
        if manifest is None:
            raise InvalidRequestError(f"agent {src!r} has no stored state")
        source = self.agent_dir(src)
        with self._locked(src, exclusive=False), self._locked(dst, exclusive=True):
            for name in manifest.segments:
                try:
                    os.link(source / name, target / name)
                except OSError:
                    shutil.copy2(source / name, target / name)
            fsync_dir(target)
            manifest.agent_id = dst
            atomic_write_bytes(target / MANIFEST_NAME, encode_manifest(manifest))

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
    spec: ModelCacheSpec,
    agent_id: str,
    caches: list[AgentKVCache],
    *,
    tokens,
    spans,
    text: bytes,
    messages: list | None,
    first_block: int,
    threads: int = LOAD_THREADS,
) -> SaveJob:
    """Pack the blocks from ``first_block`` on of ``caches`` into a SaveJob (one copy)."""
    quant = caches[0].quant
    comps = spec.components(quant)
    arrays = [x for c in caches for x in c.components]
    packed, records = _ext.pack_blocks(
        arrays,
        spec.num_layers,
        BLOCK_TOKENS,
        [(c.heads, c.width, c.dtype) for c in comps],
        first_block,
        len(tokens),
        [(c.start, c.capacity) for c in caches],
        threads,
    )
    return SaveJob(
        agent_id,
        first_block,
        packed,
        records,
        quant,
        np.asarray(tokens, dtype=np.int32),
        np.asarray(spans, dtype=np.int32),
        bytes(text),
        messages,
    )


def _capacity(rows: int) -> int:
    """Rows allocated for a loaded layer: rounded up to a block, plus one spare block."""
    return (rows + STEP - 1) // STEP * STEP + STEP


def _write_durably(path: Path, header: bytes, body: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        for chunk in (memoryview(header), memoryview(body).cast("B")):
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
            crash_point("segment-part-written")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
