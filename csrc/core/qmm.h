// Quantized matmul for MLX's affine weight format on CPU: y = x W^T, where W [N, K] is stored
// as `bits`-bit codes q packed into uint32 words (element k of a row in word k * bits / 32,
// lowest bits first) with a scale s and a bias b per group of `group` weights along K:
// W[n, k] = s[n, k / group] * q[n, k] + b[n, k / group].
//
// Activations are quantized per block of 32 to int16 (d = max |x| / 32767, x ~ d * xq) with
// each weight group's sum of the quantized x kept (xsum = sum_c d[c] * sum(xq[c])), so one
// output element is
//
//   y[m, n] = sum_j ( s[n, j] * sum_c d[m, c] * idot(q[n, c], xq[m, c]) + b[n, j] * xsum[m, j] )
//
// (c: the 32-blocks of group j; idot exact in int32). The bias enters once per group and
// the products are integer dot products (AVX2: weights widened to int16, madd), as llama.cpp
// does for Q4_1 x Q8_1 but with int16 codes: int8 activations (llama.cpp's) cost the
// embedded model 3% of its top-1 tokens against float activations on the same weights
// (perplexity +0.37%, 1,024 tokens), int16 codes cost it nothing measurable, at about the
// same instruction count (two madds per block instead of maddubs + madd).
//
// Batch invariance: every y[m, n] is reduced in one fixed order (8 float lanes over the
// blocks, the bias terms in 8 lanes by group, each set combined as gemm.h does), whatever
// M, the tile or the thread; a row's result never depends on the other rows. The portable
// path computes the same lanes in the same order, so it gives the same bits as AVX2.
#pragma once

#include <cstdint>

namespace agentkv {

enum class ScaleType { f32, f16, bf16 };

struct QuantizedWeights {
  const uint32_t* words;  // [N, K * bits / 32]
  const void* scales;     // [N, K / group] of scale_type
  const void* biases;     // [N, K / group] of scale_type
  ScaleType scale_type;
  int bits;   // 4 or 8
  int group;  // 32, 64 or 128
  int64_t N, K;
};

// x: [M, K] float32 row-major; y: [M, N] float32. K must be a multiple of `group`.
void quantized_matmul(const float* x, const QuantizedWeights& w, float* y, int64_t M);

// y_i = x W_i^T for `count` weight matrices of the same K (q, k and v; gate and up): x is
// quantized once where their groups and bits allow it, and one thread-pool job list covers
// every matrix's column blocks. Each y_i has the bits quantized_matmul(x, W_i) gives.
void quantized_matmuls(const float* x, const QuantizedWeights* ws, float* const* ys, int count,
                       int64_t M);
// "avx512-vnni", "avx2" or "portable": which implementation this CPU runs (AGENTKV_QMM=avx2
// or =portable caps it).
const char* qmm_implementation();

}  // namespace agentkv
