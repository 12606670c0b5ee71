// paged_attention: the queries of a jagged batch attend over keys and values stored in pool
// blocks, found through each row's block table. Pass 1 of 2 (docs/gpu-attention.md).
//
// A kernel *body*: mx.fast.metal_kernel / cuda_kernel declare the inputs and outputs below,
// and the backend's header (kernels/metal.h, kernels/cuda.h; csrc/kernels_cpu.cpp on the
// host, which runs the lanes as a loop through csrc/simt.h) gives the helpers: kv_half(x)
// (a stored float16 -> float), kv_half_bits(u) (16 bits -> float), kv_float(x) (a query
// element -> float), kv_exp, kv_max, KV_NEG_INF, kv_tid (the thread's index in its
// threadgroup), kv_group (the threadgroup's position), KV_SHARED_ARRAY(type, name, count),
// KV_BARRIER(), KV_SHUFFLE_XOR(x, mask) (a float from lane ^ mask of the SIMD group of 32),
// KV_RETURN, KV_UNROLL (unroll the loop that follows, so that its arrays stay in registers).
// Compile-time constants: NQ (query vectors a threadgroup holds), KL (lanes per key: a power
// of two, at most 32), TG (threads per threadgroup, a multiple of 32), KU (keys a team loads
// at once: 1, 2 or 4), T (the output's type).
//
// inputs:  q_in    [B * Hq * L * D]                row b's L queries are its last L tokens
//          kw      uint32[rows * D * kbits / 32]   key words (16 bits: two float16 a word);
//          ks, kb  half[rows * D / group]          row = (block * Hkv + head) * block_tokens
//          vw      uint32[rows * Dv * vbits / 32]          + token in block
//          vs, vb  half[rows * Dv / group]         (16 bits: unread)
//          tables  int[B * M]    row b's blocks, in token order
//          lengths int[B]        tokens of row b, these queries included
//          dims    int[17]       B, Hq, Hkv, L, D, Dv, M, block_tokens, kbits, vbits,
//                                group, window (0: none), has_sinks, channel_tokens, splits,
//                                split_keys, rotate
//          sinks   float[Hq]     (read only if has_sinks)
//          scale   float[3]      the queries' scale; rotate: the output's (1 / sqrt(Dv));
//                                the scores' soft cap c (0: none): a score s becomes
//                                c * tanh(s / c) before the softmax (Gemma 2)
//          tail    half[slots * Hkv * channel_tokens * D]   (read only if channel_tokens)
//          tail_slots int[B]
//          done    half[entries * channel_tokens * D]  the channel groups this step
//                  completes, group by group, head by head; row b's from entry
//          done_first int[B]                          done_first[b] (-1: none)
// Per-channel keys (KV format 2, channel_tokens > 0): ks/kb hold one scale and bias per
// channel per group of channel_tokens tokens, spread over the group's rows (D /
// channel_tokens per row); the tokens after the row's last complete group are float16
// keys in its tail slot. A query inside a group its step completes, before the group's last
// token, reads that group's keys in float16 from `done` (one token at a time, they would
// still be in its tail): its other groups quantized, as every later query reads them.
// Rotation (format 2, whose keys and values are stored times the Walsh-Hadamard matrix H):
// with rotate = 1 (D == Dv == 8 * KL, a power of two) the body rotates each query as it
// loads it (H q: three butterfly stages in a lane's 8 channels, log2(KL) across the team's
// lanes by shuffles; the caller folds 1 / sqrt(D) into scale[0]) and each output before it
// writes it (H o from threadgroup memory, times scale[1]); so q.(H k) == (H q).(H k) needs no
// operations around the kernel. A part's sums are rotated as they are: the merge pass adds
// them linearly. rotate = 0: the caller rotates, if the format does.
// outputs: splits == 1: out T[B * Hq * L * Dv], the attention; stats unwritten.
//          splits > 1:  out float[B * Hq * L * splits * Dv], each split's sum of
//                       exp(score - m) * value, and stats float[B * Hq * L * splits * 2]
//                       its (m, sum of exp(score - m)); paged_attention_merge.metal ends it.
// grid:    threadgroups (splits * tiles, Hkv, B), TG threads each. A threadgroup holds NQ of
//          the L * Hq / Hkv query vectors of its (row, KV head) (tile), and one part of the
//          keys they see: the row's keys in ceil(keys / split_keys) equal parts (at most
//          `splits`; the threadgroups past them write empty parts), so a row's result does
//          not depend on the other rows of its batch. Its KL-lane teams each take KU keys a
//          step (loaded together, then scored in order: KU changes no bit): a lane
//          dequantizes its ceil(D / KL) key channels and its ceil(Dv / KL) value
//          channels once for all NQ queries, the team sums the dot products by shuffles,
//          and each team keeps its own online softmax; teams, then SIMD groups, merge at
//          the end.
// The bits of a lane's `count` (<= 8) channels from `first` of a stored row: each lies in one
// word (bits divides 32), the lane's lie in at most 5 consecutive words, loaded once.
#define KV_LANE_BITS(raw, words, row_words, row, first, count, bits)                          \
  {                                                                                         \
    const unsigned int bit0 = (unsigned int)((count) > 0 ? (first) : 0) * (unsigned int)(bits); \
    const unsigned int at = (row) * (row_words) + bit0 / 32u;                                 \
    const unsigned int span = (bit0 % 32u + (unsigned int)(count) * (unsigned int)(bits) + 31u) / 32u; \
    const unsigned int w0 = words[at];                                                        \
    const unsigned int w1 = span > 1u ? words[at + 1u] : 0u;                                  \
    const unsigned int w2 = span > 2u ? words[at + 2u] : 0u;                                  \
    const unsigned int w3 = span > 3u ? words[at + 3u] : 0u;                                  \
    const unsigned int w4 = span > 4u ? words[at + 4u] : 0u;                                  \
    const unsigned int mask = (1u << (unsigned int)(bits)) - 1u;                              \
    for (int e = 0; e < 8; ++e) {                                                             \
      const unsigned int pos = bit0 % 32u + (unsigned int)e * (unsigned int)(bits);           \
      const unsigned int wi = pos / 32u;                                                      \
      const unsigned int word =                                                               \
          wi == 0u ? w0 : (wi == 1u ? w1 : (wi == 2u ? w2 : (wi == 3u ? w3 : w4)));           \
      raw[e] = e < (count) ? (word >> (pos % 32u)) & mask : 0u;                               \
    }                                                                                         \
  }
