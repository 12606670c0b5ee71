#include "rows.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "half.h"
#include "lanes.h"
#include "thread_pool.h"

namespace agentkv {
namespace {

namespace portable {
using Ops = lanes::Portable;
#include "rows_lanes.inc"
}  // namespace portable

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using Ops = lanes::Avx2;
#include "rows_lanes.inc"

// One butterfly stage inside each 8-value register: lanes with bit h clear take a + b, the
// others a - b (a the lane with bit h clear), as the scalar loop computes them.
template <int h>
__m256 butterfly8(__m256 v) {
  __m256 partner;
  if constexpr (h == 1) {
    partner = _mm256_permute_ps(v, 0xB1);  // 1 0 3 2
  } else if constexpr (h == 2) {
    partner = _mm256_permute_ps(v, 0x4E);  // 2 3 0 1
  } else {
    partner = _mm256_permute2f128_ps(v, v, 0x01);  // the other half
  }
  const __m256 sum = _mm256_add_ps(v, partner);         // lower lanes: a + b
  const __m256 difference = _mm256_sub_ps(partner, v);  // upper lanes: a - b
  return _mm256_blend_ps(sum, difference, h == 1 ? 0xAA : h == 2 ? 0xCC : 0xF0);
}

// hadamard_rows for n >= 16: spans 1, 2, 4 inside registers, the wider spans between them.
void hadamard_rows(float* x, int64_t rows, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    for (int64_t i = 0; i < n; i += 8) {
      __m256 v = _mm256_loadu_ps(row + i);
      v = butterfly8<4>(butterfly8<2>(butterfly8<1>(v)));
      _mm256_storeu_ps(row + i, v);
    }
    for (int64_t h = 8; h < n; h <<= 1) {
      const bool last = 2 * h == n;
      for (int64_t i = 0; i < n; i += 2 * h) {
        for (int64_t j = i; j < i + h; j += 8) {
          const __m256 a = _mm256_loadu_ps(row + j);
          const __m256 b = _mm256_loadu_ps(row + j + h);
          __m256 sum = _mm256_add_ps(a, b);
          __m256 difference = _mm256_sub_ps(a, b);
          if (last) {
            sum = _mm256_mul_ps(sum, s);
            difference = _mm256_mul_ps(difference, s);
          }
          _mm256_storeu_ps(row + j, sum);
          _mm256_storeu_ps(row + j + h, difference);
        }
      }
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options
#endif

#if defined(__aarch64__)
namespace neon {
using Ops = lanes::Neon;
#include "rows_lanes.inc"
}  // namespace neon
#endif

}  // namespace

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  constexpr int64_t kPiece = 16384;  // values per thread job
  const std::function<void(size_t)> piece = [&](size_t p) {
    const int64_t i = static_cast<int64_t>(p) * kPiece;
    const int64_t count = std::min(kPiece, n - i);
#if defined(__x86_64__) || defined(_M_X64)
    if (cpu_has_avx2_fma_f16c() && !cpu_forced_portable()) {
      avx2::silu_mul(g + i, u + i, out + i, count);
      return;
    }
#endif
#if defined(__aarch64__)
    if (!cpu_forced_portable()) {
      neon::silu_mul(g + i, u + i, out + i, count);
      return;
    }
#endif
    portable::silu_mul(g + i, u + i, out + i, count);
  };
  ThreadPool::shared().run(static_cast<size_t>((n + kPiece - 1) / kPiece), piece);
}

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                   float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t body = dim / 8 * 8;
    for (int64_t k = 0; k < body; k += 8) {
      for (int l = 0; l < 8; ++l) {
        lane[l] += xr[k + l] * xr[k + l];
      }
    }
    float sum =
        ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int64_t k = body; k < dim; ++k) {
      sum += xr[k] * xr[k];
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t k = 0; k < dim; ++k) {
      o[k] = xr[k] * inv * w[k];
    }
  }
}

