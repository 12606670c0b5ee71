// Eight float lanes for the host kernels: portable C++, (x86) AVX2 + FMA + F16C and
// (aarch64) NEON, two 4-lane registers. All do the same operations per lane in the same
// order (fused multiply-adds where the vector code has them), so a kernel written once over
// `Ops` gives the same bits on each.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace agentkv::lanes {

// exp(x) for x <= 0 (a softmax's score - max, a sigmoid's -|x|): Cephes' polynomial, in
// one fixed sequence of fused multiply-adds so every implementation rounds alike.
struct ExpConstants {
  static constexpr float kLow = -87.0f;
  static constexpr float kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f;
  static constexpr float kLn2Lo = -2.12194440e-4f;
  static constexpr float kP0 = 1.9875691500e-4f;
  static constexpr float kP1 = 1.3981999507e-3f;
  static constexpr float kP2 = 8.3334519073e-3f;
  static constexpr float kP3 = 4.1665795894e-2f;
  static constexpr float kP4 = 1.6666665459e-1f;
  static constexpr float kP5 = 5.0000001201e-1f;
};

// The portable 8-lane operations.
struct Portable : ExpConstants {
  struct V {
    float x[8];
  };
  static V load(const float* p) {
    V v;
    std::memcpy(v.x, p, sizeof(v.x));
    return v;
  }
  static void store(float* p, V v) {
    std::memcpy(p, v.x, sizeof(v.x));
  }
  static V set1(float f) {
    V v;
    std::fill(v.x, v.x + 8, f);
    return v;
  }
  static V zero() {
    return set1(0.0f);
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < 8; ++i) {
      c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
    }
    return c;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < 8; ++i) {
      a.x[i] *= b.x[i];
    }
    return a;
  }
  static V add(V a, V b) {
    for (int i = 0; i < 8; ++i) {
      a.x[i] += b.x[i];
    }
    return a;
  }
  static V max(V a, V b) {
    for (int i = 0; i < 8; ++i) {
      a.x[i] = std::max(a.x[i], b.x[i]);
    }
    return a;
  }
  static V sub(V a, V b) {
    for (int i = 0; i < 8; ++i) {
      a.x[i] -= b.x[i];
    }
    return a;
  }
  static V div(V a, V b) {
    for (int i = 0; i < 8; ++i) {
      a.x[i] /= b.x[i];
    }
    return a;
  }
  static V neg_abs(V a) {  // -|a|
    for (int i = 0; i < 8; ++i) {
      a.x[i] = -std::fabs(a.x[i]);
    }
    return a;
  }
  static V select_nonneg(V x, V a, V b) {  // x >= 0 ? a : b, per lane
    for (int i = 0; i < 8; ++i) {
      a.x[i] = x.x[i] >= 0.0f ? a.x[i] : b.x[i];
    }
    return a;
  }
  static float half(uint16_t h) {
    return half_to_float(h);
  }
  static V halves(const uint16_t* p) {  // eight float16 -> float, exactly
    V v;
    for (int i = 0; i < 8; ++i) {
      v.x[i] = half_to_float(p[i]);
    }
    return v;
  }
  static float hsum(V v) {  // the order of agentkv's GEMM lanes
    return ((v.x[0] + v.x[4]) + (v.x[2] + v.x[6])) + ((v.x[1] + v.x[5]) + (v.x[3] + v.x[7]));
  }
  static float exp1(float x) {
    x = std::max(x, kLow);
    const float n = std::nearbyint(x * kLog2e);
    float r = std::fma(n, -kLn2Hi, x);
    r = std::fma(n, -kLn2Lo, r);
    float p = kP0;
    p = std::fma(p, r, kP1);
    p = std::fma(p, r, kP2);
    p = std::fma(p, r, kP3);
    p = std::fma(p, r, kP4);
    p = std::fma(p, r, kP5);
    p = std::fma(p, r * r, r);
    p = p + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
  }
  static V exp(V v) {
    for (int i = 0; i < 8; ++i) {
      v.x[i] = exp1(v.x[i]);
    }
    return v;
  }
};

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

