#include "ops.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "core/attention.h"
#include "core/gemm.h"
#include "core/qmm.h"
#include "core/rows.h"
#include "core/thread_pool.h"
#include "op_support.h"

namespace agentkv::ops {
namespace {

using agentkv::QuantizedWeights;
using agentkv::ScaleType;

// The element offset of every index of `a`'s first `axes` axes, in row-major order.
std::vector<int64_t> leading_offsets(const mx::array& a, int axes) {
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  int64_t count = 1;
  for (int d = 0; d < axes; ++d) {
    count *= shape[d];
  }
  std::vector<int64_t> offsets(count);
  std::vector<int64_t> idx(axes, 0);
  for (int64_t i = 0; i < count; ++i) {
    int64_t off = 0;
    for (int d = 0; d < axes; ++d) {
      off += idx[d] * strides[d];
    }
    offsets[i] = off;
    for (int d = axes - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        break;
      }
      idx[d] = 0;
    }
  }
  return offsets;
}

// A float32 array's elements in row-major order: its own data where it is row-contiguous,
// else gathered into `scratch` through its strides (a transposed view, a broadcast).
const float* row_major(const mx::array& a, std::vector<float>& scratch) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  scratch.resize(a.size());
  const int nd = static_cast<int>(a.ndim());
  const float* src = a.data<float>();
  const int64_t last = nd ? a.shape(-1) : 1;
  const int64_t last_stride = nd ? a.strides().back() : 0;
  const std::vector<int64_t> rows = leading_offsets(a, std::max(nd - 1, 0));
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t j = 0; j < last; ++j) {
      scratch[r * last + j] = src[rows[r] + j * last_stride];
    }
  }
  return scratch.data();
}

