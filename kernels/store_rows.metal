// store_rows: a step's new keys and values as KV format 2 stores them, in one pass (on a
// GPU this replaces three operations a layer: the keys' and the values' Walsh-Hadamard
// transforms and the values' quantization; docs/gpu-attention.md).
//
// A kernel *body* (see paged_attention.metal for the helpers each backend spells). Compile-
// time constants: KL (lanes a row: D == 8 * KL), TG (threads a threadgroup, a multiple of
// 32), T (the inputs' type), H (a stored float16: half, __half; float on the host, which
// rounds it to float16 after).
//
// inputs:  k_in   T[...]     new keys: row r = (b, h, t) at b * dims[8] + h * dims[9] + t * dims[10]
//                             + dims[11] (with the lane's 8 channels after it)
//          v_in   T[...]     new values: the keys' layout, + dims[12] in place of dims[11]
//          q_in   T[...]     (the prologue) queries: row (b, h, t) at b * dims[13] + h * dims[14]
//                             + t * dims[15] + dims[16]
//          dims   int[19]    N (= B Hkv L), D, vbits (2, 4 or 8), group (a multiple of 8
//                             dividing D), NQ (= B Hq L; 0: no queries), L, Hkv, Hq, the
//                             layouts above, RoPE (0: none; 1: channel c with c + D / 2; 2:
//                             traditional, 2 j with 2 j + 1), the heads' RMS norm (0: none;
//                             1: before RoPE, Qwen3's)
//          scale  float[2]   1 / sqrt(D), the norm's epsilon
//          starts int[B]     each row's first position (RoPE)
//          rope   float[D/2+1] inverse frequencies, then the positions' scale
//          norm   [2 D]      (the norm) the queries' weights, then the keys' ones
// outputs: k_out  H[N * D]                (H k): format 2's float16 tail rows, (b, h, t) order
//          vw     uint32[N * D * vbits / 32]   (H v) quantized as mx.quantize does (affine,
//          vs, vb H[N * D / group]            in groups of `group`): words, scales, biases
//          q_out  T[max(NQ, 1) * D]      the roped queries, (b, h, t) order
// grid:    threadgroups (ceil((N + NQ) / (TG / KL)), 1, 1), TG threads each: a team of KL
//          lanes a row (N key-and-value rows, then NQ query rows), lane i holding channels
//          8 i .. 8 i + 7 of its vectors.
//
// The prologue (RoPE mode > 0: keys, values and queries read where the joint q/k/v
// projection left them): where dims[18] says so, each query and key head first normed as
// mx.fast.rms_norm does (the sum of squares in float over the team, x * rsqrt(mean + eps)
// rounded to T, times the weight, rounded to T); then queries and keys roped, as
// mx.fast.rope does (theta = position * scale * inverse frequency, in float, each result
// rounded to T); a query row stops there.
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
const int n_queries = dims[4];
const int seq = dims[5];
const int kv_heads = dims[6];
const int q_heads = dims[7];
const int rope_mode = dims[17];
const int tid = (int)kv_tid;
const int team_lane = (tid % 32) % KL;
const int r = (int)kv_group.x * (TG / KL) + tid / KL;
const bool real = r < n_rows;  // every lane runs to the end: the shuffles need all 32
const bool query = !real && r < n_rows + n_queries;
const int row = real ? r : (query ? r - n_rows : 0);  // (b, h, t) of its kind
const int heads = query ? q_heads : kv_heads;
const int t = row % seq;
const int h = (row / seq) % heads;
const int b = row / (seq * heads);
const unsigned int lane8 = 8u * (unsigned int)team_lane;
const unsigned int at = (unsigned int)(real ? r : 0) * (unsigned int)dim + lane8;  // k_out's
const unsigned int kv_at = (unsigned int)(b * dims[8] + h * dims[9] + t * dims[10]) + lane8;
const unsigned int q_at =
    (unsigned int)(b * dims[13] + h * dims[14] + t * dims[15] + dims[16]) + lane8;
float x[8];
float y[8];
const unsigned int v_at = (real ? kv_at : lane8) + (unsigned int)dims[12];  // a query: row 0's
const unsigned int k_at = (real ? kv_at : lane8) + (unsigned int)dims[11];
for (int e = 0; e < 8; ++e) {
  x[e] = query ? kv_float(q_in[q_at + (unsigned int)e]) : kv_float(k_in[k_at + (unsigned int)e]);
  y[e] = kv_float(v_in[v_at + (unsigned int)e]);
}
if (dims[18] != 0) {  // uniform across the grid, as RoPE's mode
  float squares = 0.0f;
  for (int e = 0; e < 8; ++e) {
    squares += x[e] * x[e];
  }
  for (int s = 1; s < KL; s *= 2) {
    squares += KV_SHUFFLE_XOR(squares, s);
  }
  const float inverse = kv_rsqrt(squares / (float)dim + scale[1]);
  const unsigned int w_at = (query ? 0u : (unsigned int)dim) + lane8;
  for (int e = 0; e < 8; ++e) {
    const float normed = kv_float((T)(x[e] * inverse));
    x[e] = kv_float((T)(kv_float(norm[w_at + (unsigned int)e]) * normed));
  }
}
if (rope_mode != 0) {  // uniform across the grid: every lane shuffles or none
  const float position = (float)(starts[b] + t) * rope[dim / 2];
  const int half_lanes = KL / 2;
  for (int e = 0; e < 8; ++e) {
    const float other = KV_SHUFFLE_XOR(x[e], half_lanes);
    if (rope_mode == 1) {  // channel c with c + D / 2: lane with lane ^ KL / 2
      const float theta = position * rope[8 * (team_lane % half_lanes) + e];
      const float c = kv_cos(theta);
      const float sn = kv_sin(theta);
      x[e] = team_lane < half_lanes ? x[e] * c - other * sn : other * sn + x[e] * c;
    }
  }
  if (rope_mode == 2) {  // 2 j with 2 j + 1, inside the lane
    for (int e = 0; e < 8; e += 2) {
      const float theta = position * rope[4 * team_lane + e / 2];
      const float c = kv_cos(theta);
      const float sn = kv_sin(theta);
      const float x0 = x[e];
      const float x1 = x[e + 1];
      x[e] = x0 * c - x1 * sn;
      x[e + 1] = x0 * sn + x1 * c;
    }
  }
  for (int e = 0; e < 8; ++e) {
    x[e] = kv_float((T)x[e]);  // mx.fast.rope's result, in T
    if (query) {
      q_out[(unsigned int)row * (unsigned int)dim + lane8 + (unsigned int)e] = (T)x[e];
    }
  }
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
