#include "qmm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "half.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AGENTKV_QMM_X86 1
#endif

namespace agentkv {
namespace {

constexpr int kBlock = 32;            // activations are quantized per 32 values
constexpr float kLevels = 32767.0f;   // int16 codes (int8 moved top-1 tokens: see qmm.h)
constexpr int kRows = 4;              // rows of x per tile (each weight block is unpacked once)
constexpr int64_t kColumnBlock = 64;  // weight rows per thread job

// Activations of M rows, quantized per 32-block to int16. For 4-bit weights each block is
// stored in the order the packed nibbles unpack to (the 16 even elements, then the 16 odd
// ones), so the integer dot products line up with no shuffles; integer sums do not depend
// on order.
struct Activations {
  int64_t blocks = 0;        // per row: K / 32
  int64_t groups = 0;        // per row: K / group
  std::vector<int16_t> q;    // [M, K]
  std::vector<float> scale;  // [M, blocks]: d, with x ~ d * q
  std::vector<float> sum;    // [M, groups]: sum of d * q over each weight group
};

inline int position(int i, bool nibbles) {
  return nibbles ? (i % 2) * 16 + i / 2 : i;
}

void quantize_row(const float* x, int64_t K, int group, bool nibbles, int16_t* q, float* scale,
                  float* sum) {
  const int64_t per_group = group / kBlock;
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
    int32_t total = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::clamp(std::nearbyint(xb[i] * inv), -kLevels, kLevels);
      q[b * kBlock + position(i, nibbles)] = static_cast<int16_t>(v);
      total += static_cast<int32_t>(v);
    }
    scale[b] = d;
    // The bias meets the quantized x, as the codes do: w = s q + b is centred by b, so the
    // two terms' rounding errors cancel (an exact float sum here triples the error).
    const int64_t g = b / per_group;
    sum[g] = (b % per_group == 0 ? 0.0f : sum[g]) + d * static_cast<float>(total);
  }
}

Activations quantize(const float* x, int64_t M, int64_t K, int group, bool nibbles) {
  Activations a;
  a.blocks = K / kBlock;
  a.groups = K / group;
  a.q.resize(static_cast<size_t>(M * K));
  a.scale.resize(static_cast<size_t>(M * a.blocks));
  a.sum.resize(static_cast<size_t>(M * a.groups));
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * K, K, group, nibbles, a.q.data() + m * K, a.scale.data() + m * a.blocks,
                 a.sum.data() + m * a.groups);
  }
  return a;
}

inline float scale_at(const void* p, ScaleType t, int64_t i) {
  switch (t) {
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

inline float combine_lanes(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// One weight row against up to kRows activation rows: the definition, lane by lane. Lane l
// of a block's integer dot holds the products AVX2 puts there (positions 2l, 2l+1, 16+2l
// and 17+2l), so both paths round identically.
void row_portable(const QuantizedWeights& w, int64_t n, const Activations& a, int64_t m0, int rows,
                  float* y, int64_t ldy) {
  const int64_t K = w.K;
  const int per_group = w.group / kBlock;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w.words) + n * K * w.bits / 8;
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float bias_sum = 0.0f;
    for (int64_t g = 0; g < a.groups; ++g) {
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int c = 0; c < per_group; ++c) {
        const int64_t b = g * per_group + c;
        const int16_t* xq = a.q.data() + m * K + b * kBlock;
        uint8_t wq[kBlock];
        if (w.bits == 4) {
          for (int i = 0; i < 16; ++i) {
            wq[i] = bytes[b * 16 + i] & 0x0F;
            wq[16 + i] = bytes[b * 16 + i] >> 4;
          }
        } else {
          std::memcpy(wq, bytes + b * kBlock, kBlock);
        }
        for (int l = 0; l < 8; ++l) {
          int32_t dot = 0;
          for (int t = 0; t < 4; ++t) {
            const int p = t < 2 ? 2 * l + t : 16 + 2 * l + (t - 2);
            dot += static_cast<int32_t>(wq[p]) * static_cast<int32_t>(xq[p]);
          }
          part[l] = std::fma(static_cast<float>(dot), a.scale[m * a.blocks + b], part[l]);
        }
      }
      const float s = scale_at(w.scales, w.scale_type, n * a.groups + g);
      for (int l = 0; l < 8; ++l) {
        acc[l] = std::fma(part[l], s, acc[l]);
      }
      bias_sum = std::fma(scale_at(w.biases, w.scale_type, n * a.groups + g),
                          a.sum[m * a.groups + g], bias_sum);
    }
    y[r * ldy] = combine_lanes(acc) + bias_sum;
  }
}

#if defined(AGENTKV_QMM_X86)
#define QMM_TARGET __attribute__((target("avx2,fma,f16c")))

