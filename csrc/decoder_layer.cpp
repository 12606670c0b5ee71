// One decoder layer of a Llama-family model over the block pool, as one MLX operation on
// CPU (see ops.h, decoder_layer). It runs the same kernels, on the same values, as the
// layer's ~40 separate graph operations do (rms_norm_rows, quantized_matmul, rope_rows,
// hadamard_rows, quantize_rows, quantized_attention, silu_mul), so each row's result is
// the same bits either way; what goes is the scheduling of those operations (~2-3 us each
// on MLX's CPU stream, ~1,300 per decode step of the embedded model).
#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>

#include "core/attention.h"
#include "core/half.h"
#include "core/qmm.h"
#include "core/rows.h"
#include "kvswap_ops.h"
#include "op_support.h"
#include "ops.h"

namespace agentkv::ops {
namespace {

constexpr int kLinears = 7;  // q, k, v, o, gate, up, down

// Where each array sits in the operation's inputs.
enum Input : int {
  kX = 0,
  kInputNorm,
  kPostNorm,
  kWeights,                         // kLinears x (packed codes, scales, biases)
  kKeys = kWeights + 3 * kLinears,  // the layer's arena: key words, scales, biases
  kValues = kKeys + 3,              // value words, scales, biases (written)
  kTail = kValues + 3,              // float16 keys of the groups still filling (written)
  kTables = kTail + 1,              // [B, blocks]
  kLengths,                         // [B] after the step
  kTailSlots,                       // [B]
  kRows,                            // [B * Hkv * L] value rows of the new tokens
  kTailRows,                        // [B * Hkv * L] tail rows of the new keys, or the key plan
  kFreqs,  // optional: rope periods; then each linear's bias, if any; then the q, k norms;
           // then, under KVSwap, each row's positions' end (lengths is then the table's);
           // then the next layer's query weights (LayerParams::predict_at); then the prevs
           // (LayerParams::prevs_at) where a row completes a channel group
};

struct LayerParams {
  int heads = 0, kv_heads = 0, head_dim = 0;
  float attention_scale = 1.0f, eps = 0.0f;
  int rope_dims = 0;
  bool rope_traditional = false;
  float rope_scale = 1.0f;
  std::vector<float> inv_freq;  // empty: from the periods input
  std::array<int, kLinears> bits{}, groups{};
  int key_bits = 4, value_bits = 4, group = 64, channel_tokens = 64, block_tokens = 256;
  int window = 0;
  bool rotate = true;
  std::array<bool, kLinears> has_bias{};  // added after the matmul (Qwen2's q, k, v)
  bool periods = false;                   // the rope periods are an input (kFreqs)
  bool qk_norms = false;                  // Qwen3: RMSNorm of each q and k head before RoPE
  float qk_eps = 0.0f;
  int qk_norms_at = -1;   // inputs: the q norm, then the k norm
  int positions_at = -1;  // RoPE positions end here, not at the lengths (KVSwap)
  SwapStep swap;          // rows whose KV is partly on disk (KVSwap)
  // KVSwap reading ahead: the next layer's input norm, then its q words, scales, biases,
  // then its q bias and q norm where it has them
  int predict_at = -1, predict_bits = 0, predict_group = 0;
  int predict_bias_at = -1, predict_q_norm_at = -1;
  // A row completes a channel group: kTailRows holds the key plan (KeyWrites), these many of
  // each part, and the prevs are an input (written)
  std::array<int64_t, 6> key_counts{};
  int prevs_at = -1;
  bool operator==(const LayerParams&) const = default;
};

QuantizedWeights weights(const LayerParams& p, const std::vector<mx::array>& in, int which) {
  const mx::array& w = in[kWeights + 3 * which];
  const int bits = p.bits[which];
  return {w.data<uint8_t>(),
          in[kWeights + 3 * which + 1].data<void>(),
          in[kWeights + 3 * which + 2].data<void>(),
          scale_type(in[kWeights + 3 * which + 1]),
          bits,
          p.groups[which],
          static_cast<int64_t>(w.shape(0)) * agentkv::kPackColumns,
          w.shape(1) / (2 * bits)};
}

// Linear i's bias [N] among the inputs, or null.
const float* bias_of(const LayerParams& p, const std::vector<mx::array>& in, int which) {
  if (!p.has_bias[which]) {
    return nullptr;
  }
  size_t at = kFreqs + (p.periods ? 1 : 0);  // the periods come first, if given
  for (int i = 0; i < which; ++i) {
    at += p.has_bias[i] ? 1 : 0;
  }
  return in[at].data<float>();
}

// y_i = x W_i^T (+ b_i) for the linears first .. first + ys.size() - 1, which share their
// input; a bias is added as MLX adds it after the matmul (one float add an element).
void matmuls(const LayerParams& p, const std::vector<mx::array>& in, int first, const float* x,
             std::initializer_list<float*> ys, int64_t rows) {
  std::array<QuantizedWeights, 3> ws;
  std::array<float*, 3> outs{};
  int count = 0;
  for (float* y : ys) {
    ws[count] = weights(p, in, first + count);
    outs[count++] = y;
  }
  agentkv::quantized_matmuls(x, ws.data(), outs.data(), count, rows);
  for (int i = 0; i < count; ++i) {
    if (const float* b = bias_of(p, in, first + i)) {
      const int64_t n = ws[i].N;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          outs[i][r * n + j] += b[j];
        }
      }
    }
  }
}

