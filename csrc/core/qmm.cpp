#include "qmm.h"

#include <algorithm>
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
  int64_t padded = 0;        // per row in `sum`: groups rounded up to 8 (zeros after)
  std::vector<int16_t> q;    // [M, K]
  std::vector<float> scale;  // [M, blocks]: d, with x ~ d * q
  std::vector<float> sum;    // [M, padded]: sum of d * q over each weight group
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

inline int position(int i, bool nibbles) {
  return nibbles ? (i % 2) * 16 + i / 2 : i;
}

// One 32-block's codes (int32, in element order) -> the stored order, the block's scale
// and its contribution to its group's sum. Shared by both quantizers.
inline void store_block(const int32_t* codes, float d, bool nibbles, int64_t b, int per_group,
                        int16_t* q, float* scale, float* sum) {
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[b * kBlock + position(i, nibbles)] = static_cast<int16_t>(codes[i]);
    total += codes[i];
  }
  scale[b] = d;
  // The bias meets the quantized x, as the codes do: w = s q + b is centred by b, so the
  // two terms' rounding errors cancel (an exact float sum here triples the error).
  const int64_t g = b / per_group;
  sum[g] = (b % per_group == 0 ? 0.0f : sum[g]) + d * static_cast<float>(total);
}

// Codes round half to even (rint in the default rounding mode: what AVX2's round does).
void quantize_row_portable(const float* x, int64_t K, int group, bool nibbles, int16_t* q,
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
    store_block(codes, d, nibbles, b, group / kBlock, q, scale, sum);
  }
}

#if defined(AGENTKV_QMM_X86)
__attribute__((target("avx2,fma,f16c"))) void quantize_row_avx2(const float* x, int64_t K,
                                                                int group, bool nibbles, int16_t* q,
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
    store_block(codes, d, nibbles, b, group / kBlock, q, scale, sum);
  }
}
#endif

void quantize_row(const float* x, int64_t K, int group, bool nibbles, int16_t* q, float* scale,
                  float* sum) {
#if defined(AGENTKV_QMM_X86)
  if (cpu_has_avx2_fma_f16c() && !forced_portable()) {
    return quantize_row_avx2(x, K, group, nibbles, q, scale, sum);
  }
#endif
  quantize_row_portable(x, K, group, nibbles, q, scale, sum);
}

// Quantizes into `a`, whose buffers are kept from call to call (no allocation per call).
void quantize(const float* x, int64_t M, int64_t K, int group, bool nibbles, Activations& a) {
  a.blocks = K / kBlock;
  a.groups = K / group;
  a.padded = (a.groups + 7) / 8 * 8;
  a.q.resize(static_cast<size_t>(M * K));
  a.scale.resize(static_cast<size_t>(M * a.blocks));
  a.sum.assign(static_cast<size_t>(M * a.padded), 0.0f);
  constexpr int64_t kRowsPerJob = 16;  // rows are quantized alone: any split, the same codes
  const std::function<void(size_t)> job = [&](size_t j) {
    const int64_t m1 = std::min(M, static_cast<int64_t>(j + 1) * kRowsPerJob);
    for (int64_t m = static_cast<int64_t>(j) * kRowsPerJob; m < m1; ++m) {
      quantize_row(x + m * K, K, group, nibbles, a.q.data() + m * K, a.scale.data() + m * a.blocks,
                   a.sum.data() + m * a.padded);
    }
  };
  ThreadPool::shared().run(static_cast<size_t>((M + kRowsPerJob - 1) / kRowsPerJob), job);
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

// Eight of a weight row's biases from group g0 as float, zeros past its last group.
inline void biases_at(const QuantizedWeights& w, int64_t n, int64_t groups, int64_t g0,
                      float* out) {
  for (int l = 0; l < 8; ++l) {
    out[l] = g0 + l < groups ? scale_at(w.biases, w.scale_type, n * groups + g0 + l) : 0.0f;
  }
}

inline float combine_lanes(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// One output element, the definition lane by lane. Lane l of a block's integer dot holds
// the products AVX2 puts there (positions 2l, 2l+1, 16+2l and 17+2l); the bias terms go
// to lane g % 8 in group order (padded with zeros to whole lanes), so both paths round
// identically.
float element_portable(const QuantizedWeights& w, int64_t n, const Activations& a, int64_t m) {
  const int64_t K = w.K;
  const int per_group = w.group / kBlock;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w.words) + n * K * w.bits / 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
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
  }
  float bias[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t g0 = 0; g0 < a.padded; g0 += 8) {
    float b[8];
    biases_at(w, n, a.groups, g0, b);
    for (int l = 0; l < 8; ++l) {
      bias[l] = std::fma(b[l], a.sum[m * a.padded + g0 + l], bias[l]);
    }
  }
  return combine_lanes(acc) + combine_lanes(bias);
}

