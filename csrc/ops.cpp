#include "ops.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <stdexcept>

#include "core/attention.h"
#include "core/gemm.h"

namespace agentkv::ops {
namespace {

class InvariantLinear : public mx::UnaryPrimitive {
 public:
  InvariantLinear(mx::Stream stream, bool has_bias)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    const int64_t K = w.shape(1);
    const int64_t N = w.shape(0);
    const int64_t M = x.size() / K;
    std::optional<mx::array> bias;
    if (has_bias_) {
      bias = inputs[2];
    }
    // The arrays are captured by value so their buffers outlive the queued task.
    encoder.dispatch([x, w, bias, out, M, N, K]() mutable {
      invariant_gemm(x.data<float>(), w.data<float>(), bias ? bias->data<float>() : nullptr,
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

class QuantizedAttention : public mx::UnaryPrimitive {
 public:
  struct Params {
    float scale;
    int key_bits, value_bits, group, window, key_parts;
    bool padded, sinks;
    bool operator==(const Params&) const = default;
  };

  QuantizedAttention(mx::Stream stream, Params params)
      : mx::UnaryPrimitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
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
  static void view(agentkv::KVView& v, const std::vector<mx::array>& parts, int bits, int group) {
    const mx::array& first = parts[0];
    for (const auto& p : parts) {
      if (p.strides().back() != 1 || p.strides()[2] != p.shape(3)) {
        throw std::invalid_argument("fused attention needs row-contiguous cache tokens");
      }
    }
    v.bits = bits;
    v.group = group;
    for (int i = 0; i < 3; ++i) {
      v.w_strides[i] = first.strides()[i];
    }
    if (bits == 16) {
      v.halves = first.data<uint16_t>();
      v.dim = first.shape(3);
      return;
    }
    v.words = first.data<uint32_t>();
    v.scales = parts[1].data<uint16_t>();
    v.biases = parts[2].data<uint16_t>();
    for (int i = 0; i < 3; ++i) {
      v.s_strides[i] = parts[1].strides()[i];
    }
    v.dim = first.shape(3) * 32 / bits;
  }

  static void run(const Params& p, const std::vector<mx::array>& inputs, mx::array& out) {
    const mx::array& q = inputs[0];
    const size_t value_parts = p.value_bits == 16 ? 1 : 3;
    std::vector<mx::array> keys(inputs.begin() + 1, inputs.begin() + 1 + p.key_parts);
    std::vector<mx::array> values(inputs.begin() + 1 + p.key_parts,
                                  inputs.begin() + 1 + p.key_parts + value_parts);
    size_t next = 1 + p.key_parts + value_parts;
    agentkv::AttentionArgs a;
    a.q = q.data<float>();
    for (int i = 0; i < 3; ++i) {
      a.q_strides[i] = q.strides()[i];
    }
    if (q.strides().back() != 1) {
      throw std::invalid_argument("fused attention needs contiguous query vectors");
    }
    a.out = out.data<float>();
    a.batch = q.shape(0);
    a.q_heads = q.shape(1);
    a.queries = q.shape(2);
    a.kv_heads = keys[0].shape(1);
    a.keys = keys[0].shape(2);
    a.scale = p.scale;
    a.window = p.window;
    if (p.padded) {
      a.left_padding = inputs[next++].data<int32_t>();
    }
    if (p.sinks) {
      a.sinks = inputs[next++].data<float>();
    }
    view(a.k, keys, p.key_bits, p.group);
    view(a.v, values, p.value_bits, p.group);
    agentkv::quantized_attention(a);
  }

  Params params_;
};

}  // namespace

namespace {

// The head dimension stored in one kind's components; throws unless they agree.
int head_dim(const std::vector<mx::array>& parts, int bits, int group) {
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
      parts[1].shape(3) != dim / group || parts[2].shape(3) != dim / group) {
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
                              const std::optional<mx::array>& sinks) {
  auto supported = [](int bits) { return bits == 2 || bits == 4 || bits == 8 || bits == 16; };
  if (!supported(key_bits) || !supported(value_bits)) {
    throw std::invalid_argument("fused attention supports 2, 4, 8 and 16 bits");
  }
  if (keys.size() != (key_bits == 16 ? 1u : 3u) || values.size() != (value_bits == 16 ? 1u : 3u)) {
    throw std::invalid_argument("fused attention: wrong number of key or value components");
  }
  if (queries.dtype() != mx::float32 || queries.ndim() != 4) {
    throw std::invalid_argument("fused attention: queries must be float32 [B, Hq, L, D]");
  }
  const int dim = head_dim(keys, key_bits, group);
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
  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(queries, false, stream)};
  auto add = [&](const mx::array& a, mx::Dtype dtype) {
    inputs.push_back(a.dtype() == dtype ? a : mx::view(a, dtype, stream));
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    add(keys[i], key_bits == 16 || i > 0 ? mx::uint16 : mx::uint32);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    add(values[i], value_bits == 16 || i > 0 ? mx::uint16 : mx::uint32);
  }
  if (left_padding) {
    inputs.push_back(mx::astype(*left_padding, mx::int32, stream));
  }
  if (sinks) {
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }
  mx::Shape shape = queries.shape();
  shape.back() = dim_v;
  return mx::array(
      std::move(shape), mx::float32,
      std::make_shared<QuantizedAttention>(
          stream, QuantizedAttention::Params{scale, key_bits, value_bits, group, window,
                                             static_cast<int>(keys.size()),
                                             left_padding.has_value(), sinks.has_value()}),
      std::move(inputs));
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
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream),
                                   mx::contiguous(w, false, stream)};
  if (bias) {
    inputs.push_back(mx::contiguous(*bias, false, stream));
  }
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<InvariantLinear>(stream, bias.has_value()), std::move(inputs));
}

}  // namespace agentkv::ops
