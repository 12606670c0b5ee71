"""SharedBlocks: complete KV blocks stored once, by chain hash, for every agent of a model.

::

    <model_dir>/blocks/<hh>/<hash>.v3.safetensors  header | region (layer-major, in groups)
                                                   | token ids  (store version 3)
    <model_dir>/blocks/<hh>/<hash>.safetensors     the same, region in planes (version 2:
                                                   read, shared, moved to 3 by migrate.py)
    <model_dir>/.blocks.lock                       flock(2): writers shared, the collector
                                                   exclusive

A block file is written once (``paths.atomic_write_bytes``: temporary name, fsync, rename;
its directory fsynced by ``sync_dirs`` before a manifest names it) and never modified.
Writers hold the lock *shared* from before they write or check a block file until their
manifest naming it is switched; the collector holds it *exclusive* while it deletes the
block files no manifest names. So a block file exists before any manifest names it, and
is deleted only when no switched manifest names it — across processes too.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import _ext
from .._faults import crash_point
from ..errors import CacheFormatError
from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant
from ..format.spec import ModelCacheSpec
from ..paths import FILE_MODE, atomic_write_bytes, atomic_write_text, fsync_dir, secure_mkdir
from .format import (
    BLOCK_FILE_RE,
    GROUPS,
    STORE_VERSION,
    StoredBlock,
    block_file_name,
    decode_block_file,
    encode_block_header,
    file_layout,
    read_header,
)

log = logging.getLogger("agentkv.store")

MAX_HEAD_BYTES = 1 << 20


class SwapFile(NamedTuple):
    """A block file as KVSwap reads it (its path and where its KV region starts) and as the
    pool's loader verifies it (``KVArena.read_regions``)."""

    path: str
    offset: int
    length: int
    checksum: int
    size: int
    header_crc: int
    tokens: tuple[int, ...]
    layout: int  # GROUPS: what KVSwap reads