class InvariantLinear : public mx::UnaryPrimitive {
 public:
  InvariantLinear(mx::Stream stream, bool has_bias)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    const int64_t K = w.shape(1);
    const int64_t N = w.shape(0);
    const int64_t M = x.size() / K;
    std::optional<mx::array> bias;
    if (has_bias_) {
      bias = inputs[2];
    }
    // The arrays are captured by value so their buffers outlive the queued task.
    encoder.dispatch([x, w, bias, out, M, N, K]() mutable {
      std::vector<float> gathered;
      invariant_gemm(row_major(x, gathered), w.data<float>(), bias ? bias->data<float>() : nullptr,
                     out.data<float>(), M, N, K);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's invariant linear runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVInvariantLinear";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const InvariantLinear&>(other).has_bias_;
  }

 private:
  bool has_bias_;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    const float eps = eps_;
    encoder.dispatch([inputs, out, eps]() mutable {
      std::vector<float> xs, ws;
      const float* x = row_major(inputs[0], xs);
      const float* w = row_major(inputs[1], ws);
      const int64_t dim = inputs[0].shape(-1);
      agentkv::rms_norm_rows(x, w, out.data<float>(), static_cast<int64_t>(inputs[0].size()) / dim,
                             dim, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's rms_norm runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVRmsNorm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class Hadamard : public mx::UnaryPrimitive {
 public:
  Hadamard(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    const float scale = scale_;
    encoder.dispatch([inputs, out, scale]() mutable {
      std::vector<float> xs;
      const float* x = row_major(inputs[0], xs);
      float* y = out.data<float>();
      const int64_t n = inputs[0].shape(-1);
      const int64_t rows = static_cast<int64_t>(out.size()) / std::max<int64_t>(n, 1);
      // rows in chunks over the pool: each row's butterflies alone, so the same bits
      constexpr int64_t kChunk = 64;
      const int64_t chunks = (rows + kChunk - 1) / kChunk;
      agentkv::ThreadPool::shared().run(static_cast<size_t>(chunks), [&](size_t c) {
        const int64_t r0 = static_cast<int64_t>(c) * kChunk;
        const int64_t count = std::min(kChunk, rows - r0);
        std::copy(x + r0 * n, x + (r0 + count) * n, y + r0 * n);
        agentkv::hadamard_rows(y + r0 * n, count, n, scale);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's hadamard runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVHadamard";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const Hadamard&>(other).scale_;
  }

 private:
  float scale_;
};

class SiluMul : public mx::UnaryPrimitive {
 public:
  explicit SiluMul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    encoder.dispatch([inputs, out]() mutable {
      std::vector<float> gs, us;
      agentkv::silu_mul(row_major(inputs[0], gs), row_major(inputs[1], us), out.data<float>(),
                        static_cast<int64_t>(out.size()));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's silu_mul runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVSiluMul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class Rope : public mx::UnaryPrimitive {
 public:
  // inv_freq: empty when the frequencies come as an input (periods, their inverses taken)
  Rope(mx::Stream stream, int dims, bool traditional, float scale, int offset, bool offset_input,
       std::vector<float> inv_freq)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        scale_(scale),
        offset_(offset),
        offset_input_(offset_input),
        inv_freq_(std::move(inv_freq)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    encoder.dispatch([inputs, out, dims = dims_, traditional = traditional_, scale = scale_,
                      offset = offset_, offset_input = offset_input_,
                      inv_freq = inv_freq_]() mutable {
      const mx::array& x = inputs[0];
      const int nd = static_cast<int>(x.ndim());
      const auto& shape = x.shape();
      const auto& strides = x.strides();
      int64_t heads = 1;
      for (int d = 0; d < nd - 2; ++d) {
        heads *= shape[d];
      }
      const int64_t per_batch = heads / shape[0];
      const std::vector<int64_t> offsets = leading_offsets(x, nd - 2);
      std::vector<int64_t> positions(heads);
      const int32_t* starts = offset_input ? inputs[1].data<int32_t>() : nullptr;
      const bool per_row = starts && inputs[1].size() > 1;
      for (int64_t h = 0; h < heads; ++h) {
        positions[h] = starts ? starts[per_row ? h / per_batch : 0] : offset;
      }
      if (inv_freq.empty()) {
        std::vector<float> scratch;
        const mx::array& freqs = inputs.back();
        const float* f = row_major(freqs, scratch);
        inv_freq = rope_inverse_periods(f, freqs.size());
      }
      agentkv::RopeArgs a;
      a.x = x.data<float>();
      a.out = out.data<float>();
      a.heads = heads;
      a.length = shape[nd - 2];
      a.dim = shape[nd - 1];
      a.dims = dims;
      a.head_offsets = offsets.data();
      a.row_stride = strides[nd - 2];
      a.feature_stride = strides[nd - 1];
      a.positions = positions.data();
      a.inv_freq = inv_freq.data();
      a.scale = scale;
      a.traditional = traditional;
      agentkv::rope_rows(a);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's rope runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_ &&
           offset_ == o.offset_ && offset_input_ == o.offset_input_ && inv_freq_ == o.inv_freq_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
  int offset_;
  bool offset_input_;
  std::vector<float> inv_freq_;
};

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    const int group = group_;
    const int bits = bits_;
    encoder.dispatch([inputs, out, group, bits]() mutable {
      const mx::array& x = inputs[0];
      const mx::array& w = inputs[1];
      QuantizedWeights weights{w.data<uint8_t>(),
                               inputs[2].data<void>(),
                               inputs[3].data<void>(),
                               scale_type(inputs[2]),
                               bits,
                               group,
                               static_cast<int64_t>(w.shape(0)) * agentkv::kPackColumns,
                               x.shape(-1)};
      std::vector<float> gathered;
      agentkv::quantized_matmul(row_major(x, gathered), weights, out.data<float>(),
                                static_cast<int64_t>(x.size() / x.shape(-1)));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's quantized matmul runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int group_;
  int bits_;
};

class QuantizedAttention : public mx::UnaryPrimitive {
 public:
  struct Params {
    float scale;
    int key_bits, value_bits, group, window, key_parts;
    bool padded, sinks;
    int kv_heads = 0;  // > 0: paged caches (block arenas read through tables and lengths)
    int block_tokens = 0;
    int channel_tokens = 0;  // > 0: per-channel keys with a float16 tail (paged only)
    bool done = false;       // paged per-channel keys: the groups the step completed, in float16
    float softcap = 0.0f;    // > 0: the scores' soft cap (AttentionArgs::softcap)
    bool operator==(const Params&) const = default;
  };

  QuantizedAttention(mx::Stream stream, Params params)
      : mx::UnaryPrimitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    // The task may run after this primitive is gone: it captures copies only.
    const Params params = params_;
    encoder.dispatch([inputs, out, params]() mutable { run(params, inputs, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's fused attention runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVQuantizedAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return params_ == static_cast<const QuantizedAttention&>(other).params_;
  }

 private:
  static void view(agentkv::KVView& v, const std::vector<mx::array>& parts, int bits, int group,
                   int channel_tokens = 0) {
    const mx::array& first = parts[0];
    const bool paged = first.ndim() == 2;
    for (const auto& p : parts) {
      const bool rows_packed = paged ? p.flags().row_contiguous
                                     : p.strides().back() == 1 && p.strides()[2] == p.shape(3);
      if (!rows_packed) {
        throw std::invalid_argument("fused attention needs row-contiguous cache tokens");
      }
    }
    v.bits = bits;
    v.group = group;
    v.channel_tokens = channel_tokens;
    for (int i = 0; i < 3 && !paged; ++i) {
      v.w_strides[i] = first.strides()[i];
    }
    if (bits == 16) {
      v.halves = first.data<uint16_t>();
      v.dim = first.shape(-1);
      return;
    }
    v.words = first.data<uint32_t>();
    v.scales = parts[1].data<uint16_t>();
    v.biases = parts[2].data<uint16_t>();
    for (int i = 0; i < 3 && !paged; ++i) {
      v.s_strides[i] = parts[1].strides()[i];
    }
    v.dim = first.shape(-1) * 32 / bits;
  }

  static void run(const Params& p, const std::vector<mx::array>& inputs, mx::array& out) {
    const mx::array& q = inputs[0];
    const size_t value_parts = p.value_bits == 16 ? 1 : 3;
    std::vector<mx::array> keys(inputs.begin() + 1, inputs.begin() + 1 + p.key_parts);
    std::vector<mx::array> values(inputs.begin() + 1 + p.key_parts,
                                  inputs.begin() + 1 + p.key_parts + value_parts);
    size_t next = 1 + p.key_parts + value_parts;
    agentkv::AttentionArgs a;
    std::vector<float> gathered;  // the queries, where a query vector's features are strided
    a.q = q.data<float>();
    for (int i = 0; i < 3; ++i) {
      a.q_strides[i] = q.strides()[i];
    }
    if (q.strides().back() != 1) {
      a.q = row_major(q, gathered);
      a.q_strides[2] = q.shape(3);
      a.q_strides[1] = a.q_strides[2] * q.shape(2);
      a.q_strides[0] = a.q_strides[1] * q.shape(1);
    }
    a.out = out.data<float>();
    a.batch = q.shape(0);
    a.q_heads = q.shape(1);
    a.queries = q.shape(2);
    a.scale = p.scale;
    a.softcap = p.softcap;
    a.window = p.window;
    if (p.padded) {
      a.left_padding = inputs[next++].data<int32_t>();
    }
    if (p.sinks) {
      a.sinks = inputs[next++].data<float>();
    }
    view(a.k, keys, p.key_bits, p.group, p.channel_tokens);
    view(a.v, values, p.value_bits, p.group);
    if (p.kv_heads == 0) {
      a.kv_heads = keys[0].shape(1);
      a.keys = keys[0].shape(2);
      if (p.channel_tokens > 0) {
        a.k.tail = inputs[next++].data<uint16_t>();
      }
      agentkv::quantized_attention(a);
      return;
    }
    const mx::array& tables = inputs[next++];
    a.tables = tables.data<int32_t>();
    a.table_stride = tables.shape(1);
    a.lengths = inputs[next++].data<int32_t>();
    a.kv_heads = p.kv_heads;
    a.block_tokens = p.block_tokens;
    int64_t tail_slots = 0;
    if (p.channel_tokens > 0) {
      const mx::array& tail = inputs[next++];
      a.k.tail = tail.data<uint16_t>();
      tail_slots = tail.shape(0) / (static_cast<int64_t>(p.kv_heads) * p.channel_tokens);
      a.tail_slots = inputs[next++].data<int32_t>();
    }
    int64_t done_entries = 0;
    if (p.done) {
      const mx::array& done = inputs[next++];
      a.k.done = done.data<uint16_t>();
      done_entries = done.shape(0) / p.channel_tokens;
      a.done_first = inputs[next++].data<int32_t>();
    }
    const int64_t blocks = keys[0].shape(0) / (static_cast<int64_t>(p.kv_heads) * p.block_tokens);
    for (int b = 0; b < a.batch; ++b) {
      const bool tail_ok =
          a.tail_slots == nullptr || (a.tail_slots[b] >= 0 && a.tail_slots[b] < tail_slots);
      if (!paged_table_ok(a, b, blocks) || !tail_ok ||
          !done_ok(a, b, done_entries)) {  // NaN, never a plausible answer from wrong memory
        std::fill_n(a.out, out.size(), std::numeric_limits<float>::quiet_NaN());
        return;
      }
    }
    agentkv::quantized_attention(a);
  }

  // Row b's groups completed by the step all lie inside `done` (or it has none).
  static bool done_ok(const agentkv::AttentionArgs& a, int b, int64_t entries) {
    if (a.done_first == nullptr || a.done_first[b] < 0) {
      return true;
    }
    const int ct = a.k.channel_tokens;
    const int len = a.lengths[b];
    const int groups = len / ct - (len - a.queries) / ct;  // completed by the step
    return len >= a.queries && a.done_first[b] + int64_t{groups} * a.kv_heads <= entries;
  }

  Params params_;
};

}  // namespace

namespace {

// The head dimension stored in one kind's components; throws unless they agree.
int head_dim(const std::vector<mx::array>& parts, int bits, int group, int per_scale = 0) {
  per_scale = per_scale > 0 ? per_scale : group;
  for (const auto& p : parts) {
    if (p.ndim() != 4 || p.shape(0) != parts[0].shape(0) || p.shape(1) != parts[0].shape(1) ||
        p.shape(2) != parts[0].shape(2)) {
      throw std::invalid_argument("fused attention: cache components must be [B, H, T, width]");
    }
  }
  if (bits == 16) {
    if (parts[0].dtype().size() != 2) {
      throw std::invalid_argument("fused attention: 16-bit caches hold float16");
    }
    return parts[0].shape(3);
  }
  const int dim = parts[0].shape(3) * 32 / bits;
  if (parts[0].dtype().size() != 4 || parts[1].dtype().size() != 2 ||
      parts[2].dtype().size() != 2 || (group != 32 && group != 64 && group != 128) || dim % group ||
      dim % per_scale || parts[1].shape(3) != dim / per_scale ||
      parts[2].shape(3) != dim / per_scale) {
    throw std::invalid_argument(
        "fused attention: quantized caches are uint32 words + float16 scales and biases "
        "[.., D / group], group 32, 64 or 128");
  }
  return dim;
}

}  // namespace

mx::array quantized_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                              const std::vector<mx::array>& values, float scale, int key_bits,
                              int value_bits, int group, int window,
                              const std::optional<mx::array>& left_padding,
                              const std::optional<mx::array>& sinks, int channel_tokens,
                              const std::optional<mx::array>& tail, float softcap) {
  auto supported = [](int bits) { return bits == 2 || bits == 4 || bits == 8 || bits == 16; };
  if (!supported(key_bits) || !supported(value_bits)) {
    throw std::invalid_argument("fused attention supports 2, 4, 8 and 16 bits");
  }
  if (channel_tokens != 0 &&
      ((channel_tokens != 32 && channel_tokens != 64) || key_bits == 16 || !tail)) {
    throw std::invalid_argument(
        "fused attention: per-channel keys need channel_tokens 32 or 64, quantized keys and "
        "a tail");
  }
  if (keys.size() != (key_bits == 16 ? 1u : 3u) || values.size() != (value_bits == 16 ? 1u : 3u)) {
    throw std::invalid_argument("fused attention: wrong number of key or value components");
  }
  if (queries.dtype() != mx::float32 || queries.ndim() != 4) {
    throw std::invalid_argument("fused attention: queries must be float32 [B, Hq, L, D]");
  }
  const int dim = head_dim(keys, key_bits, group, channel_tokens);
  const int dim_v = head_dim(values, value_bits, group);
  const mx::Shape& k0 = keys[0].shape();
  const mx::Shape& v0 = values[0].shape();
  if (dim != queries.shape(3) || dim % 8 || dim_v % 8 || dim > 256 || dim_v > 256) {
    throw std::invalid_argument("fused attention: unsupported head dimensions");
  }
  if (k0[0] != queries.shape(0) || v0[0] != k0[0] || v0[1] != k0[1] || v0[2] != k0[2] ||
      queries.shape(1) % k0[1] || k0[2] < queries.shape(2)) {
    throw std::invalid_argument(
        "fused attention: queries [B, Hq, L, D] need keys and values [B, Hkv, T >= L, ...] "
        "with Hq a multiple of Hkv");
  }
  if (window < 0 || (left_padding && left_padding->size() != static_cast<size_t>(k0[0])) ||
      (sinks && sinks->size() != static_cast<size_t>(queries.shape(1)))) {
    throw std::invalid_argument("fused attention: bad window, left_padding [B] or sinks [Hq]");
  }
  if (channel_tokens > 0 &&
      (tail->ndim() != 4 || tail->dtype().size() != 2 || tail->shape(0) != k0[0] ||
       tail->shape(1) != k0[1] || tail->shape(2) != channel_tokens || tail->shape(3) != dim)) {
    throw std::invalid_argument("fused attention: the tail is float16 [B, Hkv, channel_tokens, D]");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {queries};  // any strides: run() reads them
  // the kernel reads codes as uint32 and scales, biases and float16 rows as 16-bit words
  // (their element sizes checked above), as they are: no View node per array and step
  for (size_t i = 0; i < keys.size(); ++i) {
    inputs.push_back(keys[i]);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    inputs.push_back(values[i]);
  }
  if (left_padding) {
    inputs.push_back(mx::astype(*left_padding, mx::int32, stream));
  }
  if (sinks) {
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }
  if (channel_tokens > 0) {
    inputs.push_back(packed(*tail, stream));
  }
  mx::Shape shape = queries.shape();
  shape.back() = dim_v;
  QuantizedAttention::Params params{scale,
                                    key_bits,
                                    value_bits,
                                    group,
                                    window,
                                    static_cast<int>(keys.size()),
                                    left_padding.has_value(),
                                    sinks.has_value()};
  params.channel_tokens = channel_tokens;
  params.softcap = softcap;
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<QuantizedAttention>(stream, params), std::move(inputs));
}

mx::array paged_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const mx::array& tables,
                          const mx::array& lengths, int kv_heads, int block_tokens, float scale,
                          int key_bits, int value_bits, int group, int window,
                          const std::optional<mx::array>& sinks, int channel_tokens,
                          const std::optional<mx::array>& tail,
                          const std::optional<mx::array>& tail_slots,
                          const std::optional<mx::array>& done,
                          const std::optional<mx::array>& done_first, float softcap) {
  auto supported = [](int bits) { return bits == 2 || bits == 4 || bits == 8 || bits == 16; };
  if (!supported(key_bits) || !supported(value_bits)) {
    throw std::invalid_argument("paged attention supports 2, 4, 8 and 16 bits");
  }
  if (channel_tokens != 0 && ((channel_tokens != 32 && channel_tokens != 64) || key_bits == 16 ||
                              !tail || !tail_slots || block_tokens % channel_tokens)) {
    throw std::invalid_argument(
        "paged attention: per-channel keys need channel_tokens 32 or 64 dividing the block, "
        "quantized keys, a tail and tail_slots");
  }
  if (keys.size() != (key_bits == 16 ? 1u : 3u) || values.size() != (value_bits == 16 ? 1u : 3u)) {
    throw std::invalid_argument("paged attention: wrong number of key or value components");
  }
  if (queries.dtype() != mx::float32 || queries.ndim() != 4) {
    throw std::invalid_argument("paged attention: queries must be float32 [B, Hq, L, D]");
  }
  if (kv_heads < 1 || block_tokens < 1 || queries.shape(1) % kv_heads || window < 0) {
    throw std::invalid_argument("paged attention: bad kv_heads, block_tokens or window");
  }
  const int64_t rows = keys[0].ndim() == 2 ? keys[0].shape(0) : -1;
  for (const auto* parts : {&keys, &values}) {
    for (const auto& p : *parts) {
      if (p.ndim() != 2 || p.shape(0) != rows || rows % (int64_t{kv_heads} * block_tokens)) {
        throw std::invalid_argument(
            "paged attention: arenas are [blocks * kv_heads * block_tokens, width]");
      }
    }
  }
  auto dim_of = [group](const std::vector<mx::array>& parts, int bits, int per_scale) {
    if (bits == 16) {
      return static_cast<int>(parts[0].shape(1));
    }
    const int dim = parts[0].shape(1) * 32 / bits;
    if (parts[0].dtype().size() != 4 || parts[1].dtype().size() != 2 ||
        parts[2].dtype().size() != 2 || (group != 32 && group != 64 && group != 128) ||
        dim % per_scale || parts[1].shape(1) != dim / per_scale ||
        parts[2].shape(1) != dim / per_scale) {
      throw std::invalid_argument(
          "paged attention: quantized arenas are uint32 words + float16 scales and biases");
    }
    return dim;
  };
  const int dim = dim_of(keys, key_bits, channel_tokens > 0 ? channel_tokens : group);
  const int dim_v = dim_of(values, value_bits, group);
  if (dim != queries.shape(3) || dim % 8 || dim_v % 8 || dim > 256 || dim_v > 256) {
    throw std::invalid_argument("paged attention: unsupported head dimensions");
  }
  if (channel_tokens > 0 &&
      (tail->ndim() != 2 || tail->dtype().size() != 2 || tail->shape(1) != dim ||
       tail->shape(0) % (int64_t{kv_heads} * channel_tokens) || tail_slots->ndim() != 1 ||
       tail_slots->shape(0) != queries.shape(0))) {
    throw std::invalid_argument(
        "paged attention: the tail is float16 [slots * kv_heads * channel_tokens, D] and "
        "tail_slots [B]");
  }
  const int batch = queries.shape(0);
  if (done.has_value() != done_first.has_value() ||
      (done && (channel_tokens == 0 || done->ndim() != 2 || done->dtype().size() != 2 ||
                done->shape(1) != dim || done->shape(0) % channel_tokens ||
                done_first->ndim() != 1 || done_first->shape(0) != batch))) {
    throw std::invalid_argument(
        "paged attention: done (per-channel keys only) is float16 [entries * channel_tokens, "
        "D], with done_first [B]");
  }
  if (tables.ndim() != 2 || tables.shape(0) != batch || lengths.ndim() != 1 ||
      lengths.shape(0) != batch ||
      (sinks && sinks->size() != static_cast<size_t>(queries.shape(1)))) {
    throw std::invalid_argument(
        "paged attention: tables [B, blocks], lengths [B] and sinks [Hq] must match the queries");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {queries};  // any strides: run() reads them
  // the kernel reads codes as uint32 and scales, biases and float16 rows as 16-bit words
  // (their element sizes checked above), as they are: no View node per array and step
  for (size_t i = 0; i < keys.size(); ++i) {
    inputs.push_back(keys[i]);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    inputs.push_back(values[i]);
  }
  if (sinks) {
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }
  inputs.push_back(packed(mx::astype(tables, mx::int32, stream), stream));
  inputs.push_back(packed(mx::astype(lengths, mx::int32, stream), stream));
  if (channel_tokens > 0) {
    inputs.push_back(*tail);
    inputs.push_back(packed(mx::astype(*tail_slots, mx::int32, stream), stream));
  }
  if (done) {
    inputs.push_back(packed(*done, stream));
    inputs.push_back(packed(mx::astype(*done_first, mx::int32, stream), stream));
  }
  mx::Shape shape = queries.shape();
  shape.back() = dim_v;
  QuantizedAttention::Params params{scale,         key_bits,
                                    value_bits,    group,
                                    window,        static_cast<int>(keys.size()),
                                    false,         sinks.has_value(),
                                    kv_heads,      block_tokens,
                                    channel_tokens};
  params.done = done.has_value();
  params.softcap = softcap;
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<QuantizedAttention>(stream, params), std::move(inputs));
}

std::vector<float> rope_inverse_periods(const float* periods, size_t count) {
  std::vector<float> inv_freq(count);
  for (size_t i = 0; i < count; ++i) {
    inv_freq[i] = 1.0f / periods[i];
  }
  return inv_freq;
}

std::vector<float> rope_inverse_frequencies(float base, int dims) {
  std::vector<float> inv_freq;
  for (int i = 0; i < dims / 2; ++i) {
    inv_freq.push_back(static_cast<float>(std::pow(static_cast<double>(base), -2.0 * i / dims)));
  }
  return inv_freq;
}

mx::array invariant_linear(const mx::array& x, const mx::array& w,
                           const std::optional<mx::array>& bias) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 ||
      (bias && bias->dtype() != mx::float32)) {
    throw std::invalid_argument("invariant_linear takes float32 arrays");
  }
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("invariant_linear: x [..., K] and w [N, K] do not match");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))) {
    throw std::invalid_argument("invariant_linear: bias must be [N]");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {x, packed(w, stream)};  // x: any strides
  if (bias) {
    inputs.push_back(packed(*bias, stream));
  }
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<InvariantLinear>(stream, bias.has_value()), std::move(inputs));
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("rms_norm takes float32 arrays");
  }
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: x [..., D] and w [D] do not match");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps),
                   {x, packed(w, stream)});
}

mx::array hadamard(const mx::array& x, float scale) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("hadamard takes a float32 array");
  }
  const int64_t n = x.ndim() ? x.shape(-1) : 0;
  if (n < 1 || (n & (n - 1)) != 0) {
    throw std::invalid_argument("hadamard: the last axis must be a power of two");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<Hadamard>(stream, scale), {x});
}

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    throw std::invalid_argument("silu_mul takes float32 arrays");
  }
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument("silu_mul: gate and up must have the same shape");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluMul>(stream), {gate, up});
}

mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base,
               float scale, const std::variant<int, mx::array>& offset,
               const std::optional<mx::array>& freqs) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("rope takes float32 arrays");
  }
  if (x.ndim() < 3) {
    throw std::invalid_argument("rope: x must be [..., L, D] with at least 3 axes");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("rope: dims must be even and at most the feature size");
  }
  if (base.has_value() == freqs.has_value()) {
    throw std::invalid_argument("rope takes a base or frequencies, one of them");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {x};
  const bool offset_input = std::holds_alternative<mx::array>(offset);
  if (offset_input) {
    const mx::array& o = std::get<mx::array>(offset);
    if (o.size() != 1 && (o.ndim() != 1 || o.shape(0) != x.shape(0))) {
      throw std::invalid_argument("rope: an offset array holds one position or one per batch row");
    }
    inputs.push_back(packed(mx::astype(o, mx::int32, stream), stream));
  }
  std::vector<float> inv_freq;
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2) {
      throw std::invalid_argument("rope: freqs must be [dims / 2]");
    }
    inputs.push_back(packed(mx::astype(*freqs, mx::float32, stream), stream));
  } else {
    inv_freq = rope_inverse_frequencies(*base, dims);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, scale,
                                          offset_input ? 0 : std::get<int>(offset), offset_input,
                                          std::move(inv_freq)),
                   std::move(inputs));
}