// raw * scale + bias, a scale and a bias per `group` channels from group `base`: the
// lane's channels usually share one group, loaded once.
#define KV_LANE_AFFINE(out, raw, scales, biases, base, first, count)                          \
  {                                                                                         \
    const int fa = (count) > 0 ? (first) : 0;                                                 \
    const unsigned int ga = (base) + (unsigned int)(fa / group);                              \
    const unsigned int gz = (base) + (unsigned int)((fa + ((count) > 0 ? (count) - 1 : 0)) / group); \
    const float sa = kv_half(scales[ga]);                                                     \
    const float ba = kv_half(biases[ga]);                                                     \
    for (int e = 0; e < 8; ++e) {                                                             \
      float sc = sa;                                                                          \
      float bi = ba;                                                                          \
      if (gz != ga && e < (count)) {                                                          \
        const unsigned int g = (base) + (unsigned int)((fa + e) / group);                     \
        sc = kv_half(scales[g]);                                                              \
        bi = kv_half(biases[g]);                                                              \
      }                                                                                       \
      out[e] = (float)raw[e] * sc + bi;                                                       \
    }                                                                                         \
  }
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
const int n_splits = dims[14];
const int split_keys = dims[15];
const int rotate = dims[16];
const float softcap = scale[2];
const int rep = q_heads / kv_heads;
const int n_vectors = n_queries * rep;
const int tid = (int)kv_tid;
const int lane = tid % 32;
const int warp = tid / 32;
const int team_lane = lane % KL;  // this lane's part of a key
const int team = tid / KL;        // KU keys a step per team
const int n_teams = TG / KL;
const int split = (int)kv_group.x % n_splits;
const int tile = (int)kv_group.x / n_splits;
const int kvh = (int)kv_group.y;
const int b = (int)kv_group.z;
KV_SHARED_ARRAY(float, warp_m, NQ * (TG / 32));
KV_SHARED_ARRAY(float, warp_l, NQ * (TG / 32));
KV_SHARED_ARRAY(float, merged, NQ * 8 * KL);
if (b >= n_rows || tile * NQ >= n_vectors) {
  KV_RETURN;  // the whole threadgroup
}
const int length = lengths[b];
const int per_lane = (dim + KL - 1) / KL;  // at most 8 (the host picks KL)
const int per_lane_v = (dim_v + KL - 1) / KL;
const int d0 = team_lane * per_lane;
const int dv0 = team_lane * per_lane_v;
const int key_count = d0 < dim ? (dim - d0 < per_lane ? dim - d0 : per_lane) : 0;
const int value_count = dv0 < dim_v ? (dim_v - dv0 < per_lane_v ? dim_v - dv0 : per_lane_v) : 0;

