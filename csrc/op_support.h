// Helpers shared by the MLX operations (ops.cpp, decoder_layer.cpp).
#pragma once

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>

#include <algorithm>
#include <vector>

#include "core/attention.h"
#include "core/qmm.h"

namespace agentkv::ops {

// `a` itself where it is evaluated already and row-contiguous (weights, the pool's
// arrays): a Contiguous node is one more scheduled graph operation per call (~1-2 us on
// MLX's CPU stream) even when it copies nothing, and a decode step makes ~900 of them.
inline mlx::core::array packed(const mlx::core::array& a, mlx::core::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mlx::core::contiguous(a, false, stream);
}

// How every primitive's eval_cpu starts: the output allocated, and every array registered
// with the stream's encoder, which keeps them alive until the queued task has run.
inline mlx::core::cpu::CommandEncoder& start_cpu_eval(mlx::core::Stream stream,
                                                      const std::vector<mlx::core::array>& inputs,
                                                      mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  return encoder;
}

// Rotary inverse frequencies as agentkv's rope takes them: base^(-2i / dims) in double,
// rounded to float; or, from given periods, 1 / f in float.
std::vector<float> rope_inverse_frequencies(float base, int dims);
std::vector<float> rope_inverse_periods(const float* periods, size_t count);

// Whether every block row b of a paged attention reads lies inside the arena (of `blocks`
// blocks). The pool never builds a table that fails this; if one did, the batch gets NaN
// instead of reads out of bounds.
inline bool paged_table_ok(const agentkv::AttentionArgs& a, int b, int64_t blocks) {
  const int32_t* table = a.tables + static_cast<int64_t>(b) * a.table_stride;
  const int len = a.lengths[b];
  int first = 0;
  if (a.window > 0) {
    first = std::max(0, len - a.queries - a.window + 1);
  }
  if (len < a.queries || (len + a.block_tokens - 1) / a.block_tokens > a.table_stride) {
    return false;
  }
  for (int i = first / a.block_tokens; i * a.block_tokens < len; ++i) {
    if (table[i] < 0 || table[i] >= blocks) {
      return false;
    }
  }
  return true;
}

// The scale type of packed scales or biases (csrc/core/qmm.h): uint8 is two-level.
inline ScaleType scale_type(const mlx::core::array& a) {
  namespace mx = mlx::core;
  return a.dtype() == mx::float32   ? ScaleType::f32
         : a.dtype() == mx::float16 ? ScaleType::f16
         : a.dtype() == mx::uint8   ? ScaleType::ksuper
                                    : ScaleType::bf16;
}

// Whether packed scales and biases fit codes `w` (uint8 [N / 16, K * 2 * bits]) of K weights
// a row in groups of `group`: float32/float16/bfloat16 [N / 16, K / group, 16], or two-level
// uint8 [N / 16, K / 256, 160] (groups of 32, K a multiple of 256).
inline bool packed_scales_fit(const mlx::core::array& w, const mlx::core::array& scales,
                              const mlx::core::array& biases, int64_t K, int group) {
  namespace mx = mlx::core;
  const mx::Dtype sdt = scales.dtype();
  const bool two_level = sdt == mx::uint8;
  const mx::Shape shape = two_level
                              ? mx::Shape{w.shape(0), static_cast<int>(K / 256), kSuperBytes}
                              : mx::Shape{w.shape(0), static_cast<int>(K / group), kPackColumns};
  return scales.shape() == shape && biases.shape() == shape && biases.dtype() == sdt &&
         (two_level ? group == 32 && K % 256 == 0
                    : sdt == mx::float32 || sdt == mx::float16 || sdt == mx::bfloat16);
}

}  // namespace agentkv::ops
