#include "qmm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "half.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AGENTKV_QMM_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define AGENTKV_QMM_NEON 1
#endif

namespace agentkv {
namespace {

constexpr int kBlock = kPackDepth;    // activations are quantized per 32 values
constexpr float kLevels = 32512.0f;   // 127 * 256: the high byte of a code stays in int8
constexpr int64_t kColumnBlock = 64;  // columns per thread job (4 packed blocks)

// Activations of M rows, quantized per 32-block to codes xq = 256 hi + lo (hi, lo signed
// bytes, in K order). A row's K high bytes come first, then its K low ones.
struct Activations {
  int64_t K = 0;
  int64_t blocks = 0;         // per row: K / 32
  int64_t groups = 0;         // per row: K / group
  std::vector<int8_t> bytes;  // [M, 2, K]: hi, lo
  std::vector<float> scale;   // [M, blocks]: d, with x ~ d * xq
  std::vector<float> sum;     // [M, groups]: sum of d * xq over each weight group

  const int8_t* high(int64_t m, int64_t b) const {
    return bytes.data() + 2 * m * K + b * kBlock;
  }
  const int8_t* low(int64_t m, int64_t b) const {
    return bytes.data() + (2 * m + 1) * K + b * kBlock;
  }
};

// AGENTKV_QMM=portable or =avx2 caps the implementation (tests compare them).
const char* forced() {
  static const char* v = std::getenv("AGENTKV_QMM");
  return v != nullptr ? v : "";
}

bool forced_portable() {
  static const bool portable = std::string(forced()) == "portable" || cpu_forced_portable();
  return portable;
}

bool use_vnni() {
#if defined(AGENTKV_QMM_X86)
  static const bool vnni =
      cpu_has_avx512_vnni() && !forced_portable() && std::string(forced()) != "avx2";
  return vnni;
#else
  return false;
#endif
}

bool use_avx2() {
#if defined(AGENTKV_QMM_X86)
  static const bool avx2 = cpu_has_avx2_fma_f16c() && !forced_portable();
  return avx2;
#else
  return false;
#endif
}

constexpr int kMaxRows = 8;  // rows of x per tile
// 5 bits: where a packed block's fifth bits start (after its 4-bit layout of the low nibbles)
constexpr int kFifthBits = kPackColumns * kBlock / 2;

// One 32-block's codes -> its two bytes per code, its scale and its part of its group's sum.
inline void store_block(const int32_t* codes, float d, int64_t b, int per_group, int8_t* hi,
                        int8_t* lo, float* scale, float* sum) {
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int32_t low = static_cast<int8_t>(static_cast<uint8_t>(codes[i] & 0xFF));
    lo[b * kBlock + i] = static_cast<int8_t>(low);
    hi[b * kBlock + i] = static_cast<int8_t>((codes[i] - low) / 256);
    total += codes[i];
  }
  scale[b] = d;
  const int64_t g = b / per_group;
  sum[g] = (b % per_group == 0 ? 0.0f : sum[g]) + d * static_cast<float>(total);
}

// Codes round half to even (rint in the default rounding mode: what AVX2's round does). A
// block holding NaN or an infinity gets d = NaN, so its row's outputs are NaN.
void quantize_row_portable(const float* x, int64_t K, int group, int8_t* hi, int8_t* lo,
                           float* scale, float* sum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < kBlock; ++i) {
      finite = finite && std::isfinite(xb[i]);
      amax = std::max(amax, std::fabs(xb[i]));
    }
    const float d = finite ? amax / kLevels : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && amax > 0.0f ? kLevels / amax : 0.0f;
    int32_t codes[kBlock];
    for (int i = 0; i < kBlock; ++i) {
      codes[i] = static_cast<int32_t>(std::clamp(std::rint(xb[i] * inv), -kLevels, kLevels));
    }
    store_block(codes, d, b, group / kBlock, hi, lo, scale, sum);
  }
}