// The tile's query vectors: vector v = query i of head kvh * rep + v % rep, i = v / rep.
float q[NQ][8];
int first_key[NQ];  // what query j sees: keys first_key[j] ..= last_key[j]
int last_key[NQ];
int own[NQ];  // the group it reads from `done` (its first token), or -1
int k_lo = length;
int k_hi = 0;
for (int j = 0; j < NQ; ++j) {
  const int v = tile * NQ + j;
  const int i = v / rep;
  const int h = kvh * rep + v % rep;
  const bool real = v < n_vectors;
  const int p = length - n_queries + i;
  int lo = 0;
  if (window > 0 && p - window + 1 > 0) {
    lo = p - window + 1;
  }
  first_key[j] = real ? lo : 1;
  last_key[j] = real ? p : 0;
  own[j] = -1;
  if (real && channel_tokens > 0 && done_first[b] >= 0) {
    const int g = p / channel_tokens * channel_tokens;
    const int done_from = (length - n_queries) / channel_tokens * channel_tokens;
    const int complete_at = length / channel_tokens * channel_tokens;
    if (g >= done_from && g < complete_at && p < g + channel_tokens - 1) {
      own[j] = g;
    }
  }
  if (real) {
    k_lo = lo < k_lo ? lo : k_lo;
    k_hi = p + 1 > k_hi ? p + 1 : k_hi;
  }
  const unsigned int q0 = (unsigned int)(((b * q_heads + h) * n_queries + i) * dim);
  for (int e = 0; e < 8; ++e) {
    const int d = d0 + e;
    q[j][e] = real && e < key_count ? kv_float(q_in[q0 + (unsigned int)d]) * scale[0] : 0.0f;
  }
  if (rotate) {  // H q: channel d = 8 * team_lane + e (8 channels a lane, KL lanes a key)
    for (int s = 1; s < 8; s *= 2) {
      for (int e = 0; e < 8; ++e) {
        if ((e & s) == 0) {
          const float a = q[j][e];
          const float c = q[j][e + s];
          q[j][e] = a + c;
          q[j][e + s] = a - c;
        }
      }
    }
    for (int s = 1; s < KL; s *= 2) {
      for (int e = 0; e < 8; ++e) {
        const float other = KV_SHUFFLE_XOR(q[j][e], s);
        q[j][e] = (team_lane & s) != 0 ? other - q[j][e] : q[j][e] + other;
      }
    }
  }
}
int row_splits = (k_hi - k_lo + split_keys - 1) / split_keys;
row_splits = row_splits < 1 ? 1 : (row_splits > n_splits ? n_splits : row_splits);
const int chunk = (k_hi - k_lo + row_splits - 1) / row_splits;
const int s0 = k_lo + split * chunk;
const int s1 = s0 + chunk < k_hi ? s0 + chunk : k_hi;

const unsigned int k_words = (unsigned int)(dim * kbits / 32);
const unsigned int v_words = (unsigned int)(dim_v * vbits / 32);
const unsigned int k_groups = (unsigned int)(dim / (channel_tokens > 0 ? channel_tokens : group));
const unsigned int v_groups = (unsigned int)(dim_v / group);
int complete = length + 1;  // per-channel keys: tokens from here on are in the tail
unsigned int tail0 = 0u;
int done_from = 0;  // the first group this step completes (its entry: done0)
unsigned int done0 = 0u;
if (channel_tokens > 0) {
  complete = length / channel_tokens * channel_tokens;
  tail0 = ((unsigned int)tail_slots[b] * (unsigned int)kv_heads + (unsigned int)kvh) *
          (unsigned int)channel_tokens;
  done_from = (length - n_queries) / channel_tokens * channel_tokens;
  done0 = (unsigned int)(done_first[b] > 0 ? done_first[b] : 0);
}

