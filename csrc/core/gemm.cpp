#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "cpu_features.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AGENTKV_GEMM_X86 1
#endif

namespace agentkv {
namespace {

constexpr int64_t kColumnBlock = 64;  // w rows per block: 64 x K floats stay in L2

inline float combine_lanes(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

inline float finish(float sum, const float* x, const float* w, int64_t k0, int64_t K) {
  for (int64_t k = k0; k < K; ++k) {
    sum = std::fma(x[k], w[k], sum);
  }
  return sum;
}

// The definition, one element at a time; also the path for CPUs without AVX2.
template <int MR, int NR>
void tile_generic(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                  float* y, int64_t ldy, int64_t K) {
  const int64_t k8 = K / 8 * 8;
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      const float* xr = x + r * ldx;
      const float* wc = w + c * ldw;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < k8; k += 8) {
        for (int l = 0; l < 8; ++l) {
          lanes[l] = std::fma(xr[k + l], wc[k + l], lanes[l]);
        }
      }
      const float sum = finish(combine_lanes(lanes), xr, wc, k8, K);
      y[r * ldy + c] = bias ? sum + bias[c] : sum;
    }
  }
}

#if defined(AGENTKV_GEMM_X86)
#define GEMM_TARGET __attribute__((target("avx2,fma")))

GEMM_TARGET inline float hsum_fixed(__m256 v) {
  // lanes (l0 + l4, l1 + l5, l2 + l6, l3 + l7), then pairs (0, 2) and (1, 3), then 0 + 1:
  // the order combine_lanes() spells out.
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

template <int MR, int NR>
GEMM_TARGET void tile_avx2(const float* x, int64_t ldx, const float* w, int64_t ldw,
                           const float* bias, float* y, int64_t ldy, int64_t K) {
  const int64_t k8 = K / 8 * 8;
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      acc[r][c] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      wv[c] = _mm256_loadu_ps(w + c * ldw + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      const float sum = finish(hsum_fixed(acc[r][c]), x + r * ldx, w + c * ldw, k8, K);
      y[r * ldy + c] = bias ? sum + bias[c] : sum;
    }
  }
}

#endif

using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                      int64_t);

template <int MR, int NR>
Tile pick() {
#if defined(AGENTKV_GEMM_X86)
  if (cpu_has_avx2_fma()) {
    return &tile_avx2<MR, NR>;
  }
#endif
  return &tile_generic<MR, NR>;
}

Tile tile_for(int rows, int cols) {
  static const Tile table[4][2] = {{pick<1, 1>(), pick<1, 2>()},
                                   {pick<2, 1>(), pick<2, 2>()},
                                   {pick<3, 1>(), pick<3, 2>()},
                                   {pick<4, 1>(), pick<4, 2>()}};
  return table[rows - 1][cols - 1];
}

void column_block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K, int64_t j0, int64_t j1) {
  for (int64_t i = 0; i < M; i += 4) {
    const int rows = static_cast<int>(std::min<int64_t>(4, M - i));
    for (int64_t j = j0; j < j1; j += 2) {
      const int cols = static_cast<int>(std::min<int64_t>(2, j1 - j));
      tile_for(rows, cols)(x + i * K, K, w + j * K, K, bias ? bias + j : nullptr, y + i * N + j, N,
                           K);
    }
  }
}

void run_blocks(int64_t blocks, double flops, const std::function<void(size_t)>& block) {
  if (flops < 4e6) {  // too small to be worth waking the pool
    for (int64_t b = 0; b < blocks; ++b) {
      block(static_cast<size_t>(b));
    }
    return;
  }
  ThreadPool::shared().run(static_cast<size_t>(blocks), block);
}

}  // namespace

void invariant_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M,
                    int64_t N, int64_t K) {
  const std::function<void(size_t)> block = [&](size_t b) {
    const int64_t j0 = static_cast<int64_t>(b) * kColumnBlock;
    column_block(x, w, bias, y, M, N, K, j0, std::min(N, j0 + kColumnBlock));
  };
  run_blocks((N + kColumnBlock - 1) / kColumnBlock, 2.0 * static_cast<double>(M) * N * K, block);
}

const char* gemm_implementation() {
  return cpu_has_avx2_fma() ? "avx2-fma" : "generic";
}

}  // namespace agentkv