#if defined(AGENTKV_QMM_X86)
__attribute__((target("avx2,fma,f16c"))) void quantize_row_avx2(const float* x, int64_t K,
                                                                int group, int8_t* hi, int8_t* lo,
                                                                float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 top = _mm256_set1_ps(kLevels);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      // x - x is 0 for finite x, NaN for infinities and NaN
      finite = _mm256_and_ps(
          finite, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_EQ_OQ));
    }
    const bool all_finite = _mm256_movemask_ps(finite) == 0xFF;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.0f;
    for (float l : lanes) {
      m = std::max(m, l);
    }
    const float d = all_finite ? m / kLevels : std::numeric_limits<float>::quiet_NaN();
    const __m256 inv = _mm256_set1_ps(all_finite && m > 0.0f ? kLevels / m : 0.0f);
    alignas(32) int32_t codes[kBlock];
    for (int i = 0; i < 4; ++i) {
      __m256 r =
          _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), top)), top);
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), _mm256_cvtps_epi32(r));
    }
    store_block(codes, d, b, group / kBlock, hi, lo, scale, sum);
  }
}
#endif

// Quantizes into `a`, whose buffers are kept from call to call (no allocation per call).
void quantize(const float* x, int64_t M, int64_t K, int group, Activations& a) {
  a.K = K;
  a.blocks = K / kBlock;
  a.groups = K / group;
  a.bytes.resize(static_cast<size_t>(2 * M * K));
  a.scale.resize(static_cast<size_t>(M * a.blocks));
  a.sum.resize(static_cast<size_t>(M * a.groups));
  constexpr int64_t kRowsPerJob = 16;  // rows are quantized alone: any split, the same codes
  const std::function<void(size_t)> job = [&](size_t j) {
    const int64_t m1 = std::min(M, static_cast<int64_t>(j + 1) * kRowsPerJob);
    for (int64_t m = static_cast<int64_t>(j) * kRowsPerJob; m < m1; ++m) {
      int8_t* hi = a.bytes.data() + 2 * m * K;
      int8_t* lo = hi + K;
      float* scale = a.scale.data() + m * a.blocks;
      float* sum = a.sum.data() + m * a.groups;
#if defined(AGENTKV_QMM_X86)
      if (use_avx2()) {  // (VNNI implies it)
        quantize_row_avx2(x + m * K, K, group, hi, lo, scale, sum);
        continue;
      }
#endif
      quantize_row_portable(x + m * K, K, group, hi, lo, scale, sum);
    }
  };
  ThreadPool::shared().run(static_cast<size_t>((M + kRowsPerJob - 1) / kRowsPerJob), job);
}

// Entry i = 16 G + n (block-wide group G, column n) of a two-level scale (qmm.h).
inline float super_scale_at(const void* p, int64_t i) {
  const int64_t G = i / kPackColumns;
  const int n = static_cast<int>(i % kPackColumns);
  const auto* super = static_cast<const uint8_t*>(p) + G / kSuperGroups * kSuperBytes;
  uint16_t d;
  std::memcpy(&d, super + 2 * n, 2);
  return half_to_float(d) * static_cast<float>(super[32 + 16 * (G % kSuperGroups) + n]);
}

