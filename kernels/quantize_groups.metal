// quantize_groups: the channel groups a step completes, quantized per channel as KV format 2
// stores its keys (format/quant.py, quantize_channels), in one pass. On a GPU this replaces
// about 14 operations a layer in a step that completes a group (a prefill chunk; one decode
// step in channel_tokens): the minimum and maximum, the scale, the codes, their packing.
//
// A kernel *body* (helpers: kernels/metal.h, kernels/cuda.h; csrc/kernels_cpu.cpp on the
// host): kv_half(x) (a stored float16 -> float), kv_to_half(x) (x rounded to float16, as a
// float), kv_rint(x) (to the nearest integer, ties to even, as mx.round), kv_max, kv_tid,
// kv_group. Compile-time constant: H (the stored scales' and biases' type: half, __half; float
// on the host, whose values are float16 already).
//
// inputs:  x     half[G * channel_tokens * D]  the groups' keys (rotated), group by group,
//                                              a group's rows token by token
//          dims  int[3]  D, bits (2, 4 or 8), channel_tokens (D a multiple of it)
// outputs: words uint32[G * channel_tokens * D * bits / 32]  each row's codes, packed along
//                                              D as mx.quantize packs them
//          scales, biases H[G * D]             the group's D scales and biases, which
//                                              quantize_channels lays over its rows: channel
//                                              c of group g at g * D + c
// grid:    threadgroups (G, 1, 1) of D * bits / 32 threads (no thread past the groups): thread
//          w of group g owns the 32 / bits channels of word w, over the group's rows.
// Per channel over the group's rows: bias = min (a float16 already), scale = float16 of
// (max - min) / (2^bits - 1), code = min(max(rint((x - bias) / (scale or 1)), 0), 2^bits - 1).
const int dim = dims[0];
const int bits = dims[1];
const int channel_tokens = dims[2];
const int per = 32 / bits;
const unsigned int row_words = (unsigned int)(dim * bits / 32);
const unsigned int g = (unsigned int)kv_group.x;
const int c0 = (int)kv_tid * per;
const unsigned int base = g * (unsigned int)channel_tokens * (unsigned int)dim + (unsigned int)c0;
const float levels = (float)((1 << bits) - 1);
float lo[16];
float hi[16];
for (int e = 0; e < 16; ++e) {
  lo[e] = 0.0f;
  hi[e] = 0.0f;
}
for (int t = 0; t < channel_tokens; ++t) {
  for (int e = 0; e < per; ++e) {
    const float v = kv_half(x[base + (unsigned int)(t * dim + e)]);
    lo[e] = t == 0 || v < lo[e] ? v : lo[e];
    hi[e] = t == 0 || v > hi[e] ? v : hi[e];
  }
}
for (int e = 0; e < per; ++e) {
  const float scale = kv_to_half((hi[e] - lo[e]) / levels);
  scales[g * (unsigned int)dim + (unsigned int)(c0 + e)] = (H)scale;
  biases[g * (unsigned int)dim + (unsigned int)(c0 + e)] = (H)lo[e];
  hi[e] = scale == 0.0f ? 1.0f : scale;  // now the divisor
}
for (int t = 0; t < channel_tokens; ++t) {
  unsigned int word = 0u;
  for (int e = 0; e < per; ++e) {
    const float v = kv_half(x[base + (unsigned int)(t * dim + e)]);
    const float code = kv_rint((v - lo[e]) / hi[e]);
    const float clipped = code < 0.0f ? 0.0f : (code > levels ? levels : code);
    word |= (unsigned int)clipped << (unsigned int)(e * bits);
  }
  words[(g * (unsigned int)channel_tokens + (unsigned int)t) * row_words + (unsigned int)kv_tid] = word;
}
