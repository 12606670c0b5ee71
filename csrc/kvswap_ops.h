// KVSwap in the MLX graph (docs/kvswap.md): what a step's swapped rows pass to the
// operations that read the pool (decoder_layer, kvswap_stage).
#pragma once

#include <mlx/array.h>

#include <memory>
#include <vector>

#include "core/attention.h"
#include "core/kvswap.h"

namespace agentkv::ops {

namespace mx = mlx::core;

// The swapped rows of one step at one layer: row rows[i] of the batch stages through
// swaps[i]; its table's first slots / groups-per-block entries are its staging blocks.
struct SwapStep {
  std::vector<std::shared_ptr<agentkv::KVSwapSet>> swaps;
  std::vector<int> rows;
  int layer = -1;
  // A prefill chunk of one swapped row (the step's only row): exact attention over its whole
  // context, its evicted blocks streamed in (stream_swapped_row), not KVSwap's choice.
  bool stream = false;
  bool operator==(const SwapStep&) const = default;
  bool empty() const {
    return swaps.empty();
  }
};

// Stage each swapped row's groups for `layer` into the arena (keys, values: the layer's
// components) from its rotated queries q [B, Hq, 1, D] (float32, contiguous). Returns the
// rows that failed (their KVSwapSet::error() says why).
std::vector<int> stage_swapped_rows(const SwapStep& step, const float* q, int q_heads, int head_dim,
                                    const std::vector<const mx::array*>& parts,
                                    const int32_t* tables, int table_stride);

// The attention of a swapped row's prefill chunk, exact (docs/kvswap.md): key chunk by key
// chunk (attention_stream_*), each chunk's evicted blocks read back into the row's first
// staging blocks first (KVSwapSet::load_block). `a` describes the step (one row, its table
// naming -1 for evicted blocks: a private copy is patched here). False if a read failed (the
// set's error() says why): the row's output is then not written.
bool stream_swapped_row(const SwapStep& step, agentkv::AttentionArgs a,
                        const std::vector<const mx::array*>& parts);

// A copy of `queries` [B, Hq, 1, D] float32 that is evaluated after each swapped row has
// staged its groups for `layer` into `keys` / `values` (the layer's arena, written in
// place); a row whose reads failed gets NaN. The paged attention takes the copy as its
// queries, so MLX runs the staging first. CPU only.
mx::array kvswap_stage(const mx::array& queries, const std::vector<mx::array>& keys,
                       const std::vector<mx::array>& values, const mx::array& tables,
                       const std::vector<std::shared_ptr<agentkv::KVSwapSet>>& swaps,
                       const std::vector<int>& rows, int layer);

}  // namespace agentkv::ops
