import struct
import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import _ext


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bitwise CRC-32C (Castagnoli), the textbook definition."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def block_checksum_reference(data: bytes) -> int:
    """Four CRC-32C lanes over interleaved 8-byte words, then the tail (see checksum.h)."""
    words = len(data) // 8
    lanes = [b"".join(data[8 * i : 8 * i + 8] for i in range(j, words, 4)) for j in range(4)]
    parts = [crc32c_reference(lane) for lane in lanes] + [crc32c_reference(data[8 * words :])]
    return crc32c_reference(struct.pack("<5I", *parts))


def test_crc32c_check_value():
    assert _ext.crc32c(b"123456789") == 0xE3069283
    assert _ext.crc32c(b"") == 0
    assert zlib.crc32(b"123456789") == 0xCBF43926  # CRC-32 (zlib) is a different polynomial


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=40))
def test_crc32c_matches_reference_and_continues(a, b):
    assert _ext.crc32c(a) == crc32c_reference(a)
    assert _ext.crc32c(b, _ext.crc32c(a)) == crc32c_reference(a + b)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=700))
def test_block_checksum_matches_its_definition(data):
    assert _ext.block_checksum(data) == block_checksum_reference(data)


def test_block_checksum_sees_a_single_flipped_bit_and_moved_words():
    data = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    reference = _ext.block_checksum(data)
    flipped = bytearray(data)
    flipped[1234] ^= 0x10
    assert _ext.block_checksum(bytes(flipped)) != reference
    swapped = data[8:16] + data[:8] + data[16:]  # two words trade lanes
    assert _ext.block_checksum(swapped) != reference
    rotated = data[32:] + data[:32]  # every word keeps its lane, the order changes
    assert _ext.block_checksum(rotated) != reference