inline float scale_at(const void* p, ScaleType t, int64_t i) {
  switch (t) {
    case ScaleType::ksuper:
      return super_scale_at(p, i);
    case ScaleType::f32:
      return static_cast<const float*>(p)[i];
    case ScaleType::f16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::bf16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
  return 0.0f;
}

// The bytes of packed block (nb, b) of w.
inline const uint8_t* block_codes(const QuantizedWeights& w, int64_t nb, int64_t b) {
  const int64_t bytes = kPackColumns * kBlock * w.bits / 8;
  return w.codes + (nb * (w.K / kBlock) + b) * bytes;
}

// Code of column n at k = 4 j + t of a packed block.
inline int32_t code_at(const uint8_t* block, int bits, int n, int j, int t) {
  if (bits == 8) {
    return block[64 * j + 4 * n + t];
  }
  const uint8_t byte = block[64 * (j / 2) + 4 * n + t];
  const int32_t low = j % 2 == 0 ? byte & 0x0F : byte >> 4;
  if (bits == 4) {
    return low;
  }
  const int bit = 4 * n + t;  // 5 bits: the fifth bits of quad j, a little-endian 64-bit mask
  return low | (((block[kFifthBits + 8 * j + bit / 8] >> (bit % 8)) & 1) << 4);
}

// Rows [m0, m0 + rows) against packed block nb (16 columns), the definition element by
// element (qmm.h).
void tile_portable(const QuantizedWeights& w, int64_t nb, const Activations& a, int64_t m0,
                   int rows, float* y, int64_t ldy) {
  const int per_group = w.group / kBlock;
  const int64_t at = nb * a.groups * kPackColumns;  // the block's scales and biases
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    for (int n = 0; n < kPackColumns; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        float part = 0.0f;
        for (int c = 0; c < per_group; ++c) {
          const int64_t b = g * per_group + c;
          const uint8_t* block = block_codes(w, nb, b);
          const int8_t* hi = a.high(m, b);
          const int8_t* lo = a.low(m, b);
          int32_t dot = 0;
          for (int j = 0; j < kBlock / 4; ++j) {
            for (int t = 0; t < 4; ++t) {
              const int32_t xq = 256 * hi[4 * j + t] + lo[4 * j + t];
              dot += code_at(block, w.bits, n, j, t) * xq;
            }
          }
          const float d = a.scale[m * a.blocks + b];
          part = c == 0 ? static_cast<float>(dot) * d : std::fma(static_cast<float>(dot), d, part);
        }
        acc = std::fma(part, scale_at(w.scales, w.scale_type, at + g * kPackColumns + n), acc);
      }
      float bias = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        bias = std::fma(scale_at(w.biases, w.scale_type, at + g * kPackColumns + n),
                        a.sum[m * a.groups + g], bias);
      }
      y[r * ldy + n] = acc + bias;
    }
  }
}

#if defined(AGENTKV_QMM_X86)
#include "qmm_x86.inc"
#endif

