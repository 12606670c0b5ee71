#include "ops.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <stdexcept>

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

}  // namespace

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
