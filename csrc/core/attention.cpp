#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "half.h"
#include "lanes.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AGENTKV_ATTENTION_X86 1
#endif

namespace agentkv {
namespace {

constexpr int kTile = 64;     // tokens per tile
constexpr int kMaxDim = 256;  // largest head dimension
constexpr int kQueryBlock = 32;
// Keys per chunk: each query's range is cut into chunks of this many keys from its start,
// each chunk runs its own online softmax and the chunks merge in order (flash-decoding's
// split, fixed so the result never depends on the batch or the threads). Chunks of one
// query may run on different threads when there are too few tasks to fill the pool (one
// agent decoding: one task per KV head).
constexpr int kChunk = 512;

// The fused attention's own lane operations on top of lanes.h's: unpacking quantized words.
struct Portable : lanes::Portable {
  static V unpack(const uint32_t* packed, int shift, uint32_t mask) {
    V v;
    for (int r = 0; r < 8; ++r) {
      v.x[r] = static_cast<float>((packed[r] >> shift) & mask);
    }
    return v;
  }
  // Word w of rows idx[0..8) (starting at words + w_off[idx[r]]) -> cols[w * 8 + r].
  static void columns(const uint32_t* words, const int64_t* w_off, const int* idx, int width,
                      uint32_t* cols) {
    for (int w = 0; w < width; ++w) {
      for (int r = 0; r < 8; ++r) {
        cols[w * 8 + r] = words[w_off[idx[r]] + w];
      }
    }
  }
  static V unpack_row(const uint32_t* words, int d, int per_word, int bits) {
    V v;
    const uint32_t mask = (1u << bits) - 1;
    for (int e = 0; e < 8; ++e) {
      const int idx = d + e;
      v.x[e] = static_cast<float>((words[idx / per_word] >> ((idx % per_word) * bits)) & mask);
    }
    return v;
  }
};

// Where rows [t0, t1) of batch row b, KV head h start: element offsets into the words (or
// halves) and into the scales and biases of `view`.
void tile_rows(const AttentionArgs& a, const KVView& view, int b, int h, int t0, int t1, int64_t* w,
               int64_t* s) {
  if (a.tables != nullptr) {
    const int32_t* table = a.tables + static_cast<int64_t>(b) * a.table_stride;
    const int64_t w_width = view.bits == 16 ? view.dim : view.dim * view.bits / 32;
    const int ct = view.channel_tokens;
    const int64_t s_width = view.bits == 16 ? 0 : view.dim / (ct > 0 ? ct : view.group);
    // Divisions once per tile (a division costs as much as the rest of a row's offsets):
    // the token's block, its place in it and in its channel group, then counted forward.
    const int bt = a.block_tokens;
    int block = t0 / bt, at = t0 % bt, in_group = ct > 0 ? t0 % ct : 0;
    int64_t first = (static_cast<int64_t>(table[block]) * a.kv_heads + h) * bt;
    for (int t = t0; t < t1; ++t) {
      const int64_t row = first + at;
      w[t - t0] = row * w_width;
      // Per-channel: the scales of the token's channel group start at the group's first row.
      s[t - t0] = (row - in_group) * s_width;
      if (ct > 0 && ++in_group == ct) {
        in_group = 0;
      }
      if (++at == bt && t + 1 < t1) {
        at = 0;
        first = (static_cast<int64_t>(table[++block]) * a.kv_heads + h) * bt;
      }
    }
    return;
  }
  const int64_t w0 = b * view.w_strides[0] + h * view.w_strides[1];
  const int64_t s0 = b * view.s_strides[0] + h * view.s_strides[1];
  const int ct = view.channel_tokens;
  const int pad = a.left_padding ? a.left_padding[b] : 0;  // groups start at the row's token 0
  for (int t = t0; t < t1; ++t) {
    w[t - t0] = w0 + t * view.w_strides[2];
    s[t - t0] = s0 + (ct > 0 ? pad + (t - pad) / ct * ct : t) * view.s_strides[2];
  }
}

// Per-channel keys: where rows [t0, t1) of batch row b, KV head h lie in the float16 tail
// (-1: a whole group, in the arena or cache). Contiguous caches: row b's tail is slot b.
void tail_rows(const AttentionArgs& a, int b, int h, int t0, int t1, int64_t* out) {
  const int ct = a.k.channel_tokens;
  const int pad = a.left_padding ? a.left_padding[b] : 0;
  const int len = a.lengths ? a.lengths[b] : a.keys;
  const int complete = pad + (len - pad) / ct * ct;
  const int slot = a.tail_slots ? a.tail_slots[b] : b;
  const int64_t base = (static_cast<int64_t>(slot) * a.kv_heads + h) * ct;
  for (int t = t0; t < t1; ++t) {
    out[t - t0] = t >= complete ? (base + t - complete) * a.k.dim : -1;
  }
}

namespace portable {
using Ops = Portable;
#include "attention_impl.inc"
}  // namespace portable

#if defined(AGENTKV_ATTENTION_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

struct Avx2 : lanes::Avx2 {
  static V unpack(const uint32_t* packed, int shift, uint32_t mask) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
    const __m256i v =
        _mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(static_cast<int>(mask)));
    return _mm256_cvtepi32_ps(v);
  }
  // As Portable::columns; 8 rows one after another (a tile inside a block) are loaded whole
  // and transposed 8 words at a time.
  static void columns(const uint32_t* words, const int64_t* w_off, const int* idx, int width,
                      uint32_t* cols) {
    bool adjacent = width % 8 == 0;
    for (int r = 1; r < 8 && adjacent; ++r) {
      adjacent = w_off[idx[r]] == w_off[idx[0]] + r * width;
    }
    if (!adjacent) {
      Portable::columns(words, w_off, idx, width, cols);
      return;
    }
    const uint32_t* base = words + w_off[idx[0]];
    for (int w0 = 0; w0 < width; w0 += 8) {
      __m256i x[8];
      for (int r = 0; r < 8; ++r) {
        x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + r * width + w0));
      }
      __m256i t[8], u[8];
      for (int r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_epi32(x[r], x[r + 1]);
        t[r + 1] = _mm256_unpackhi_epi32(x[r], x[r + 1]);
      }
      for (int r = 0; r < 8; r += 4) {
        u[r] = _mm256_unpacklo_epi64(t[r], t[r + 2]);
        u[r + 1] = _mm256_unpackhi_epi64(t[r], t[r + 2]);
        u[r + 2] = _mm256_unpacklo_epi64(t[r + 1], t[r + 3]);
        u[r + 3] = _mm256_unpackhi_epi64(t[r + 1], t[r + 3]);
      }
      for (int c = 0; c < 4; ++c) {
        auto* out = reinterpret_cast<__m256i*>(cols + (w0 + c) * 8);
        _mm256_storeu_si256(out, _mm256_permute2x128_si256(u[c], u[c + 4], 0x20));
        _mm256_storeu_si256(out + 4, _mm256_permute2x128_si256(u[c], u[c + 4], 0x31));
      }
    }
  }
  static V unpack_row(const uint32_t* words, int d, int per_word, int bits) {
    if (bits == 4) {  // eight nibbles of one word
      const __m256i w = _mm256_set1_epi32(static_cast<int>(words[d / 8]));
      const __m256i v =
          _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                           _mm256_set1_epi32(0xF));
      return _mm256_cvtepi32_ps(v);
    }
    const Portable::V v = Portable::unpack_row(words, d, per_word, bits);
    return _mm256_loadu_ps(v.x);
  }
};