// [B, L, heads, dim] rows of a projection, rotated by position into [B, heads, L, dim].
void rotary(const LayerParams& p, const float* x, float* out, int batch, int length, int heads,
            const int32_t* lengths) {
  const int64_t dim = p.head_dim;
  std::vector<int64_t> offsets(static_cast<size_t>(batch) * heads);
  std::vector<int64_t> positions(offsets.size());
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      offsets[b * heads + h] = (static_cast<int64_t>(b) * length * heads + h) * dim;
      positions[b * heads + h] = lengths[b] - length;
    }
  }
  agentkv::RopeArgs a;
  a.x = x;
  a.out = out;
  a.heads = static_cast<int64_t>(batch) * heads;
  a.length = length;
  a.dim = dim;
  a.dims = p.rope_dims;
  a.head_offsets = offsets.data();
  a.row_stride = heads * dim;
  a.feature_stride = 1;
  a.positions = positions.data();
  a.inv_freq = p.inv_freq.data();
  a.scale = p.rope_scale;
  a.traditional = p.rope_traditional;
  agentkv::rope_rows(a);
}

// [B, A, C, dim] -> [B, C, A, dim]
void swap_axes(const float* x, float* out, int batch, int a, int c, int64_t dim) {
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < a; ++i) {
      for (int j = 0; j < c; ++j) {
        std::memcpy(out + ((static_cast<int64_t>(b) * c + j) * a + i) * dim,
                    x + ((static_cast<int64_t>(b) * a + i) * c + j) * dim, dim * sizeof(float));
      }
    }
  }
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = a[i] + b[i];
  }
}

void view(agentkv::KVView& v, const std::vector<mx::array>& in, int first, int bits, int group,
          int dim, int channel_tokens) {
  v.bits = bits;
  v.group = group;
  v.channel_tokens = channel_tokens;
  v.words = in[first].data<uint32_t>();
  v.scales = in[first + 1].data<uint16_t>();
  v.biases = in[first + 2].data<uint16_t>();
  v.dim = dim;
}

// KVSwap reading ahead (docs/kvswap.md): each swapped row whose set predicts the next layer
// gets that layer's query predicted from this layer's input (the next layer's norm and query
// projection, RoPE at the row's position, the pool's rotation) and starts its reads, which
// run while this layer computes.
void predict_next(const LayerParams& p, const std::vector<mx::array>& in, const float* xs,
                  const int32_t* ends) {
  const int next = p.swap.layer + 1;
  std::vector<size_t> which;
  for (size_t i = 0; i < p.swap.swaps.size(); ++i) {
    if (p.swap.swaps[i]->predicts(next)) {
      which.push_back(i);
    }
  }
  if (which.empty()) {
    return;
  }
  const int n = static_cast<int>(which.size()), H = p.heads;
  const int64_t D = in[kX].shape(2), hd = p.head_dim;
  std::vector<float> x(n * D), normed(n * D), q(n * H * hd), qh(n * H * hd);
  std::vector<int32_t> at(n);
  for (int i = 0; i < n; ++i) {
    const int b = p.swap.rows[which[i]];  // one new token a swapped row
    std::memcpy(x.data() + i * D, xs + b * D, D * sizeof(float));
    at[i] = ends[b];
  }
  agentkv::rms_norm_rows(x.data(), in[p.predict_at].data<float>(), normed.data(), n, D, p.eps);
  const mx::array& w = in[p.predict_at + 1];
  const QuantizedWeights weights = {w.data<uint8_t>(),
                                    in[p.predict_at + 2].data<void>(),
                                    in[p.predict_at + 3].data<void>(),
                                    scale_type(in[p.predict_at + 2]),
                                    p.predict_bits,
                                    p.predict_group,
                                    static_cast<int64_t>(w.shape(0)) * agentkv::kPackColumns,
                                    w.shape(1) / (2 * p.predict_bits)};
  float* outs[1] = {q.data()};
  agentkv::quantized_matmuls(normed.data(), &weights, outs, 1, n);
  if (p.predict_bias_at >= 0) {
    const float* bias = in[p.predict_bias_at].data<float>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < H * hd; ++j) {
        q[r * H * hd + j] += bias[j];
      }
    }
  }
  if (p.predict_q_norm_at >= 0) {
    agentkv::rms_norm_rows(q.data(), in[p.predict_q_norm_at].data<float>(), q.data(), n * H, hd,
                           p.qk_eps);
  }
  rotary(p, q.data(), qh.data(), n, 1, H, at.data());
  if (p.rotate) {
    agentkv::hadamard_rows(qh.data(), n * H, hd,
                           static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))));
  }
  for (int i = 0; i < n; ++i) {
    p.swap.swaps[which[i]]->predict(next, qh.data() + i * H * hd);
  }
}

