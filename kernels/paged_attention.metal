// paged_attention: the queries of a jagged batch attend over keys and values stored in
// pool blocks, found through each row's block table. One thread per query vector.
//
// This is a kernel *body* (see gather/merge/extract): mx.fast.metal_kernel / cuda_kernel
// declare the names below; csrc/kernels_cpu.cpp compiles this very file for CPU through
// shim.h. Helpers the backends spell differently come from the header each passes:
// kv_half(x) (a stored float16 -> float), kv_exp(x), kv_max(a, b), KV_NEG_INF.
//
// inputs:  q       float[B * Hq * L * D]       row b's L queries are its last L tokens
//          kw      uint32[rows * D * kbits / 32]   key words; row = (block * Hkv + head)
//          ks, kb  half[rows * D / group]           * block_tokens + token in block
//          vw      uint32[rows * Dv * vbits / 32]  value words
//          vs, vb  half[rows * Dv / group]
//          tables  int[B * M]    row b's blocks, in token order
//          lengths int[B]        tokens of row b, these queries included
//          dims    int[14]       B, Hq, Hkv, L, D, Dv, M, block_tokens, kbits, vbits,
//                                group, window (0: none), has_sinks, channel_tokens
//          sinks   float[Hq]     (read only if has_sinks)
//          scale   float[1]
//          tail    half[slots * Hkv * channel_tokens * D]   (read only if channel_tokens)
//          tail_slots int[B]
// Per-channel keys (KV format 2, channel_tokens > 0): ks/kb hold one scale and bias per
// channel per group of channel_tokens tokens, spread over the group's rows (D /
// channel_tokens per row); the tokens after the row's last complete group are float16
// keys in its tail slot. Rotation (format 2) is the caller's: queries in, output out.
// output:  out     float[B * Hq * L * Dv]
// grid:    (L, Hq, B)
const int n_rows = dims[0];
const int q_heads = dims[1];
const int kv_heads = dims[2];
const int n_queries = dims[3];
const int dim = dims[4];
const int dim_v = dims[5];
const int table_width = dims[6];
const int block_tokens = dims[7];
const int kbits = dims[8];
const int vbits = dims[9];
const int group = dims[10];
const int window = dims[11];
const int has_sinks = dims[12];
const int channel_tokens = dims[13];
const int i = (int)thread_position_in_grid.x;
const int h = (int)thread_position_in_grid.y;
const int b = (int)thread_position_in_grid.z;
if (i >= n_queries || h >= q_heads || b >= n_rows) {
  return;
}
const int kvh = h / (q_heads / kv_heads);
const int length = lengths[b];
const int p = length - n_queries + i;
int lo = 0;
if (window > 0 && p - window + 1 > 0) {
  lo = p - window + 1;
}
const unsigned int q0 = (unsigned int)((b * q_heads + h) * n_queries + i);
float qv[256];
for (int d = 0; d < dim; ++d) {
  qv[d] = q[q0 * (unsigned int)dim + (unsigned int)d] * scale[0];
}
float acc[256];
for (int d = 0; d < dim_v; ++d) {
  acc[d] = 0.0f;
}
float m = KV_NEG_INF;
float l = 0.0f;
if (has_sinks) {
  m = sinks[h];
  l = 1.0f;
}
const int k_per = 32 / kbits;
const int v_per = 32 / vbits;
const unsigned int k_mask = (1u << kbits) - 1u;
const unsigned int v_mask = (1u << vbits) - 1u;
const unsigned int k_words = (unsigned int)(dim / k_per);
const unsigned int v_words = (unsigned int)(dim_v / v_per);
const unsigned int k_groups = (unsigned int)(dim / (channel_tokens > 0 ? channel_tokens : group));
int complete = length + 1;  // per-channel keys: tokens from here on are in the tail
unsigned int tail0 = 0u;
if (channel_tokens > 0) {
  complete = length / channel_tokens * channel_tokens;
  tail0 = ((unsigned int)tail_slots[b] * (unsigned int)kv_heads + (unsigned int)kvh) *
          (unsigned int)channel_tokens;
}
const unsigned int v_groups = (unsigned int)(dim_v / group);
for (int t = lo; t <= p; ++t) {
  const int block = tables[b * table_width + t / block_tokens];
  const unsigned int row =
      ((unsigned int)block * (unsigned int)kv_heads + (unsigned int)kvh) *
          (unsigned int)block_tokens +
      (unsigned int)(t % block_tokens);
  float s = 0.0f;
  if (t >= complete) {
    const unsigned int at = (tail0 + (unsigned int)(t - complete)) * (unsigned int)dim;
    for (int d = 0; d < dim; ++d) {
      s += qv[d] * kv_half(tail[at + (unsigned int)d]);
    }
  } else if (channel_tokens > 0) {
    const unsigned int first = (row - (unsigned int)(t % channel_tokens)) * k_groups;
    for (int d = 0; d < dim; ++d) {
      const unsigned int word = kw[row * k_words + (unsigned int)(d / k_per)];
      const float x = (float)((word >> ((d % k_per) * kbits)) & k_mask);
      const unsigned int g = first + (unsigned int)d;
      s += qv[d] * (x * kv_half(ks[g]) + kv_half(kb[g]));
    }
  } else {
    for (int d = 0; d < dim; ++d) {
      const unsigned int word = kw[row * k_words + (unsigned int)(d / k_per)];
      const float x = (float)((word >> ((d % k_per) * kbits)) & k_mask);
      const unsigned int g = row * k_groups + (unsigned int)(d / group);
      s += qv[d] * (x * kv_half(ks[g]) + kv_half(kb[g]));
    }
  }
  const float m_new = kv_max(m, s);
  const float correction = (m == KV_NEG_INF) ? 0.0f : kv_exp(m - m_new);
  const float e = kv_exp(s - m_new);
  l = l * correction + e;
  for (int d = 0; d < dim_v; ++d) {
    const unsigned int word = vw[row * v_words + (unsigned int)(d / v_per)];
    const float x = (float)((word >> ((d % v_per) * vbits)) & v_mask);
    const unsigned int g = row * v_groups + (unsigned int)(d / group);
    acc[d] = acc[d] * correction + e * (x * kv_half(vs[g]) + kv_half(vb[g]));
  }
  m = m_new;
}
const float inv = (l > 0.0f) ? 1.0f / l : 0.0f;
for (int d = 0; d < dim_v; ++d) {
  out[q0 * (unsigned int)dim_v + (unsigned int)d] = acc[d] * inv;
}