#if defined(AGENTKV_QMM_NEON)
// NEON: one row against a packed block, 16 columns in four int32x4 accumulators. vld4q_u8
// splits a quad's 64 bytes into its four k (16 columns each); the codes are widened to
// int16 and multiplied by the row's int16 code of that k (vmlal_n_s16): the integer dot is
// exact, and each float step is the definition's per lane, so the bits are the portable
// path's.
namespace neon {

template <int BITS>
void row_block(const QuantizedWeights& w, int64_t nb, const Activations& a, int64_t m, float* y) {
  const int per_group = w.group / kBlock;
  const int64_t at = nb * a.groups * kPackColumns;
  float32x4_t acc[4], part[4];
  for (int i = 0; i < 4; ++i) {
    acc[i] = vdupq_n_f32(0.0f);
  }
  float s[kPackColumns];
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int c = 0; c < per_group; ++c) {
      const int64_t b = g * per_group + c;
      const uint8_t* block = block_codes(w, nb, b);
      const int8_t* hi = a.high(m, b);
      const int8_t* lo = a.low(m, b);
      int32x4_t dot[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
      for (int j = 0; j < kBlock / 4; ++j) {
        const uint8x16x4_t v = vld4q_u8(block + 64 * (BITS == 8 ? j : j / 2));
        for (int t = 0; t < 4; ++t) {
          uint8x16_t codes = v.val[t];
          if constexpr (BITS != 8) {
            codes = j % 2 == 0 ? vandq_u8(codes, vdupq_n_u8(0x0F)) : vshrq_n_u8(codes, 4);
          }
          if constexpr (BITS == 5) {  // the fifth bits of the 16 columns at this t
            uint64_t mask;
            std::memcpy(&mask, block + kFifthBits + 8 * j, 8);
            uint8_t fifth[16];
            for (int n = 0; n < 16; ++n) {
              fifth[n] = static_cast<uint8_t>(((mask >> (4 * n + t)) & 1) << 4);
            }
            codes = vorrq_u8(codes, vld1q_u8(fifth));
          }
          const int16x8_t first = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(codes)));
          const int16x8_t second = vreinterpretq_s16_u16(vmovl_high_u8(codes));
          const int16_t xq = static_cast<int16_t>(256 * hi[4 * j + t] + lo[4 * j + t]);
          dot[0] = vmlal_n_s16(dot[0], vget_low_s16(first), xq);
          dot[1] = vmlal_high_n_s16(dot[1], first, xq);
          dot[2] = vmlal_n_s16(dot[2], vget_low_s16(second), xq);
          dot[3] = vmlal_high_n_s16(dot[3], second, xq);
        }
      }
      const float32x4_t d = vdupq_n_f32(a.scale[m * a.blocks + b]);
      for (int i = 0; i < 4; ++i) {
        const float32x4_t f = vcvtq_f32_s32(dot[i]);
        part[i] = c == 0 ? vmulq_f32(f, d) : vfmaq_f32(part[i], f, d);
      }
    }
    for (int n = 0; n < kPackColumns; ++n) {
      s[n] = scale_at(w.scales, w.scale_type, at + g * kPackColumns + n);
    }
    for (int i = 0; i < 4; ++i) {
      acc[i] = vfmaq_f32(acc[i], part[i], vld1q_f32(s + 4 * i));
    }
  }
  float32x4_t bias[4];
  for (int i = 0; i < 4; ++i) {
    bias[i] = vdupq_n_f32(0.0f);
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int n = 0; n < kPackColumns; ++n) {
      s[n] = scale_at(w.biases, w.scale_type, at + g * kPackColumns + n);
    }
    const float32x4_t sum = vdupq_n_f32(a.sum[m * a.groups + g]);
    for (int i = 0; i < 4; ++i) {
      bias[i] = vfmaq_f32(bias[i], vld1q_f32(s + 4 * i), sum);
    }
  }
  for (int i = 0; i < 4; ++i) {
    vst1q_f32(y + 4 * i, vaddq_f32(acc[i], bias[i]));
  }
}

template <int BITS>
void tile(const QuantizedWeights& w, int64_t nb, const Activations& a, int64_t m0, int rows,
          float* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    row_block<BITS>(w, nb, a, m0 + r, y + r * ldy);
  }
}

}  // namespace neon
#endif

// Rows [m0, m0 + rows) (at most kMaxRows) against packed block nb, into y (row stride ldy).
using TileKernel = void (*)(const QuantizedWeights&, int64_t, const Activations&, int64_t, int,
                            float*, int64_t);

TileKernel kernel_for(int bits) {
#if defined(AGENTKV_QMM_X86)
  if (use_vnni()) {
    return bits == 4 ? &vnni::tile<4> : bits == 5 ? &vnni::tile<5> : &vnni::tile<8>;
  }
  if (use_avx2()) {
    return bits == 4 ? &avx2::tile<4> : bits == 5 ? &avx2::tile<5> : &avx2::tile<8>;
  }
#endif
#if defined(AGENTKV_QMM_NEON)
  if (!forced_portable()) {
    return bits == 4 ? &neon::tile<4> : bits == 5 ? &neon::tile<5> : &neon::tile<8>;
  }
#endif
  (void)bits;
  return &tile_portable;
}

void check(const QuantizedWeights& w) {
  if (w.bits != 4 && w.bits != 5 && w.bits != 8) {
    throw std::invalid_argument("agentkv's quantized matmul takes 4-, 5- or 8-bit weights");
  }
  if (w.group != 32 && w.group != 64 && w.group != 128) {
    throw std::invalid_argument("agentkv's quantized matmul takes groups of 32, 64 or 128");
  }
  if (w.K % w.group != 0 || w.N % kPackColumns != 0) {
    throw std::invalid_argument(
        "agentkv's quantized matmul: K must be a multiple of the group, N of 16");
  }
}