QMM_TARGET inline float hsum_fixed(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

QMM_TARGET inline float scale_avx2(const void* p, ScaleType t, int64_t i) {
  if (t == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  }
  return scale_at(p, t, i);
}

// Integer dot of one 32-block against weights widened to int16 (positions 0-15, 16-31),
// as 8 int32 lanes.
QMM_TARGET inline __m256i dot16(__m256i w_lo, __m256i w_hi, const int16_t* xq) {
  const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
}

template <int BITS, int ROWS>
QMM_TARGET void rows_avx2(const QuantizedWeights& w, int64_t n, const Activations& a, int64_t m0,
                          float* y, int64_t ldy) {
  const int64_t K = w.K;
  const int per_group = w.group / kBlock;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w.words) + n * K * BITS / 8;
  const int16_t* xq = a.q.data() + m0 * K;
  const float* xd = a.scale.data() + m0 * a.blocks;
  const float* xs = a.sum.data() + m0 * a.groups;
  __m256 acc[ROWS];
  float bias_sum[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm256_setzero_ps();
    bias_sum[r] = 0.0f;
  }
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 part[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      part[r] = _mm256_setzero_ps();
    }
    for (int c = 0; c < per_group; ++c) {
      const int64_t b = g * per_group + c;
      __m128i lo, hi;
      if constexpr (BITS == 4) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + b * 16));
        lo = _mm_and_si128(packed, low_nibbles);
        hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
      } else {
        lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + b * 32));
        hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + b * 32 + 16));
      }
      const __m256i w_lo = _mm256_cvtepu8_epi16(lo);
      const __m256i w_hi = _mm256_cvtepu8_epi16(hi);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(dot16(w_lo, w_hi, xq + r * K + b * kBlock));
        part[r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(xd + r * a.blocks + b), part[r]);
      }
    }
    const __m256 s = _mm256_set1_ps(scale_avx2(w.scales, w.scale_type, n * a.groups + g));
    const float bias = scale_avx2(w.biases, w.scale_type, n * a.groups + g);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm256_fmadd_ps(part[r], s, acc[r]);
      bias_sum[r] = std::fma(bias, xs[r * a.groups + g], bias_sum[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
    y[r * ldy] = hsum_fixed(acc[r]) + bias_sum[r];
  }
}

template <int BITS>
QMM_TARGET void row_avx2(const QuantizedWeights& w, int64_t n, const Activations& a, int64_t m0,
                         int rows, float* y, int64_t ldy) {
  switch (rows) {
    case 1:
      return rows_avx2<BITS, 1>(w, n, a, m0, y, ldy);
    case 2:
      return rows_avx2<BITS, 2>(w, n, a, m0, y, ldy);
    case 3:
      return rows_avx2<BITS, 3>(w, n, a, m0, y, ldy);
    default:
      return rows_avx2<BITS, 4>(w, n, a, m0, y, ldy);
  }
}

#endif

bool forced_portable() {
  static const bool forced = [] {
    const char* v = std::getenv("AGENTKV_QMM");
    return v != nullptr && std::string(v) == "portable";
  }();
  return forced;
}

using RowKernel = void (*)(const QuantizedWeights&, int64_t, const Activations&, int64_t, int,
                           float*, int64_t);

RowKernel kernel_for(int bits) {
#if defined(AGENTKV_QMM_X86)
  if (cpu_has_avx2_fma_f16c() && !forced_portable()) {
    return bits == 4 ? &row_avx2<4> : &row_avx2<8>;
  }
#endif
  (void)bits;
  return &row_portable;
}

}  // namespace

void quantized_matmul(const float* x, const QuantizedWeights& w, float* y, int64_t M) {
  if (w.bits != 4 && w.bits != 8) {
    throw std::invalid_argument("agentkv's quantized matmul takes 4- or 8-bit weights");
  }
  if (w.group != 32 && w.group != 64 && w.group != 128) {
    throw std::invalid_argument("agentkv's quantized matmul takes groups of 32, 64 or 128");
  }
  if (w.K % w.group != 0) {
    throw std::invalid_argument("the input size must be a multiple of the group size");
  }
  const Activations a = quantize(x, M, w.K, w.group, w.bits == 4);
  const RowKernel row = kernel_for(w.bits);
  const int64_t N = w.N;
  const std::function<void(size_t)> job = [&](size_t block) {
    const int64_t n0 = static_cast<int64_t>(block) * kColumnBlock;
    const int64_t n1 = std::min(N, n0 + kColumnBlock);
    for (int64_t m = 0; m < M; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
      for (int64_t n = n0; n < n1; ++n) {
        row(w, n, a, m, rows, y + m * N + n, N);
      }
    }
  };
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  if (static_cast<double>(M) * N * w.K < 2e5) {  // too small to be worth waking the pool
    for (int64_t b = 0; b < blocks; ++b) {
      job(static_cast<size_t>(b));
    }
    return;
  }
  ThreadPool::shared().run(static_cast<size_t>(blocks), job);
}

const char* qmm_implementation() {
  return cpu_has_avx2_fma_f16c() && !forced_portable() ? "avx2" : "portable";
}

}  // namespace agentkv
