// float16 <-> float32 on the host: half_to_float exactly (subnormals, infinities and NaNs
// included), one definition for the fused attention and the host shim of the kernel bodies;
// float_to_half rounds to nearest even, as MLX's astype(float16) does.
#pragma once

#include <cstdint>
#include <cstring>

namespace agentkv {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
#if defined(__aarch64__)
  const __fp16 h = static_cast<__fp16>(f);  // the hardware conversion (IEEE, nearest even)
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#elif defined(__FLT16_MAX__)
  const _Float16 h = static_cast<_Float16>(f);  // the conversion MLX's float16_t makes
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t magnitude = x & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) {  // infinity or NaN (quiet, top payload bits kept)
    const uint16_t nan = magnitude > 0x7F800000u ? 0x200u | ((magnitude >> 13) & 0x3FFu) : 0;
    return sign | 0x7C00u | nan;
  }
  if (magnitude >= 0x477FF000u) {  // rounds past the largest half
    return sign | 0x7C00u;
  }
  if (magnitude < 0x38800000u) {  // a half subnormal (or zero): round the shifted mantissa
    if (magnitude < 0x33000001u) {
      return sign;
    }
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14 .. 24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t midpoint = 1u << (shift - 1);
    half += rest > midpoint || (rest == midpoint && (half & 1u));
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((magnitude >> 13) - ((127 - 15) << 10));
  const uint32_t rest = magnitude & 0x1FFFu;
  half += rest > 0x1000u || (rest == 0x1000u && (half & 1u));
  return sign | static_cast<uint16_t>(half);
#endif
}

}  // namespace agentkv