// Where a step's new keys go (agentkv.pool.arena.WritePlan): tail rows `direct` take the new
// keys `direct_src` (null: all of them in order). A row that completes channel groups takes
// its tail's rows `gather`, then every new key, as one source list: keys `group_src` (a
// channel group's tokens after another) are quantized per channel into arena rows
// `group_rows`, keys `rest_src` go to tail rows `rest_rows`, and each completing row's last
// group, `prev_src`, to its prevs rows `prev_rows` (float16). The groups, in float16, are
// what a query inside one reads (AttentionArgs::done_first: each row's first, -1: none).
struct KeyWrites {
  const int32_t *direct = nullptr, *direct_src = nullptr, *gather = nullptr;
  const int32_t *group_src = nullptr, *group_rows = nullptr, *rest_src = nullptr;
  const int32_t *rest_rows = nullptr, *prev_src = nullptr, *prev_rows = nullptr;
  const int32_t* done_first = nullptr;
  int64_t n_direct = 0, n_gather = 0, n_group = 0, n_rest = 0, n_prev = 0, n_done_first = 0;
};

KeyWrites key_writes(const LayerParams& p, const mx::array& rows, int64_t written) {
  KeyWrites w;
  const int32_t* at = rows.data<int32_t>();
  if (p.prevs_at < 0) {
    w.direct = at;
    w.n_direct = written;
    return w;
  }
  auto take = [&](const int32_t*& part, int64_t n) {
    part = at;
    at += n;
  };
  w.n_direct = p.key_counts[0];
  w.n_gather = p.key_counts[1];
  w.n_group = p.key_counts[2];
  w.n_rest = p.key_counts[3];
  w.n_prev = p.key_counts[4];
  w.n_done_first = p.key_counts[5];
  take(w.direct, w.n_direct);
  take(w.direct_src, w.n_direct);
  take(w.gather, w.n_gather);
  take(w.group_src, w.n_group);
  take(w.group_rows, w.n_group);
  take(w.rest_src, w.n_rest);
  take(w.rest_rows, w.n_rest);
  take(w.prev_src, w.n_prev);
  take(w.prev_rows, w.n_prev);
  take(w.done_first, w.n_done_first);
  return w;
}

// A swapped row's prefill (SwapStep::stream): its table names -1 for its evicted blocks,
// which are read back into its staging blocks; every other block and the staging blocks
// must lie inside the arenas.
bool stream_table_ok(agentkv::AttentionArgs a, int64_t blocks, const agentkv::KVSwapSet& set) {
  const std::vector<int32_t>& staging = set.staging();
  if (staging.empty()) {
    return false;
  }
  for (int32_t s : staging) {
    if (s < 0 || s >= blocks) {
      return false;
    }
  }
  std::vector<int32_t> table(a.tables, a.tables + a.table_stride);
  for (int i = 0; i < set.blocks() && i < a.table_stride; ++i) {
    table[i] = staging[0];
  }
  a.tables = table.data();
  return paged_table_ok(a, 0, blocks);
}

bool within(const int32_t* v, int64_t n, int64_t end) {
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] < 0 || v[i] >= end) {
      return false;
    }
  }
  return true;
}

// The new keys (float16 bits, [written, hd]) into the tails, the arena's key rows and the
// prevs as `w` says (the same values as agentkv.pool.arena.KVArena.append writes); each
// group completed, in float16, into `done` (what attention reads for a query inside it).
void write_keys(const LayerParams& p, const KeyWrites& w, const uint16_t* fresh,
                const agentkv::KVView& k, uint16_t* prevs, std::vector<uint16_t>& done) {
  const int64_t hd = p.head_dim, row_bytes = hd * sizeof(uint16_t);
  auto* tail = const_cast<uint16_t*>(k.tail);
  std::vector<uint16_t> gathered(w.n_gather * hd);  // read before anything is written
  for (int64_t i = 0; i < w.n_gather; ++i) {
    std::memcpy(gathered.data() + i * hd, tail + w.gather[i] * hd, row_bytes);
  }
  auto source = [&](int32_t s) {
    return s < w.n_gather ? gathered.data() + s * hd : fresh + (s - w.n_gather) * hd;
  };
  for (int64_t i = 0; i < w.n_direct; ++i) {
    std::memcpy(tail + w.direct[i] * hd, fresh + (w.direct_src ? w.direct_src[i] : i) * hd,
                row_bytes);
  }
  const int ct = p.channel_tokens;
  const int64_t width = hd * p.key_bits / 32, spread = hd / ct;
  std::vector<uint16_t> group(ct * hd), scales(hd), biases(hd);
  std::vector<uint32_t> words(ct * width);
  done.resize(w.n_group * hd);
  auto* key_words = const_cast<uint32_t*>(k.words);
  auto* key_scales = const_cast<uint16_t*>(k.scales);
  auto* key_biases = const_cast<uint16_t*>(k.biases);
  for (int64_t g = 0; g < w.n_group; g += ct) {
    for (int t = 0; t < ct; ++t) {
      std::memcpy(group.data() + t * hd, source(w.group_src[g + t]), row_bytes);
    }
    std::copy(group.begin(), group.end(), done.begin() + g * hd);
    agentkv::quantize_channels(group.data(), ct, hd, p.key_bits, words.data(), scales.data(),
                               biases.data());
    for (int t = 0; t < ct; ++t) {
      const int64_t row = w.group_rows[g + t];
      std::memcpy(key_words + row * width, words.data() + t * width, width * sizeof(uint32_t));
      std::memcpy(key_scales + row * spread, scales.data() + t * spread, spread * sizeof(uint16_t));
      std::memcpy(key_biases + row * spread, biases.data() + t * spread, spread * sizeof(uint16_t));
    }
  }
  for (int64_t i = 0; i < w.n_rest; ++i) {
    std::memcpy(tail + w.rest_rows[i] * hd, source(w.rest_src[i]), row_bytes);
  }
  for (int64_t i = 0; i < w.n_prev; ++i) {
    std::memcpy(prevs + w.prev_rows[i] * hd, source(w.prev_src[i]), row_bytes);
  }
}