float m[NQ];
float l[NQ];
float acc[NQ][8];
for (int j = 0; j < NQ; ++j) {
  m[j] = KV_NEG_INF;
  l[j] = 0.0f;
  for (int e = 0; e < 8; ++e) {
    acc[j][e] = 0.0f;
  }
}
// Every thread runs the same number of steps (the shuffles need all 32 lanes); a team past
// the end reads the split's first key and keeps nothing of it. A team takes KU keys a step
// (keys base + team + u * n_teams: the same keys in the same order as KU = 1), loading all
// of them before it scores the first, so their loads are in flight together.
for (int base = s0; base < s1; base += n_teams * KU) {
  bool in[KU];
  int tk[KU];
  bool wanted[KU];
  float x[KU][8];   // the key's channels
  float xf[KU][8];  // its own group's float16 copy, where a query of the tile reads that
  float y[KU][8];   // the value's channels
  KV_UNROLL
  for (int u = 0; u < KU; ++u) {
    const int t_want = base + u * n_teams + team;
    in[u] = t_want < s1;
    const int t = in[u] ? t_want : s0;
    tk[u] = t;
    const int block = tables[b * table_width + t / block_tokens];
    const unsigned int row =
        ((unsigned int)block * (unsigned int)kv_heads + (unsigned int)kvh) *
            (unsigned int)block_tokens +
        (unsigned int)(t % block_tokens);
    unsigned int raw[8];
    if (t >= complete) {
      for (int e = 0; e < 8; ++e) {
        const int d = e < key_count ? d0 + e : 0;
        x[u][e] = kv_half(tail[(tail0 + (unsigned int)(t - complete)) * (unsigned int)dim +
                               (unsigned int)d]);
      }
    } else if (kbits == 16) {
      KV_LANE_BITS(raw, kw, k_words, row, d0, key_count, 16);
      for (int e = 0; e < 8; ++e) {
        x[u][e] = kv_half_bits(raw[e]);
      }
    } else if (channel_tokens > 0) {  // a scale and a bias per channel of the group's rows
      KV_LANE_BITS(raw, kw, k_words, row, d0, key_count, kbits);
      const unsigned int g0 = (row - (unsigned int)(t % channel_tokens)) * k_groups + d0;
      for (int e = 0; e < 8; ++e) {
        const unsigned int g = e < key_count ? g0 + (unsigned int)e : g0;
        x[u][e] = (float)raw[e] * kv_half(ks[g]) + kv_half(kb[g]);
      }
    } else {
      KV_LANE_BITS(raw, kw, k_words, row, d0, key_count, kbits);
      KV_LANE_AFFINE(x[u], raw, ks, kb, row * k_groups, d0, key_count);
    }
    for (int e = 0; e < 8; ++e) {
      x[u][e] = e < key_count ? x[u][e] : 0.0f;
    }
    // the key's group read in float16 too, where a query of the tile reads it so
    const int key_group =
        channel_tokens > 0 && t < complete ? t / channel_tokens * channel_tokens : -2;
    wanted[u] = false;
    for (int j = 0; j < NQ; ++j) {
      wanted[u] = wanted[u] || own[j] == key_group;
    }
    for (int e = 0; e < 8; ++e) {
      xf[u][e] = 0.0f;
    }
    if (wanted[u]) {
      const unsigned int entry = done0 +
                                 (unsigned int)((key_group - done_from) / channel_tokens) *
                                     (unsigned int)kv_heads +
                                 (unsigned int)kvh;
      const unsigned int at =
          (entry * (unsigned int)channel_tokens + (unsigned int)(t - key_group)) *
          (unsigned int)dim;
      for (int e = 0; e < 8; ++e) {
        xf[u][e] = e < key_count ? kv_half(done[at + (unsigned int)(d0 + e)]) : 0.0f;
      }
    }
    if (vbits == 16) {
      KV_LANE_BITS(raw, vw, v_words, row, dv0, value_count, 16);
      for (int e = 0; e < 8; ++e) {
        y[u][e] = e < value_count ? kv_half_bits(raw[e]) : 0.0f;
      }
    } else {
      KV_LANE_BITS(raw, vw, v_words, row, dv0, value_count, vbits);
      KV_LANE_AFFINE(y[u], raw, vs, vb, row * v_groups, dv0, value_count);
    }
  }
  KV_UNROLL
  for (int u = 0; u < KU; ++u) {
    const int t = tk[u];
    const int key_group =
        channel_tokens > 0 && t < complete ? t / channel_tokens * channel_tokens : -2;
    float s[NQ];
    for (int j = 0; j < NQ; ++j) {
      const bool f = wanted[u] && own[j] == key_group;
      float dot = 0.0f;
      for (int e = 0; e < 8; ++e) {
        dot += q[j][e] * (f ? xf[u][e] : x[u][e]);
      }
      s[j] = dot;
    }
    for (int offset = 1; offset < KL; offset *= 2) {
      for (int j = 0; j < NQ; ++j) {
        s[j] += KV_SHUFFLE_XOR(s[j], offset);
      }
    }
    if (softcap > 0.0f) {
      for (int j = 0; j < NQ; ++j) {
        s[j] = softcap * kv_tanh(s[j] / softcap);
      }
    }
    for (int j = 0; j < NQ; ++j) {
      if (in[u] && t >= first_key[j] && t <= last_key[j]) {
        if (s[j] > m[j]) {
          const float c = kv_exp(m[j] - s[j]);
          l[j] *= c;
          for (int e = 0; e < 8; ++e) {
            acc[j][e] *= c;
          }
          m[j] = s[j];
        }
        const float p = kv_exp(s[j] - m[j]);
        l[j] += p;
        for (int e = 0; e < 8; ++e) {
          acc[j][e] += p * y[u][e];
        }
      }
    }
  }
}

