// The kernels of kernels/*.metal on CPU: the same bodies, run over their grid.
//
// merge and extract take *units*: uint16 or uint32 views of the cache components (they
// only move bits), many outputs (every layer and component) in one parallel pass.
#pragma once

#include <mlx/array.h>

#include <array>
#include <optional>
#include <vector>

namespace agentkv::kernels {

namespace mx = mlx::core;

// kernels/paged_attention.metal over its grid (each threadgroup's lanes as a loop: simt.h),
// then kernels/paged_attention_merge.metal where dims[14] (splits) > 1: dims as the body
// documents them; `vectors`, `lanes_per_key` and `keys_in_flight` are its NQ, KL and KU. Keys and
// values are (words, scales, biases); 16-bit kinds pass their float16 rows as words and any scales.
// Format 2: `done` and `done_first`, the groups the step completes (none where absent).
mx::array paged_attention(const mx::array& q, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const mx::array& tables,
                          const mx::array& lengths, const std::array<int, 17>& dims,
                          const std::optional<mx::array>& sinks, float scale, int threads,
                          const std::optional<mx::array>& tail,
                          const std::optional<mx::array>& tail_slots, int vectors,
                          int lanes_per_key, const std::optional<mx::array>& done,
                          const std::optional<mx::array>& done_first, float softcap = 0.0f,
                          int keys_in_flight = 1);

// kernels/store_rows.metal over its grid (each threadgroup's lanes as a loop), with the
// kernel's own inputs (its header says what `dims` holds: the rows' layouts in `keys`,
// `values` and `queries`, and the prologue's RoPE and norm; `starts` and `rope` are read
// only with RoPE, `norm` (the queries' then the keys' 2 D weights) and `eps` only with the
// norm) -> (H k as float16 [N, D], H v quantized as mx.quantize does: words uint32
// [N, D * value_bits / 32], scales and biases float16 [N, D / group], the roped queries
// float32 [max(NQ, 1), D]). Every row it reads is checked to lie inside its array. KV
// format 2's store of a step on a GPU, for tests.
std::vector<mx::array> store_rows(const mx::array& keys, const mx::array& values,
                                  const mx::array& queries, const std::vector<int>& dims,
                                  const mx::array& starts, const mx::array& rope,
                                  const mx::array& norm, float eps, int threads);

// kernels/dense_rows.metal over its grid: the keys [N, D] and values [N, Dv] (float32) that
// `src` (int32 [3 + N * 3]: N, 0, 0, then a row's key source 0 arena / 1 tail / 2 done, key
// row, value arena row) names, dequantized (and rotated back where dims[7], times `scale`);
// dims as the body documents them. Every named row is checked to lie in its array.
std::vector<mx::array> dense_rows(const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values, const mx::array& tail,
                                  const mx::array& done, const mx::array& src,
                                  const std::array<int, 8>& dims, float scale, int threads);

// kernels/quantize_groups.metal over its grid: whole channel groups of keys [..., G * ct, D]
// -> (words uint32 [G * ct, D * bits / 32], scales and biases float16 [G * ct, D / ct]), as
// quant.quantize_channels lays them out.
std::vector<mx::array> quantize_groups(const mx::array& x, int bits, int channel_tokens);

// sources[k]: the source arrays of output k; rows: int32 [n_rows, 5];
// dims per output: heads, width, used, capacity, (chunk: ignored)
std::vector<mx::array> merge(const std::vector<std::vector<mx::array>>& sources,
                             const mx::array& rows, const std::vector<std::array<int, 5>>& dims,
                             int threads);

// meta per output: row, first, length, heads, width, batch_capacity, capacity
std::vector<mx::array> extract(const std::vector<mx::array>& batches,
                               const std::vector<std::array<int, 7>>& metas, int threads);

}  // namespace agentkv::kernels
