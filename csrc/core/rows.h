// Row-wise layer pieces of a transformer on CPU, each row computed alone (the result of a
// row never depends on the other rows of the batch): RMS normalization, rotary position
// embedding and the SwiGLU gate. They replace MLX's CPU fallbacks for mx.fast.rms_norm and
// mx.fast.rope, which MLX composes from 8 and ~15 graph operations (measured on the
// embedded model: ~40 and ~100 us a call at decode, 60 calls each per token), and mlx-lm's
// compiled swiglu, whose exp MLX's x86 wheel runs one value at a time through a library fma
// (~8% of a 512-token prefill).
#pragma once

#include <cstdint>

namespace agentkv {

// out[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * w. The sum of squares runs
// over 8 lanes (lane l takes k = l, l + 8, ...) combined in a fixed order, then the tail.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                   float eps);

// Rotary embedding of rows of `dim` features; the first `dims` are rotated by the angle
// position * scale * inv_freq[i] (inv_freq: dims / 2 values), the rest copied.
// traditional: pairs (2i, 2i + 1); otherwise halves (i, i + dims / 2).
// x is read through element strides: x + head_offset(h) + l * row_stride, feature
// stride 1 or `feature_stride`; out is contiguous [heads, L, dim]. Row l of head h
// is at position positions[h] + l (each head's sequence may start elsewhere).
struct RopeArgs {
  const float* x;
  float* out;
  int64_t heads;                // every index before the sequence axis, flattened
  int64_t length;               // L
  int64_t dim;                  // features in a row
  int64_t dims;                 // features rotated (even, <= dim)
  const int64_t* head_offsets;  // [heads] element offset of each (flattened) head in x
  int64_t row_stride;           // elements between positions
  int64_t feature_stride;       // elements between features
  const int64_t* positions;     // [heads] first position of each head's rows
  const float* inv_freq;        // [dims / 2]
  float scale;
  bool traditional;
};
void rope_rows(const RopeArgs& a);

// out[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i], for i < n (AVX2 or the
// portable lanes, the same bits; spread over the thread pool).
void silu_mul(const float* g, const float* u, float* out, int64_t n);

// The KV cache's writes, as MLX computes them (the same operations in the same order, so
// the same bits; tests/kernels/test_row_ops.py checks both against MLX):
//
// mx.hadamard_transform of rows of n floats (n a power of two), in place: butterflies of
// span 1, 2, .., n / 2, the last stage's sums and differences multiplied by `scale`.
void hadamard_rows(float* x, int64_t rows, int64_t n, float scale);
// mx.quantize's affine quantization of rows of `dim` floats per group of `group` (bits 2,
// 4 or 8: codes packed lowest bits first into uint32 words), its float32 scales and biases
// stored as float16 (astype's rounding): words [rows, dim * bits / 32], scales and biases
// [rows, dim / group] (float16 bits).
void quantize_rows(const float* x, int64_t rows, int64_t dim, int bits, int group, uint32_t* words,
                   uint16_t* scales, uint16_t* biases);
// Format 2's per-channel keys (agentkv.format.quant.quantize_channels): `tokens` rows of
// `dim` float16 keys (x, half bits) as one channel group. Per channel c: lo = half(min),
// scale = half((max - lo) / (2^bits - 1)), code = rint((x - lo) / (scale or 1)) clipped to
// [0, 2^bits - 1], packed along the row lowest bits first: words [tokens, dim * bits / 32];
// the dim scales and biases spread over the rows, dim / tokens a row: [tokens, dim / tokens]
// (float16 bits). NaN keys give unspecified codes.
void quantize_channels(const uint16_t* x, int tokens, int64_t dim, int bits, uint32_t* words,
                       uint16_t* scales, uint16_t* biases);

}  // namespace agentkv
