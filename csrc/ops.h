// agentkv's MLX operations: lazy graph ops backed by csrc/core kernels on CPU.
#pragma once

#include <mlx/array.h>
#include <mlx/utils.h>

#include <memory>
#include <optional>
#include <tuple>
#include <variant>

namespace agentkv {
class KVSwapSet;
}

namespace agentkv::ops {

namespace mx = mlx::core;

// x [..., K] @ w[N, K]^T (+ bias[N]) in float32, every output reduced in the same
// order whatever the batch (see csrc/core/gemm.h). CPU only.
mx::array invariant_linear(const mx::array& x, const mx::array& w,
                           const std::optional<mx::array>& bias);

// x [..., K] @ W^T for W [N, K] in MLX's affine format, packed (csrc/core/qmm.h: codes uint8
// [N / 16, K * 2 * bits], scales and biases [N / 16, K / group_size, 16]); bits 4 or 8, groups
// of 32, 64 or 128, float32/float16/bfloat16 scales. Activations go int16 per 32 and every
// output is reduced in one fixed order whatever the batch. Returns [..., N] in x's dtype.
// CPU only.
// MLX's affine weights (nn.QuantizedLinear's uint32 weight [N, K * bits / 32], scales and
// biases [N, K / group_size]) packed for quantized_matmul (csrc/core/qmm.h), losslessly:
// codes uint8 [ceil(N / 16), K * 2 * bits], scales and biases [ceil(N / 16), K / group_size,
// 16] of their dtype (padded columns zero). Evaluates its inputs; the results are evaluated.
std::tuple<mx::array, mx::array, mx::array> pack_quantized(const mx::array& w,
                                                           const mx::array& scales,
                                                           const mx::array& biases, int group_size,
                                                           int bits);

// Packed float32 scales or biases (pack_quantized, groups of 32) and a float16 factor d a row
// and 256 K -> the two-level form quantized_matmul also takes (uint8 [ceil(N / 16), K / 256,
// 160], csrc/core/qmm.h), bit for bit the same values; throws where a value is not d times
// an integer in 0 .. 255.
mx::array pack_super_scales(const mx::array& packed, const mx::array& super);

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits);

// Attention of queries [B, Hq, L, D] float32 over stored keys and values (each a
// tuple: words, scales, biases for 2/4/8 bits, or one float16 array for 16 bits,
// [B, Hkv, T, ...]) with causal masking from each row's left padding, an optional
// sliding window, optional attention sinks and an optional soft cap of the scores (Gemma
// 2's: softcap > 0; see csrc/core/attention.h). CPU only.
// Per-channel keys (channel_tokens > 0): each row's group still filling is float16 in
// tail [B, Hkv, channel_tokens, D].
mx::array quantized_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                              const std::vector<mx::array>& values, float scale, int key_bits,
                              int value_bits, int group, int window,
                              const std::optional<mx::array>& left_padding,
                              const std::optional<mx::array>& sinks, int channel_tokens = 0,
                              const std::optional<mx::array>& tail = std::nullopt,
                              float softcap = 0.0f);

// The same attention over paged caches: keys and values are arenas of token rows
// [blocks * kv_heads * block_tokens, width] (see csrc/core/attention.h); row b of the batch
// holds lengths[b] tokens in blocks tables[b, :], and its L queries are its last L tokens.
// A jagged batch: no padding, no copies. CPU only. Per-channel keys (channel_tokens > 0):
// the groups still filling are float16 rows of `tail`, slot tail_slots[b] per batch row;
// `done` (float16 [entries * channel_tokens, D]) holds the groups the step completed, row b's
// from entry done_first[b] (-1: none), which a query inside one reads until its last token.
mx::array paged_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const mx::array& tables,
                          const mx::array& lengths, int kv_heads, int block_tokens, float scale,
                          int key_bits, int value_bits, int group, int window,
                          const std::optional<mx::array>& sinks, int channel_tokens = 0,
                          const std::optional<mx::array>& tail = std::nullopt,
                          const std::optional<mx::array>& tail_slots = std::nullopt,
                          const std::optional<mx::array>& done = std::nullopt,
                          const std::optional<mx::array>& done_first = std::nullopt,
                          float softcap = 0.0f);

