#include "kvswap_ops.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "op_support.h"

namespace agentkv::ops {

std::vector<int> stage_swapped_rows(const SwapStep& step, const float* q, int q_heads, int head_dim,
                                    const std::vector<const mx::array*>& parts,
                                    const int32_t* tables, int table_stride) {
  agentkv::SwapArena arena;
  for (const auto* p : parts) {
    arena.base.push_back(const_cast<uint8_t*>(p->data<uint8_t>()));
    arena.row_bytes.push_back(static_cast<int64_t>(p->shape(1)) * p->itemsize());
    arena.rows = p->shape(0);
  }
  std::vector<int> failed;
  for (size_t i = 0; i < step.swaps.size(); ++i) {
    const int b = step.rows[i];
    const float* row_q = q + static_cast<int64_t>(b) * q_heads * head_dim;
    if (!step.swaps[i]->stage(step.layer, row_q, arena,
                              tables + static_cast<int64_t>(b) * table_stride)) {
      failed.push_back(b);
    }
  }
  return failed;
}

bool stream_swapped_row(const SwapStep& step, agentkv::AttentionArgs a,
                        const std::vector<const mx::array*>& parts) {
  agentkv::SwapArena arena;
  for (const auto* p : parts) {
    arena.base.push_back(const_cast<uint8_t*>(p->data<uint8_t>()));
    arena.row_bytes.push_back(static_cast<int64_t>(p->shape(1)) * p->itemsize());
    arena.rows = p->shape(0);
  }
  agentkv::KVSwapSet& set = *step.swaps[0];
  const int b = step.rows[0];
  const std::vector<int32_t>& staging = set.staging();
  const int chunk_keys = agentkv::attention_chunk_keys();
  const int per_chunk = chunk_keys / a.block_tokens;  // blocks a key chunk spans
  if (a.batch != 1 || b != 0 || chunk_keys % a.block_tokens ||
      staging.size() < static_cast<size_t>(per_chunk) || a.window != 0) {
    return false;
  }
  // The row's table with each evicted block pointing at a staging block: the chunk being
  // run names the staging block its evicted blocks were read into; the others are not read.
  std::vector<int32_t> table(a.tables, a.tables + a.table_stride);
  const int evicted = set.blocks();
  for (int i = 0; i < evicted && i < a.table_stride; ++i) {
    table[i] = staging[0];
  }
  a.tables = table.data();
  const int length = a.lengths[0];
  const int chunks = (length + chunk_keys - 1) / chunk_keys;
  std::vector<float> states;
  agentkv::attention_stream_start(a, states);
  for (int c = 0; c < chunks; ++c) {
    for (int j = 0; j < per_chunk; ++j) {
      const int block = c * per_chunk + j;
      if (block < evicted) {
        if (!set.load_block(step.layer, block, arena, j)) {
          return false;
        }
        table[block] = staging[j];
      }
    }
    agentkv::attention_stream_chunk(a, 0, c, states);
  }
  agentkv::attention_stream_finish(a, 0, states);
  return true;
}

namespace {

class KVSwapStage : public mx::UnaryPrimitive {
 public:
  KVSwapStage(mx::Stream stream, SwapStep step)
      : mx::UnaryPrimitive(stream), step_(std::move(step)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    encoder.dispatch([inputs, out, step = step_]() mutable {
      const mx::array& q = inputs[0];
      std::memcpy(out.data<float>(), q.data<float>(), q.nbytes());
      std::vector<const mx::array*> parts;
      for (size_t i = 1; i < 7; ++i) {
        parts.push_back(&inputs[i]);
      }
      const mx::array& tables = inputs[7];
      const int heads = q.shape(1), dim = q.shape(3);
      const auto failed = stage_swapped_rows(step, q.data<float>(), heads, dim, parts,
                                             tables.data<int32_t>(), tables.shape(1));
      for (int b : failed) {
        std::fill_n(out.data<float>() + static_cast<int64_t>(b) * heads * dim,
                    static_cast<int64_t>(heads) * dim, std::numeric_limits<float>::quiet_NaN());
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's KVSwap staging runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVSwapStage";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return step_ == static_cast<const KVSwapStage&>(other).step_;
  }

 private:
  SwapStep step_;
};

}  // namespace

mx::array kvswap_stage(const mx::array& queries, const std::vector<mx::array>& keys,
                       const std::vector<mx::array>& values, const mx::array& tables,
                       const std::vector<std::shared_ptr<agentkv::KVSwapSet>>& swaps,
                       const std::vector<int>& rows, int layer) {
  if (queries.dtype() != mx::float32 || queries.ndim() != 4 || queries.shape(2) != 1) {
    throw std::invalid_argument("kvswap_stage: queries must be float32 [B, Hq, 1, D]");
  }
  if (keys.size() != 3 || values.size() != 3) {
    throw std::invalid_argument("kvswap_stage: keys and values are words, scales, biases");
  }
  if (tables.dtype() != mx::int32 || tables.ndim() != 2 || tables.shape(0) != queries.shape(0)) {
    throw std::invalid_argument("kvswap_stage: tables must be int32 [B, blocks]");
  }
  if (swaps.size() != rows.size()) {
    throw std::invalid_argument("kvswap_stage: one row per swap set");
  }
  for (int b : rows) {
    if (b < 0 || b >= queries.shape(0)) {
      throw std::invalid_argument("kvswap_stage: a swapped row outside the batch");
    }
  }
  for (const auto& s : swaps) {
    if (!s) {
      throw std::invalid_argument("kvswap_stage: a swap set is None");
    }
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> in = {packed(queries, stream)};
  in.insert(in.end(), keys.begin(), keys.end());
  in.insert(in.end(), values.begin(), values.end());
  in.push_back(packed(tables, stream));
  return mx::array(queries.shape(), mx::float32,
                   std::make_shared<KVSwapStage>(stream, SwapStep{swaps, rows, layer}),
                   std::move(in));
}

}  // namespace agentkv::ops
