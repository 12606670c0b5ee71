// The kernels of kernels/*.metal on CPU: the same bodies, run over their grid.
//
// Arrays are passed as *units*: uint16 or uint32 views of the cache components
// (the kernels only move bits). Each call handles many outputs (every layer and
// component) in one parallel pass.
#pragma once

#include <mlx/array.h>

#include <array>
#include <vector>

namespace agentkv::kernels {

namespace mx = mlx::core;

// meta per output: plane, heads, width, length, capacity, (chunk: ignored), n_blocks
std::vector<mx::array> gather(const mx::array& blocks, const mx::array& table,
                              const std::vector<std::array<int, 7>>& metas, int threads);

// sources[k]: the source arrays of output k; rows: int32 [n_rows, 5];
// dims per output: heads, width, used, capacity, (chunk: ignored)
std::vector<mx::array> merge(const std::vector<std::vector<mx::array>>& sources,
                             const mx::array& rows, const std::vector<std::array<int, 5>>& dims,
                             int threads);

// meta per output: row, first, length, heads, width, batch_capacity, capacity
std::vector<mx::array> extract(const std::vector<mx::array>& batches,
                               const std::vector<std::array<int, 7>>& metas, int threads);

}  // namespace agentkv::kernels
