// paged_attention_merge: pass 2 of paged attention (docs/gpu-attention.md), where pass 1
// (paged_attention.metal) split each query's keys into `splits` parts: one thread per output
// element merges the parts' online softmax states in split order, with the sink's logit.
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
float top = KV_NEG_INF;
for (int s = 0; s < n_splits; ++s) {
  top = kv_max(top, stats[(o * (unsigned int)n_splits + (unsigned int)s) * 2u]);
}
const int h = hi / n_queries;
float keep = 1.0f;
float sink = 0.0f;
if (has_sinks) {  // the sink's logit joins the softmax, its value is zero
  const float with_sink = kv_max(top, sinks[h]);
  keep = top == KV_NEG_INF ? 0.0f : kv_exp(top - with_sink);
  sink = kv_exp(sinks[h] - with_sink);
}
float total = 0.0f;
float sum = 0.0f;
for (int s = 0; s < n_splits; ++s) {
  const unsigned int at = o * (unsigned int)n_splits + (unsigned int)s;
  const float m = stats[at * 2u];
  const float f = m == KV_NEG_INF ? 0.0f : kv_exp(m - top);
  total += stats[at * 2u + 1u] * f;
  sum += parts[at * (unsigned int)dim_v + (unsigned int)d] * f;
}
total = total * keep + sink;
out[o * (unsigned int)dim_v + (unsigned int)d] = (T)(total > 0.0f ? sum * keep / total : 0.0f);