namespace {

// The weight formats the quantized matmul takes (csrc/core/qmm.h), or a message naming `op`.
void check_bits_and_group(const std::string& op, int bits, int group_size) {
  if (bits != 4 && bits != 5 && bits != 8) {
    throw std::invalid_argument(op + " takes 4-, 5- or 8-bit weights, not " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(op + " takes groups of 32, 64 or 128, not " +
                                std::to_string(group_size));
  }
}

}  // namespace

std::tuple<mx::array, mx::array, mx::array> pack_quantized(const mx::array& w,
                                                           const mx::array& scales,
                                                           const mx::array& biases, int group_size,
                                                           int bits) {
  check_bits_and_group("pack_quantized", bits, group_size);
  if (w.dtype() != mx::uint32 || w.ndim() != 2 ||
      static_cast<int64_t>(w.shape(1)) * 32 % (bits * group_size) != 0) {
    throw std::invalid_argument(
        "pack_quantized: w must be uint32 [N, K * bits / 32] with K a multiple of the group");
  }
  const int64_t N = w.shape(0), K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  const mx::Shape groups = {w.shape(0), static_cast<int>(K / group_size)};
  const mx::Dtype sdt = scales.dtype();
  if (scales.shape() != groups || biases.shape() != groups || biases.dtype() != sdt ||
      (sdt != mx::float32 && sdt != mx::float16 && sdt != mx::bfloat16)) {
    throw std::invalid_argument(
        "pack_quantized: scales and biases must be float32/float16/bfloat16 [N, K / group]");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> in = {mx::contiguous(w, false, stream),
                               mx::contiguous(scales, false, stream),
                               mx::contiguous(biases, false, stream)};
  mx::eval(in);
  const int blocks = static_cast<int>((N + agentkv::kPackColumns - 1) / agentkv::kPackColumns);
  const auto make = [](mx::Shape shape, mx::Dtype dtype) {
    size_t bytes = dtype.size();
    for (int d : shape) {
      bytes *= static_cast<size_t>(d);
    }
    return mx::array(mx::allocator::malloc(bytes), std::move(shape), dtype);
  };
  mx::array codes = make({blocks, static_cast<int>(K * 2 * bits)}, mx::uint8);
  mx::array s = make({blocks, groups[1], agentkv::kPackColumns}, sdt);
  mx::array b = make({blocks, groups[1], agentkv::kPackColumns}, sdt);
  agentkv::pack_weights(in[0].data<uint32_t>(), in[1].data<void>(), in[2].data<void>(),
                        static_cast<int>(sdt.size()), bits, group_size, N, K, codes.data<uint8_t>(),
                        s.data<void>(), b.data<void>());
  return {codes, s, b};
}

mx::array pack_super_scales(const mx::array& packed, const mx::array& super) {
  if (packed.dtype() != mx::float32 || packed.ndim() != 3 ||
      packed.shape(2) != agentkv::kPackColumns || packed.shape(1) % agentkv::kSuperGroups != 0 ||
      super.dtype() != mx::float16 || super.ndim() != 2 ||
      super.shape(1) * agentkv::kSuperGroups != packed.shape(1) ||
      (super.shape(0) + agentkv::kPackColumns - 1) / agentkv::kPackColumns != packed.shape(0)) {
    throw std::invalid_argument(
        "pack_super_scales: packed must be float32 [ceil(N / 16), K / 32, 16] (pack_quantized "
        "with groups of 32) and super float16 [N, K / 256]");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> in = {mx::contiguous(packed, false, stream),
                               mx::contiguous(super, false, stream)};
  mx::eval(in);
  const mx::Shape shape = {packed.shape(0), super.shape(1), agentkv::kSuperBytes};
  mx::array out(mx::allocator::malloc(static_cast<size_t>(packed.shape(0)) * super.shape(1) *
                                      agentkv::kSuperBytes),
                shape, mx::uint8);
  if (!agentkv::pack_super_scales(in[0].data<float>(), in[1].data<uint16_t>(), super.shape(0),
                                  static_cast<int64_t>(packed.shape(1)) * 32,
                                  out.data<uint8_t>())) {
    throw std::invalid_argument(
        "pack_super_scales: some value is not float(d) * m for its row's d and an integer m "
        "in 0 .. 255");
  }
  return out;
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits) {
  check_bits_and_group("quantized_matmul", bits, group_size);
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || w.shape(1) % (2 * bits * group_size) != 0) {
    throw std::invalid_argument(
        "quantized_matmul: w must be packed codes, uint8 [N / 16, K * 2 * bits] "
        "(agentkv.mlx_adapter.pack_quantized)");
  }
  const int64_t N = static_cast<int64_t>(w.shape(0)) * agentkv::kPackColumns;
  const int64_t K = w.shape(1) / (2 * bits);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument("quantized_matmul: x [..., K] does not match w's K = " +
                                std::to_string(K));
  }
  if (!packed_scales_fit(w, scales, biases, K, group_size)) {
    throw std::invalid_argument(
        "quantized_matmul: scales and biases must be float32/float16/bfloat16 "
        "[N / 16, K / group, 16], or two-level uint8 [N / 16, K / 256, 160] "
        "(pack_super_scales: groups of 32, K a multiple of 256)");
  }
  if (!mx::issubdtype(x.dtype(), mx::floating)) {
    throw std::invalid_argument("quantized_matmul: x must be floating point");
  }
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {
      mx::astype(x, mx::float32, stream),  // any strides: gathered in eval where needed
      packed(w, stream), packed(scales, stream), packed(biases, stream)};
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(N);
  mx::array out(std::move(shape), mx::float32,
                std::make_shared<QuantizedMatmul>(stream, group_size, bits), std::move(inputs));
  return x.dtype() == mx::float32 ? out : mx::astype(out, x.dtype(), stream);
}

}  // namespace agentkv::ops
