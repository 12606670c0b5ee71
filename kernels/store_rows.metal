// store_rows: a step's new keys and values as KV format 2 stores them, in one pass (on a
// GPU this replaces three operations a layer: the keys' and the values' Walsh-Hadamard
// transforms and the values' quantization; docs/gpu-attention.md).
//
// A kernel *body* (see paged_attention.metal for the helpers each backend spells). Compile-
// time constants: KL (lanes a row: D == 8 * KL), TG (threads a threadgroup, a multiple of
// 32), T (the inputs' type), H (a stored float16: half, __half; float on the host, which
// rounds it to float16 after).
//
// inputs:  k_in   T[N * D]   new keys, rows in (batch, head, token) order
//          v_in   T[N * D]   new values
//          dims   int[4]     N, D, vbits (2, 4 or 8), group (a multiple of 8 dividing D)
//          scale  float[1]   1 / sqrt(D)
// outputs: k_out  H[N * D]                (H k): format 2's float16 tail rows
//          vw     uint32[N * D * vbits / 32]   (H v) quantized as mx.quantize does (affine,
//          vs, vb H[N * D / group]            in groups of `group`): words, scales, biases
// grid:    threadgroups (ceil(N / (TG / KL)), 1, 1), TG threads each: a team of KL lanes a
//          row, lane i holding channels 8 i .. 8 i + 7 of its key and its value.
//
// The transform: three butterfly stages in the lane's registers, then log2(KL) across its
// team by shuffles (the query's in paged_attention.metal), times 1 / sqrt(D); each result
// rounded to T, as MLX's transform of a T input returns it. The quantization follows
// mx.quantize's affine rule: over a group, w_min (from +max float) and w_max (from 0), a
// scale of max((w_max - w_min) / (2^bits - 1), 1e-7) signed towards the larger edge, the
// edge's own code q0 = round(edge / scale), then scale = edge / q0 and bias = edge unless q0
// is 0 (then bias 0); each code min(round((v - bias) / scale), 2^bits - 1), packed from bit
// 0 of word 0 upward, with the float scale and bias, stored rounded to T and then to H (as
// mx.quantize's T scales cast to float16). That is the rule of MLX's GPU kernels (round:
// half away from zero; w_max from 0); MLX's CPU mx.quantize rounds half to even and takes
// w_max from -inf, so on the CPU the two part at an exact tie (tests/kernels/test_store_rows.py).
const int n_rows = dims[0];
const int dim = dims[1];
const int vbits = dims[2];
const int group = dims[3];
const int tid = (int)kv_tid;
const int team_lane = (tid % 32) % KL;
const int r = (int)kv_group.x * (TG / KL) + tid / KL;
const bool real = r < n_rows;  // every lane runs to the end: the shuffles need all 32
const unsigned int at = (unsigned int)(real ? r : 0) * (unsigned int)dim + 8u * (unsigned int)team_lane;
float x[8];
float y[8];
for (int e = 0; e < 8; ++e) {
  x[e] = kv_float(k_in[at + (unsigned int)e]);
  y[e] = kv_float(v_in[at + (unsigned int)e]);
}
for (int s = 1; s < 8; s *= 2) {
  for (int e = 0; e < 8; ++e) {
    if ((e & s) == 0) {
      const float a = x[e];
      const float c = x[e + s];
      x[e] = a + c;
      x[e + s] = a - c;
      const float av = y[e];
      const float cv = y[e + s];
      y[e] = av + cv;
      y[e + s] = av - cv;
    }
  }
}
for (int s = 1; s < KL; s *= 2) {
  for (int e = 0; e < 8; ++e) {
    const float other = KV_SHUFFLE_XOR(x[e], s);
    x[e] = (team_lane & s) != 0 ? other - x[e] : x[e] + other;
    const float other_v = KV_SHUFFLE_XOR(y[e], s);
    y[e] = (team_lane & s) != 0 ? other_v - y[e] : y[e] + other_v;
  }
}
for (int e = 0; e < 8; ++e) {
  x[e] = kv_float((T)(x[e] * scale[0]));
  y[e] = kv_float((T)(y[e] * scale[0]));
  if (real) {
    k_out[at + (unsigned int)e] = (H)x[e];
  }
}
// the value's group: group / 8 neighbouring lanes of the team
float w_min = 3.402823466e+38f;
float w_max = 0.0f;
for (int e = 0; e < 8; ++e) {
  w_min = y[e] < w_min ? y[e] : w_min;
  w_max = kv_max(w_max, y[e]);
}
for (int s = 1; s < group / 8; s *= 2) {
  const float lo = KV_SHUFFLE_XOR(w_min, s);
  const float hi = KV_SHUFFLE_XOR(w_max, s);
  w_min = lo < w_min ? lo : w_min;
  w_max = kv_max(w_max, hi);
}
const float n_bins = (float)((1 << vbits) - 1);
float q_scale = kv_max((w_max - w_min) / n_bins, 1e-7f);
const bool side = (w_min < 0.0f ? -w_min : w_min) > (w_max < 0.0f ? -w_max : w_max);
q_scale = side ? q_scale : -q_scale;
const float edge = side ? w_min : w_max;
const float q0 = kv_round(edge / q_scale);
const bool at_zero = q0 == 0.0f;
q_scale = at_zero ? q_scale : edge / q0;
const float bias = at_zero ? 0.0f : edge;
const int d0 = 8 * team_lane;
if (real && d0 % group == 0) {
  const unsigned int g = (unsigned int)r * (unsigned int)(dim / group) + (unsigned int)(d0 / group);
  vs[g] = (H)kv_float((T)q_scale);  // mx.quantize stores them in T, the caller in float16
  vb[g] = (H)kv_float((T)bias);
}
unsigned int lo_word = 0u;  // the lane's codes from bit 8 * vbits * (lane % (4 / vbits)) on
unsigned int hi_word = 0u;  // 8-bit: the second word's
for (int e = 0; e < 8; ++e) {
  const float code = kv_round((y[e] - bias) / q_scale);
  const unsigned int c = (unsigned int)(code < 0.0f ? 0.0f : (code > n_bins ? n_bins : code));
  if (vbits == 8 && e >= 4) {
    hi_word |= c << (unsigned int)(8 * (e - 4));
  } else {
    lo_word |= c << (unsigned int)(vbits * e);
  }
}
const unsigned int row_words = (unsigned int)(dim * vbits / 32);
const unsigned int w0 = (unsigned int)(real ? r : 0) * row_words;
if (vbits == 2) {  // 16 bits a lane: two lanes a word, the even one writes it
  const float other = KV_SHUFFLE_XOR((float)lo_word, 1);
  if (real && team_lane % 2 == 0) {
    vw[w0 + (unsigned int)(team_lane / 2)] = lo_word | ((unsigned int)other << 16u);
  }
} else if (vbits == 4) {
  if (real) {
    vw[w0 + (unsigned int)team_lane] = lo_word;
  }
} else if (real) {
  vw[w0 + 2u * (unsigned int)team_lane] = lo_word;
  vw[w0 + 2u * (unsigned int)team_lane + 1u] = hi_word;
}
