#include "checksum.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define AGENTKV_CRC_X86 1
#elif defined(__aarch64__)
#include <arm_acle.h>
#define AGENTKV_CRC_ARM 1
#endif

namespace agentkv {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    }
    table[i] = c;
  }
  return table;
}
constexpr auto kTable = make_table();

// The raw register update (no pre/post inversion), one byte at a time.
uint32_t update_table(uint32_t state, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    state = kTable[(state ^ p[i]) & 0xFF] ^ (state >> 8);
  }
  return state;
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

#if defined(AGENTKV_CRC_X86)
#define HW_TARGET __attribute__((target("sse4.2")))
HW_TARGET inline uint32_t step_hw(uint32_t state, uint64_t word) {
  return static_cast<uint32_t>(_mm_crc32_u64(state, word));
}
HW_TARGET inline uint32_t step_byte_hw(uint32_t state, uint8_t byte) {
  return _mm_crc32_u8(state, byte);
}
bool have_hw() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}
#elif defined(AGENTKV_CRC_ARM)
#define HW_TARGET __attribute__((target("crc")))
HW_TARGET inline uint32_t step_hw(uint32_t state, uint64_t word) {
  return __crc32cd(state, word);
}
HW_TARGET inline uint32_t step_byte_hw(uint32_t state, uint8_t byte) {
  return __crc32cb(state, byte);
}
bool have_hw() {
  return true;  // every ARMv8.1+ core, Apple silicon included, has CRC32
}
#else
#define HW_TARGET
inline uint32_t step_hw(uint32_t state, uint64_t word) {
  uint8_t bytes[8];
  std::memcpy(bytes, &word, 8);
  return update_table(state, bytes, 8);
}
inline uint32_t step_byte_hw(uint32_t state, uint8_t byte) {
  return update_table(state, &byte, 1);
}
bool have_hw() {
  return false;
}
#endif

inline uint32_t step(uint32_t state, uint64_t word) {
  if (have_hw()) {
    return step_hw(state, word);
  }
  uint8_t bytes[8];
  std::memcpy(bytes, &word, 8);
  return update_table(state, bytes, 8);
}

HW_TARGET uint32_t update_hw(uint32_t state, const uint8_t* p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    state = step_hw(state, load64(p + i));
  }
  for (; i < n; ++i) {
    state = step_byte_hw(state, p[i]);
  }
  return state;
}

// Four words at a time into the four lanes: four independent dependency chains.
HW_TARGET size_t update4_hw(uint32_t* lanes, const uint8_t* p, size_t n) {
  uint32_t a = lanes[0], b = lanes[1], c = lanes[2], d = lanes[3];
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = step_hw(a, load64(p + i));
    b = step_hw(b, load64(p + i + 8));
    c = step_hw(c, load64(p + i + 16));
    d = step_hw(d, load64(p + i + 24));
  }
  lanes[0] = a;
  lanes[1] = b;
  lanes[2] = c;
  lanes[3] = d;
  return i;
}

uint32_t update(uint32_t state, const uint8_t* p, size_t n) {
  return have_hw() ? update_hw(state, p, n) : update_table(state, p, n);
}

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  return ~update(~crc, static_cast<const uint8_t*>(data), size);
}

void BlockChecksum::feed_word(uint64_t word) {
  uint32_t& lane = lanes_[words_ % 4];
  lane = step(lane, word);
  ++words_;
}

void BlockChecksum::update(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (pending_size_) {
    const size_t take = std::min(size, 8 - pending_size_);
    std::memcpy(pending_ + pending_size_, p, take);
    pending_size_ += take;
    p += take;
    size -= take;
    if (pending_size_ < 8) {
      return;
    }
    feed_word(load64(pending_));
    pending_size_ = 0;
  }
  while (size >= 8 && words_ % 4 != 0) {
    feed_word(load64(p));
    p += 8;
    size -= 8;
  }
  if (have_hw() && size >= 32) {
    const size_t done = update4_hw(lanes_, p, size);
    words_ += done / 8;
    p += done;
    size -= done;
  }
  while (size >= 8) {
    feed_word(load64(p));
    p += 8;
    size -= 8;
  }
  std::memcpy(pending_, p, size);
  pending_size_ = size;
}

uint32_t BlockChecksum::finish() const {
  uint8_t parts[20];
  for (int k = 0; k < 4; ++k) {
    const uint32_t c = ~lanes_[k];
    std::memcpy(parts + 4 * k, &c, 4);  // little-endian on every target we build for
  }
  const uint32_t tail = crc32c(pending_, pending_size_);
  std::memcpy(parts + 16, &tail, 4);
  return crc32c(parts, sizeof(parts));
}

uint32_t block_checksum(const void* data, size_t size) {
  BlockChecksum sum;
  sum.update(data, size);
  return sum.finish();
}

const char* crc32c_implementation() {
#if defined(AGENTKV_CRC_X86)
  return have_hw() ? "sse4.2" : "table";
#elif defined(AGENTKV_CRC_ARM)
  return "armv8-crc";
#else
  return "table";
#endif
}

}  // namespace agentkv
