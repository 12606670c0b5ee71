// What the host CPU offers the hot kernels, checked once (the kernels compile their vector
// paths with target attributes and pick them at run time, so one binary runs everywhere).
#pragma once

namespace agentkv {

// AVX2 + FMA + F16C: the fused attention and the quantized matmul.
inline bool cpu_has_avx2_fma_f16c() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// AVX2 + FMA: the batch-invariant float32 GEMM.
inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

}  // namespace agentkv
