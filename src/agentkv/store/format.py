"""agentkv's files on disk (store version 3): safetensors files, shared blocks stored once.

::

    <cache_dir>/<fingerprint[:16]>/
        blocks/<hh>/<hash>.v3.safetensors  one complete 256-token block, named by its chain
                                         hash, written once, shared by every agent naming it
                                         (``<hash>.safetensors``: store version 2, still read)
        agents/<agent_id>/
            manifest.safetensors         the switch point: tokens, spans, text + JSON record
            seg-00000007.safetensors     the agent's private blocks (its partial tail)
            .lock                        flock(2) between processes

A *region* is one block's KV, laid out layer-major (see ``csrc/core/block_io.h``) in one of
two layouts, which the file's name says: *planes* (segments, and block files of store
version 2) described as ordinary safetensors tensors ``b000003.l017.k.w`` / ``l017.k.w`` of
shape ``[heads, tokens, width]``; *groups* (block files of store version 3): per layer, one
extent per 64-token group (every component of the group, head by head: what KVSwap reads
with one ``pread``), tensors ``l017.g2.k.w`` of shape ``[heads, 64, width]``. One striped
CRC-32C covers each region as stored. Files are written once under a new name and never
modified, so a reader's mmap never sees a change.

The *manifest* holds the agent's token ids (int32 [n]), each token's byte span in the text
(int32 [n, 2]), the text (uint8), in KV format 2 the float16 keys of the channel group
still filling (``tail`` [layers, heads, n % channel_tokens, key_dim]: they are not in any
block until the group completes), optionally the float16 keys of the last completed group as
they were computed (``prev`` [layers, heads, channel_tokens, key_dim]: a later turn that cuts
back into that group restores them exactly, as the engine does in memory) and a JSON
record: store version, model fingerprint and cache geometry, quantization, the chain seed
of its block hashes, token count, generation, files (name, size, header CRC-32C) and blocks
(file, offset, length, checksum, tokens, hash), CRC-32Cs of the arrays and of the record
itself. A save writes and fsyncs its new block files and segment, then atomically replaces
the manifest: a crash leaves the old state or the new one, never a mix. Store-version-1
manifests (every block in the agent's own segments, no hashes) and store-version-2
manifests (block files in planes) are still read; ``store/migrate.py`` moves a store's
block files to version 3.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import struct
from dataclasses import dataclass, field

import numpy as np

from .. import _ext
from ..errors import CacheFormatError, InvalidRequestError
from ..format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from ..format.quant import Component, KVQuant

# The store version: the layout of these files (not the KV format of the bytes inside a
# block, ``KVQuant``: a manifest records that separately, under "quant"). Each file keeps
# it under its on-disk key "format_version".
STORE_VERSION = 3
READABLE_STORE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.safetensors"
MANIFEST_KIND = "agentkv-manifest"
SEGMENT_KIND = "agentkv-segment"
BLOCK_KIND = "agentkv-block"
SEGMENT_RE = re.compile(r"^seg-\d{8}\.safetensors$")
# <hash>[.<variant>][.v3].safetensors: a variant (a checksum) names a block file of a hash
# whose bytes differ from those of the hash's own file (``block_file_name``)
BLOCK_FILE_RE = re.compile(
    r"^blocks/([0-9a-f]{2})/([0-9a-f]{64})(\.[0-9a-f]{8})?(\.v3)?\.safetensors$"
)
# How a file lays out its block regions (csrc/core/block_io.h): in planes (segments, block
# files of store version 2) or in groups of GROUP_TOKENS (block files of store version 3).
PLANES, GROUPS = 0, 1
_V3_BLOCK_SUFFIX = ".v3.safetensors"
MAX_HEADER_BYTES = 64 << 20
_DTYPE_CODES = {"uint32": "U32", "float16": "F16", "uint8": "U8", "float32": "F32"}


def segment_name(generation: int) -> str:
    return f"seg-{generation:08d}.safetensors"


def block_file_name(digest: bytes, version: int = STORE_VERSION, variant: int | None = None) -> str:
    """Where a shared block of this store version lives, relative to the model directory.
    ``variant`` (the region's checksum): the file of a block whose hash's own file holds
    other bytes (computed elsewhere: ``SharedBlocks.ensure``)."""
    hex_digest = digest.hex()
    suffix = _V3_BLOCK_SUFFIX if version >= 3 else ".safetensors"
    tag = "" if variant is None else f".{variant:08x}"
    return f"blocks/{hex_digest[:2]}/{hex_digest}{tag}{suffix}"


def is_variant(name: str) -> bool:
    """Whether a block file is a variant (``block_file_name``)."""
    match = BLOCK_FILE_RE.match(name)
    return match is not None and match.group(3) is not None


def is_shared_file(name: str) -> bool:
    return BLOCK_FILE_RE.match(name) is not None


def file_layout(name: str) -> int:
    """GROUPS for a block file of store version 3 (by its name, or a path ending in it),
    else PLANES."""
    return GROUPS if str(name).endswith(_V3_BLOCK_SUFFIX) else PLANES


def block_file_version(name: str) -> int:
    return 3 if file_layout(name) == GROUPS else 2


@dataclass(frozen=True)
class SegmentRecord:
    size: int
    header_crc: int


@dataclass(frozen=True)
class ManifestBlock:
    """Where one block of an agent is stored: a region of a file (a shared block file, or
    one of the agent's segments) and, for a complete block, its chain hash."""

    segment: str  # "blocks/..." (relative to the model dir) or "seg-..." (to the agent's)
    offset: int
    length: int
    checksum: int
    tokens: int
    hash: str | None = None  # hex chain hash (complete blocks; store version 2)


MAX_LINEAGE = 256  # versions a manifest remembers: its own and its local ancestors'


@dataclass(frozen=True)
class RemoteRecord:
    """Where a manifest stands with a fleet's object store (docs/fleet.md): ``lineage`` is
    this state's version (first), then the versions it was saved on top of, newest first,
    at most ``MAX_LINEAGE``. A store's version that is in it is one this state continues."""

    lineage: tuple[str, ...]

    @property
    def version(self) -> str:
        return self.lineage[0]

    def continues(self, version: str | None) -> bool:
        return version in self.lineage

    @classmethod
    def first(cls) -> RemoteRecord:
        return cls((new_version(),))

    def successor(self) -> RemoteRecord:
        """The record of a state saved on top of this one."""
        return RemoteRecord((new_version(), *self.lineage[: MAX_LINEAGE - 1]))

    def to_dict(self) -> dict:
        return {"lineage": list(self.lineage)}

    @classmethod
    def from_dict(cls, record) -> RemoteRecord:
        lineage = record["lineage"]
        if not isinstance(lineage, list) or not 0 < len(lineage) <= MAX_LINEAGE:
            raise ValueError("bad remote lineage")
        if not all(_is_version(v) for v in lineage):
            raise ValueError(f"bad remote version in {lineage[:4]!r}")
        return cls(tuple(lineage))


def new_version() -> str:
    """A fresh, random name for an agent's state."""
    return secrets.token_hex(8)


def _is_version(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 64 and value.isalnum()


@dataclass
class Manifest:
    """An agent's durable state: its text and tokens, and where its KV blocks are."""

    agent_id: str
    model_fingerprint: str
    model_name: str
    geometry: dict
    quant: KVQuant
    generation: int
    tokens: np.ndarray  # int32 [n]
    spans: np.ndarray  # int32 [n, 2], byte offsets into text
    text: bytes
    blocks: list[ManifestBlock]
    segments: dict[str, SegmentRecord]
    messages: list | None = None
    updated_at: str = ""
    block_tokens: int = BLOCK_TOKENS
    chain_seed: str | None = None  # hex; None in store version 1 (the default seed)
    store_version: int = STORE_VERSION
    extra: dict = field(default_factory=dict)
    tail: np.ndarray | None = None  # float16 [layers, heads, n % ct, key_dim]: KV format 2
    prev: np.ndarray | None = None  # float16 [layers, heads, ct, key_dim]: the last full group
    # an agent whose bytes are its own (pool.hashing.private_seed): chain_seed is private,
    # made from its salt's seed and this nonce
    nonce: str | None = None
    remote: RemoteRecord | None = None  # the fleet's object store, where one is used

    def tail_shape(self) -> tuple[int, ...] | None:
        """The shape ``tail`` must have (None: this KV format keeps no tail)."""
        if not self.quant.channel_keys:
            return None
        g = self.geometry
        rows = self.token_count % self.quant.channel_tokens
        return (int(g["num_layers"]), int(g["kv_heads"]), rows, int(g["key_head_dim"]))

    def prev_shape(self) -> tuple[int, ...] | None:
        """The shape ``prev`` has where it may be kept (None: no completed channel group)."""
        shape = self.tail_shape()
        if shape is None or self.token_count < self.quant.channel_tokens:
            return None
        return (*shape[:2], self.quant.channel_tokens, shape[3])

    @property
    def prev_group(self) -> int:
        """The first token of the last completed channel group (what ``prev`` holds)."""
        ct = self.quant.channel_tokens
        return (self.token_count // ct - 1) * ct

    @property
    def token_count(self) -> int:
        return int(self.tokens.shape[0])

    def components(self) -> list[list[Component]]:
        """Every layer's stored components (the KV format's ``layer(i)``)."""
        g = self.geometry
        return self.quant.layer_components(
            int(g["num_layers"]), g["kv_heads"], g["key_head_dim"], g["value_head_dim"]
        )

    def block_bytes(self, tokens: int) -> int:
        g = self.geometry
        return tokens * self.quant.bytes_per_token(
            int(g["num_layers"]), g["kv_heads"], g["key_head_dim"], g["value_head_dim"]
        )


def manifest_version(m: Manifest) -> int:
    """The store version a manifest is written with: 3 if it names a block file of version
    3 (an older agentkv must refuse it: it would read that file in the wrong layout), else
    2, which every agentkv since the shared block files reads."""
    return STORE_VERSION if any(file_layout(name) == GROUPS for name in m.segments) else 2


def _crc(data) -> int:
    array = np.ascontiguousarray(data)
    return _ext.crc32c(memoryview(array.reshape(-1).view(np.uint8)) if array.size else b"")


def encode_manifest(m: Manifest) -> bytes:
    from safetensors.numpy import save

    tokens = np.ascontiguousarray(m.tokens, dtype=np.int32)
    spans = np.ascontiguousarray(m.spans, dtype=np.int32).reshape(-1, 2)
    text = np.frombuffer(m.text, dtype=np.uint8)
    record = {
        # 2 while it names no version-3 block file: an older agentkv reads it (and its
        # collector keeps the files it names) until the agent's blocks move to version 3
        "format_version": manifest_version(m),
        "agent_id": m.agent_id,
        "model_fingerprint": m.model_fingerprint,
        "model_name": m.model_name,
        "geometry": m.geometry,
        "quant": m.quant.to_dict(),
        "block_tokens": m.block_tokens,
        "token_count": m.token_count,
        "generation": m.generation,
        "chain_seed": m.chain_seed,
        "segments": {name: [s.size, s.header_crc] for name, s in sorted(m.segments.items())},
        "blocks": [[b.segment, b.offset, b.length, b.checksum, b.tokens, b.hash] for b in m.blocks],
        "checksums": {"tokens": _crc(tokens), "spans": _crc(spans), "text": _crc(text)},
        "messages": m.messages,
        "updated_at": m.updated_at,
    }
    if m.nonce is not None:
        record["nonce"] = m.nonce
    if m.remote is not None:
        record["remote"] = m.remote.to_dict()
    arrays = {"tokens": tokens, "spans": spans, "text": text}
    if m.tail_shape() is not None:
        if m.tail is None or m.tail.shape != m.tail_shape() or m.tail.dtype != np.float16:
            raise ValueError(f"a manifest in KV format 2 needs its float16 tail {m.tail_shape()}")
        arrays["tail"] = np.ascontiguousarray(m.tail)
        record["checksums"]["tail"] = _crc(arrays["tail"])
    if m.prev is not None:
        if m.prev.shape != m.prev_shape() or m.prev.dtype != np.float16:
            raise ValueError(f"the last channel group's keys must be float16 {m.prev_shape()}")
        arrays["prev"] = np.ascontiguousarray(m.prev)
        record["checksums"]["prev"] = _crc(arrays["prev"])
    text_record = json.dumps(record, separators=(",", ":"))
    metadata = {
        "format": MANIFEST_KIND,
        "agentkv": text_record,
        "agentkv_crc32c": str(_ext.crc32c(text_record.encode())),
    }
    return save(arrays, metadata=metadata)


def read_header(data: bytes, path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts."""
    if len(data) < 8:
        raise CacheFormatError(path, "file is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length < 2 or length > MAX_HEADER_BYTES or length > len(data) - 8:
        raise CacheFormatError(path, f"header length {length} is not sane")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, ValueError) as exc:
        raise CacheFormatError(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CacheFormatError(path, "header is not a JSON object")
    return header, 8 + length


def _require(condition: bool, path, reason: str) -> None:
    if not condition:
        raise CacheFormatError(path, reason)


def decode_manifest(data: bytes, path) -> Manifest:
    """Parse and check a manifest file's bytes; raises CacheFormatError naming what is wrong."""
    record = _manifest_record(data, path)
    arrays = _manifest_arrays(data, record, path)
    manifest = _manifest_of(record, arrays, path)
    _check_blocks(manifest, path)
    if manifest.tail_shape() is not None:
        tail = arrays.get("tail")
        _require(
            tail is not None and tail.dtype == np.float16 and tail.shape == manifest.tail_shape(),
            path,
            f"the keys of the channel group still filling must be float16 {manifest.tail_shape()}",
        )
        _require(record["checksums"].get("tail") == _crc(tail), path, "tail checksum mismatch")
        manifest.tail = tail
    prev = arrays.get("prev")
    if prev is not None:
        shape = manifest.prev_shape()
        _require(
            prev.dtype == np.float16 and prev.shape == shape,
            path,
            f"the last channel group's keys must be float16 {shape}",
        )
        _require(record["checksums"].get("prev") == _crc(prev), path, "prev checksum mismatch")
        manifest.prev = prev
    return manifest


def _manifest_record(data: bytes, path) -> dict:
    """The manifest's JSON record, its checksum and store version checked."""
    header, _ = read_header(data, path)
    meta = header.get("__metadata__")
    _require(
        isinstance(meta, dict) and meta.get("format") == MANIFEST_KIND,
        path,
        "not an agentkv manifest",
    )
    text_record = meta.get("agentkv")
    _require(isinstance(text_record, str), path, "manifest record is missing")
    _require(
        meta.get("agentkv_crc32c") == str(_ext.crc32c(text_record.encode())),
        path,
        "manifest record checksum mismatch",
    )
    try:
        record = json.loads(text_record)
    except ValueError:
        raise CacheFormatError(path, "manifest record is not JSON") from None
    _require(isinstance(record, dict), path, "manifest record is not a JSON object")
    version = record.get("format_version")  # the store version, under its on-disk key
    _require(
        version in READABLE_STORE_VERSIONS,
        path,
        f"unknown store version {version!r} (this agentkv reads {READABLE_STORE_VERSIONS})",
    )
    record["checksums"] = record.get("checksums") or {}
    return record


def manifest_remote(head: bytes, path) -> RemoteRecord | None:
    """The fleet's-store record of a manifest, from its header alone (``head``: the length
    prefix and JSON); CacheFormatError if the header fails its checks."""
    record = _manifest_record(head, path)
    try:
        remote = record.get("remote")
        return None if remote is None else RemoteRecord.from_dict(remote)
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(path, f"manifest record is malformed ({exc})") from None


def _manifest_arrays(data: bytes, record: dict, path) -> dict[str, np.ndarray]:
    """The manifest's tensors, the tokens, spans and text checked against the record."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(data)
    except (SafetensorError, ValueError) as exc:
        raise CacheFormatError(path, f"tensors are unreadable ({exc})") from None
    tokens, spans, text = arrays.get("tokens"), arrays.get("spans"), arrays.get("text")
    _require(
        tokens is not None and spans is not None and text is not None,
        path,
        "manifest lacks tokens, spans or text",
    )
    _require(tokens.dtype == np.int32 and tokens.ndim == 1, path, "tokens must be int32 [n]")
    n = tokens.shape[0]
    _require(spans.dtype == np.int32 and spans.shape == (n, 2), path, "spans must be int32 [n, 2]")
    _require(text.dtype == np.uint8 and text.ndim == 1, path, "text must be uint8 [bytes]")
    checks = record["checksums"]
    for name, array in (("tokens", tokens), ("spans", spans), ("text", text)):
        _require(checks.get(name) == _crc(array), path, f"{name} checksum mismatch")
    _require(record.get("token_count") == n, path, "token count disagrees with the tokens")
    _require(n > 0, path, "manifest holds no tokens")
    _check_spans(spans, len(text), path)
    return arrays


def _manifest_of(record: dict, arrays: dict[str, np.ndarray], path) -> Manifest:
    """The Manifest a checked record and its arrays describe (its tail not yet read)."""
    version = record["format_version"]
    try:
        quant = KVQuant.from_dict(record["quant"])
        geometry = record["geometry"]
        block_tokens = int(record["block_tokens"])
        generation = int(record["generation"])
        segments = {
            str(name): SegmentRecord(int(size), int(crc))
            for name, (size, crc) in record["segments"].items()
        }
        blocks = [_manifest_block(entry, version) for entry in record["blocks"]]
        seed = record.get("chain_seed") if version >= 2 else None
        if seed is not None:
            bytes.fromhex(seed)
        nonce = record.get("nonce")
        if nonce is not None and (seed is None or not str(nonce).isalnum()):
            raise ValueError(f"bad nonce {nonce!r}")
        remote = record.get("remote")
        remote = None if remote is None else RemoteRecord.from_dict(remote)
    except (KeyError, TypeError, ValueError, InvalidRequestError) as exc:
        raise CacheFormatError(path, f"manifest record is malformed ({exc})") from None
    return Manifest(
        agent_id=str(record.get("agent_id")),
        model_fingerprint=str(record.get("model_fingerprint")),
        model_name=str(record.get("model_name", "")),
        geometry=geometry,
        quant=quant,
        generation=generation,
        tokens=arrays["tokens"],
        spans=arrays["spans"],
        text=arrays["text"].tobytes(),
        blocks=blocks,
        segments=segments,
        messages=record.get("messages"),
        updated_at=str(record.get("updated_at", "")),
        block_tokens=block_tokens,
        chain_seed=seed,
        store_version=version,
        nonce=None if nonce is None else str(nonce),
        remote=remote,
    )


def _manifest_block(entry, version: int) -> ManifestBlock:
    if version == 1:
        segment, offset, length, checksum, tokens = entry
        digest = None
    else:
        segment, offset, length, checksum, tokens, digest = entry
        if digest is not None and (len(bytes.fromhex(digest)) != 32):
            raise ValueError(f"bad block hash {digest!r}")
    return ManifestBlock(str(segment), int(offset), int(length), int(checksum), int(tokens), digest)


def _check_spans(spans: np.ndarray, text_len: int, path) -> None:
    starts, ends = spans[:, 0].astype(np.int64), spans[:, 1].astype(np.int64)
    ok = (
        bool(np.all(starts >= 0))
        and bool(np.all(starts <= ends))
        and bool(np.all(ends <= text_len))
        and bool(np.all(np.diff(ends) >= 0))
        and bool(np.all(np.diff(starts) >= 0))
    )
    _require(ok, path, "token spans are not ordered offsets inside the text")


def _check_blocks(m: Manifest, path) -> None:
    _require(
        m.block_tokens == BLOCK_TOKENS, path, f"block size {m.block_tokens} is not {BLOCK_TOKENS}"
    )
    g = m.geometry
    try:
        m.components()
        layers = int(g["num_layers"])
    except (KeyError, TypeError, InvalidRequestError) as exc:
        raise CacheFormatError(path, f"geometry is malformed ({exc})") from None
    _require(layers > 0, path, "geometry has no layers")
    per_token = m.block_bytes(1)
    expected = math.ceil(m.token_count / m.block_tokens)
    _require(
        len(m.blocks) == expected,
        path,
        f"{len(m.blocks)} blocks for {m.token_count} tokens (expected {expected})",
    )
    for i, b in enumerate(m.blocks):
        want = min(m.block_tokens, m.token_count - i * m.block_tokens)
        _require(b.tokens == want, path, f"block {i} holds {b.tokens} tokens, expected {want}")
        _require(b.length == per_token * b.tokens, path, f"block {i} has the wrong length")
        shared = is_shared_file(b.segment)
        _require(
            b.segment in m.segments and (SEGMENT_RE.match(b.segment) is not None or shared),
            path,
            f"block {i} names an unknown segment {b.segment!r}",
        )
        named = b.hash is not None and b.segment in (
            block_file_name(bytes.fromhex(b.hash), block_file_version(b.segment), variant)
            for variant in (None, b.checksum)
        )
        _require(
            not shared or named,
            path,
            f"block {i} names a shared block file that is not its hash's",
        )
        seg = m.segments[b.segment]
        _require(
            0 < b.offset and b.offset + b.length <= seg.size,
            path,
            f"block {i} lies outside segment {b.segment}",
        )


def encode_segment_header(
    *,
    agent_id: str,
    fingerprint: str,
    generation: int,
    components: list[list[Component]],
    first_block: int,
    packed: list[tuple],
) -> tuple[bytes, list[tuple]]:
    """The safetensors header for packed block regions (records from ``KVArena.pack``).

    Returns the header (length prefix included, padded to 8 bytes) and the
    ``(offset, length, checksum, tokens)`` of each block relative to the data start.
    """
    tensors: dict = {}
    blocks = []
    for i, (_, offset, length, checksum, tokens) in enumerate(packed):
        index = first_block + i
        end = _add_region(tensors, f"b{index:06d}.", components, tokens, offset)
        assert end == offset + length
        blocks.append([index, offset, length, checksum, tokens])
    record = {
        "format_version": STORE_VERSION,
        "agent_id": agent_id,
        "model_fingerprint": fingerprint,
        "generation": generation,
        "block_tokens": BLOCK_TOKENS,
        "blocks": blocks,
    }
    return _safetensors_header(SEGMENT_KIND, record, tensors), blocks


def _add_region(
    tensors: dict, prefix: str, components, tokens: int, start: int, *, grouped: bool = False
) -> int:
    """Describe one block region (layer-major from ``start``) as tensors: in planes
    ``<prefix>l017.k.w`` [heads, tokens, width], or ``grouped`` ``<prefix>l017.g2.k.w``
    [heads, rows, width] per 64-token group; returns where the region ends."""
    position = start
    span = GROUP_TOKENS if grouped else tokens
    for layer, comps in enumerate(components):
        parts = [
            (c.name, _DTYPE_CODES[c.dtype], c.heads, c.width, c.heads * c.row_bytes) for c in comps
        ]
        for group, first in enumerate(range(0, tokens, span)):
            rows = min(span, tokens - first)
            stem = f"{prefix}l{layer:03d}.g{group}." if grouped else f"{prefix}l{layer:03d}."
            for name, dtype, heads, width, row_bytes in parts:
                size = rows * row_bytes
                tensors[stem + name] = {
                    "dtype": dtype,
                    "shape": [heads, rows, width],
                    "data_offsets": [position, position + size],
                }
                position += size
    return position


def _safetensors_header(kind: str, record: dict, tensors: dict | str) -> bytes:
    """A safetensors header (length prefix included, padded to 8 bytes) whose metadata
    names the file's ``kind`` and holds agentkv's JSON ``record``; ``tensors`` as a dict, or
    as its JSON members already written (``_block_tensors``: the same bytes)."""
    metadata = {"format": kind, "agentkv": json.dumps(record, separators=(",", ":"))}
    if isinstance(tensors, str):
        head = json.dumps({"__metadata__": metadata}, separators=(",", ":"))
        body = (head[:-1] + "," + tensors + "}").encode()
    else:
        body = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


@functools.lru_cache(maxsize=16)
def _block_tensors(components: tuple[tuple[Component, ...], ...], version: int) -> str:
    """A block file's tensors (its region, then ``tokens``) as JSON object members, written
    once per format and store version: the same for every full block (a version-3 file
    names ~720 of them)."""
    tensors: dict = {}
    length = _add_region(tensors, "", components, BLOCK_TOKENS, 0, grouped=version >= 3)
    tensors["tokens"] = {
        "dtype": "I32",
        "shape": [BLOCK_TOKENS],
        "data_offsets": [length, length + 4 * BLOCK_TOKENS],
    }
    return json.dumps(tensors, separators=(",", ":"))[1:-1]


@dataclass(frozen=True)
class StoredBlock:
    """A shared block file as found on disk: what a manifest records to name it, and the
    token ids it holds (a hit by hash is confirmed by comparing them)."""

    name: str  # relative to the model directory
    size: int
    header_crc: int
    offset: int
    length: int
    checksum: int
    tokens: tuple[int, ...]
    parent: bytes = b""  # the chain hash of the blocks before it


def encode_block_header(
    *,
    fingerprint: str,
    digest: bytes,
    parent: bytes,
    components: list[list[Component]],
    length: int,
    checksum: int,
    version: int = STORE_VERSION,
) -> bytes:
    """The safetensors header of a shared block file of store ``version`` (3: groups, 2:
    planes): the region's tensors (``l017.g2.k.w`` [heads, 64, width] or ``l017.k.w``
    [heads, 256, width]), then ``tokens`` int32 [256] (length prefix included, padded)."""
    tensors = _block_tensors(tuple(tuple(c) for c in components), version)
    assert f'"data_offsets":[{length},{length + 4 * BLOCK_TOKENS}]' in tensors[-60:]
    record = {
        "format_version": version,
        "model_fingerprint": fingerprint,
        "hash": digest.hex(),
        "parent": parent.hex(),
        "block_tokens": BLOCK_TOKENS,
        "checksum": checksum,
    }
    return _safetensors_header(BLOCK_KIND, record, tensors)


def decode_block_file(
    head: bytes,
    tail: bytes,
    path,
    *,
    name: str,
    size: int,
    fingerprint: str,
    digest: bytes,
    length: int,
) -> StoredBlock:
    """Check a shared block file's header (``head``: the length prefix and JSON) and its
    token ids (``tail``: the 1 KiB after the region)."""
    header, data_start = read_header(head, path)
    meta = header.get("__metadata__")
    _require(isinstance(meta, dict) and meta.get("format") == BLOCK_KIND, path, "not a block file")
    try:
        record = json.loads(meta["agentkv"])
        checksum = int(record["checksum"])
        parent = bytes.fromhex(record["parent"])
    except (KeyError, TypeError, ValueError):
        raise CacheFormatError(path, "block record is malformed") from None
    _require(
        record.get("format_version") == block_file_version(name),
        path,
        "block store version does not match the file's name",
    )
    _require(record.get("model_fingerprint") == fingerprint, path, "another model's block")
    _require(record.get("hash") == digest.hex(), path, "block file holds another hash")
    _require(size == data_start + length + 4 * BLOCK_TOKENS, path, "block file has the wrong size")
    _require(len(tail) == 4 * BLOCK_TOKENS, path, "block file lacks its token ids")
    tokens = tuple(int(t) for t in np.frombuffer(tail, dtype="<i4"))
    return StoredBlock(
        name, size, _ext.crc32c(head[8:]), data_start, length, checksum, tokens, parent
    )
