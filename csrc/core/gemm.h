// A batch-invariant float32 GEMM for linear layers: y = x w^T (+ b).
//
// Why: BLAS libraries pick kernels by shape, so a row of x gets different
// low-order bits when it is multiplied alone or in a batch of 4 (measured with
// OpenBLAS: almost every row differs). Then batching agents changes their
// greedy tokens. Here every y[i, j] is reduced in one fixed order whatever M,
// the tile or the thread that computes it:
//
//   8 lanes over k (lane l sums k = l, l + 8, ... with fused multiply-adds),
//   combined as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
//   then the K % 8 tail in order (fused), then the bias.
//
// Tiles of up to 4 rows x 2 columns keep w blocks in L2 and x rows in L1;
// columns are split across the shared thread pool.
#pragma once

#include <cstdint>

namespace agentkv {

// x: [M, K] row-major, w: [N, K] row-major (a linear layer's weight), bias: [N]
// or null, y: [M, N].
void invariant_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M,
                    int64_t N, int64_t K);

// "avx2-fma" or "generic": which implementation this CPU runs.
const char* gemm_implementation();

}  // namespace agentkv
