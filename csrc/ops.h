// agentkv's MLX operations: lazy graph ops backed by csrc/core kernels on CPU.
#pragma once

#include <mlx/array.h>
#include <mlx/utils.h>

#include <optional>

namespace agentkv::ops {

namespace mx = mlx::core;

// x [..., K] @ w[N, K]^T (+ bias[N]) in float32, every output reduced in the same
// order whatever the batch (see csrc/core/gemm.h). CPU only.
mx::array invariant_linear(const mx::array& x, const mx::array& w,
                           const std::optional<mx::array>& bias);

}  // namespace agentkv::ops