struct Avx2 : ExpConstants {
  using V = __m256;
  static V load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  static void store(float* p, V v) {
    _mm256_storeu_ps(p, v);
  }
  static V set1(float f) {
    return _mm256_set1_ps(f);
  }
  static V zero() {
    return _mm256_setzero_ps();
  }
  static V fma(V a, V b, V c) {
    return _mm256_fmadd_ps(a, b, c);
  }
  static V mul(V a, V b) {
    return _mm256_mul_ps(a, b);
  }
  static V add(V a, V b) {
    return _mm256_add_ps(a, b);
  }
  static V max(V a, V b) {
    return _mm256_max_ps(a, b);
  }
  static V sub(V a, V b) {
    return _mm256_sub_ps(a, b);
  }
  static V div(V a, V b) {
    return _mm256_div_ps(a, b);
  }
  static V neg_abs(V a) {
    return _mm256_or_ps(a, _mm256_set1_ps(-0.0f));
  }
  static V select_nonneg(V x, V a, V b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static float half(uint16_t h) {  // exact, as half_to_float
    return _cvtsh_ss(h);
  }
  static V halves(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float hsum(V v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
  }
  static V exp(V x) {
    x = _mm256_max_ps(_mm256_set1_ps(kLow), x);  // NaN stays NaN, as std::max(x, kLow)
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
    V p = _mm256_set1_ps(kP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float exp1(float x) {
    return _mm256_cvtss_f32(exp(_mm256_set1_ps(x)));
  }
};

#pragma GCC pop_options
#endif

#if defined(__aarch64__)
// NEON (every aarch64 CPU has it): lanes 0-3 in `lo`, 4-7 in `hi`.
struct Neon : ExpConstants {
  struct V {
    float32x4_t lo, hi;
  };
  static V load(const float* p) {
    return {vld1q_f32(p), vld1q_f32(p + 4)};
  }
  static void store(float* p, V v) {
    vst1q_f32(p, v.lo);
    vst1q_f32(p + 4, v.hi);
  }
  static V set1(float f) {
    return {vdupq_n_f32(f), vdupq_n_f32(f)};
  }
  static V zero() {
    return set1(0.0f);
  }
  static V fma(V a, V b, V c) {  // a * b + c, fused
    return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
  }
  static V mul(V a, V b) {
    return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)};
  }
  static V add(V a, V b) {
    return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)};
  }
  static V max(V a, V b) {
    return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)};
  }
  static V sub(V a, V b) {
    return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)};
  }
  static V div(V a, V b) {
    return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)};
  }
  static V neg_abs(V a) {
    return {vnegq_f32(vabsq_f32(a.lo)), vnegq_f32(vabsq_f32(a.hi))};
  }
  static V select_nonneg(V x, V a, V b) {
    const float32x4_t z = vdupq_n_f32(0.0f);
    return {vbslq_f32(vcgeq_f32(x.lo, z), a.lo, b.lo), vbslq_f32(vcgeq_f32(x.hi, z), a.hi, b.hi)};
  }
  static float half(uint16_t h) {
    return half_to_float(h);
  }
  static V halves(const uint16_t* p) {  // the hardware conversion: exact
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
  }
  static float hsum(V v) {  // ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7))
    const float32x4_t s = vaddq_f32(v.lo, v.hi);
    const float32x2_t u = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
  }
  static float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(kLow));  // NaN stays NaN
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
    float32x4_t r = vfmaq_f32(x, n, vdupq_n_f32(-kLn2Hi));
    r = vfmaq_f32(r, n, vdupq_n_f32(-kLn2Lo));
    float32x4_t p = vdupq_n_f32(kP0);
    p = vfmaq_f32(vdupq_n_f32(kP1), p, r);
    p = vfmaq_f32(vdupq_n_f32(kP2), p, r);
    p = vfmaq_f32(vdupq_n_f32(kP3), p, r);
    p = vfmaq_f32(vdupq_n_f32(kP4), p, r);
    p = vfmaq_f32(vdupq_n_f32(kP5), p, r);
    p = vfmaq_f32(r, p, vmulq_f32(r, r));
    p = vaddq_f32(p, vdupq_n_f32(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
  }
  static V exp(V v) {
    return {exp4(v.lo), exp4(v.hi)};
  }
  static float exp1(float x) {
    return vgetq_lane_f32(exp4(vdupq_n_f32(x)), 0);
  }
};
#endif

}  // namespace agentkv::lanes
