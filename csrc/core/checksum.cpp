#include "checksum.h"

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

constexpr uint32_t kPoly = 0x82F63B78u; // CRC-32C, reflected

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
HW_TARGET uint32_t update_hw(uint32_t state, const uint8_t* p, size_t n) {
  uint64_t s = state;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    s = _mm_crc32_u64(s, load64(p + i));
  }
  uint32_t s32 = static_cast<uint32_t>(s);
  for (; i < n; ++i) {
    s32 = _mm_crc32_u8(s32, p[i]);
  }
  return s32;
}
HW_TARGET void update4_hw(uint32_t* states, const uint8_t* p, size_t stripe) {
  uint64_t a = states[0], b = states[1], c = states[2], d = states[3];
  for (size_t i = 0; i < stripe; i += 8) {
    a = _mm_crc32_u64(a, load64(p + i));
    b = _mm_crc32_u64(b, load64(p + stripe + i));
    c = _mm_crc32_u64(c, load64(p + 2 * stripe + i));
    d = _mm_crc32_u64(d, load64(p + 3 * stripe + i));
  }
  states[0] = static_cast<uint32_t>(a);
  states[1] = static_cast<uint32_t>(b);
  states[2] = static_cast<uint32_t>(c);
  states[3] = static_cast<uint32_t>(d);
}
bool have_hw() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}
#elif defined(AGENTKV_CRC_ARM)
#define HW_TARGET __attribute__((target("crc")))
HW_TARGET uint32_t update_hw(uint32_t state, const uint8_t* p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    state = __crc32cd(state, load64(p + i));
  }
  for (; i < n; ++i) {
    state = __crc32cb(state, p[i]);
  }
  return state;
}
HW_TARGET void update4_hw(uint32_t* states, const uint8_t* p, size_t stripe) {
  uint32_t a = states[0], b = states[1], c = states[2], d = states[3];
  for (size_t i = 0; i < stripe; i += 8) {
    a = __crc32cd(a, load64(p + i));
    b = __crc32cd(b, load64(p + stripe + i));
    c = __crc32cd(c, load64(p + 2 * stripe + i));
    d = __crc32cd(d, load64(p + 3 * stripe + i));
  }
  states[0] = a;
  states[1] = b;
  states[2] = c;
  states[3] = d;
}
bool have_hw() {
  return true; // every ARMv8.1+ core, Apple silicon included, has CRC32
}
#else
uint32_t update_hw(uint32_t state, const uint8_t* p, size_t n) {
  return update_table(state, p, n);
}
void update4_hw(uint32_t* states, const uint8_t* p, size_t stripe) {
  for (int k = 0; k < 4; ++k) {
    states[k] = update_table(states[k], p + k * stripe, stripe);
  }
}
bool have_hw() {
  return false;
}
#endif

uint32_t update(uint32_t state, const uint8_t* p, size_t n) {
  return have_hw() ? update_hw(state, p, n) : update_table(state, p, n);
}

} // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  return ~update(~crc, static_cast<const uint8_t*>(data), size);
}

uint32_t block_checksum(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  const size_t stripe = size / 32 * 8;
  uint32_t states[4] = {~0u, ~0u, ~0u, ~0u};
  if (have_hw()) {
    update4_hw(states, p, stripe);
  } else {
    for (int k = 0; k < 4; ++k) {
      states[k] = update_table(states[k], p + k * stripe, stripe);
    }
  }
  uint8_t parts[20];
  for (int k = 0; k < 4; ++k) {
    const uint32_t c = ~states[k];
    std::memcpy(parts + 4 * k, &c, 4); // little-endian on every target we build for
  }
  const uint32_t tail = crc32c(p + 4 * stripe, size - 4 * stripe);
  std::memcpy(parts + 16, &tail, 4);
  return crc32c(parts, sizeof(parts));
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

} // namespace agentkv
