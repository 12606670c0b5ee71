// dense_rows: the keys and values one row of a prefill chunk sees, gathered from the pool's
// arenas and dequantized in one pass, in the queries' type, for MLX's fused attention
// (kernels/dense.py, docs/gpu-attention.md). It replaces a layer's gathers, per-channel and
// per-token dequantizations, casts and concatenations (about 20 operations a layer).
//
// A kernel *body* (helpers: kernels/metal.h, kernels/cuda.h; csrc/kernels_cpu.cpp on the
// host): kv_half(x) (a stored float16 -> float), kv_half_bits(u) (16 bits -> float),
// KV_SHUFFLE_XOR, kv_tid, kv_group. Compile-time constants: T (the outputs' type), TG
// (threads a threadgroup).
//
// inputs:  kw, ks, kb   one layer's key arena: words, scales, biases (as paged_attention.metal
//                       reads them; 16 bits: two float16 a word, scales and biases unread)
//          vw, vs, vb   its value arena
//          tail  half[...]   format 2's float16 tails          (read where a row says so)
//          done  half[...]   the step's completed groups, float16 (read where a row says so)
//          src   int[3 + N * 3]  N (and two unread ints), then for output row i: where its
//                            key lies (0: arena row, 1: tail row, 2: `done` row), that
//                            row, and its value's arena row (N is here, not in dims, so
//                            that dims stay one constant array a layer shape)
//          dims  int[8]      D, Dv, kbits, vbits, group, channel_tokens (0: per-token
//                            keys), units = max(D, Dv) / 8, rotate
//          scale float[1]    1 / sqrt(D) (read where rotate)
// outputs: k_out T[N * D], v_out T[N * Dv]
// grid:    threadgroups (ceil(N * units / TG), 1, 1), TG threads each: thread u of row i
//          writes channels 8 u .. 8 u + 7 of its key (if 8 u < D) and of its value (if
//          8 u < Dv); neighbouring threads write neighbouring channels. Every thread runs to
//          the end (the rotation's shuffles need all 32 lanes); those past N write nothing.
// rotate = 1 (KV format 2, whose keys and values are stored times the Walsh-Hadamard matrix
// H; D == Dv, a power of two from 32 to 256, so a row's D / 8 threads are lanes of one SIMD
// group): each key and value is rotated back (H is its own inverse: three butterfly stages
// in a thread's 8 channels, log2(D / 8) across the row's lanes by shuffles, times
// 1 / sqrt(D), as store_rows.metal rotates), so the queries and the output need no rotation
// around the attention (two operations a layer fewer).
// A stored value is q * scale + bias in float (as kernels/dense.py's MLX operations
// compute it), rounded once to T. Per-token groups (`group` channels a scale, D % 8 == 0,
// group % 8 == 0); per-channel keys (format 2): the scales and biases of the group of
// channel_tokens rows a row lies in are the D values from (row / channel_tokens) * D
// (quant.quantize_channels spreads them over the group's rows). bits divide 32.
const int n_out = src[0];
const int dim = dims[0];
const int dim_v = dims[1];
const int kbits = dims[2];
const int vbits = dims[3];
const int group = dims[4];
const int channel_tokens = dims[5];
const int units = dims[6];
const int rotate = dims[7];
const unsigned int id = (unsigned int)kv_group.x * (unsigned int)TG + (unsigned int)kv_tid;
const bool real = id < (unsigned int)n_out * (unsigned int)units;
const unsigned int i = real ? id / (unsigned int)units : 0u;
const int c0 = (int)(id % (unsigned int)units) * 8;
const int kind = src[3u * i + 3u];
const unsigned int krow = (unsigned int)src[3u * i + 4u];
const unsigned int vrow = (unsigned int)src[3u * i + 5u];
float x[8];
float y[8];
for (int e = 0; e < 8; ++e) {
  x[e] = 0.0f;
  y[e] = 0.0f;
}
if (c0 < dim) {
  if (kind != 0) {
    const unsigned int at = krow * (unsigned int)dim + (unsigned int)c0;
    for (int e = 0; e < 8; ++e) {
      x[e] = kv_half(kind == 1 ? tail[at + (unsigned int)e] : done[at + (unsigned int)e]);
    }
  } else {
    const unsigned int row_words = (unsigned int)(dim * kbits / 32);
    const unsigned int mask = (1u << (unsigned int)kbits) - 1u;
    for (int e = 0; e < 8; ++e) {
      const unsigned int pos = (unsigned int)(c0 + e) * (unsigned int)kbits;
      const unsigned int q = (kw[krow * row_words + pos / 32u] >> (pos % 32u)) & mask;
      if (kbits == 16) {
        x[e] = kv_half_bits(q);
      } else {
        const unsigned int g = channel_tokens > 0
            ? krow / (unsigned int)channel_tokens * (unsigned int)dim + (unsigned int)(c0 + e)
            : krow * (unsigned int)(dim / group) + (unsigned int)((c0 + e) / group);
        x[e] = (float)q * kv_half(ks[g]) + kv_half(kb[g]);
      }
    }
  }
}
if (c0 < dim_v) {
  const unsigned int row_words = (unsigned int)(dim_v * vbits / 32);
  const unsigned int mask = (1u << (unsigned int)vbits) - 1u;
  for (int e = 0; e < 8; ++e) {
    const unsigned int pos = (unsigned int)(c0 + e) * (unsigned int)vbits;
    const unsigned int q = (vw[vrow * row_words + pos / 32u] >> (pos % 32u)) & mask;
    if (vbits == 16) {
      y[e] = kv_half_bits(q);
    } else {
      const unsigned int g = vrow * (unsigned int)(dim_v / group) + (unsigned int)((c0 + e) / group);
      y[e] = (float)q * kv_half(vs[g]) + kv_half(vb[g]);
    }
  }
}
if (rotate != 0) {
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
  const int team_lane = c0 / 8;
  for (int s = 1; s < units; s *= 2) {
    for (int e = 0; e < 8; ++e) {
      const float other = KV_SHUFFLE_XOR(x[e], s);
      x[e] = (team_lane & s) != 0 ? other - x[e] : x[e] + other;
      const float other_v = KV_SHUFFLE_XOR(y[e], s);
      y[e] = (team_lane & s) != 0 ? other_v - y[e] : y[e] + other_v;
    }
  }
  for (int e = 0; e < 8; ++e) {
    x[e] = x[e] * scale[0];
    y[e] = y[e] * scale[0];
  }
}
if (real && c0 < dim) {
  const unsigned int o = i * (unsigned int)dim + (unsigned int)c0;
  for (int e = 0; e < 8; ++e) {
    k_out[o + (unsigned int)e] = (T)x[e];
  }
}
if (real && c0 < dim_v) {
  const unsigned int o = i * (unsigned int)dim_v + (unsigned int)c0;
  for (int e = 0; e < 8; ++e) {
    v_out[o + (unsigned int)e] = (T)y[e];
  }
}