// Columns [n0, n1) of w (whole packed blocks) against every row of the quantized x, into
// y [M, w.N].
void columns(const QuantizedWeights& w, const Activations& a, float* y, int64_t M, int64_t n0,
             int64_t n1) {
  const TileKernel tile = kernel_for(w.bits);
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
    for (int64_t n = n0; n < n1; n += kPackColumns) {
      tile(w, n / kPackColumns, a, m, rows, y + m * w.N + n, w.N);
    }
  }
}

}  // namespace

void quantized_matmul(const float* x, const QuantizedWeights& w, float* y, int64_t M) {
  float* ys[1] = {y};
  quantized_matmuls(x, &w, ys, 1, M);
}

void quantized_matmuls(const float* x, const QuantizedWeights* ws, float* const* ys, int count,
                       int64_t M) {
  for (int i = 0; i < count; ++i) {
    check(ws[i]);
    if (ws[i].K != ws[0].K || ws[i].group != ws[0].group) {
      for (int j = 0; j < count; ++j) {  // activations quantized differently: one at a time
        quantized_matmuls(x, ws + j, ys + j, 1, M);
      }
      return;
    }
  }
  thread_local Activations scratch;  // one matmul at a time per calling thread
  Activations& a = scratch;          // (the workers read the caller's, through this name)
  quantize(x, M, ws[0].K, ws[0].group, a);
  // One job list over every matrix's column blocks, so no core waits at a matrix's end.
  std::vector<std::pair<int, int64_t>> jobs;
  double work = 0;
  for (int i = 0; i < count; ++i) {
    for (int64_t n0 = 0; n0 < ws[i].N; n0 += kColumnBlock) {
      jobs.emplace_back(i, n0);
    }
    work += static_cast<double>(M) * ws[i].N * ws[i].K;
  }
  const std::function<void(size_t)> job = [&](size_t j) {
    const auto [i, n0] = jobs[j];
    columns(ws[i], a, ys[i], M, n0, std::min(ws[i].N, n0 + kColumnBlock));
  };
  if (work < 2e4) {  // too small to be worth sharing
    for (size_t j = 0; j < jobs.size(); ++j) {
      job(j);
    }
    return;
  }
  ThreadPool::shared().run(jobs.size(), job);
}