void run(LayerParams p, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array& x = in[kX];
  const int batch = x.shape(0), length = x.shape(1);
  const int64_t model_dim = x.shape(2), rows = static_cast<int64_t>(batch) * length;
  const int H = p.heads, Hkv = p.kv_heads;
  const int64_t hd = p.head_dim;
  const int64_t hidden = in[kWeights + 3 * 4].shape(0) * agentkv::kPackColumns;  // gate's outputs
  const int32_t* lengths = in[kLengths].data<int32_t>();
  float* y = out.data<float>();

  agentkv::AttentionArgs a;
  a.batch = batch;
  a.q_heads = H;
  a.kv_heads = Hkv;
  a.queries = length;
  a.scale = p.attention_scale;
  a.window = p.window;
  a.tables = in[kTables].data<int32_t>();
  a.table_stride = in[kTables].shape(1);
  a.lengths = lengths;
  a.block_tokens = p.block_tokens;
  a.tail_slots = in[kTailSlots].data<int32_t>();
  view(a.k, in, kKeys, p.key_bits, p.group, hd, p.channel_tokens);
  view(a.v, in, kValues, p.value_bits, p.group, hd, 0);
  a.k.tail = in[kTail].data<uint16_t>();

  // Every row the step reads or writes inside its arrays, or NaN and no write at all.
  const int64_t arena_rows = in[kKeys].shape(0);
  const int64_t blocks = arena_rows / (static_cast<int64_t>(Hkv) * p.block_tokens);
  const int64_t tail_rows = in[kTail].shape(0);
  const int64_t slots = tail_rows / (static_cast<int64_t>(Hkv) * p.channel_tokens);
  bool ok = true;
  for (int b = 0; b < batch && ok; ++b) {
    const bool table_ok =
        p.swap.stream ? stream_table_ok(a, blocks, *p.swap.swaps[0]) : paged_table_ok(a, b, blocks);
    ok = table_ok && a.tail_slots[b] >= 0 && a.tail_slots[b] < slots;
  }
  const int32_t* value_rows = in[kRows].data<int32_t>();
  const int64_t written = rows * Hkv;
  const KeyWrites keys = key_writes(p, in[kTailRows], written);
  const int64_t sources = keys.n_gather + written;
  const int64_t prev_rows = p.prevs_at >= 0 ? in[p.prevs_at].shape(0) : 0;
  ok = ok && within(value_rows, written, arena_rows) &&
       within(keys.direct, keys.n_direct, tail_rows) &&
       (!keys.direct_src || within(keys.direct_src, keys.n_direct, written)) &&
       within(keys.gather, keys.n_gather, tail_rows) &&
       within(keys.group_src, keys.n_group, sources) &&
       within(keys.group_rows, keys.n_group, arena_rows) &&
       within(keys.rest_src, keys.n_rest, sources) &&
       within(keys.rest_rows, keys.n_rest, tail_rows) &&
       within(keys.prev_src, keys.n_prev, sources) &&
       within(keys.prev_rows, keys.n_prev, prev_rows);
  for (int b = 0; b < batch && ok && keys.done_first != nullptr; ++b) {
    const int ct = p.channel_tokens;  // the groups the row completes, inside what is written
    const int64_t groups = lengths[b] / ct - (lengths[b] - length) / ct;
    ok = keys.done_first[b] < 0 ||
         (lengths[b] >= length && (keys.done_first[b] + groups * Hkv) * ct <= keys.n_group);
  }
  if (!ok) {
    std::fill_n(y, out.size(), std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (p.periods) {
    p.inv_freq = rope_inverse_periods(in[kFreqs].data<float>(), in[kFreqs].size());
  }

  const float* xs = x.data<float>();
  std::vector<float> normed(rows * model_dim), h(rows * model_dim), r(rows * model_dim);
  std::vector<float> q(rows * H * hd), qh(rows * H * hd);
  std::vector<float> k(rows * Hkv * hd), kh(rows * Hkv * hd);
  std::vector<float> v(rows * Hkv * hd), vh(rows * Hkv * hd);
  agentkv::rms_norm_rows(xs, in[kInputNorm].data<float>(), normed.data(), rows, model_dim, p.eps);
  matmuls(p, in, 0, normed.data(), {q.data(), k.data(), v.data()}, rows);
  if (p.qk_norms) {  // per head, in place (each row is read whole before it is written)
    const mx::array& q_norm = in[p.qk_norms_at];
    const mx::array& k_norm = in[p.qk_norms_at + 1];
    agentkv::rms_norm_rows(q.data(), q_norm.data<float>(), q.data(), rows * H, hd, p.qk_eps);
    agentkv::rms_norm_rows(k.data(), k_norm.data<float>(), k.data(), rows * Hkv, hd, p.qk_eps);
  }
  const int32_t* ends = p.positions_at >= 0 ? in[p.positions_at].data<int32_t>() : lengths;
  rotary(p, q.data(), qh.data(), batch, length, H, ends);
  rotary(p, k.data(), kh.data(), batch, length, Hkv, ends);
  swap_axes(v.data(), vh.data(), batch, length, Hkv, hd);
  const auto rotation = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as Python
  if (p.rotate) {  // keys and values are stored as H k, H v; q.(H k) == (H q).(H k)
    agentkv::hadamard_rows(qh.data(), rows * H, hd, rotation);
    agentkv::hadamard_rows(kh.data(), rows * Hkv, hd, rotation);
    agentkv::hadamard_rows(vh.data(), rows * Hkv, hd, rotation);
  }

  // The new keys join their tails (float16), and complete groups are quantized into the
  // arena; the new values are quantized into the arena.
  std::vector<uint16_t> fresh(written * hd);
  for (int64_t i = 0; i < written * hd; ++i) {
    fresh[i] = agentkv::float_to_half(kh[i]);
  }
  uint16_t* prevs =
      p.prevs_at >= 0 ? const_cast<uint16_t*>(in[p.prevs_at].data<uint16_t>()) : nullptr;
  std::vector<uint16_t> done;
  write_keys(p, keys, fresh.data(), a.k, prevs, done);
  if (keys.done_first != nullptr) {
    a.k.done = done.data();
    a.done_first = keys.done_first;
  }
  const int64_t word_width = hd * p.value_bits / 32, scale_width = hd / p.group;
  std::vector<uint32_t> words(written * word_width);
  std::vector<uint16_t> scales(written * scale_width), biases(written * scale_width);
  agentkv::quantize_rows(vh.data(), written, hd, p.value_bits, p.group, words.data(), scales.data(),
                         biases.data());
  auto* arena_words = const_cast<uint32_t*>(a.v.words);
  auto* arena_scales = const_cast<uint16_t*>(a.v.scales);
  auto* arena_biases = const_cast<uint16_t*>(a.v.biases);
  for (int64_t i = 0; i < written; ++i) {
    std::memcpy(arena_words + value_rows[i] * word_width, words.data() + i * word_width,
                word_width * sizeof(uint32_t));
    std::memcpy(arena_scales + value_rows[i] * scale_width, scales.data() + i * scale_width,
                scale_width * sizeof(uint16_t));
    std::memcpy(arena_biases + value_rows[i] * scale_width, biases.data() + i * scale_width,
                scale_width * sizeof(uint16_t));
  }

  // Swapped rows bring the groups their queries need into their staging blocks.
  std::vector<int> failed;
  std::vector<const mx::array*> parts;
  for (int i = 0; i < 6; ++i) {
    parts.push_back(&in[kKeys + i]);
  }
  if (!p.swap.empty() && !p.swap.stream) {
    failed = stage_swapped_rows(p.swap, qh.data(), H, hd, parts, a.tables, a.table_stride);
    if (p.predict_at >= 0) {
      predict_next(p, in, xs, ends);
    }
  }

  // Attention (its output in q's buffer, [B, H, L, hd]), then back to [B, L, H * hd]; a
  // swapped row's prefill chunk streams its evicted blocks in, exactly.
  a.q = qh.data();
  a.q_strides[0] = H * length * hd;
  a.q_strides[1] = length * hd;
  a.q_strides[2] = hd;
  a.out = q.data();
  if (p.swap.stream) {
    if (!stream_swapped_row(p.swap, a, parts)) {
      failed.push_back(p.swap.rows[0]);
    }
  } else {
    agentkv::quantized_attention(a);
  }
  if (p.rotate) {
    agentkv::hadamard_rows(q.data(), rows * H, hd, rotation);
  }
  swap_axes(q.data(), qh.data(), batch, H, length, hd);
  matmuls(p, in, 3, qh.data(), {r.data()}, rows);
  add(xs, r.data(), h.data(), rows * model_dim);

  std::vector<float> gate(rows * hidden), up(rows * hidden);
  agentkv::rms_norm_rows(h.data(), in[kPostNorm].data<float>(), normed.data(), rows, model_dim,
                         p.eps);
  matmuls(p, in, 4, normed.data(), {gate.data(), up.data()}, rows);
  agentkv::silu_mul(gate.data(), up.data(), gate.data(), rows * hidden);
  matmuls(p, in, 6, gate.data(), {r.data()}, rows);
  add(h.data(), r.data(), y, rows * model_dim);
  for (int b : failed) {  // never a token from a row whose reads failed
    std::fill_n(y + static_cast<int64_t>(b) * length * model_dim, length * model_dim,
                std::numeric_limits<float>::quiet_NaN());
  }
}

class DecoderLayer : public mx::UnaryPrimitive {
 public:
  DecoderLayer(mx::Stream stream, LayerParams params)
      : mx::UnaryPrimitive(stream), params_(std::move(params)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = start_cpu_eval(stream(), inputs, out);
    encoder.dispatch([inputs, out, p = params_]() mutable { run(p, inputs, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("agentkv's decoder layer runs on the CPU only");
  }

  const char* name() const override {
    return "AgentKVDecoderLayer";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return params_ == static_cast<const DecoderLayer&>(other).params_;
  }

 private:
  LayerParams params_;
};

void require(bool condition, const char* message) {
  if (!condition) {
    throw std::invalid_argument(std::string("decoder_layer: ") + message);
  }
}

}  // namespace

mx::array decoder_layer(const mx::array& x, const std::vector<mx::array>& norms, float eps,
                        const std::vector<mx::array>& linears, const std::vector<int>& bits,
                        const std::vector<int>& groups, int heads, int kv_heads,
                        float attention_scale, int rope_dims, bool rope_traditional,
                        std::optional<float> rope_base, float rope_scale,
                        const std::optional<mx::array>& rope_freqs,
                        const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                        const mx::array& tail, const mx::array& tables, const mx::array& lengths,
                        const mx::array& tail_slots, const mx::array& rows,
                        const std::optional<mx::array>& tail_rows, int key_bits, int value_bits,
                        int group, int channel_tokens, int block_tokens, int window, bool rotate,
                        const std::vector<std::optional<mx::array>>& linear_biases,
                        const std::optional<std::vector<mx::array>>& qk_norms, float qk_eps,
                        const std::optional<mx::array>& positions,
                        const std::vector<std::shared_ptr<agentkv::KVSwapSet>>& swaps,
                        const std::vector<int>& swap_rows, int layer,
                        const std::vector<std::optional<mx::array>>& predict, int predict_bits,
                        int predict_group, const std::optional<mx::array>& key_plan,
                        const std::vector<int64_t>& key_counts,
                        const std::optional<mx::array>& prevs, bool swap_stream) {
  require(x.dtype() == mx::float32 && x.ndim() == 3, "x must be float32 [B, L, D]");
  const int batch = x.shape(0), length = x.shape(1), dim = x.shape(2);
  require(norms.size() == 2 && linears.size() == 3 * kLinears && bits.size() == kLinears &&
              groups.size() == kLinears,
          "two norms and seven quantized linears (q, k, v, o, gate, up, down) as packed codes, "
          "scales, biases");
  for (const auto& n : norms) {
    require(n.dtype() == mx::float32 && n.ndim() == 1 && n.shape(0) == dim,
            "norm weights must be float32 [D]");
  }
  require(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "bad head counts");
  for (int i = 0; i < kLinears; ++i) {
    const mx::array& w = linears[3 * i];
    require((bits[i] == 4 || bits[i] == 5 || bits[i] == 8) &&
                (groups[i] == 32 || groups[i] == 64 || groups[i] == 128) &&
                w.dtype() == mx::uint8 && w.ndim() == 2 &&
                w.shape(1) % (2 * bits[i] * groups[i]) == 0,
            "linears are 4/5/8-bit codes packed by agentkv.mlx_adapter.pack_quantized, groups "
            "32/64/128");
    require(packed_scales_fit(w, linears[3 * i + 1], linears[3 * i + 2], w.shape(1) / (2 * bits[i]),
                              groups[i]),
            "scales and biases must be float [N / 16, K / group, 16] or two-level uint8 "
            "[N / 16, K / 256, 160] (groups of 32)");
  }
  auto outputs = [&](int i) { return linears[3 * i].shape(0) * agentkv::kPackColumns; };
  auto inputs = [&](int i) { return static_cast<int>(linears[3 * i].shape(1) / (2 * bits[i])); };
  const int head_dim = outputs(0) / heads;
  const int hidden = outputs(4);
  require(outputs(0) == heads * head_dim && outputs(1) == kv_heads * head_dim &&
              outputs(2) == kv_heads * head_dim && outputs(3) == dim && outputs(5) == hidden &&
              outputs(6) == dim && inputs(0) == dim && inputs(1) == dim && inputs(2) == dim &&
              inputs(3) == heads * head_dim && inputs(4) == dim && inputs(5) == dim &&
              inputs(6) == hidden,
          "the linears' shapes do not make a Llama block");
  require(head_dim % 8 == 0 && head_dim <= 256 && (head_dim & (head_dim - 1)) == 0,
          "the head dim must be a power of two, at most 256");
  require(rope_dims > 0 && rope_dims % 2 == 0 && rope_dims <= head_dim,
          "rope dims must be even and at most the head dim");
  require(rope_base.has_value() != rope_freqs.has_value(), "rope takes a base or periods");
  require(!rope_freqs || (rope_freqs->ndim() == 1 && rope_freqs->shape(0) == rope_dims / 2),
          "rope periods must be [dims / 2]");
  require((key_bits == 2 || key_bits == 4 || key_bits == 8) &&
              (value_bits == 2 || value_bits == 4 || value_bits == 8) &&
              (group == 32 || group == 64 || group == 128) && head_dim % group == 0 &&
              (channel_tokens == 32 || channel_tokens == 64) && head_dim % channel_tokens == 0 &&
              block_tokens > 0 && block_tokens % channel_tokens == 0 && window >= 0,
          "the KV format must be per-channel keys (2/4/8 bits) and 2/4/8-bit values");
  require(keys.size() == 3 && values.size() == 3, "keys and values are words, scales, biases");
  const int64_t arena_rows = keys[0].ndim() == 2 ? keys[0].shape(0) : -1;
  const std::array<std::pair<const mx::array*, mx::Shape>, 6> parts = {{
      {&keys[0], {keys[0].shape(0), head_dim * key_bits / 32}},
      {&keys[1], {keys[0].shape(0), head_dim / channel_tokens}},
      {&keys[2], {keys[0].shape(0), head_dim / channel_tokens}},
      {&values[0], {keys[0].shape(0), head_dim * value_bits / 32}},
      {&values[1], {keys[0].shape(0), head_dim / group}},
      {&values[2], {keys[0].shape(0), head_dim / group}},
  }};
  for (const auto& [part, shape] : parts) {
    require(part->ndim() == 2 && part->shape() == shape && part->flags().row_contiguous &&
                (part == &keys[0] || part == &values[0] ? part->dtype() == mx::uint32
                                                        : part->dtype() == mx::float16),
            "the arena is row-contiguous uint32 words and float16 scales and biases");
  }
  require(arena_rows % (int64_t{kv_heads} * block_tokens) == 0,
          "the arena is [blocks * kv_heads * block_tokens, width]");
  require(tail.dtype() == mx::float16 && tail.ndim() == 2 && tail.shape(1) == head_dim &&
              tail.shape(0) % (int64_t{kv_heads} * channel_tokens) == 0 &&
              tail.flags().row_contiguous,
          "the tail is float16 [slots * kv_heads * channel_tokens, head dim]");
  const int writes = batch * kv_heads * length;
  auto int32_vector = [](const mx::array& a, int n) {
    return a.dtype() == mx::int32 && a.ndim() == 1 && a.shape(0) == n;
  };
  require(tables.dtype() == mx::int32 && tables.ndim() == 2 && tables.shape(0) == batch &&
              int32_vector(lengths, batch) && int32_vector(tail_slots, batch) &&
              int32_vector(rows, writes) && (!tail_rows || int32_vector(*tail_rows, writes)),
          "tables [B, blocks], lengths and tail_slots [B], rows and tail_rows [B * Hkv * L] "
          "must be int32");
  require(
      tail_rows.has_value() != key_plan.has_value() && key_plan.has_value() == prevs.has_value(),
      "the new keys go to tail_rows, or (a row completing a channel group) as key_plan "
      "says, with the prevs");
  if (key_plan) {
    require(key_counts.size() == 6 &&
                std::all_of(key_counts.begin(), key_counts.end(), [](int64_t c) { return c >= 0; }),
            "key_counts: six counts (direct, gathered, group, rest and prev rows, done_first)");
    // direct rows and their sources, gathered rows, then sources and rows of the others, then
    // each row's first completed group (B of them)
    const int64_t n = 2 * key_counts[0] + key_counts[1] +
                      2 * (key_counts[2] + key_counts[3] + key_counts[4]) + key_counts[5];
    require(key_counts[2] % channel_tokens == 0 && key_counts[5] == batch && n > 0 &&
                n < (int64_t{1} << 31) && int32_vector(*key_plan, static_cast<int>(n)),
            "key_plan: int32 direct rows and sources, gathered rows, group sources and rows, "
            "rest sources and rows, prev sources and rows, each row's first completed group, "
            "as many as key_counts says");
    require(prevs->dtype() == mx::float16 && prevs->shape() == tail.shape() &&
                prevs->flags().row_contiguous,
            "the prevs are float16, shaped as the tail");
  }

  require(linear_biases.size() == kLinears, "one bias or none for each of the seven linears");
  require(!qk_norms || (qk_norms->size() == 2 && (*qk_norms)[0].dtype() == mx::float32 &&
                        (*qk_norms)[1].dtype() == mx::float32 &&
                        (*qk_norms)[0].shape() == mx::Shape{head_dim} &&
                        (*qk_norms)[1].shape() == mx::Shape{head_dim}),
          "the q and k norms are two float32 [head dim] weights");
  for (int i = 0; i < kLinears; ++i) {
    const auto& b = linear_biases[i];
    require(!b || (b->dtype() == mx::float32 && b->ndim() == 1 && b->shape(0) == outputs(i)),
            "a linear's bias must be float32 [its outputs]");
  }

  require(!positions || (positions->dtype() == mx::int32 && positions->ndim() == 1 &&
                         positions->shape(0) == batch),
          "positions must be int32 [B]");
  require(swaps.size() == swap_rows.size() &&
              (swaps.empty() || ((length == 1 || swap_stream) && layer >= 0)),
          "swapped rows: one row per swap set, one new token a row, and the layer");
  require(!swap_stream ||
              (swaps.size() == 1 && batch == 1 && window == 0 && swaps[0]->staging().size() >= 2),
          "swap_stream: one swapped row alone (its prefill chunk), no sliding window, two "
          "staging blocks at least");
  for (size_t i = 0; i < swaps.size(); ++i) {
    require(swaps[i] && swap_rows[i] >= 0 && swap_rows[i] < batch, "a swapped row is bad");
  }

  require(predict.empty() || predict.size() == 6,
          "predict: the next layer's input norm, q "
          "words, scales, biases, q bias or None, q norm or None");
  if (!predict.empty()) {
    require(!swaps.empty(), "predict: only with swapped rows");
    require(predict[0] && predict[1] && predict[2] && predict[3], "predict: norm and q weights");
    require(predict[0]->dtype() == mx::float32 && predict[0]->shape() == mx::Shape{dim},
            "predict: the norm must be float32 [D]");
    const mx::array& w = *predict[1];
    require((predict_bits == 4 || predict_bits == 5 || predict_bits == 8) &&
                (predict_group == 32 || predict_group == 64 || predict_group == 128) &&
                dim % predict_group == 0 && w.dtype() == mx::uint8 && w.ndim() == 2 &&
                w.shape(0) * agentkv::kPackColumns == heads * head_dim &&
                w.shape(1) == 2 * predict_bits * dim,
            "predict: q must be packed 4/5/8-bit codes [heads * head dim / 16, D * 2 * bits] in "
            "groups of 32/64/128");
    const mx::Shape scale_shape = {w.shape(0), dim / predict_group, agentkv::kPackColumns};
    const mx::Dtype sdt = predict[2]->dtype();
    require(predict[2]->shape() == scale_shape && predict[3]->shape() == scale_shape &&
                predict[3]->dtype() == sdt &&
                (sdt == mx::float32 || sdt == mx::float16 || sdt == mx::bfloat16),
            "predict: q's scales and biases must be float [N / 16, D / group, 16]");
    require(!predict[4] || (predict[4]->dtype() == mx::float32 &&
                            predict[4]->shape() == mx::Shape{heads * head_dim}),
            "predict: q's bias must be float32 [heads * head dim]");
    require(predict[5].has_value() == qk_norms.has_value() &&
                (!predict[5] || (predict[5]->dtype() == mx::float32 &&
                                 predict[5]->shape() == mx::Shape{head_dim})),
            "predict: the q norm must be float32 [head dim], given where the model has q and "
            "k norms and only there");
  }

  LayerParams p;
  p.swap = SwapStep{swaps, swap_rows, layer, swap_stream};
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.attention_scale = attention_scale;
  p.eps = eps;
  p.rope_dims = rope_dims;
  p.rope_traditional = rope_traditional;
  p.rope_scale = rope_scale;
  if (rope_base) {
    p.inv_freq = rope_inverse_frequencies(*rope_base, rope_dims);
  }
  std::copy(bits.begin(), bits.end(), p.bits.begin());
  std::copy(groups.begin(), groups.end(), p.groups.begin());
  p.key_bits = key_bits;
  p.value_bits = value_bits;
  p.group = group;
  p.channel_tokens = channel_tokens;
  p.block_tokens = block_tokens;
  p.window = window;
  p.rotate = rotate;

  const mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> in = {packed(x, stream), packed(norms[0], stream),
                               packed(norms[1], stream)};
  for (const auto& l : linears) {
    in.push_back(packed(l, stream));
  }
  // The pool's arrays go in as they are: the operation writes the new rows into them in
  // place, as the pool's scatters and block I/O do (the pool holds their only reference).
  in.insert(in.end(), keys.begin(), keys.end());
  in.insert(in.end(), values.begin(), values.end());
  in.push_back(tail);
  for (const auto* a :
       {&tables, &lengths, &tail_slots, &rows, tail_rows ? &*tail_rows : &*key_plan}) {
    in.push_back(packed(*a, stream));
  }
  if (rope_freqs) {
    in.push_back(packed(mx::astype(*rope_freqs, mx::float32, stream), stream));
  }
  p.periods = rope_freqs.has_value();
  for (int i = 0; i < kLinears; ++i) {
    if (linear_biases[i]) {
      p.has_bias[i] = true;
      in.push_back(packed(*linear_biases[i], stream));
    }
  }
  if (qk_norms) {
    p.qk_norms = true;
    p.qk_eps = qk_eps;
    p.qk_norms_at = static_cast<int>(in.size());
    in.push_back(packed((*qk_norms)[0], stream));
    in.push_back(packed((*qk_norms)[1], stream));
  }
  if (positions) {
    p.positions_at = static_cast<int>(in.size());
    in.push_back(packed(*positions, stream));
  }
  if (!predict.empty()) {
    p.predict_at = static_cast<int>(in.size());
    p.predict_bits = predict_bits;
    p.predict_group = predict_group;
    for (int i = 0; i < 4; ++i) {
      in.push_back(packed(*predict[i], stream));
    }
    if (predict[4]) {
      p.predict_bias_at = static_cast<int>(in.size());
      in.push_back(packed(*predict[4], stream));
    }
    if (predict[5]) {
      p.predict_q_norm_at = static_cast<int>(in.size());
      in.push_back(packed(*predict[5], stream));
    }
  }
  if (prevs) {
    p.prevs_at = static_cast<int>(in.size());
    std::copy(key_counts.begin(), key_counts.end(), p.key_counts.begin());
    in.push_back(*prevs);  // written in place, as the tail
  }
  return mx::array({batch, length, dim}, mx::float32,
                   std::make_shared<DecoderLayer>(stream, std::move(p)), std::move(in));
}

}  // namespace agentkv::ops