class SharedBlocks:
    def __init__(self, model_dir: Path, spec: ModelCacheSpec, quant: KVQuant):
        self._setup(model_dir, spec.fingerprint, spec.components(quant))

    @classmethod
    def of_manifest(cls, model_dir: Path, manifest) -> SharedBlocks:
        """The block files of a stored agent's model, as its manifest describes them."""
        shared = cls.__new__(cls)
        shared._setup(model_dir, manifest.model_fingerprint, manifest.components())
        return shared

    def _setup(self, model_dir: Path, fingerprint: str, components) -> None:
        self.model_dir = Path(model_dir)
        self.dir = self.model_dir / "blocks"
        self.fingerprint = fingerprint
        self.components = components
        self.region_bytes = BLOCK_TOKENS * sum(
            c.heads * c.row_bytes for comps in components for c in comps
        )

    def path(self, name: str) -> Path:
        return self.model_dir / name

    # -- locking ------------------------------------------------------------------------

    def writing(self):
        """Held (shared) by a save from its first block file to its manifest switch."""
        return blocks_writing(self.model_dir)

    def hold(self) -> ExitStack:
        """``writing()`` held past one call, until ``close()`` (or garbage collection): by a
        KVSwap agent from the first block file its swap writes until the manifest naming
        them is switched (the writer closes it)."""
        held = ExitStack()
        held.enter_context(self.writing())
        return held

    # -- reading ------------------------------------------------------------------------

    def find(self, digest: bytes) -> StoredBlock | None:
        """The stored block with this hash, if there is a sound one (a damaged file is
        moved to quarantine and reported as absent): the hash's own store-version-3 file,
        else its version-2 file (never a variant: ``ensure``)."""
        found = self.find_file(block_file_name(digest), digest)
        if found is None:
            found = self.find_file(block_file_name(digest, 2), digest)
        return found

    def find_file(self, name: str, digest: bytes) -> StoredBlock | None:
        path = self.path(name)
        length = self.region_bytes
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                prefix = fh.read(8)
                if len(prefix) < 8:
                    raise CacheFormatError(path, "file is shorter than a safetensors header")
                header_len = int.from_bytes(prefix, "little")
                if header_len > MAX_HEAD_BYTES:
                    raise CacheFormatError(path, f"header length {header_len} is not sane")
                head = prefix + fh.read(header_len)
                _, data_start = read_header(head, path)
                fh.seek(data_start + length)
                tail = fh.read(4 * BLOCK_TOKENS)
            return decode_block_file(
                head,
                tail,
                path,
                name=name,
                size=size,
                fingerprint=self.fingerprint,
                digest=digest,
                length=length,
            )
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("agentkv: cannot read block file %s: %s", path, exc)
            return None
        except CacheFormatError as exc:
            self.quarantine(name, exc.reason)
            return None

    # -- writing ------------------------------------------------------------------------

    def ensure(
        self,
        digest: bytes,
        parent: bytes,
        tokens,
        region: memoryview,
        checksum: int,
        *,
        version: int = STORE_VERSION,
    ) -> StoredBlock:
        """The block file of ``digest`` holding exactly ``region`` (laid out for store
        ``version``: groups for 3), written where missing: the hash's own file where its
        bytes are these (read and compared), else a *variant* named by the hash and the
        checksum (the hash's own file holds other bytes: computed by an earlier agentkv or
        another machine). So a file is reused only for the bytes it holds; one whose bytes
        no longer match its own checksum is quarantined and written again.

        Call inside ``writing()``. The file is fsynced and renamed into place (fault points
        ``block-written``, ``block-renamed``); its directory is fsynced by ``sync_dirs``
        before any manifest names it.
        """
        name = block_file_name(digest, version)
        found = self._holding(name, digest, region)
        if found is None:
            return self.write(digest, parent, tokens, region, checksum, version)
        if found is not True:
            return found
        variant = block_file_name(digest, version, checksum)
        other = self._holding(variant, digest, region)
        if other is not None and other is not True:
            return other
        log.warning(
            "agentkv: block file %s holds other bytes than this block of the same tokens; "
            "writing this one as %s",
            name,
            variant,
        )
        return self.write(digest, parent, tokens, region, checksum, version, variant=checksum)

    def _holding(self, name: str, digest: bytes, region) -> StoredBlock | bool | None:
        """The sound block file ``name`` if its region's bytes are ``region``'s; True if it
        is sound and holds other bytes; None if there is none (a damaged one is moved to
        quarantine: a region that does not match its own checksum too)."""
        found = self.find_file(name, digest)
        if found is None:
            return None
        try:
            with open(self.path(name), "rb") as fh:
                fh.seek(found.offset)
                held = fh.read(found.length)
        except OSError as exc:
            log.warning("agentkv: cannot read block file %s: %s", name, exc)
            return True  # kept, not taken
        if len(held) == found.length and held == bytes(region):
            return found
        if len(held) != found.length or _ext.block_checksum(np.frombuffer(held, np.uint8)) != (
            found.checksum
        ):
            self.quarantine(name, "block region does not match its checksum")
            return None
        return True

    def write(
        self,
        digest: bytes,
        parent: bytes,
        tokens,
        region,
        checksum: int,
        version: int = STORE_VERSION,
        *,
        variant: int | None = None,
    ) -> StoredBlock:
        """Write the block file of ``digest`` of store ``version`` from ``region`` (laid out
        for that version: groups for 3, planes for 2), as ``ensure`` does (``variant``: the
        name of a variant)."""
        name = block_file_name(digest, version, variant)
        path = self.path(name)
        secure_mkdir(path.parent)
        header = encode_block_header(
            fingerprint=self.fingerprint,
            digest=digest,
            parent=parent,
            components=self.components,
            length=len(region),
            checksum=checksum,
            version=version,
        )
        ids = np.ascontiguousarray(tokens, dtype="<i4")
        if ids.shape != (BLOCK_TOKENS,):
            raise ValueError("a block file holds exactly one complete block")
        atomic_write_bytes(path, header, region, ids, label="block", sync_dir=False)
        # what find_file would read back from it (without parsing a ~57 KB header again)
        return StoredBlock(
            name,
            len(header) + len(region) + ids.nbytes,
            _ext.crc32c(header[8:]),
            len(header),
            len(region),
            checksum,
            tuple(int(t) for t in ids),
            bytes(parent),
        )

    def ensure_pool_blocks(self, pool, blocks: list[int]) -> list[SwapFile]:
        """The block files of these complete, sealed pool blocks (written where missing,
        their directories synced): where KVSwap reads them back (``pool/swap.py``). Call
        inside ``writing()``."""
        records = pool.blocks.records
        if any(records[b].hash is None or not records[b].full for b in blocks):
            raise ValueError("only complete, sealed blocks have block files")
        packed, regions = pool.arena.pack(
            blocks, [BLOCK_TOKENS] * len(blocks), [GROUPS] * len(blocks)
        )
        view = memoryview(packed)
        found = []
        for block, (_, offset, length, checksum, _count) in zip(blocks, regions):
            record = records[block]
            region = view[offset : offset + length]
            stored = self.ensure(record.hash, record.parent, record.tokens, region, checksum)
            found.append(stored)
        self.sync_dirs([f.name for f in found])
        return [
            SwapFile(
                str(self.path(f.name)),
                f.offset,
                f.length,
                f.checksum,
                f.size,
                f.header_crc,
                f.tokens,
                file_layout(f.name),
            )
            for f in found
        ]

    def sync_dirs(self, names) -> None:
        """fsync the directories of these block files (and ``blocks/`` itself)."""
        dirs = {self.path(name).parent for name in names}
        for directory in sorted(dirs):
            fsync_dir(directory)
        if dirs:
            fsync_dir(self.dir)

    # -- collecting ---------------------------------------------------------------------

    def collect(self, *, wait: bool = True) -> int:
        """Delete the block files no manifest names (see ``collect_block_files``)."""
        return collect_block_files(self.model_dir, wait=wait)

    def quarantine(self, name: str, reason: str) -> Path | None:
        """Move a damaged block file aside (kept, never deleted)."""
        from .. import _ext

        path = self.path(name)
        if not path.exists():
            return None
        target_dir = self.model_dir / "quarantine" / "blocks"
        secure_mkdir(target_dir)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        target = target_dir / f"{path.name}.{stamp}"
        _ext.forget_mappings([str(path)])
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None
        atomic_write_text(target_dir / f"{target.name}.REASON.txt", reason + "\n")
        log.warning("agentkv: quarantined block file %s to %s: %s", path, target, reason)
        return target

    def disk_bytes(self) -> int:
        if not self.dir.exists():
            return 0
        total = 0
        for sub in self.dir.iterdir():
            for entry in sub.iterdir() if sub.is_dir() else ():
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    continue
        return total