// Rows [m0, m0 + rows) of x against weight rows [n0, n0 + cols).
void tile_portable(const QuantizedWeights& w, int64_t n0, int cols, const Activations& a,
                   int64_t m0, int rows, float* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < cols; ++j) {
      y[r * ldy + j] = element_portable(w, n0 + j, a, m0 + r);
    }
  }
}

#if defined(AGENTKV_QMM_X86)
namespace avx2 {
#define QMM_TARGET __attribute__((target("avx2,fma,f16c")))
#define QMM_VNNI 0
#include "qmm_x86.inc"
#undef QMM_TARGET
#undef QMM_VNNI
}  // namespace avx2

namespace vnni {
#define QMM_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define QMM_VNNI 1
#include "qmm_x86.inc"
#undef QMM_TARGET
#undef QMM_VNNI
}  // namespace vnni
#endif

#if defined(AGENTKV_QMM_NEON)
// NEON: element_portable's lanes in two 4-lane registers (lanes 0-3, 4-7), up to 4 rows of x
// against one weight row (each weight block widened once). The integer dots are exact and
// every float step is the portable one per lane, so the bits are the portable path's.
namespace neon {

// A 32-block of a weight row widened to int16 in the activations' stored order: positions
// 0-7, 8-15, 16-23, 24-31 (4 bits: the low nibbles, then the high ones).
template <int BITS>
inline void unpack(const uint8_t* row, int64_t b, int16x8_t w[4]) {
  uint8x16_t first, second;
  if constexpr (BITS == 4) {
    const uint8x16_t bytes = vld1q_u8(row + b * 16);
    first = vandq_u8(bytes, vdupq_n_u8(0x0F));
    second = vshrq_n_u8(bytes, 4);
  } else {
    first = vld1q_u8(row + b * 32);
    second = vld1q_u8(row + b * 32 + 16);
  }
  w[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(first)));
  w[1] = vreinterpretq_s16_u16(vmovl_high_u8(first));
  w[2] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(second)));
  w[3] = vreinterpretq_s16_u16(vmovl_high_u8(second));
}

// (p0 + p1, p2 + p3, p4 + p5, p6 + p7) of the products of eight positions
inline int32x4_t pairs(int16x8_t w, int16x8_t x) {
  return vpaddq_s32(vmull_s16(vget_low_s16(w), vget_low_s16(x)), vmull_high_s16(w, x));
}

template <int BITS, int ROWS>
void column(const QuantizedWeights& w, int64_t n, const Activations& a, int64_t m0, float* y,
            int64_t ldy) {
  const int64_t K = w.K;
  const int per_group = w.group / kBlock;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.words) + n * K * BITS / 8;
  float32x4_t acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0] = acc[r][1] = vdupq_n_f32(0.0f);
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    float32x4_t part[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
      part[r][0] = part[r][1] = vdupq_n_f32(0.0f);
    }
    for (int c = 0; c < per_group; ++c) {
      const int64_t b = g * per_group + c;
      int16x8_t wq[4];
      unpack<BITS>(row, b, wq);
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* xq = a.q.data() + (m0 + r) * K + b * kBlock;
        const int32x4_t lo =
            vaddq_s32(pairs(wq[0], vld1q_s16(xq)), pairs(wq[2], vld1q_s16(xq + 16)));
        const int32x4_t hi =
            vaddq_s32(pairs(wq[1], vld1q_s16(xq + 8)), pairs(wq[3], vld1q_s16(xq + 24)));
        const float32x4_t d = vdupq_n_f32(a.scale[(m0 + r) * a.blocks + b]);
        part[r][0] = vfmaq_f32(part[r][0], vcvtq_f32_s32(lo), d);
        part[r][1] = vfmaq_f32(part[r][1], vcvtq_f32_s32(hi), d);
      }
    }
    const float32x4_t s = vdupq_n_f32(scale_at(w.scales, w.scale_type, n * a.groups + g));
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = vfmaq_f32(acc[r][0], part[r][0], s);
      acc[r][1] = vfmaq_f32(acc[r][1], part[r][1], s);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float32x4_t bias[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    const float* sums = a.sum.data() + (m0 + r) * a.padded;
    for (int64_t g0 = 0; g0 < a.padded; g0 += 8) {
      float b[8];
      biases_at(w, n, a.groups, g0, b);
      bias[0] = vfmaq_f32(bias[0], vld1q_f32(b), vld1q_f32(sums + g0));
      bias[1] = vfmaq_f32(bias[1], vld1q_f32(b + 4), vld1q_f32(sums + g0 + 4));
    }
    float lanes[8], bias_lanes[8];
    vst1q_f32(lanes, acc[r][0]);
    vst1q_f32(lanes + 4, acc[r][1]);
    vst1q_f32(bias_lanes, bias[0]);
    vst1q_f32(bias_lanes + 4, bias[1]);
    y[r * ldy] = combine_lanes(lanes) + combine_lanes(bias_lanes);
  }
}