// The teams of a SIMD group merge (lanes team_lane of each team hold the same channels).
for (int offset = KL; offset < 32; offset *= 2) {
  for (int j = 0; j < NQ; ++j) {
    const float m_other = KV_SHUFFLE_XOR(m[j], offset);
    const float l_other = KV_SHUFFLE_XOR(l[j], offset);
    const float m_both = kv_max(m[j], m_other);
    const float ours = m_both == KV_NEG_INF ? 0.0f : kv_exp(m[j] - m_both);
    const float theirs = m_both == KV_NEG_INF ? 0.0f : kv_exp(m_other - m_both);
    l[j] = l[j] * ours + l_other * theirs;
    for (int e = 0; e < 8; ++e) {
      const float acc_other = KV_SHUFFLE_XOR(acc[j][e], offset);
      acc[j][e] = acc[j][e] * ours + acc_other * theirs;
    }
    m[j] = m_both;
  }
}
// Then the SIMD groups, through threadgroup memory, in a fixed order.
if (lane == team_lane) {
  for (int j = 0; j < NQ; ++j) {
    warp_m[warp * NQ + j] = m[j];
    warp_l[warp * NQ + j] = l[j];
  }
}
KV_BARRIER();
float m_all[NQ];
float l_all[NQ];
float mine[NQ];
for (int j = 0; j < NQ; ++j) {
  float top = KV_NEG_INF;
  for (int w = 0; w < TG / 32; ++w) {
    top = kv_max(top, warp_m[w * NQ + j]);
  }
  float sum = 0.0f;
  for (int w = 0; w < TG / 32; ++w) {
    const float mw = warp_m[w * NQ + j];
    sum += top == KV_NEG_INF ? 0.0f : warp_l[w * NQ + j] * kv_exp(mw - top);
  }
  m_all[j] = top;
  l_all[j] = sum;
  mine[j] = top == KV_NEG_INF ? 0.0f : kv_exp(m[j] - top);
}
for (int w = 0; w < TG / 32; ++w) {
  if (warp == w && lane == team_lane) {
    for (int j = 0; j < NQ; ++j) {
      for (int e = 0; e < 8; ++e) {  // a fixed count: acc stays in registers
        if (e < value_count) {
          const int d = dv0 + e;
          const float part = acc[j][e] * mine[j];
          merged[j * 8 * KL + d] = w == 0 ? part : merged[j * 8 * KL + d] + part;
        }
      }
    }
  }
  KV_BARRIER();
}
for (int k = tid; k < NQ * dim_v; k += TG) {
  const int j = k / dim_v;
  const int d = k % dim_v;
  const int v = tile * NQ + j;
  if (v < n_vectors) {
    const int i = v / rep;
    const int h = kvh * rep + v % rep;
    const unsigned int o = (unsigned int)((b * q_heads + h) * n_queries + i);
    float sum = merged[j * 8 * KL + d];
    if (rotate) {  // (H o)[d] = sum over c of (-1)^popcount(d & c) o[c], times 1 / sqrt(Dv)
      sum = 0.0f;
      for (int c = 0; c < dim_v; ++c) {
        int x = d & c;
        x ^= x >> 8;
        x ^= x >> 4;
        x ^= x >> 2;
        x ^= x >> 1;
        const float o = merged[j * 8 * KL + c];
        sum += (x & 1) != 0 ? -o : o;
      }
      sum *= scale[1];
    }
    if (n_splits == 1) {
      float total = l_all[j];
      float keep = 1.0f;
      if (has_sinks) {  // the sink's logit joins the softmax, its value is zero
        const float top = kv_max(m_all[j], sinks[h]);
        keep = m_all[j] == KV_NEG_INF ? 0.0f : kv_exp(m_all[j] - top);
        total = total * keep + kv_exp(sinks[h] - top);
      }
      out[o * (unsigned int)dim_v + (unsigned int)d] = (T)(total > 0.0f ? sum * keep / total : 0.0f);
    } else {
      const unsigned int at = o * (unsigned int)n_splits + (unsigned int)split;
      out[at * (unsigned int)dim_v + (unsigned int)d] = (T)sum;
      if (d == 0) {
        stats[at * 2u] = m_all[j];
        stats[at * 2u + 1u] = l_all[j];
      }
    }
  }
}
#undef KV_LANE_BITS
#undef KV_LANE_AFFINE