void rope_rows(const RopeArgs& a) {
  const int64_t half = a.dims / 2;
  // cos, sin of every (position, frequency) of a head's rows: shared by the heads that
  // start at the same position (all heads of one sequence)
  std::vector<float> cs(static_cast<size_t>(a.length * half * 2));
  const int64_t fs = a.feature_stride;
  for (int64_t h = 0; h < a.heads; ++h) {
    if (h == 0 || a.positions[h] != a.positions[h - 1]) {
      for (int64_t l = 0; l < a.length; ++l) {
        const float pos = static_cast<float>(a.positions[h] + l) * a.scale;
        float* row = cs.data() + l * half * 2;
        for (int64_t i = 0; i < half; ++i) {
          const float theta = pos * a.inv_freq[i];
          row[2 * i] = std::cos(theta);
          row[2 * i + 1] = std::sin(theta);
        }
      }
    }
    const float* xh = a.x + a.head_offsets[h];
    for (int64_t l = 0; l < a.length; ++l) {
      const float* src = xh + l * a.row_stride;
      const float* row = cs.data() + l * half * 2;
      float* dst = a.out + (h * a.length + l) * a.dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i0 = a.traditional ? 2 * i : i;
        const int64_t i1 = a.traditional ? 2 * i + 1 : i + half;
        const float x0 = src[i0 * fs];
        const float x1 = src[i1 * fs];
        const float c = row[2 * i];
        const float s = row[2 * i + 1];
        dst[i0] = x0 * c - x1 * s;
        dst[i1] = x0 * s + x1 * c;
      }
      for (int64_t k = a.dims; k < a.dim; ++k) {
        dst[k] = src[k * fs];
      }
    }
  }
}

void hadamard_rows(float* x, int64_t rows, int64_t n, float scale) {
#if defined(__x86_64__) || defined(_M_X64)
  if (n >= 16 && cpu_has_avx2_fma_f16c() && !cpu_forced_portable()) {
    return avx2::hadamard_rows(x, rows, n, scale);
  }
#endif
  if (n == 1) {  // no butterflies: the scale alone, as MLX's transform
    for (int64_t r = 0; r < rows; ++r) {
      x[r] *= scale;
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    for (int64_t h = 1; h < n; h <<= 1) {
      const bool last = 2 * h == n;
      for (int64_t i = 0; i < n; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float a = row[j];
          const float b = row[j + h];
          float sum = a + b;
          float difference = a - b;
          if (last) {
            sum *= scale;
            difference *= scale;
          }
          row[j] = sum;
          row[j + h] = difference;
        }
      }
    }
  }
}

void quantize_rows(const float* x, int64_t rows, int64_t dim, int bits, int group, uint32_t* words,
                   uint16_t* scales, uint16_t* biases) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits;
  const int64_t groups = rows * (dim / group);
  for (int64_t g = 0; g < groups; ++g) {
    const float* w = x + g * group;
    float w_min = std::numeric_limits<float>::infinity();
    float w_max = -w_min;
    for (int j = 0; j < group; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    uint32_t* out = words + g * (group / per_word);
    for (int j = 0; j < group / per_word; ++j) {
      uint64_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float code = std::rint((w[j * per_word + k] - bias) / scale);
        code = std::min(std::max(code, 0.0f), n_bins);
        word |= static_cast<uint64_t>(code) << (k * bits);
      }
      out[j] = static_cast<uint32_t>(word);
    }
    scales[g] = float_to_half(scale);
    biases[g] = float_to_half(bias);
  }
}

void quantize_channels(const uint16_t* x, int tokens, int64_t dim, int bits, uint32_t* words,
                       uint16_t* scales, uint16_t* biases) {
  const auto levels = static_cast<float>((1 << bits) - 1);
  const int per_word = 32 / bits;
  const int64_t width = dim * bits / 32;
  std::fill_n(words, tokens * width, 0u);
  for (int64_t c = 0; c < dim; ++c) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int t = 0; t < tokens; ++t) {
      const float v = half_to_float(x[t * dim + c]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const uint16_t lo_half = float_to_half(lo);
    const uint16_t scale_half = float_to_half((hi - half_to_float(lo_half)) / levels);
    const float bias = half_to_float(lo_half), scale = half_to_float(scale_half);
    const float divisor = scale == 0.0f ? 1.0f : scale;
    for (int t = 0; t < tokens; ++t) {
      float code = std::rint((half_to_float(x[t * dim + c]) - bias) / divisor);
      code = std::min(std::max(code, 0.0f), levels);
      words[t * width + c / per_word] |= static_cast<uint32_t>(code) << ((c % per_word) * bits);
    }
    scales[c] =
        scale_half;  // [tokens, dim / tokens] row-major: channel c at row c / (dim / tokens)
    biases[c] = lo_half;
  }
}

}  // namespace agentkv
