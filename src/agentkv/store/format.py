"""agentkv's on-disk format (version 1): safetensors files, one agent per directory.

::

    <cache_dir>/<fingerprint[:16]>/agents/<agent_id>/
        manifest.safetensors     the switch point: tokens, spans, text + JSON record
        seg-00000007.safetensors immutable segments of 256-token KV blocks
        .lock                    flock(2) between processes

A *segment* holds consecutive blocks. Inside it, each block is one contiguous
region (see ``csrc/core/block_io.h``) described as ordinary safetensors tensors
``b000003.l017.k.w`` of shape ``[heads, tokens, width]``; one striped CRC-32C
covers each region. Segments are written once under a new name and never
modified, so a reader's mmap never sees a change.

The *manifest* holds the agent's token ids (int32 [n]), each token's byte span
in the text (int32 [n, 2]), the text (uint8), and a JSON record: format
version, model fingerprint and cache geometry, quantization, token count,
generation, segments (name, size, header CRC-32C) and blocks (segment, offset,
length, checksum, tokens), CRC-32Cs of the arrays and of the record itself.
A save writes and fsyncs its new segment, then atomically replaces the
manifest: a crash leaves the old state or the new one, never a mix.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field

import numpy as np

from .. import _ext
from ..errors import CacheFormatError, InvalidRequestError
from ..kv.quant import Component, KVQuant

FORMAT_VERSION = 1
BLOCK_TOKENS = 256
MANIFEST_NAME = "manifest.safetensors"
MANIFEST_KIND = "agentkv-manifest"
SEGMENT_KIND = "agentkv-segment"
SEGMENT_RE = re.compile(r"^seg-\d{8}\.safetensors$")
MAX_HEADER_BYTES = 64 << 20
_DTYPE_CODES = {"uint32": "U32", "float16": "F16", "uint8": "U8", "float32": "F32"}


def segment_name(generation: int) -> str:
    return f"seg-{generation:08d}.safetensors"


@dataclass(frozen=True)
class SegmentRecord:
    size: int
    header_crc: int


@dataclass(frozen=True)
class BlockRecord:
    segment: str
    offset: int
    length: int
    checksum: int
    tokens: int


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
    blocks: list[BlockRecord]
    segments: dict[str, SegmentRecord]
    messages: list | None = None
    updated_at: str = ""
    block_tokens: int = BLOCK_TOKENS
    extra: dict = field(default_factory=dict)

    @property
    def token_count(self) -> int:
        return int(self.tokens.shape[0])

    def components(self) -> list[Component]:
        g = self.geometry
        return self.quant.components(g["kv_heads"], g["key_head_dim"], g["value_head_dim"])

    def block_bytes(self, tokens: int) -> int:
        per_token = sum(c.heads * c.row_bytes for c in self.components())
        return tokens * per_token * self.geometry["num_layers"]


def _crc(data) -> int:
    return _ext.crc32c(memoryview(np.ascontiguousarray(data)).cast("B"))


def encode_manifest(m: Manifest) -> bytes:
    from safetensors.numpy import save

    tokens = np.ascontiguousarray(m.tokens, dtype=np.int32)
    spans = np.ascontiguousarray(m.spans, dtype=np.int32).reshape(-1, 2)
    text = np.frombuffer(m.text, dtype=np.uint8)
    record = {
        "format_version": FORMAT_VERSION,
        "agent_id": m.agent_id,
        "model_fingerprint": m.model_fingerprint,
        "model_name": m.model_name,
        "geometry": m.geometry,
        "quant": m.quant.to_dict(),
        "block_tokens": m.block_tokens,
        "token_count": m.token_count,
        "generation": m.generation,
        "segments": {name: [s.size, s.header_crc] for name, s in sorted(m.segments.items())},
        "blocks": [[b.segment, b.offset, b.length, b.checksum, b.tokens] for b in m.blocks],
        "checksums": {"tokens": _crc(tokens), "spans": _crc(spans), "text": _crc(text)},
        "messages": m.messages,
        "updated_at": m.updated_at,
    }
    text_record = json.dumps(record, separators=(",", ":"))
    metadata = {
        "format": MANIFEST_KIND,
        "agentkv": text_record,
        "agentkv_crc32c": str(_ext.crc32c(text_record.encode())),
    }
    return save({"tokens": tokens, "spans": spans, "text": text}, metadata=metadata)


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
    version = record.get("format_version")
    _require(
        version == FORMAT_VERSION,
        path,
        f"unknown format version {version!r} (this agentkv reads {FORMAT_VERSION})",
    )

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
    checks = record.get("checksums") or {}
    for name, array in (("tokens", tokens), ("spans", spans), ("text", text)):
        _require(checks.get(name) == _crc(array), path, f"{name} checksum mismatch")
    _require(record.get("token_count") == n, path, "token count disagrees with the tokens")
    _require(n > 0, path, "manifest holds no tokens")
    _check_spans(spans, len(text), path)

    try:
        quant = KVQuant(**record["quant"])
        geometry = record["geometry"]
        block_tokens = int(record["block_tokens"])
        generation = int(record["generation"])
        segments = {
            str(name): SegmentRecord(int(size), int(crc))
            for name, (size, crc) in record["segments"].items()
        }
        blocks = [
            BlockRecord(str(s), int(o), int(ln), int(c), int(t))
            for s, o, ln, c, t in record["blocks"]
        ]
    except (KeyError, TypeError, ValueError, InvalidRequestError) as exc:
        raise CacheFormatError(path, f"manifest record is malformed ({exc})") from None
    manifest = Manifest(
        agent_id=str(record.get("agent_id")),
        model_fingerprint=str(record.get("model_fingerprint")),
        model_name=str(record.get("model_name", "")),
        geometry=geometry,
        quant=quant,
        generation=generation,
        tokens=tokens,
        spans=spans,
        text=text.tobytes(),
        blocks=blocks,
        segments=segments,
        messages=record.get("messages"),
        updated_at=str(record.get("updated_at", "")),
        block_tokens=block_tokens,
    )
    _check_blocks(manifest, path)
    return manifest


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
        _require(
            b.segment in m.segments and SEGMENT_RE.match(b.segment) is not None,
            path,
            f"block {i} names an unknown segment {b.segment!r}",
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
    layers: int,
    components: list[Component],
    first_block: int,
    packed: list[tuple],
) -> tuple[bytes, list[tuple]]:
    """The safetensors header for packed block regions (records from ``pack_blocks``).

    Returns the header (length prefix included, padded to 8 bytes) and the
    ``(offset, length, checksum, tokens)`` of each block relative to the data start.
    """
    tensors: dict = {}
    blocks = []
    for i, (_, offset, length, checksum, tokens) in enumerate(packed):
        index = first_block + i
        position = offset
        for layer in range(layers):
            for comp in components:
                size = comp.heads * tokens * comp.row_bytes
                tensors[f"b{index:06d}.l{layer:03d}.{comp.name}"] = {
                    "dtype": _DTYPE_CODES[comp.dtype],
                    "shape": [comp.heads, tokens, comp.width],
                    "data_offsets": [position, position + size],
                }
                position += size
        assert position == offset + length
        blocks.append([index, offset, length, checksum, tokens])
    record = {
        "format_version": FORMAT_VERSION,
        "agent_id": agent_id,
        "model_fingerprint": fingerprint,
        "generation": generation,
        "block_tokens": BLOCK_TOKENS,
        "blocks": blocks,
    }
    header = {
        "__metadata__": {
            "format": SEGMENT_KIND,
            "agentkv": json.dumps(record, separators=(",", ":")),
        },
        **tensors,
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body, blocks
