// Checksums of stored KV blocks.
//
// crc32c() is standard CRC-32C (Castagnoli; check value of "123456789" is
// 0xE3069283). block_checksum() is the checksum agentkv stores for a block
// region: CRC-32C is a serial chain of ~3-cycle steps, so one chain reads only
// ~10 GB/s; four independent chains over four stripes run at memory speed.
//
//   region:  | stripe 0 | stripe 1 | stripe 2 | stripe 3 | tail |
//            each stripe is floor(n / 32) * 8 bytes; the tail is the rest
//   result:  crc32c( le32(c0) le32(c1) le32(c2) le32(c3) le32(c_tail) )
#pragma once

#include <cstddef>
#include <cstdint>

namespace agentkv {

// Continue a CRC-32C over more bytes; start with crc = 0.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);

inline uint32_t crc32c(const void* data, size_t size) {
  return crc32c_extend(0, data, size);
}

uint32_t block_checksum(const void* data, size_t size);

// "sse4.2", "armv8-crc" or "table": which implementation this CPU runs.
const char* crc32c_implementation();

} // namespace agentkv