template <int BITS>
void tile(const QuantizedWeights& w, int64_t n0, int cols, const Activations& a, int64_t m0,
          int rows, float* y, int64_t ldy) {
  for (int j = 0; j < cols; ++j) {
    switch (rows) {
      case 1:
        column<BITS, 1>(w, n0 + j, a, m0, y + j, ldy);
        break;
      case 2:
        column<BITS, 2>(w, n0 + j, a, m0, y + j, ldy);
        break;
      case 3:
        column<BITS, 3>(w, n0 + j, a, m0, y + j, ldy);
        break;
      default:
        column<BITS, 4>(w, n0 + j, a, m0, y + j, ldy);
    }
  }
}

}  // namespace neon
#endif

using TileKernel = void (*)(const QuantizedWeights&, int64_t, int, const Activations&, int64_t, int,
                            float*, int64_t);

TileKernel kernel_for(int bits) {
#if defined(AGENTKV_QMM_X86)
  if (use_vnni()) {
    return bits == 4 ? &vnni::tile_avx2_any<4> : &vnni::tile_avx2_any<8>;
  }
  if (cpu_has_avx2_fma_f16c() && !forced_portable()) {
    return bits == 4 ? &avx2::tile_avx2_any<4> : &avx2::tile_avx2_any<8>;
  }
#endif
#if defined(AGENTKV_QMM_NEON)
  if (!forced_portable()) {
    return bits == 4 ? &neon::tile<4> : &neon::tile<8>;
  }
#endif
  (void)bits;
  return &tile_portable;
}

}  // namespace

namespace {

void check(const QuantizedWeights& w) {
  if (w.bits != 4 && w.bits != 8) {
    throw std::invalid_argument("agentkv's quantized matmul takes 4- or 8-bit weights");
  }
  if (w.group != 32 && w.group != 64 && w.group != 128) {
    throw std::invalid_argument("agentkv's quantized matmul takes groups of 32, 64 or 128");
  }
  if (w.K % w.group != 0) {
    throw std::invalid_argument("the input size must be a multiple of the group size");
  }
}

// Weight rows [n0, n1) of w against every row of the quantized x, into y [M, w.N].
void columns(const QuantizedWeights& w, const Activations& a, float* y, int64_t M, int64_t n0,
             int64_t n1) {
  const TileKernel tile = kernel_for(w.bits);
  const int64_t N = w.N;
  // Tiles: one row of x (decode) against 4 weight rows, two against two, else up to 4 rows
  // against one weight row at a time; with VNNI's 512-bit registers (two weight rows to each)
  // 1-4 or 8 rows against four. The tile changes no result (see qmm.h).
  const int cols = M == 1 || use_vnni() ? 4 : M == 2 ? 2 : 1;
  const bool wide_rows = use_vnni() && w.group == kBlock;
  for (int64_t m = 0; m < M;) {
    // 8 rows at a time where VNNI's 32-token-group tile takes them, else up to 4
    const int rows =
        wide_rows && M - m >= 8 ? 8 : static_cast<int>(std::min<int64_t>(kRows, M - m));
    for (int64_t n = n0; n < n1; n += cols) {
      const int c = static_cast<int>(std::min<int64_t>(cols, n1 - n));
      if (rows == 8 && c != 4) {  // the 8-row tile takes 4 weight rows only
        tile(w, n, c, a, m, 4, y + m * N + n, N);
        tile(w, n, c, a, m + 4, 4, y + (m + 4) * N + n, N);
      } else {
        tile(w, n, c, a, m, rows, y + m * N + n, N);
      }
    }
    m += rows;
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
    if (ws[i].K != ws[0].K || ws[i].group != ws[0].group ||
        (ws[i].bits == 4) != (ws[0].bits == 4)) {
      for (int j = 0; j < count; ++j) {  // activations quantized differently: one at a time
        quantized_matmuls(x, ws + j, ys + j, 1, M);
      }
      return;
    }
  }
  thread_local Activations scratch;  // one matmul at a time per calling thread
  Activations& a = scratch;          // (the workers read the caller's, through this name)
  quantize(x, M, ws[0].K, ws[0].group, ws[0].bits == 4, a);
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

const char* qmm_implementation() {
#if defined(AGENTKV_QMM_NEON)
  return forced_portable() ? "portable" : "neon";
#endif
  return use_vnni()                                      ? "avx512-vnni"
         : cpu_has_avx2_fma_f16c() && !forced_portable() ? "avx2"
                                                         : "portable";
}

}  // namespace agentkv
