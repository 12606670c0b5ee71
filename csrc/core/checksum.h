// Checksums of stored KV blocks.
//
// crc32c() is standard CRC-32C (Castagnoli; check value of "123456789" is
// 0xE3069283). BlockChecksum is the checksum agentkv stores for a block
// region: CRC-32C is a serial chain of ~3-cycle steps, so one chain reads only
// ~10 GB/s; four chains over interleaved 8-byte words run at memory speed, and
// the region can be fed in pieces, in order, right after each piece is copied
// (the loader checksums what it just read while it is still in L1).
//
//   region:  w0 w1 w2 w3 w4 w5 ... w(m-1) tail     (8-byte words, < 8 tail bytes)
//   lane j:  crc32c of words j, j+4, j+8, ...
//   result:  crc32c( le32(lane0) le32(lane1) le32(lane2) le32(lane3) le32(crc32c(tail)) )
#pragma once

#include <cstddef>
#include <cstdint>

namespace agentkv {

// Continue a CRC-32C over more bytes; start with crc = 0.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);

inline uint32_t crc32c(const void* data, size_t size) {
  return crc32c_extend(0, data, size);
}

class BlockChecksum {
 public:
  void update(const void* data, size_t size);
  uint32_t finish() const;

 private:
  void feed_word(uint64_t word);
  uint32_t lanes_[4] = {~0u, ~0u, ~0u, ~0u};  // raw CRC registers
  uint64_t words_ = 0;                        // words fed: the next goes to lane words_ % 4
  uint8_t pending_[8] = {};
  size_t pending_size_ = 0;
};

uint32_t block_checksum(const void* data, size_t size);

// "sse4.2", "armv8-crc" or "table": which implementation this CPU runs.
const char* crc32c_implementation();

}  // namespace agentkv
