// paged_attention_merge: pass 2 of paged attention (docs/gpu-attention.md), where pass 1
// (paged_attention.metal) split each query's keys into `splits` parts: one thread per output
// element merges the parts' online softmax states, with the sink's logit. It reads 4 parts a
// step (parts s, s + 1, s + 2, s + 3 into 4 running sums, added up in a fixed order at the
// end), so that their loads are in flight together: the parts' count alone fixes the order,
// so a row gets the same bits alone or batched.
//
// inputs:  parts  float[B * Hq * L * splits * Dv]  each split's sum of exp(score - m) * value
//          stats  float[B * Hq * L * splits * 2]   each split's (m, sum of exp(score - m))
//          sinks  float[Hq]                          (read only if has_sinks)
//          dims   int[6]    B, Hq, L, Dv, splits, has_sinks
// output:  out    T[B * Hq * L * Dv]
// grid:    (Dv, Hq * L, B)
const int n_rows = dims[0];
const int q_heads = dims[1];
const int n_queries = dims[2];
const int dim_v = dims[3];
const int n_splits = dims[4];
const int has_sinks = dims[5];
const int d = (int)thread_position_in_grid.x;
const int hi = (int)thread_position_in_grid.y;
const int b = (int)thread_position_in_grid.z;
if (d >= dim_v || hi >= q_heads * n_queries || b >= n_rows) {
  return;
}
const unsigned int o = (unsigned int)(b * q_heads * n_queries + hi);
const unsigned int first = o * (unsigned int)n_splits;
float tops[4] = {KV_NEG_INF, KV_NEG_INF, KV_NEG_INF, KV_NEG_INF};
for (int s = 0; s < n_splits; s += 4) {
  KV_UNROLL
  for (int u = 0; u < 4; ++u) {
    const int k = s + u < n_splits ? s + u : s;
    tops[u] = kv_max(tops[u], stats[(first + (unsigned int)k) * 2u]);
  }
}
const float top = kv_max(kv_max(tops[0], tops[1]), kv_max(tops[2], tops[3]));
const int h = hi / n_queries;
float keep = 1.0f;
float sink = 0.0f;
if (has_sinks) {  // the sink's logit joins the softmax, its value is zero
  const float with_sink = kv_max(top, sinks[h]);
  keep = top == KV_NEG_INF ? 0.0f : kv_exp(top - with_sink);
  sink = kv_exp(sinks[h] - with_sink);
}
float totals[4] = {0.0f, 0.0f, 0.0f, 0.0f};
float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
for (int s = 0; s < n_splits; s += 4) {
  KV_UNROLL
  for (int u = 0; u < 4; ++u) {
    const bool real = s + u < n_splits;
    const unsigned int at = first + (unsigned int)(real ? s + u : s);
    const float m = stats[at * 2u];
    const float f = !real || m == KV_NEG_INF ? 0.0f : kv_exp(m - top);
    totals[u] += stats[at * 2u + 1u] * f;
    sums[u] += parts[at * (unsigned int)dim_v + (unsigned int)d] * f;
  }
}
const float total = ((totals[0] + totals[1]) + (totals[2] + totals[3])) * keep + sink;
const float sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
out[o * (unsigned int)dim_v + (unsigned int)d] = (T)(total > 0.0f ? sum * keep / total : 0.0f);
