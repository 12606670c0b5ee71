// gather: an agent's KV blocks -> one contiguous [1, heads, capacity, width] array
// for one (layer, component), in units of T (uint16 or uint32 bit patterns).
//
// This is a kernel *body*: mx.fast.metal_kernel / cuda_kernel generate the
// signature from the names below, and csrc/kernels_cpu.cpp compiles this very
// file for CPU through shim.h (one call per grid point). It uses only the C++
// subset Metal, CUDA and host C++ share.
//
// inputs:  blocks  T[]        block regions back to back (layout: csrc/core/block_io.h)
//          table   int[2 * n]  per block: unit offset of its region, tokens in it
//          meta    int[7]      plane, heads, width, length, capacity, chunk, n
//                  plane: units per block token before this (layer, component)
//                  in a region, so the plane of a block of `tokens` starts at
//                  region + tokens * plane; n: blocks in `table`
// output:  out     T[heads * capacity * width]; rows >= length are zero
// grid:    (ceil(256 * width / chunk), ceil(capacity / 256), heads)
const int plane = meta[0];
const int heads = meta[1];
const int width = meta[2];
const int length = meta[3];
const int capacity = meta[4];
const int chunk = meta[5];
const int n_blocks = meta[6];
const int b = (int)thread_position_in_grid.y;
const int h = (int)thread_position_in_grid.z;
const int row0 = 256 * b;
if (h >= heads || row0 >= capacity) {
  return;
}
const int rows = (capacity - row0 < 256) ? capacity - row0 : 256;
const int u0 = (int)thread_position_in_grid.x * chunk;
const int u_end = rows * width;
if (u0 >= u_end) {
  return;
}
const int u1 = (u0 + chunk < u_end) ? u0 + chunk : u_end;
int tokens = 0;
if (b < n_blocks) {
  tokens = table[2 * b + 1];
}
int kept = length - row0;
kept = (kept < tokens) ? kept : tokens;
kept = (kept < 0) ? 0 : kept;
const int copy_end = (kept * width < u1) ? kept * width : u1;
const unsigned int dst = ((unsigned int)h * (unsigned int)capacity + (unsigned int)row0) *
                         (unsigned int)width;
if (u0 < copy_end) {
  const unsigned int src =
      (unsigned int)table[2 * b] + (unsigned int)(tokens * plane + h * tokens * width);
  for (int u = u0; u < copy_end; ++u) {
    out[dst + u] = blocks[src + u];
  }
}
for (int u = (copy_end > u0 ? copy_end : u0); u < u1; ++u) {
  out[dst + u] = T(0);
}
