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

// kernels/paged_attention.metal over its grid: dims as the body documents them.
mx::array paged_attention(const mx::array& q, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const mx::array& tables,
                          const mx::array& lengths, const std::array<int, 14>& dims,
                          const std::optional<mx::array>& sinks, float scale, int threads,
                          const std::optional<mx::array>& tail = std::nullopt,
                          const std::optional<mx::array>& tail_slots = std::nullopt);

// sources[k]: the source arrays of output k; rows: int32 [n_rows, 5];
// dims per output: heads, width, used, capacity, (chunk: ignored)
std::vector<mx::array> merge(const std::vector<std::vector<mx::array>>& sources,
                             const mx::array& rows, const std::vector<std::array<int, 5>>& dims,
                             int threads);

// meta per output: row, first, length, heads, width, batch_capacity, capacity
std::vector<mx::array> extract(const std::vector<mx::array>& batches,
                               const std::vector<std::array<int, 7>>& metas, int threads);

}  // namespace agentkv::kernels