namespace avx2 {
using Ops = Avx2;
#include "attention_impl.inc"
}  // namespace avx2

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma,f16c")

// AVX-512: the AVX2 operations, and a value row's 4-bit codes unpacked 16 at a time (the
// same floats).
struct Avx512 : Avx2 {
  // Codes d .. d + 15 of a row (two words of eight nibbles) -> 16 floats at out.
  static void unpack_row16(const uint32_t* words, float* out) {
    const __m512i both = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(words))));
    const __m512i shifts =
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(both, shifts), _mm512_set1_epi32(0xF));
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(codes));
  }
  // 16 rows' 4-bit codes from their columns (`columns` of rows 0-7 and of rows 8-15) ->
  // out[d * stride + j], j = 0..15: what `unpack` gives 8 rows at a time.
  static void unpack_columns16(const uint32_t* first, const uint32_t* second, int words, float* out,
                               int stride) {
    const __m512i mask = _mm512_set1_epi32(0xF);
    for (int w = 0; w < words; ++w) {
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + w * 8))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + w * 8)), 1);
      for (int e = 0; e < 8; ++e) {
        const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(both, 4 * e), mask);
        _mm512_storeu_ps(out + (w * 8 + e) * stride, _mm512_cvtepi32_ps(codes));
      }
    }
  }
};

namespace avx512 {
using Ops = Avx512;
#include "attention_impl.inc"
}  // namespace avx512

#pragma GCC pop_options

#endif

#if defined(__aarch64__)
// NEON: lanes.h's operations, with the unpacking written for two 4-lane registers.
struct Neon : lanes::Neon {
  static V unpack(const uint32_t* packed, int shift, uint32_t mask) {
    const int32x4_t by = vdupq_n_s32(-shift);  // a negative left shift shifts right
    const uint32x4_t m = vdupq_n_u32(mask);
    return {vcvtq_f32_u32(vandq_u32(vshlq_u32(vld1q_u32(packed), by), m)),
            vcvtq_f32_u32(vandq_u32(vshlq_u32(vld1q_u32(packed + 4), by), m))};
  }
  static void columns(const uint32_t* words, const int64_t* w_off, const int* idx, int width,
                      uint32_t* cols) {
    Portable::columns(words, w_off, idx, width, cols);
  }
  static V unpack_row(const uint32_t* words, int d, int per_word, int bits) {
    const Portable::V v = Portable::unpack_row(words, d, per_word, bits);
    return load(v.x);
  }
};

