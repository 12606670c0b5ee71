#include "kernels_cpu.h"

#include <mlx/mlx.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/half.h"
#include "core/thread_pool.h"
#include "kernels/shim.h"
#include "simt.h"

namespace agentkv::kernels {
namespace {

// One grid point of each kernel: the kernel body, verbatim, as a function body.
// The chunk is the whole span (grid x = 1): each call copies whole planes.

// The helpers the paged attention bodies name, on the host (Metal and CUDA get theirs from
// kernels/metal.h and kernels/cuda.h). Each thread of a threadgroup is a coroutine that
// suspends at barriers and shuffles (simt.h), so the lanes run as a loop.
inline float kv_half(uint16_t h) {
  return half_to_float(h);
}
inline float kv_half_bits(unsigned int bits) {
  return half_to_float(static_cast<uint16_t>(bits));
}
inline float kv_float(float x) {
  return x;
}
inline float kv_exp(float x) {
  return std::exp(x);
}
inline float kv_max(float a, float b) {
  return a > b ? a : b;
}
inline float kv_tanh(float x) {
  return std::tanh(x);
}
inline float kv_cos(float x) {
  return std::cos(x);
}
inline float kv_sin(float x) {
  return std::sin(x);
}
inline float kv_rsqrt(float x) {
  return 1.0f / std::sqrt(x);
}
inline float kv_round(float x) {
  return std::round(x);
}
inline float kv_rint(float x) {
  return std::nearbyint(x);  // the default rounding: to nearest, ties to even
}
inline float kv_to_half(float x) {
  return half_to_float(float_to_half(x));
}
constexpr float KV_NEG_INF = -std::numeric_limits<float>::infinity();
#define KV_SHARED_ARRAY(type, name, count) type* name = kv_ctx.shared<type>(kv_shared, (count))
#define KV_BARRIER() \
  co_await simt::Barrier {}
#define KV_SHUFFLE_XOR(x, mask) (co_await simt::Shuffle<float>{(x), (mask)})
#define KV_RETURN co_return
#define KV_UNROLL

// One thread of pass 1 (kernels/paged_attention.metal), as a coroutine.
template <int NQ, int KL, int TG, int KU>
simt::Thread paged_attention_thread(simt::Group& kv_ctx, unsigned int kv_tid, uint3 kv_group,
                                    const float* q_in, const uint32_t* kw, const uint16_t* ks,
                                    const uint16_t* kb, const uint32_t* vw, const uint16_t* vs,
                                    const uint16_t* vb, const int* tables, const int* lengths,
                                    const int* dims, const float* sinks, const float* scale,
                                    const uint16_t* tail, const int* tail_slots,
                                    const uint16_t* done, const int* done_first, float* out,
                                    float* stats) {
  using T = float;
  int kv_shared = 0;
#include "kernels/paged_attention.metal"
}

// One thread of kernels/store_rows.metal, as a coroutine: T (the inputs) and H (its float16
// outputs) are float here; the caller rounds the float16 ones after.
template <int KL, int TG>
simt::Thread store_rows_thread(unsigned int kv_tid, uint3 kv_group, const float* k_in,
                               const float* v_in, const float* q_in, const int* dims,
                               const float* scale, const int* starts, const float* rope,
                               const float* norm, float* k_out, uint32_t* vw, float* vs, float* vb,
                               float* q_out) {
  using T = float;
  using H = float;
#include "kernels/store_rows.metal"
  co_return;
}

// One thread of kernels/dense_rows.metal, as a coroutine (its rotation shuffles); T is float
// here, and the caller rounds to the queries' type after (one rounding either way).
template <int TG>
simt::Thread dense_rows_thread(unsigned int kv_tid, uint3 kv_group, const uint32_t* kw,
                               const uint16_t* ks, const uint16_t* kb, const uint32_t* vw,
                               const uint16_t* vs, const uint16_t* vb, const uint16_t* tail,
                               const uint16_t* done, const int* src, const int* dims,
                               const float* scale, float* k_out, float* v_out) {
  using T = float;
#include "kernels/dense_rows.metal"
  co_return;
}

// One thread of kernels/quantize_groups.metal (a plain function); H is float here, and the
// caller stores its float16 values as float16 after (exactly: they are float16 already).
void quantize_groups_thread(unsigned int kv_tid, uint3 kv_group, const uint16_t* x, const int* dims,
                            uint32_t* words, float* scales, float* biases) {
  using H = float;
#include "kernels/quantize_groups.metal"
}

// One grid point of pass 2 (kernels/paged_attention_merge.metal).
void paged_attention_merge_point(const float* parts, const float* stats, const float* sinks,
                                 const int* dims, float* out, uint3 thread_position_in_grid) {
  using T = float;
#include "kernels/paged_attention_merge.metal"
}

#undef KV_SHARED_ARRAY
#undef KV_BARRIER
#undef KV_SHUFFLE_XOR
#undef KV_RETURN
#undef KV_UNROLL

template <typename T>
void merge_point(const T* const* srcs, const int* rows, const int* dims, T* out,
                 uint3 thread_position_in_grid) {
#include "kernels/merge.metal"
}

template <typename T>
void extract_point(const T* batch, const int* meta, const int* dims, T* out,
                   uint3 thread_position_in_grid) {
#include "kernels/extract.metal"
}

constexpr int kWholeSpan = 1 << 30;

void check_units(const mx::array& a, const char* what) {
  if (a.dtype() != mx::uint16 && a.dtype() != mx::uint32) {
    throw std::invalid_argument(std::string(what) + " must be viewed as uint16 or uint32 units");
  }
}

mx::array new_array(mx::Shape shape, mx::Dtype dtype) {
  size_t n = 1;
  for (int d : shape) {
    n *= static_cast<size_t>(d);
  }
  return mx::array(mx::allocator::malloc(n * dtype.size()), std::move(shape), dtype);
}

// Run the grid columns on the shared pool (persistent threads: these kernels run
// once per layer of every batch change, too often to spawn threads each time).
void run_columns(size_t n, int threads, const std::function<void(size_t)>& f) {
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  ThreadPool::shared().run(n, f);
}

// A unit of work: one (output, y, z) grid column.
struct Column {
  int output;
  unsigned int y;
  unsigned int z;
};

}  // namespace

namespace {

// The pointers one pass-1 threadgroup reads and writes.
struct PagedArgs {
  const float* q;
  const uint32_t* kw;
  const uint16_t* ks;
  const uint16_t* kb;
  const uint32_t* vw;
  const uint16_t* vs;
  const uint16_t* vb;
  const int* tables;
  const int* lengths;
  const int* dims;
  const float* sinks;
  const float* scale;
  const uint16_t* tail;
  const int* tail_slots;
  const uint16_t* done;
  const int* done_first;
  float* out;
  float* stats;
};

constexpr int kThreadgroup = 128;  // kernels/gpu.py's THREADGROUP for paged attention

template <int NQ, int KL, int KU>
void run_paged_group(const PagedArgs& a, uint3 group) {
  simt::Group g;
  g.run(kThreadgroup, [&](int t) {
    return paged_attention_thread<NQ, KL, kThreadgroup, KU>(
        g, static_cast<unsigned>(t), group, a.q, a.kw, a.ks, a.kb, a.vw, a.vs, a.vb, a.tables,
        a.lengths, a.dims, a.sinks, a.scale, a.tail, a.tail_slots, a.done, a.done_first, a.out,
        a.stats);
  });
}

template <int NQ, int KL>
void run_paged_group(const PagedArgs& a, uint3 group, int keys_in_flight) {
  switch (keys_in_flight) {
    case 1:
      return run_paged_group<NQ, KL, 1>(a, group);
    case 2:
      return run_paged_group<NQ, KL, 2>(a, group);
    default:
      return run_paged_group<NQ, KL, 4>(a, group);
  }
}

template <int NQ>
void run_paged_group(const PagedArgs& a, uint3 group, int lanes_per_key, int keys_in_flight) {
  switch (lanes_per_key) {
    case 4:
      return run_paged_group<NQ, 4>(a, group, keys_in_flight);
    case 8:
      return run_paged_group<NQ, 8>(a, group, keys_in_flight);
    case 16:
      return run_paged_group<NQ, 16>(a, group, keys_in_flight);
    default:
      return run_paged_group<NQ, 32>(a, group, keys_in_flight);
  }
}

void run_paged_group(const PagedArgs& a, uint3 group, int vectors, int lanes_per_key,
                     int keys_in_flight) {
  switch (vectors) {
    case 1:
      return run_paged_group<1>(a, group, lanes_per_key, keys_in_flight);
    case 2:
      return run_paged_group<2>(a, group, lanes_per_key, keys_in_flight);
    case 4:
      return run_paged_group<4>(a, group, lanes_per_key, keys_in_flight);
    default:
      return run_paged_group<8>(a, group, lanes_per_key, keys_in_flight);
  }
}

struct StoreArgs {
  const float* k;
  const float* v;
  const float* q;
  const int* dims;
  const float* scale;
  const int* starts;
  const float* rope;
  const float* norm;
  float* k_out;
  uint32_t* vw;
  float* vs;
  float* vb;
  float* q_out;
};

template <int KL>
void run_store_group(const StoreArgs& a, unsigned int group) {
  simt::Group g;
  g.run(kThreadgroup, [&](int t) {
    return store_rows_thread<KL, kThreadgroup>(static_cast<unsigned>(t), uint3{group, 0, 0}, a.k,
                                               a.v, a.q, a.dims, a.scale, a.starts, a.rope, a.norm,
                                               a.k_out, a.vw, a.vs, a.vb, a.q_out);
  });
}

bool power_of_two_in(int x, int lo, int hi) {
  return x >= lo && x <= hi && (x & (x - 1)) == 0;
}

}  // namespace

mx::array paged_attention(const mx::array& q_in, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const mx::array& tables_in,
                          const mx::array& lengths_in, const std::array<int, 17>& dims,
                          const std::optional<mx::array>& sinks_in, float scale_value, int threads,
                          const std::optional<mx::array>& tail_in,
                          const std::optional<mx::array>& tail_slots_in, int vectors,
                          int lanes_per_key, const std::optional<mx::array>& done_in,
                          const std::optional<mx::array>& done_first_in, float softcap,
                          int keys_in_flight) {
  if (keys.size() != 3 || values.size() != 3) {
    throw std::invalid_argument("paged attention: keys and values are words, scales, biases");
  }
  const auto [n_rows, q_heads, kv_heads, n_queries, dim, dim_v, width, block_tokens, kbits, vbits,
              group, window, has_sinks, channel_tokens, splits, split_keys, rotate] = dims;
  auto supported = [](int bits) { return bits == 2 || bits == 4 || bits == 8 || bits == 16; };
  auto grouped = [&](int bits, int d) { return bits == 16 || (group >= 1 && d % group == 0); };
  if (n_rows < 1 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads || n_queries < 1 || dim < 1 ||
      dim_v < 1 || block_tokens < 1 || !supported(kbits) || !supported(vbits) ||
      !grouped(kbits, dim) || !grouped(vbits, dim_v) || dim * kbits % 32 || dim_v * vbits % 32 ||
      window < 0 || has_sinks != (sinks_in ? 1 : 0) || splits < 1 || split_keys < 1 ||
      !power_of_two_in(vectors, 1, 8) || !power_of_two_in(lanes_per_key, 4, 32) ||
      !power_of_two_in(keys_in_flight, 1, 4) || (dim + lanes_per_key - 1) / lanes_per_key > 8 ||
      (dim_v + lanes_per_key - 1) / lanes_per_key > 8 || (rotate != 0 && rotate != 1) ||
      (rotate && (dim != dim_v || dim != 8 * lanes_per_key)) ||
      (channel_tokens != 0 && (channel_tokens < 8 || kbits == 16 || dim % channel_tokens ||
                               block_tokens % channel_tokens || !tail_in || !tail_slots_in))) {
    throw std::invalid_argument("paged attention: bad dims");
  }
  mx::array q = mx::contiguous(mx::astype(q_in, mx::float32));
  mx::array tables = mx::contiguous(mx::astype(tables_in, mx::int32));
  mx::array lengths = mx::contiguous(mx::astype(lengths_in, mx::int32));
  mx::array sinks = sinks_in ? mx::contiguous(mx::astype(*sinks_in, mx::float32))
                             : mx::zeros({q_heads}, mx::float32);
  std::vector<mx::array> parts;
  for (const auto* list : {&keys, &values}) {
    for (size_t i = 0; i < 3; ++i) {
      parts.push_back(mx::contiguous(mx::view((*list)[i], i == 0 ? mx::uint32 : mx::uint16)));
    }
  }
  mx::array tail =
      tail_in ? mx::contiguous(mx::view(*tail_in, mx::uint16)) : mx::zeros({1}, mx::uint16);
  mx::array tail_slots = tail_slots_in ? mx::contiguous(mx::astype(*tail_slots_in, mx::int32))
                                       : mx::zeros({n_rows}, mx::int32);
  mx::array done =
      done_in ? mx::contiguous(mx::view(*done_in, mx::uint16)) : mx::zeros({1}, mx::uint16);
  mx::array done_first = done_first_in ? mx::contiguous(mx::astype(*done_first_in, mx::int32))
                                       : mx::full({n_rows}, -1, mx::int32);
  std::vector<mx::array> to_eval = {q, tables, lengths, sinks, tail, tail_slots, done, done_first};
  to_eval.insert(to_eval.end(), parts.begin(), parts.end());
  mx::eval(to_eval);
  if (q.size() != static_cast<size_t>(n_rows) * q_heads * n_queries * dim ||
      tables.size() != static_cast<size_t>(n_rows) * width ||
      lengths.size() != static_cast<size_t>(n_rows)) {
    throw std::invalid_argument("paged attention: queries, tables or lengths do not match dims");
  }
  const uint64_t rows = parts[0].size() / (dim * kbits / 32);
  const int* tbl = tables.data<int>();
  const int* len = lengths.data<int>();
  if (channel_tokens > 0) {
    const int64_t slots = tail.size() / (int64_t{kv_heads} * channel_tokens * dim);
    for (int b = 0; b < n_rows; ++b) {
      const int slot = tail_slots.data<int>()[b];
      if (tail_slots.size() != static_cast<size_t>(n_rows) || slot < 0 || slot >= slots) {
        throw std::invalid_argument("paged attention: a tail slot outside the tails");
      }
    }
  }
  if (done_first.size() != static_cast<size_t>(n_rows)) {
    throw std::invalid_argument("paged attention: done_first must have one entry a row");
  }
  for (int b = 0; b < n_rows && channel_tokens > 0; ++b) {  // a row's completed groups
    const int first = done_first.data<int>()[b];
    const int groups = len[b] / channel_tokens - (len[b] - n_queries) / channel_tokens;
    const int64_t end = (int64_t{first} + int64_t{groups} * kv_heads) * channel_tokens * dim;
    if (first >= 0 && (!done_in || end > static_cast<int64_t>(done.size()))) {
      throw std::invalid_argument("paged attention: row " + std::to_string(b) +
                                  "'s completed groups lie outside `done`");
    }
  }
  for (int b = 0; b < n_rows; ++b) {  // every block a query can read must lie in the arenas
    if (len[b] < n_queries || (len[b] + block_tokens - 1) / block_tokens > width) {
      throw std::invalid_argument("paged attention: row " + std::to_string(b) + " is too long");
    }
    for (int i = 0; i * block_tokens < len[b]; ++i) {
      const int block = tbl[b * width + i];
      const bool read = window == 0 || (i + 1) * block_tokens > len[b] - n_queries - window + 1;
      if (read &&
          (block < 0 || (static_cast<uint64_t>(block) + 1) * kv_heads * block_tokens > rows)) {
        throw std::invalid_argument("paged attention: row " + std::to_string(b) +
                                    " names a block outside the arenas");
      }
    }
  }
  const int rep = q_heads / kv_heads;
  const int tiles = (n_queries * rep + vectors - 1) / vectors;
  const size_t outputs = static_cast<size_t>(n_rows) * q_heads * n_queries;
  mx::array out = new_array({n_rows, q_heads, n_queries, dim_v}, mx::float32);
  mx::array parts_out =
      splits > 1 ? new_array({static_cast<int>(outputs), splits, dim_v}, mx::float32) : out;
  mx::array stats = new_array({static_cast<int>(outputs), splits, 2}, mx::float32);
  // rotate: 1 / sqrt(D) of the queries' rotation folded into their scale, then the output's
  const float scale[3] = {rotate ? scale_value / std::sqrt(static_cast<float>(dim)) : scale_value,
                          rotate ? 1.0f / std::sqrt(static_cast<float>(dim_v)) : 1.0f, softcap};
  const PagedArgs args{q.data<float>(),
                       parts[0].data<uint32_t>(),
                       parts[1].data<uint16_t>(),
                       parts[2].data<uint16_t>(),
                       parts[3].data<uint32_t>(),
                       parts[4].data<uint16_t>(),
                       parts[5].data<uint16_t>(),
                       tbl,
                       len,
                       dims.data(),
                       sinks.data<float>(),
                       scale,
                       tail.data<uint16_t>(),
                       tail_slots.data<int>(),
                       done.data<uint16_t>(),
                       done_first.data<int>(),
                       parts_out.data<float>(),
                       stats.data<float>()};
  const int across = splits * tiles;
  run_columns(static_cast<size_t>(across) * kv_heads * n_rows, threads, [&](size_t k) {
    const uint3 group{static_cast<unsigned>(k % across),
                      static_cast<unsigned>(k / across % kv_heads),
                      static_cast<unsigned>(k / across / kv_heads)};
    run_paged_group(args, group, vectors, lanes_per_key, keys_in_flight);
  });
  if (splits > 1) {
    const int merge_dims[6] = {n_rows, q_heads, n_queries, dim_v, splits, has_sinks};
    run_columns(static_cast<size_t>(n_rows) * q_heads * n_queries, threads, [&](size_t k) {
      for (int d = 0; d < dim_v; ++d) {
        const uint3 point{static_cast<unsigned>(d),
                          static_cast<unsigned>(k % (q_heads * n_queries)),
                          static_cast<unsigned>(k / (q_heads * n_queries))};
        paged_attention_merge_point(parts_out.data<float>(), stats.data<float>(),
                                    sinks.data<float>(), merge_dims, out.data<float>(), point);
      }
    });
  }
  return out;
}

namespace {

// The last element a row of `heads` heads reads, at b * sb + h * sh + t * st + off + D - 1.
int64_t last_read(int batch, int heads, int seq, const int* layout, int off, int dim) {
  return static_cast<int64_t>(batch - 1) * layout[0] + static_cast<int64_t>(heads - 1) * layout[1] +
         static_cast<int64_t>(seq - 1) * layout[2] + off + dim - 1;
}

}  // namespace

std::vector<mx::array> store_rows(const mx::array& keys_in, const mx::array& values_in,
                                  const mx::array& queries_in, const std::vector<int>& d,
                                  const mx::array& starts_in, const mx::array& rope_in,
                                  const mx::array& norm_in, float eps, int threads) {
  if (d.size() != 19) {
    throw std::invalid_argument("store rows: dims holds 19 ints");
  }
  const int n = d[0], dim = d[1], value_bits = d[2], group = d[3], nq = d[4], seq = d[5],
            kv_heads = d[6], q_heads = d[7], rope_mode = d[17], norm_mode = d[18];
  const int kl = dim / 8;
  if (dim % 8 || !power_of_two_in(kl, 4, 32) ||
      (value_bits != 2 && value_bits != 4 && value_bits != 8) || group < 8 || group % 8 ||
      dim % group || n < 1 || seq < 1 || kv_heads < 1 || n % (seq * kv_heads) || nq < 0 ||
      rope_mode < 0 || rope_mode > 2 || norm_mode < 0 || norm_mode > 1 ||
      (norm_mode && !rope_mode)) {
    throw std::invalid_argument("store rows: bad dims");
  }
  const int batch = n / (seq * kv_heads);
  if (nq && (q_heads < 1 || nq != batch * q_heads * seq)) {
    throw std::invalid_argument("store rows: the queries' rows do not match the keys'");
  }
  for (int i = 8; i < 17; ++i) {
    if (d[i] < 0) {
      throw std::invalid_argument("store rows: a negative stride or offset");
    }
  }
  if (last_read(batch, kv_heads, seq, &d[8], d[11], dim) >= static_cast<int64_t>(keys_in.size()) ||
      last_read(batch, kv_heads, seq, &d[8], d[12], dim) >=
          static_cast<int64_t>(values_in.size()) ||
      (nq && last_read(batch, q_heads, seq, &d[13], d[16], dim) >=
                 static_cast<int64_t>(queries_in.size()))) {
    throw std::invalid_argument("store rows: a row lies outside its array");
  }
  if (rope_mode && (static_cast<int>(starts_in.size()) < batch ||
                    static_cast<int>(rope_in.size()) < dim / 2 + 1)) {
    throw std::invalid_argument("store rows: RoPE needs each row's start and D / 2 + 1 floats");
  }
  if (norm_mode && (static_cast<int>(norm_in.size()) < 2 * dim || !(eps > 0.0f))) {
    throw std::invalid_argument("store rows: the norm needs 2 D weights and an epsilon > 0");
  }
  mx::array k = mx::contiguous(mx::astype(mx::flatten(keys_in), mx::float32));
  mx::array v = mx::contiguous(mx::astype(mx::flatten(values_in), mx::float32));
  mx::array q = mx::contiguous(mx::astype(mx::flatten(queries_in), mx::float32));
  mx::array starts = mx::contiguous(mx::astype(mx::flatten(starts_in), mx::int32));
  mx::array rope = mx::contiguous(mx::astype(mx::flatten(rope_in), mx::float32));
  mx::array norm = mx::contiguous(mx::astype(mx::flatten(norm_in), mx::float32));
  mx::eval({k, v, q, starts, rope, norm});
  mx::array k_out = new_array({n, dim}, mx::float32);
  mx::array vw = new_array({n, dim * value_bits / 32}, mx::uint32);
  mx::array vs = new_array({n, dim / group}, mx::float32);
  mx::array vb = new_array({n, dim / group}, mx::float32);
  mx::array q_out = new_array({std::max(nq, 1), dim}, mx::float32);
  const float scale[2] = {1.0f / std::sqrt(static_cast<float>(dim)), eps};
  StoreArgs args{k.data<float>(),
                 v.data<float>(),
                 q.data<float>(),
                 d.data(),
                 scale,
                 starts.data<int>(),
                 rope.data<float>(),
                 norm.data<float>(),
                 k_out.data<float>(),
                 vw.data<uint32_t>(),
                 vs.data<float>(),
                 vb.data<float>(),
                 q_out.data<float>()};
  const int rows_a_group = kThreadgroup / kl;
  const size_t groups = static_cast<size_t>((n + nq + rows_a_group - 1) / rows_a_group);
  run_columns(groups, threads, [&](size_t i) {
    const auto g = static_cast<unsigned>(i);
    switch (kl) {
      case 4:
        return run_store_group<4>(args, g);
      case 8:
        return run_store_group<8>(args, g);
      case 16:
        return run_store_group<16>(args, g);
      default:
        return run_store_group<32>(args, g);
    }
  });
  return {mx::astype(k_out, mx::float16), vw, mx::astype(vs, mx::float16),
          mx::astype(vb, mx::float16), q_out};
}

std::vector<mx::array> dense_rows(const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values, const mx::array& tail_in,
                                  const mx::array& done_in, const mx::array& src_in,
                                  const std::array<int, 8>& dims, float scale, int threads) {
  if (keys.size() != 3 || values.size() != 3) {
    throw std::invalid_argument("dense rows: keys and values are words, scales, biases");
  }
  const auto [dim, dim_v, kbits, vbits, group, channel_tokens, units, rotate] = dims;
  auto supported = [](int bits) { return bits == 2 || bits == 4 || bits == 8 || bits == 16; };
  auto grouped = [&](int bits, int d) { return bits == 16 || (group >= 8 && d % group == 0); };
  if (dim < 8 || dim % 8 || dim_v < 8 || dim_v % 8 || !supported(kbits) || !supported(vbits) ||
      !grouped(vbits, dim_v) ||
      (channel_tokens == 0 ? !grouped(kbits, dim) : kbits == 16 || dim % channel_tokens) ||
      (group % 8 && (kbits != 16 || vbits != 16)) || units != std::max(dim, dim_v) / 8 ||
      (rotate != 0 && (rotate != 1 || dim != dim_v || !power_of_two_in(dim, 32, 256)))) {
    throw std::invalid_argument("dense rows: bad dims");
  }
  std::vector<mx::array> parts;
  for (const auto* list : {&keys, &values}) {
    for (size_t i = 0; i < 3; ++i) {
      parts.push_back(mx::contiguous(mx::view((*list)[i], i == 0 ? mx::uint32 : mx::uint16)));
    }
  }
  mx::array tail = mx::contiguous(mx::view(tail_in, mx::uint16));
  mx::array done = mx::contiguous(mx::view(done_in, mx::uint16));
  mx::array src = mx::contiguous(mx::astype(src_in, mx::int32));
  std::vector<mx::array> to_eval = {tail, done, src};
  to_eval.insert(to_eval.end(), parts.begin(), parts.end());
  mx::eval(to_eval);
  const int n = src.size() >= 3 ? src.data<int>()[0] : -1;
  if (n < 0 || src.size() != 3 + static_cast<size_t>(n) * 3) {
    throw std::invalid_argument("dense rows: src must hold its count, then 3 ints a row");
  }
  const uint64_t key_rows = parts[0].size() / (dim * kbits / 32);
  const uint64_t value_rows = parts[3].size() / (dim_v * vbits / 32);
  const int* s = src.data<int>() + 3;
  for (int i = 0; i < n; ++i) {  // every row a thread reads lies in its array
    const int kind = s[3 * i];
    const int64_t krow = s[3 * i + 1];
    const int64_t vrow = s[3 * i + 2];
    const uint64_t limit = kind == 0   ? key_rows
                           : kind == 1 ? tail.size() / dim
                           : kind == 2 ? done.size() / dim
                                       : 0;
    if (krow < 0 || static_cast<uint64_t>(krow) >= limit || vrow < 0 ||
        static_cast<uint64_t>(vrow) >= value_rows) {
      throw std::invalid_argument("dense rows: output row " + std::to_string(i) +
                                  " names a row outside its array");
    }
  }
  mx::array k_out = new_array({n, dim}, mx::float32);
  mx::array v_out = new_array({n, dim_v}, mx::float32);
  const size_t groups = (static_cast<size_t>(n) * units + kThreadgroup - 1) / kThreadgroup;
  const float scale_in[1] = {scale};
  run_columns(groups, threads, [&](size_t g) {
    simt::Group group_run;
    group_run.run(kThreadgroup, [&](int t) {
      return dense_rows_thread<kThreadgroup>(
          static_cast<unsigned>(t), uint3{static_cast<unsigned>(g), 0, 0},
          parts[0].data<uint32_t>(), parts[1].data<uint16_t>(), parts[2].data<uint16_t>(),
          parts[3].data<uint32_t>(), parts[4].data<uint16_t>(), parts[5].data<uint16_t>(),
          tail.data<uint16_t>(), done.data<uint16_t>(), src.data<int>(), dims.data(), scale_in,
          k_out.data<float>(), v_out.data<float>());
    });
  });
  return {k_out, v_out};
}

std::vector<mx::array> quantize_groups(const mx::array& x_in, int bits, int channel_tokens) {
  if (x_in.ndim() < 2) {
    throw std::invalid_argument("quantize groups: rows [..., D] expected");
  }
  const int dim = x_in.shape(-1);
  const int64_t rows = static_cast<int64_t>(x_in.size() / dim);
  if ((bits != 2 && bits != 4 && bits != 8) || channel_tokens < 1 || dim % channel_tokens ||
      dim * bits % 32 || rows % channel_tokens) {
    throw std::invalid_argument("quantize groups: bad dims");
  }
  mx::array x = mx::contiguous(mx::view(mx::astype(x_in, mx::float16), mx::uint16));
  mx::eval(x);
  const int groups = static_cast<int>(rows / channel_tokens);
  const int row_words = dim * bits / 32;
  mx::array words = new_array({static_cast<int>(rows), row_words}, mx::uint32);
  mx::array scales = new_array({static_cast<int>(rows), dim / channel_tokens}, mx::float32);
  mx::array biases = new_array({static_cast<int>(rows), dim / channel_tokens}, mx::float32);
  const int dims[3] = {dim, bits, channel_tokens};
  for (int g = 0; g < groups; ++g) {
    for (int t = 0; t < row_words; ++t) {
      quantize_groups_thread(static_cast<unsigned>(t), uint3{static_cast<unsigned>(g), 0, 0},
                             x.data<uint16_t>(), dims, words.data<uint32_t>(), scales.data<float>(),
                             biases.data<float>());
    }
  }
  return {words, mx::astype(scales, mx::float16), mx::astype(biases, mx::float16)};
}

std::vector<mx::array> merge(const std::vector<std::vector<mx::array>>& sources_in,
                             const mx::array& rows_in, const std::vector<std::array<int, 5>>& dims,
                             int threads) {
  if (sources_in.size() != dims.size()) {
    throw std::invalid_argument("need one dims entry per output");
  }
  mx::array rows = mx::contiguous(mx::astype(rows_in, mx::int32));
  std::vector<std::vector<mx::array>> sources;
  std::vector<mx::array> to_eval{rows};
  for (const auto& list : sources_in) {
    std::vector<mx::array> contiguous;
    for (const auto& a : list) {
      check_units(a, "merge sources");
      contiguous.push_back(mx::contiguous(a));
      to_eval.push_back(contiguous.back());
    }
    sources.push_back(std::move(contiguous));
  }
  mx::eval(to_eval);
  if (rows.ndim() != 2 || rows.shape(1) != 5) {
    throw std::invalid_argument("rows must be int32 [n_rows, 5]");
  }
  const int n_rows = rows.shape(0);
  const int* row_data = rows.data<int>();
  std::vector<std::array<int, 5>> params = dims;
  std::vector<mx::array> outputs;
  std::vector<std::vector<const void*>> pointers(sources.size());
  std::vector<Column> columns;
  for (size_t k = 0; k < sources.size(); ++k) {
    auto& d = params[k];
    d[4] = kWholeSpan;
    if (sources[k].empty()) {
      throw std::invalid_argument("merge needs at least one source per output");
    }
    const mx::Dtype dtype = sources[k][0].dtype();
    for (const auto& a : sources[k]) {
      if (a.dtype() != dtype) {
        throw std::invalid_argument("merge sources of one output must share a dtype");
      }
      pointers[k].push_back(a.data<void>());
    }
    for (int r = 0; r < n_rows; ++r) {
      const int* row = row_data + 5 * r;
      const int source = row[0];
      const bool known = source >= 0 && source < static_cast<int>(sources[k].size());
      const mx::array* a = known ? &sources[k][source] : nullptr;
      const bool fits = known && a->ndim() == 4 && a->shape(1) == d[0] && a->shape(3) == d[1] &&
                        a->shape(2) == row[4] && row[1] >= 0 && row[1] < a->shape(0) &&
                        row[2] >= 0 && row[3] >= 0 && row[2] + row[3] <= row[4] && row[3] <= d[2] &&
                        d[2] <= d[3];
      if (!fits) {
        throw std::invalid_argument("merge row " + std::to_string(r) + " does not fit its source");
      }
    }
    outputs.push_back(new_array({n_rows, d[0], d[3], d[1]}, dtype));
    for (int r = 0; r < n_rows; ++r) {
      for (int h = 0; h < d[0]; ++h) {
        columns.push_back(
            {static_cast<int>(k), static_cast<unsigned>(r), static_cast<unsigned>(h)});
      }
    }
  }
  run_columns(columns.size(), threads, [&](size_t i) {
    const Column& c = columns[i];
    const uint3 point{0, c.y, c.z};
    const auto& ptrs = pointers[c.output];
    if (outputs[c.output].dtype() == mx::uint16) {
      merge_point(reinterpret_cast<const uint16_t* const*>(ptrs.data()), row_data,
                  params[c.output].data(), outputs[c.output].data<uint16_t>(), point);
    } else {
      merge_point(reinterpret_cast<const uint32_t* const*>(ptrs.data()), row_data,
                  params[c.output].data(), outputs[c.output].data<uint32_t>(), point);
    }
  });
  return outputs;
}

std::vector<mx::array> extract(const std::vector<mx::array>& batches_in,
                               const std::vector<std::array<int, 7>>& metas, int threads) {
  if (batches_in.size() != metas.size()) {
    throw std::invalid_argument("need one meta entry per batch array");
  }
  std::vector<mx::array> batches;
  for (const auto& a : batches_in) {
    check_units(a, "batch");
    batches.push_back(mx::contiguous(a));
  }
  mx::eval(batches);
  std::vector<mx::array> outputs;
  std::vector<Column> columns;
  const int chunk[1] = {kWholeSpan};
  for (size_t k = 0; k < metas.size(); ++k) {
    const auto& m = metas[k];
    const auto& b = batches[k];
    if (b.ndim() != 4 || m[0] < 0 || m[0] >= b.shape(0) || m[3] != b.shape(1) ||
        m[4] != b.shape(3) || m[5] != b.shape(2) || m[1] + m[2] > m[5] || m[2] > m[6]) {
      throw std::invalid_argument("extract " + std::to_string(k) + " does not fit its batch");
    }
    outputs.push_back(new_array({1, m[3], m[6], m[4]}, b.dtype()));
    for (int h = 0; h < m[3]; ++h) {
      columns.push_back({static_cast<int>(k), 0, static_cast<unsigned>(h)});
    }
  }
  run_columns(columns.size(), threads, [&](size_t i) {
    const Column& c = columns[i];
    const uint3 point{0, 0, c.z};
    if (outputs[c.output].dtype() == mx::uint16) {
      extract_point(batches[c.output].data<uint16_t>(), metas[c.output].data(), chunk,
                    outputs[c.output].data<uint16_t>(), point);
    } else {
      extract_point(batches[c.output].data<uint32_t>(), metas[c.output].data(), chunk,
                    outputs[c.output].data<uint32_t>(), point);
    }
  });
  return outputs;
}

}  // namespace agentkv::kernels