void pack_weights(const uint32_t* words, const void* scales, const void* biases, int scale_bytes,
                  int bits, int group, int64_t N, int64_t K, uint8_t* codes, void* packed_scales,
                  void* packed_biases) {
  const int64_t blocks = (N + kPackColumns - 1) / kPackColumns, depth = K / kBlock;
  const int64_t groups = K / group, bytes = kPackColumns * kBlock * bits / 8;
  const auto* src = reinterpret_cast<const uint8_t*>(words);
  const std::function<void(size_t)> job = [&](size_t nb) {
    uint8_t* out = codes + static_cast<int64_t>(nb) * depth * bytes;
    std::memset(out, 0, static_cast<size_t>(depth * bytes));  // columns past N stay zero
    for (int n = 0; n < kPackColumns; ++n) {
      const int64_t col = static_cast<int64_t>(nb) * kPackColumns + n;
      if (col >= N) {
        break;
      }
      const uint8_t* row = src + col * K * bits / 8;  // little-endian words: codes in K order
      for (int64_t b = 0; b < depth; ++b) {
        uint8_t* to = out + b * bytes + 4 * n;
        if (bits == 8) {  // quad j: the 4 codes of k = 4j .. 4j + 3, as they are
          for (int j = 0; j < kBlock / 4; ++j) {
            std::memcpy(to + 64 * j, row + b * kBlock + 4 * j, 4);
          }
          continue;
        }
        if (bits == 5) {  // the source a bit stream: k at bits 5k .. 5k + 4 of the row
          for (int k = 0; k < kBlock; ++k) {
            const int64_t at = (b * kBlock + k) * 5;
            const uint32_t two = row[at / 8] | (at / 8 + 1 < K * 5 / 8 ? row[at / 8 + 1] << 8 : 0);
            const uint32_t code = (two >> (at % 8)) & 0x1F;
            const int j = k / 4, t = k % 4;
            to[64 * (j / 2) + t] |= static_cast<uint8_t>((code & 0x0F) << (4 * (j % 2)));
            const int bit = 4 * n + t;
            out[b * bytes + kFifthBits + 8 * j + bit / 8] |=
                static_cast<uint8_t>((code >> 4) << (bit % 8));
          }
          continue;
        }
        // 4 bits: source byte i holds k = 2i (low nibble) and 2i + 1; packed byte t of quad
        // pair p holds k = 8p + t (low) and 8p + 4 + t (high)
        const uint8_t* in = row + b * kBlock / 2;
        for (int p = 0; p < kBlock / 8; ++p) {
          const uint8_t s0 = in[4 * p], s1 = in[4 * p + 1], s2 = in[4 * p + 2], s3 = in[4 * p + 3];
          uint8_t* q = to + 64 * p;
          q[0] = static_cast<uint8_t>((s0 & 0x0F) | (s2 << 4));
          q[1] = static_cast<uint8_t>((s0 >> 4) | (s2 & 0xF0));
          q[2] = static_cast<uint8_t>((s1 & 0x0F) | (s3 << 4));
          q[3] = static_cast<uint8_t>((s1 >> 4) | (s3 & 0xF0));
        }
      }
    }
    for (const auto& [from, to] : {std::pair{scales, packed_scales}, {biases, packed_biases}}) {
      const auto* in = static_cast<const uint8_t*>(from);
      auto* dst = static_cast<uint8_t*>(to) +
                  static_cast<int64_t>(nb) * groups * kPackColumns * scale_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        for (int n = 0; n < kPackColumns; ++n) {
          const int64_t col = static_cast<int64_t>(nb) * kPackColumns + n;
          uint8_t* at = dst + (g * kPackColumns + n) * scale_bytes;
          if (col < N) {
            std::memcpy(at, in + (col * groups + g) * scale_bytes, scale_bytes);
          } else {
            std::memset(at, 0, scale_bytes);
          }
        }
      }
    }
  };
  ThreadPool::shared().run(static_cast<size_t>(blocks), job);
}

bool pack_super_scales(const float* packed, const uint16_t* super, int64_t N, int64_t K,
                       uint8_t* out) {
  const int64_t blocks = (N + kPackColumns - 1) / kPackColumns, groups = K / kBlock;
  const int64_t supers = groups / kSuperGroups;
  std::atomic<bool> exact{true};
  const std::function<void(size_t)> job = [&](size_t nb) {
    for (int64_t S = 0; S < supers && exact.load(std::memory_order_relaxed); ++S) {
      uint8_t* to = out + (static_cast<int64_t>(nb) * supers + S) * kSuperBytes;
      std::memset(to, 0, kSuperBytes);
      for (int n = 0; n < kPackColumns; ++n) {
        const int64_t col = static_cast<int64_t>(nb) * kPackColumns + n;
        if (col >= N) {
          break;
        }
        const uint16_t h = super[col * supers + S];
        const float d = half_to_float(h);
        std::memcpy(to + 2 * n, &h, 2);
        for (int j = 0; j < kSuperGroups; ++j) {
          const float s =
              packed[(static_cast<int64_t>(nb) * groups + S * kSuperGroups + j) * kPackColumns + n];
          const float m = d == 0.0f ? 0.0f : std::nearbyint(s / d);
          const float back = d * m;
          if (!(m >= 0.0f && m <= 255.0f) || std::memcmp(&back, &s, 4) != 0) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
          to[32 + 16 * j + n] = static_cast<uint8_t>(m);
        }
      }
    }
  };
  ThreadPool::shared().run(static_cast<size_t>(blocks), job);
  return exact.load();
}

const char* qmm_implementation() {
#if defined(AGENTKV_QMM_NEON)
  return forced_portable() ? "portable" : "neon";
#endif
  return use_vnni() ? "avx512-vnni" : use_avx2() ? "avx2" : "portable";
}

}  // namespace agentkv
