// What the host CPU offers the hot kernels, checked once (the kernels compile their vector
// paths with target attributes and pick them at run time, so one binary runs everywhere).
#pragma once

#include <cstdlib>
#include <cstring>

namespace agentkv {

// AGENTKV_CPU=portable: every host kernel on its portable C++ path (tests compare the paths;
// AGENTKV_QMM and AGENTKV_ATTENTION_IMPL choose per kernel).
inline bool cpu_forced_portable() {
  static const bool portable = [] {
    const char* v = std::getenv("AGENTKV_CPU");
    return v != nullptr && std::strcmp(v, "portable") == 0;
  }();
  return portable;
}

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

// AVX-512 with VNNI (and BW, VL): the quantized matmul's wider tiles, vpdpwssd.
// __builtin_cpu_supports also checks that the OS saves the AVX-512 state.
inline bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = cpu_has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

// AVX-512 F and VL (on top of AVX2 + FMA + F16C): the fused attention's 16-code unpacking.
inline bool cpu_has_avx512f() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = cpu_has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512vl");
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