// x [..., D] * rsqrt(mean(x^2) + eps) * w, float32, each row alone (csrc/core/rows.h):
// one graph operation where MLX's CPU fallback for mx.fast.rms_norm makes eight. CPU only.
// silu(gate) * up (mlx-lm's swiglu) as one CPU operation, float32, any strides.
mx::array silu_mul(const mx::array& gate, const mx::array& up);

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);

// mx.hadamard_transform(x, scale)'s bits for float32 rows (last axis a power of two), as one
// graph operation whose rows are spread over agentkv's thread pool (csrc/core/rows.h). CPU only.
mx::array hadamard(const mx::array& x, float scale);

// mx.fast.rope's rotary embedding of x [..., L, D] float32 (positions offset + l along
// axis -2; an offset array holds one start or one per batch row), from `base` or from
// `freqs` (dims / 2 periods), as one graph operation. CPU only.
mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base,
               float scale, const std::variant<int, mx::array>& offset,
               const std::optional<mx::array>& freqs);

// One decoder layer of a Llama-family model (RMSNorm, q/k/v projections, RoPE, attention
// over the block pool, o projection, RMSNorm, SwiGLU MLP, both residuals) for B rows of L
// new tokens each, as one CPU operation: the same kernels on the same values as the
// layer's separate operations, so the same bits. Weights: `linears` holds q, k, v, o,
// gate, up, down as MLX affine words, scales, biases; `linear_biases` holds each linear's own
// bias [N] or none (Qwen2's q, k, v have one), added after its matmul; `qk_norms` (Qwen3)
// RMS-normalizes each q and k head (weights [head dim], eps qk_eps) before RoPE. The KV
// cache is the pool's layer arena in format 2 (per-channel keys of key_bits, values of
// value_bits, `rotate`: stored times the Hadamard matrix): the new values are quantized into
// `values` at `rows`, the new keys (float16) go to `tail` at `tail_rows` (both [B * kv_heads
// * L], ordered batch, head, token), written in place, as the pool's scatters do. Where a row
// completes a channel group, `key_plan` replaces tail_rows (agentkv.pool.arena.WritePlan's
// direct rows and sources, gathered tail rows, then the sources and rows of the complete
// groups, of the rest and of the prevs; `key_counts` of each): complete groups are quantized
// per channel into `keys`, and each completing row's last group goes to `prevs` (float16,
// shaped as the tail), in place. Rows' positions start at
// lengths[b] - L, or at positions[b] - L where given (KVSwap: the tables and lengths then
// describe what attention reads, csrc/kvswap_ops.h); each swapped row (swap_rows[i], one
// new token) stages its groups through swaps[i] before its attention, and a row whose
// reads failed gets NaN. `predict` (KVSwap reading ahead: the next layer's input norm, its q
// words, scales and biases of predict_bits in groups of predict_group, its q bias or None,
// its q norm or None): each swapped row whose set predicts layer + 1 starts that layer's
// reads from a query predicted from this layer's input. CPU only.
mx::array decoder_layer(const mx::array& x, const std::vector<mx::array>& norms, float eps,
                        const std::vector<mx::array>& linears, const std::vector<int>& bits,
                        const std::vector<int>& groups, int heads, int kv_heads,
                        float attention_scale, int rope_dims, bool rope_traditional,
                        std::optional<float> rope_base, float rope_scale,
                        const std::optional<mx::array>& rope_freqs,
                        const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                        const mx::array& tail, const mx::array& tables, const mx::array& lengths,
                        const mx::array& tail_slots, const mx::array& rows,
                        const std::optional<mx::array>& tail_rows, int key_bits, int value_bits,
                        int group, int channel_tokens, int block_tokens, int window, bool rotate,
                        const std::vector<std::optional<mx::array>>& linear_biases,
                        const std::optional<std::vector<mx::array>>& qk_norms, float qk_eps,
                        const std::optional<mx::array>& positions,
                        const std::vector<std::shared_ptr<agentkv::KVSwapSet>>& swaps,
                        const std::vector<int>& swap_rows, int layer,
                        const std::vector<std::optional<mx::array>>& predict, int predict_bits,
                        int predict_group, const std::optional<mx::array>& key_plan = std::nullopt,
                        const std::vector<int64_t>& key_counts = {},
                        const std::optional<mx::array>& prevs = std::nullopt,
                        bool swap_stream = false);

}  // namespace agentkv::ops
