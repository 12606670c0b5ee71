"""RemoteAgents: one model's agents in a fleet's object store (docs/fleet.md).

::

    <prefix>/<fingerprint[:16]>/model.json                               the model's record
    <prefix>/<fingerprint[:16]>/blocks/<hh>/<hash>.v3.safetensors       immutable, by hash
    <prefix>/<fingerprint[:16]>/agents/<id>/seg-00000007.<crc>.safetensors  immutable
    <prefix>/<fingerprint[:16]>/agents/<id>/manifest.safetensors         the one mutable object

Every object holds the bytes of the local file of the same name. ``fetch`` reads an agent's
manifest and the files it names that this machine lacks, checking every byte (the manifest's
own checks, each block file's header, hash and size, each region's CRC-32C) before
``install`` writes any of it; ``commit`` uploads the files a manifest names that the store
lacks, then writes the manifest with ``If-Match`` on the version it continues (or
``If-None-Match: *``), so of two servers racing on one agent exactly one wins.

``push`` and ``pull`` decide, from the local manifest's ``remote`` record and the store's
``HEAD``, whether there is anything to move and whether moving it would lose a turn.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from .. import _ext
from .._faults import crash_point
from ..agent_id import validate_agent_id
from ..errors import AgentBusyError, AgentKVError, CacheFormatError
from ..paths import atomic_write_bytes, fsync_dir, secure_mkdir
from .agent_store import MAX_MANIFEST_BYTES, AgentStore, agent_lock
from .block_files import SharedBlocks, blocks_writing
from .format import (
    BLOCK_TOKENS,
    MANIFEST_NAME,
    Manifest,
    RemoteRecord,
    SegmentRecord,
    decode_block_file,
    decode_manifest,
    encode_manifest,
    is_shared_file,
    manifest_remote,
    new_version,
    read_header,
)
from .objects import Listed, ObjectMissing, ObjectStore, PreconditionFailed

VERSION_META = "agentkv-version"
TRANSFER_THREADS = 8
MAX_HEAD_BYTES = 1 << 20
MODEL_RECORD = "model.json"
# How long a commit trusts that a file it saw in the store is still there; ``collect``
# deletes only files older than its min age (default COLLECT_MIN_AGE_S, far longer)
PRESENT_TTL_S = 300.0
COLLECT_MIN_AGE_S = 3600.0
# a segment's key under <model>/agents/<id>/ (``RemoteAgents.file_key``)
SEGMENT_KEY_RE = re.compile(r"^seg-\d{8}\.[0-9a-f]{8}\.safetensors$")


class RemoteDamaged(AgentKVError):
    """An object of the store failed its checks; nothing of the fetch was installed."""

    def __init__(self, reason: str, key: str | None = None):
        super().__init__(f"the store's copy is damaged: {reason}")
        self.reason = reason
        self.key = key


@dataclass(frozen=True)
class RemoteHead:
    """What the store holds for an agent, from a ``HEAD`` of its manifest."""

    version: str | None
    etag: str


@dataclass
class Fetched:
    """An agent read from the store and checked, not yet installed."""

    manifest: Manifest
    data: bytes  # the manifest's bytes
    files: dict[str, bytes]  # name (as the manifest says it) -> bytes, for files not here
    etag: str

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(len(b) for b in self.files.values())


class Moved(Enum):
    """What a ``push`` or ``pull`` did."""

    SAME = "up to date"
    MOVED = "moved"
    ABSENT = "not there"


@dataclass(frozen=True)
class Transfer:
    agent_id: str
    moved: Moved
    version: str | None
    nbytes: int


def file_key(model: str, agent_id: str, name: str, record: SegmentRecord) -> str:
    """A file's key in the store: a block file's is its name; a segment's adds its header
    CRC (two servers racing on one generation never write one key)."""
    if is_shared_file(name):
        return f"{model}/{name}"
    stem = name.removesuffix(".safetensors")
    return f"{model}/agents/{agent_id}/{stem}.{record.header_crc:08x}.safetensors"


def stored_models(objects: ObjectStore) -> list[str]:
    """The model directories (fingerprint prefixes) the store holds agents of."""
    return sorted(
        key.split("/")[0]
        for key in objects.keys("")
        if key.count("/") == 1 and key.endswith("/" + MODEL_RECORD)
    )


class RemoteAgents:
    """One model directory (``<root>/<fingerprint[:16]>``) and its twin in the store."""

    def __init__(self, objects: ObjectStore, model_dir: Path, *, threads: int = TRANSFER_THREADS):
        self.objects = objects
        self.model_dir = Path(model_dir)
        self.model = self.model_dir.name
        # immutable keys known to be in the store, sound, and when that was last seen: a
        # commit trusts it for PRESENT_TTL_S (``collect`` may delete what no manifest names)
        self._present: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="agentkv-s3")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _known(self, key: str) -> bool:
        seen = self._present.get(key)
        return seen is not None and time.monotonic() - seen < PRESENT_TTL_S

    # -- names ----------------------------------------------------------------------------

    def manifest_key(self, agent_id: str) -> str:
        return f"{self.model}/agents/{validate_agent_id(agent_id)}/{MANIFEST_NAME}"

    def file_key(self, agent_id: str, name: str, record: SegmentRecord) -> str:
        return file_key(self.model, agent_id, name, record)

    def agent_dir(self, agent_id: str) -> Path:
        return self.model_dir / "agents" / validate_agent_id(agent_id)

    # -- reading --------------------------------------------------------------------------

    def head(self, agent_id: str) -> RemoteHead | None:
        found = self.objects.head(self.manifest_key(agent_id))
        if found is None:
            return None
        return RemoteHead(found.metadata.get(VERSION_META), found.etag)

    def agent_ids(self) -> list[str]:
        """Agents with a manifest in the store, by listing."""
        ids = []
        for key in self.objects.keys(f"{self.model}/agents/"):
            parts = key.split("/")
            if len(parts) == 4 and parts[3] == MANIFEST_NAME:
                ids.append(parts[2])
        return sorted(ids)

    def fetch(self, agent_id: str) -> Fetched | None:
        """The agent's state in the store, every byte checked (RemoteDamaged if any fails,
        StoreUnavailable if the store does not answer); None if the store has none."""
        key = self.manifest_key(agent_id)
        try:
            data, head = self.objects.get(key)
        except ObjectMissing:
            return None
        label = f"{self.objects.url}/{key}"
        try:
            if len(data) > MAX_MANIFEST_BYTES:
                raise CacheFormatError(label, f"manifest is {len(data)} bytes, too large")
            manifest = decode_manifest(data, label)
            if manifest.agent_id != agent_id:
                raise CacheFormatError(label, f"manifest belongs to agent {manifest.agent_id!r}")
            if not manifest.model_fingerprint.startswith(self.model):
                raise CacheFormatError(label, "manifest's model fingerprint is not its folder's")
        except CacheFormatError as exc:
            raise RemoteDamaged(f"its manifest: {exc.reason}", key) from None
        remote = manifest.remote
        if remote is None or remote.version != head.metadata.get(VERSION_META):
            raise RemoteDamaged("its manifest's version is not the one it is stored under", key)
        shared = SharedBlocks.of_manifest(self.model_dir, manifest)
        wanted = [
            (name, record)
            for name, record in manifest.segments.items()
            if not _here(shared, manifest, name, record)
        ]
        files = dict(
            zip(
                [name for name, _ in wanted],
                self._pool.map(lambda item: self._fetch_file(manifest, agent_id, *item), wanted),
            )
        )
        return Fetched(manifest, data, files, head.etag)

    def _fetch_file(
        self, manifest: Manifest, agent_id: str, name: str, record: SegmentRecord
    ) -> bytes:
        key = self.file_key(agent_id, name, record)
        try:
            data, _ = self.objects.get(key)
        except ObjectMissing:
            raise RemoteDamaged(f"{name} is missing from the store", key) from None
        try:
            check_file(manifest, name, record, data, f"{self.objects.url}/{key}")
        except CacheFormatError as exc:
            self._present.pop(key, None)  # the next commit naming it uploads it again
            raise RemoteDamaged(f"{name}: {exc.reason}", key) from None
        self._present[key] = time.monotonic()
        return data

    # -- installing ------------------------------------------------------------------------

    def install(self, fetched: Fetched) -> None:
        """Write a fetched agent to the local store: its block files (before any manifest
        names them), its segments, then its manifest switched atomically. A crash part way
        leaves the old manifest or none (the agent is fetched again), never one naming a
        file that is not there."""
        manifest = fetched.manifest
        directory = self.agent_dir(manifest.agent_id)
        secure_mkdir(directory)
        self._install_model_record()
        shared = SharedBlocks.of_manifest(self.model_dir, manifest)
        names = [n for n in fetched.files if is_shared_file(n)]
        segments = [n for n in fetched.files if not is_shared_file(n)]

        def write_all(files: dict[Path, str], label: str) -> None:
            # on the transfer threads: their fsyncs overlap (one journal commit for many)
            for path in files:
                secure_mkdir(path.parent)
            list(self._pool.map(
                lambda path: atomic_write_bytes(path, fetched.files[files[path]], label=label,
                                                sync_dir=False),
                files,
            ))  # fmt: skip

        with blocks_writing(self.model_dir):
            write_all({shared.path(name): name for name in names}, "block")
            shared.sync_dirs(names)
            with agent_lock(directory, exclusive=True):
                manifest_path = directory / MANIFEST_NAME
                if manifest_path.exists():  # its segments are about to be replaced
                    manifest_path.unlink()
                    fsync_dir(directory)
                write_all({directory / name: name for name in segments}, "segment")
                fsync_dir(directory)
                crash_point("fetched-files-installed")
                atomic_write_bytes(manifest_path, fetched.data, label="manifest")
                AgentStore._collect_garbage(directory, manifest.segments)

    def _install_model_record(self) -> None:
        """The model's ``model.json`` (its name and cache spec, which ``agentkv cache``
        lists), from the store where this machine has none."""
        path = self.model_dir / MODEL_RECORD
        if path.exists():
            return
        key = f"{self.model}/{MODEL_RECORD}"
        try:
            data, _ = self.objects.get(key)
            record = json.loads(data)
            sound = str(record["fingerprint"]).startswith(self.model)
        except (ObjectMissing, ValueError, KeyError, TypeError):
            sound = False
        if not sound:
            raise RemoteDamaged(f"{MODEL_RECORD} is missing or malformed", key)
        secure_mkdir(self.model_dir)
        atomic_write_bytes(path, data, label=MODEL_RECORD)

    # -- writing ----------------------------------------------------------------------------

    def commit(self, data: bytes, manifest: Manifest, head: RemoteHead | None) -> str:
        """Make ``manifest`` (``data``, its bytes, and its files on this machine) the store's
        state of its agent on top of ``head`` (None: the store has no state of it): every
        file it names that the store lacks uploaded, then the manifest written with
        ``If-Match`` (``If-None-Match: *``). Its new ETag. PreconditionFailed: another
        version is there (nothing of this commit is named); StoreUnavailable."""
        if manifest.remote is None:
            raise ValueError("a manifest without a version record cannot be committed")
        agent_id = manifest.agent_id
        self._upload_model_record()
        list(
            self._pool.map(
                lambda item: self._upload_file(manifest, agent_id, *item),
                list(manifest.segments.items()),
            )
        )
        meta = {VERSION_META: manifest.remote.version}
        key = self.manifest_key(agent_id)
        if head is None:
            return self.objects.put(key, data, if_none_match=True, metadata=meta)
        return self.objects.put(key, data, if_match=head.etag, metadata=meta)

    def _upload_model_record(self) -> None:
        key = f"{self.model}/{MODEL_RECORD}"
        if self._known(key):
            return
        if self.objects.head(key) is None:
            self.objects.put(key, (self.model_dir / MODEL_RECORD).read_bytes())
        self._present[key] = time.monotonic()

    def _upload_file(
        self, manifest: Manifest, agent_id: str, name: str, record: SegmentRecord
    ) -> None:
        key = self.file_key(agent_id, name, record)
        if self._known(key):
            return
        found = self.objects.head(key)
        if found is None or found.size != record.size:
            shared = is_shared_file(name)
            path = self.model_dir / name if shared else self.agent_dir(agent_id) / name
            with open(path, "rb") as fh:
                data = fh.read()
            check_file(manifest, name, record, data, path)  # never bytes the manifest does not name
            self.objects.put(key, data)
            crash_point("store-file-uploaded")
        self._present[key] = time.monotonic()

    # -- moving one agent -------------------------------------------------------------------

    def push(self, agent_id: str, *, force: bool = False, adopt: bool = True) -> Transfer:
        """Commit the local state of the agent to the store, if the store lacks it. Refuses
        (AgentBusyError) where the store holds a version the local state does not continue
        (another machine's turns), unless ``force``. ``adopt``: give a local manifest without
        a version record one (else such an agent is not pushed: ``Moved.ABSENT``)."""
        found = self.read_local(agent_id, adopt=adopt)
        if found is None:
            return Transfer(agent_id, Moved.ABSENT, None, 0)
        data, manifest = found
        head = self.head(agent_id)
        if head is not None and head.version == manifest.remote.version:
            return Transfer(agent_id, Moved.SAME, head.version, 0)
        busy = AgentBusyError(
            f"agent {agent_id!r}: the store {self.objects.url} holds a version this machine's "
            "copy does not continue (another server ran turns of it)"
        )
        if head is not None and not manifest.remote.continues(head.version) and not force:
            raise busy
        sent = self.objects.traffic.snapshot()[1]["up"]
        try:
            self.commit(data, manifest, head)
        except PreconditionFailed:  # another server committed between the HEAD and the PUT
            raise busy from None
        sent = self.objects.traffic.snapshot()[1]["up"] - sent
        return Transfer(agent_id, Moved.MOVED, manifest.remote.version, sent)

    def read_local(self, agent_id: str, *, adopt: bool = True) -> tuple[bytes, Manifest] | None:
        """The agent's local manifest (bytes, decoded), given a version record if it has none
        (an agent saved before it was ever in a store; rewritten in place, crash-safe), or
        None (no manifest, or none with a record and not ``adopt``)."""
        path = self.agent_dir(agent_id) / MANIFEST_NAME
        with agent_lock(path.parent, exclusive=False, create=False):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return None
        manifest = decode_manifest(data, path)
        if manifest.agent_id != agent_id:
            raise CacheFormatError(path, f"manifest belongs to agent {manifest.agent_id!r}")
        if manifest.remote is None:
            if not adopt:
                return None
            manifest.remote = RemoteRecord.first()
            recorded = encode_manifest(manifest)
            with agent_lock(path.parent, exclusive=True):
                if path.read_bytes() != data:
                    raise CacheFormatError(path, "the manifest changed while it was read")
                atomic_write_bytes(path, recorded, label="manifest")
            data = recorded
        return data, manifest

    def pull(self, agent_id: str, *, force: bool = False) -> Transfer:
        """Install the store's state of the agent, unless this machine holds it already.
        Refuses (AgentBusyError) to replace a local state with turns the store's does not
        hold, unless ``force``."""
        head = self.head(agent_id)
        if head is None:
            return Transfer(agent_id, Moved.ABSENT, None, 0)
        local = local_record(self.agent_dir(agent_id))
        if local is not None and local.version == head.version:
            return Transfer(agent_id, Moved.SAME, head.version, 0)
        fetched = self.fetch(agent_id)
        if fetched is None:
            return Transfer(agent_id, Moved.ABSENT, None, 0)
        if local is not None and not fetched.manifest.remote.continues(local.version) and not force:
            raise AgentBusyError(
                f"agent {agent_id!r}: this machine's copy has turns the store "
                f"{self.objects.url} lacks; push it, or pull with --force to replace it"
            )
        self.install(fetched)
        return Transfer(agent_id, Moved.MOVED, fetched.manifest.remote.version, fetched.nbytes)


def local_record(directory: Path) -> RemoteRecord | None:
    """The version record of a local agent's manifest, read from its header alone (None: no
    manifest). A manifest without one gets a fresh one (its turns are in no store)."""
    path = directory / MANIFEST_NAME
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            head = prefix + fh.read(min(length, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return None
    return manifest_remote(head, path) or RemoteRecord((new_version(),))


def _here(shared: SharedBlocks, manifest: Manifest, name: str, record: SegmentRecord) -> bool:
    """Whether this machine holds a sound block file of these very bytes (never a segment:
    those are the agent's own)."""
    if not is_shared_file(name):
        return False
    blocks = [b for b in manifest.blocks if b.segment == name]
    found = shared.find_file(name, bytes.fromhex(blocks[0].hash))
    return found is not None and found.size == record.size and found.header_crc == record.header_crc


def check_file(manifest: Manifest, name: str, record: SegmentRecord, data: bytes, label) -> None:
    """Check one file a manifest names, as read from anywhere: its size and header CRC as the
    manifest records them, a block file's header (model, hash, size) and token ids (the
    agent's), and the CRC-32C of every region the manifest reads from it: every byte of the
    file. CacheFormatError names what is wrong."""
    if len(data) != record.size:
        raise CacheFormatError(label, f"{len(data)} bytes, expected {record.size}")
    _, data_start = read_header(data[: min(len(data), MAX_HEAD_BYTES)], label)
    if _ext.crc32c(data[8:data_start]) != record.header_crc:
        raise CacheFormatError(label, "header checksum mismatch")
    blocks = [b for b in manifest.blocks if b.segment == name]
    if is_shared_file(name):
        first = blocks[0]
        end = data_start + first.length
        stored = decode_block_file(
            data[:data_start],
            data[end : end + 4 * BLOCK_TOKENS],
            label,
            name=name,
            size=len(data),
            fingerprint=manifest.model_fingerprint,
            digest=bytes.fromhex(first.hash),
            length=first.length,
        )
        # its token ids (which other agents' turns match against) are the manifest's own
        at = manifest.blocks.index(first) * manifest.block_tokens
        if stored.tokens != tuple(manifest.tokens[at : at + manifest.block_tokens].tolist()):
            raise CacheFormatError(label, "block file holds other token ids than its agent's")
    view = np.frombuffer(data, np.uint8)
    for b in blocks:
        if _ext.block_checksum(view[b.offset : b.offset + b.length]) != b.checksum:
            raise CacheFormatError(label, "block region checksum mismatch")


@dataclass
class Collected:
    """What ``collect`` found: the files no manifest names, old enough to delete (deleted
    unless it was a dry run), what it kept and why."""

    deleted: list[str]
    nbytes: int
    kept_young: int  # unnamed files younger than the min age (an upload in flight, maybe)
    named: int  # files some manifest names
    unreadable: list[str]  # manifests that failed their checks: their agents' files kept


def collect(
    objects: ObjectStore, *, min_age_s: float = COLLECT_MIN_AGE_S, dry_run: bool = False,
    now: float | None = None,
) -> Collected:  # fmt: skip
    """Delete the files of the store no agent's manifest names and that were written more
    than ``min_age_s`` ago: a lost race's and a killed upload's files, the segments an
    agent's later turns replaced, a deleted agent's files. Only agentkv's own kinds of key
    are considered (block files, segments); a manifest that fails its checks keeps its
    agent's files and, since it may name any of them, every block file of its model. A
    file's age is its last write: an upload in flight writes its files before its manifest,
    so they are young while it runs (docs/fleet.md, "Collecting")."""
    now = time.time() if now is None else now
    out = Collected([], 0, 0, 0, [])
    for model in stored_models(objects):
        listed = objects.listing(f"{model}/")
        named, keep_blocks, keep_agents = set(), False, set()
        for item in listed:
            parts = item.key.split("/")
            if len(parts) != 4 or parts[1] != "agents" or parts[3] != MANIFEST_NAME:
                continue
            agent_id = parts[2]
            try:
                data, _ = objects.get(item.key)
                manifest = decode_manifest(data, f"{objects.url}/{item.key}")
                if manifest.agent_id != agent_id:
                    raise CacheFormatError(item.key, "a manifest of another agent")
            except ObjectMissing:  # deleted since the listing: its files are unnamed now
                continue
            except CacheFormatError:
                out.unreadable.append(item.key)
                keep_blocks = True
                keep_agents.add(agent_id)
                continue
            named.update(
                file_key(model, agent_id, name, record)
                for name, record in manifest.segments.items()
            )
        for item in listed:
            if not _collectable(item, model, keep_blocks, keep_agents):
                continue
            if item.key in named:
                out.named += 1
            elif now - item.modified < min_age_s:
                out.kept_young += 1
            else:
                if not dry_run:
                    objects.delete(item.key)
                out.deleted.append(item.key)
                out.nbytes += item.size
    return out


def _collectable(item: Listed, model: str, keep_blocks: bool, keep_agents: set[str]) -> bool:
    """Whether ``item`` is one of agentkv's files that ``collect`` may delete."""
    rel = item.key[len(model) + 1 :]
    if is_shared_file(rel):
        return not keep_blocks
    parts = rel.split("/")
    return (
        len(parts) == 3
        and parts[0] == "agents"
        and parts[1] not in keep_agents
        and SEGMENT_KEY_RE.match(parts[2]) is not None
    )
