// Quantized matmul on CPU for MLX's affine weights, repacked for it: y = x W^T, where
// W [N, K] holds `bits`-bit codes q with a scale s and a bias b per group of `group` weights
// along K: W[n, k] = s[n, k / group] * q[n, k] + b[n, k / group].
//
// The packed layout (made from nn.QuantizedLinear's arrays at load, by pure array ops:
// agentkv.mlx_adapter.pack_quantized) puts 16 output columns side by side, so one 512-bit
// register's 32-bit lanes are 16 columns and one vpdpbusd multiplies 4 weights of each by 4 bytes
// of x:
//
//   codes  [N / 16, K / 32, 16 * 32 * bits / 8] uint8: for a block of 16 columns and 32 K,
//          "quad" j (k = 4j .. 4j + 3 of the block) of all 16 columns is 64 bytes, byte
//          4 n + t holding code(n, 4 j + t). 8 bits: quad j is bytes 64 j ...; 4 bits: quads
//          2p and 2p + 1 share bytes 64 p ..., quad 2p in the low nibbles, 2p + 1 the high.
//          5 bits: the 4-bit layout of the codes' low nibbles (256 bytes), then each quad's
//          fifth bits as a little-endian 64-bit mask (bytes 256 + 8 j ...: bit 4 n + t is
//          the fifth bit of byte 4 n + t of quad j), so a quad's 64 codes are its nibbles
//          plus 16 under one AVX-512 byte mask.
//   scales, biases [N / 16, K / group, 16] (float32/float16/bfloat16, as stored), or in two
//          levels (ScaleType::ksuper, groups of 32 and K a multiple of 256: llama.cpp's
//          K-quant super-blocks): uint8 [N / 16, K / 256, 160], per block and 256 K the 16
//          columns' float16 factors d (bytes 0-31, column n at 2 n) then 8 x 16 uint8
//          multipliers m (byte 32 + 16 j + n: group j of the 256), s = float(d) * float(m).
//          The product is exact in float32 (11 by 8 bits), so it is the float32 scale it
//          stands for bit for bit: the same element as with that float32 array, in 1.25
//          bytes a group and column instead of 4 (a Q4_K tensor resident at 1.03x its
//          file's bytes, not 1.33x).
// N here is a multiple of 16 (the caller pads; padded columns come out as zeros).
//
// Activations are quantized per block of 32 to int16 codes (d = max |x| / 32512, x ~ d * xq)
// kept as two signed bytes, xq = 256 hi + lo, so the integer dot of a block against a column
// is exact in int32 (vpdpbusd: 8 K-quads for hi, 8 for lo). With each weight group's sum of
// the quantized x kept (sum_j = sum_c d_c * sum(xq_c)), one output element is, in this
// order, for every path and every M (batch invariance: a row's result never depends on the
// other rows, the tile or the thread):
//
//   acc = 0;  for each group j:  part = dot_c0 * d_c0;  part = fma(dot_c, d_c, part) for the
//                                group's other blocks c;  acc = fma(part, s_j, acc)
//   bias = 0; for each group j:  bias = fma(b_j, sum_j, bias)
//   y = acc + bias
//
// int8 activations (llama.cpp's Q8_1) cost the embedded model 3% of its top-1 tokens
// against float activations on the same weights; 15-bit codes cost it nothing measurable.
// The bias meets the quantized x, as the codes do, so the two terms' rounding cancels.
#pragma once

#include <cstdint>

namespace agentkv {

enum class ScaleType { f32, f16, bf16, ksuper };

constexpr int kSuperGroups = 8;   // groups of 32 in a two-level scale's super-block
constexpr int kSuperBytes = 160;  // a super-block's 16 columns: 16 float16 d, 8 x 16 m

constexpr int kPackColumns = 16;  // output columns of a packed block
constexpr int kPackDepth = 32;    // K of a packed block (and of an activation block)

struct QuantizedWeights {
  const uint8_t* codes;  // [N / 16, K / 32, 16 * 32 * bits / 8]
  const void* scales;    // [N / 16, K / group, 16] of scale_type
  const void* biases;    // [N / 16, K / group, 16] of scale_type
  ScaleType scale_type;
  int bits;   // 4, 5 or 8
  int group;  // 32, 64 or 128
  int64_t N;  // a multiple of 16
  int64_t K;  // a multiple of group
};

// x: [M, K] float32 row-major; y: [M, N] float32.
void quantized_matmul(const float* x, const QuantizedWeights& w, float* y, int64_t M);

// y_i = x W_i^T for `count` weight matrices of the same K (q, k and v; gate and up): x is
// quantized once where their groups allow it, and one thread-pool job list covers every
// matrix's columns. Each y_i has the bits quantized_matmul(x, W_i) gives.
void quantized_matmuls(const float* x, const QuantizedWeights* ws, float* const* ys, int count,
                       int64_t M);

// MLX's affine layout (words uint32 [N, K * bits / 32], scales and biases [N, K / group] of
// `scale_bytes` bytes each) -> the packed one above, losslessly; columns N .. 16 * blocks - 1
// get zero codes, scales and biases. `codes` holds blocks * K * 2 * bits bytes, the packed
// scales and biases blocks * (K / group) * 16 entries each (blocks = ceil(N / 16)).
void pack_weights(const uint32_t* words, const void* scales, const void* biases, int scale_bytes,
                  int bits, int group, int64_t N, int64_t K, uint8_t* codes, void* packed_scales,
                  void* packed_biases);

// Packed float32 scales or biases [N' / 16, K / 32, 16] (pack_weights) and one float16
// factor d a row and 256 K (`super` [N, K / 256]) -> the two-level form (ScaleType::ksuper)
// in `out` [N' / 16, K / 256, 160], where every value is float(d) * m for an integer m in
// 0 .. 255, bit for bit (columns past N: d = m = 0). Returns false, with `out` undefined,
// where some value is not.
bool pack_super_scales(const float* packed, const uint16_t* super, int64_t N, int64_t K,
                       uint8_t* out);

// "avx512-vnni", "avx2", "neon" or "portable": which implementation this CPU runs
// (AGENTKV_QMM=avx2 or =portable caps it).
const char* qmm_implementation();

}  // namespace agentkv
