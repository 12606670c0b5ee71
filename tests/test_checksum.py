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
    stripe = len(data) // 32 * 8
    parts = [crc32c_reference(data[k * stripe : (k + 1) * stripe]) for k in range(4)]
    parts.append(crc32c_reference(data[4 * stripe :]))
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


def test_block_checksum_sees_a_single_flipped_bit_and_swapped_stripes():
    data = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    reference = _ext.block_checksum(data)
    flipped = bytearray(data)
    flipped[1234] ^= 0x10
    assert _ext.block_checksum(bytes(flipped)) != reference
    q = len(data) // 4
    swapped = data[q : 2 * q] + data[:q] + data[2 * q :]
    assert _ext.block_checksum(swapped) != reference