namespace neon {
using Ops = Neon;
#include "attention_impl.inc"
}  // namespace neon
#endif

}  // namespace

namespace {

// AGENTKV_ATTENTION_IMPL=portable runs the portable lanes (tests compare them with AVX2).
std::string forced() {
  static const char* v = std::getenv("AGENTKV_ATTENTION_IMPL");
  return v != nullptr ? v : "";
}

bool portable_only() {
  static const bool portable = forced() == "portable" || cpu_forced_portable();
  return portable;
}

bool use_avx2() {
  static const bool ok = cpu_has_avx2_fma_f16c() && !portable_only();
  return ok;
}

// AGENTKV_ATTENTION_IMPL=avx2 keeps the AVX2 path where AVX-512 is there.
bool use_avx512() {
  static const bool ok = use_avx2() && forced() != "avx2" && cpu_has_avx512f();
  return ok;
}

template <typename Task, typename Finish>
void run_split(const AttentionArgs& a, int blocks, Task task, Finish finish) {
  int longest = a.keys;
  if (a.lengths != nullptr) {
    longest = 0;
    for (int b = 0; b < a.batch; ++b) {
      longest = std::max(longest, a.lengths[b]);
    }
  }
  const int chunks = std::max(1, (longest + kChunk - 1) / kChunk);
  const size_t tasks = static_cast<size_t>(a.batch) * a.kv_heads * blocks;
  ThreadPool& pool = ThreadPool::shared();
  // which (b, kvh, query block) a task index names
  const auto where = [&](size_t t, int& b, int& kvh, int& i0, int& i1) {
    const int block = static_cast<int>(t % blocks);
    kvh = static_cast<int>((t / blocks) % a.kv_heads);
    b = static_cast<int>(t / blocks / a.kv_heads);
    i0 = block * kQueryBlock;
    i1 = std::min(a.queries, i0 + kQueryBlock);
  };
  if (chunks == 1 || tasks >= 2 * static_cast<size_t>(pool.size())) {
    const std::function<void(size_t)> run = [&](size_t t) {
      int b, kvh, i0, i1;
      where(t, b, kvh, i0, i1);
      task(b, kvh, i0, i1, 0, chunks, nullptr);
    };
    pool.run(tasks, run);
    return;
  }
  const size_t stride = static_cast<size_t>(a.q_heads / a.kv_heads) *
                        std::min(a.queries, kQueryBlock) * (a.v.dim + 2);
  std::vector<float> partials(tasks * chunks * stride);
  const std::function<void(size_t)> run = [&](size_t t) {
    int b, kvh, i0, i1;
    where(t / chunks, b, kvh, i0, i1);
    const int chunk = static_cast<int>(t % chunks);
    task(b, kvh, i0, i1, chunk, chunk + 1, partials.data() + t * stride);
  };
  pool.run(tasks * chunks, run);
  const std::function<void(size_t)> merge = [&](size_t t) {
    int b, kvh, i0, i1;
    where(t, b, kvh, i0, i1);
    finish(b, kvh, i0, i1, chunks, partials.data() + t * chunks * stride, stride);
  };
  pool.run(tasks, merge);
}

// One implementation's task and merge (its namespace's `task` and `finish_partials`) over
// the split.
using TaskFn = void (*)(const AttentionArgs&, int, int, int, int, int, int, float*);
using FinishFn = void (*)(const AttentionArgs&, int, int, int, int, int, const float*, size_t);

void run_kernel(const AttentionArgs& a, int blocks, TaskFn task, FinishFn finish) {
  run_split(
      a, blocks,
      [&](int b, int kvh, int i0, int i1, int c0, int c1, float* partial) {
        task(a, b, kvh, i0, i1, c0, c1, partial);
      },
      [&](int b, int kvh, int i0, int i1, int chunks, const float* p, size_t stride) {
        finish(a, b, kvh, i0, i1, chunks, p, stride);
      });
}

}  // namespace

void quantized_attention(const AttentionArgs& a) {
  const int blocks = (a.queries + kQueryBlock - 1) / kQueryBlock;
#if defined(AGENTKV_ATTENTION_X86)
  if (use_avx512()) {
    return run_kernel(a, blocks, &avx512::task, &avx512::finish_partials);
  }
  if (use_avx2()) {
    return run_kernel(a, blocks, &avx2::task, &avx2::finish_partials);
  }
#endif
#if defined(__aarch64__)
  if (!portable_only()) {
    return run_kernel(a, blocks, &neon::task, &neon::finish_partials);
  }
#endif
  run_kernel(a, blocks, &portable::task, &portable::finish_partials);
}

const char* attention_implementation() {
#if defined(__aarch64__)
  return portable_only() ? "portable" : "neon";
#endif
  return use_avx512() ? "avx512" : use_avx2() ? "avx2-fma-f16c" : "portable";
}

}  // namespace agentkv
