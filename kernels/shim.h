// Compiles the kernel bodies in this directory (*.metal) as host C++.
//
// Each body is included inside a function whose parameters carry the names
// the body uses (as mx.fast.metal_kernel would declare them), plus
// `thread_position_in_grid`; csrc/kernels_cpu.cpp calls it once per grid
// point. So the CPU extension runs the very lines that Metal and CUDA run.
#pragma once

namespace agentkv::kernels {

struct uint3 {
  unsigned int x, y, z;
};

}  // namespace agentkv::kernels