def blocks_writing(model_dir: Path):
    """``SharedBlocks.writing()`` for a model directory."""
    return _locked(Path(model_dir), fcntl.LOCK_SH)


@contextmanager
def _locked(model_dir: Path, mode: int, *, busy_ok: bool = False) -> Iterator[bool]:
    """The block files' lock in ``mode``; yields whether it is held (False only with
    ``busy_ok`` and LOCK_NB, when another holder has it)."""
    secure_mkdir(model_dir)
    fd = os.open(model_dir / ".blocks.lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            if not busy_ok:
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


def named_block_files(model_dir: Path) -> set[str]:
    """The block files the manifests of a model's agents (quarantined ones too) name."""
    from .format import MANIFEST_NAME, decode_manifest, is_shared_file

    named = set()
    # Agents first, then quarantine: an agent directory moved aside after the first glob
    # is found by the second. A manifest that cannot be read for another reason than its
    # format (or its move) stops the collection: it may name files still needed.
    for folder in ("agents", "quarantine"):
        for path in (model_dir / folder).glob(f"*/{MANIFEST_NAME}"):
            try:
                manifest = decode_manifest(path.read_bytes(), path)
            except (FileNotFoundError, CacheFormatError):
                continue  # moved aside (seen in quarantine), or names nothing loadable
            named.update(name for name in manifest.segments if is_shared_file(name))
    return named


def collect_block_files(model_dir: Path, *, wait: bool = True) -> int:
    """Delete every block file (and leftover temporary file) of a model that no manifest
    names; returns how many. The manifests are read under the exclusive lock, so no save
    can name a file between the mark and the sweep. ``wait=False``: nothing now (0) if a
    save (or a swapped agent) holds the lock; a later collection gets the files."""
    from .. import _ext

    blocks = Path(model_dir) / "blocks"
    if not blocks.exists():
        return 0
    mode = fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB
    with _locked(Path(model_dir), mode, busy_ok=not wait) as held:
        if not held:
            return 0
        keep = named_block_files(Path(model_dir))
        dead = []
        for sub in blocks.iterdir():
            if not sub.is_dir():
                continue
            for entry in sub.iterdir():
                name = f"blocks/{sub.name}/{entry.name}"
                if entry.name.endswith(".tmp") or (BLOCK_FILE_RE.match(name) and name not in keep):
                    dead.append(entry)
        _ext.forget_mappings([str(p) for p in dead])
        for entry in dead:
            entry.unlink(missing_ok=True)
            crash_point("block-collected")
    return len(dead)
