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

// A query's integer codes for scoring 4-bit per-channel keys (format 2, a tile inside one
// channel group, whose scales are already folded into the query): fq_d ~ dq * xq_d with
// xq_d = round(fq_d / dq) in [-kCodeMax, kCodeMax]. The score of a key row with codes c is
// fma(float(sum_d (c_d - 8) xq_d), dq, score0), the 8 s_d of the centred codes in score0
// (its biases b_d + 8 s_d): centred, the codes' rounding errors largely cancel. The dot is
// exact in int32 (256 channels * 15 * 32512 < 2^31), so every path gives the same bits.
// The x86 paths split each code as xq = 256 hi + lo (hi, lo signed bytes) for dot products
// of unsigned bytes (the key codes) by signed bytes (vpdpbusd, vpmaddubsw): `hi` and `lo`
// hold them per 16 channels, the 8 even channels then the 8 odd ones, so that for word w
// of a key row (channels 8w .. 8w + 7, lowest nibble first) the words' low nibbles
// (channels 8w + {0, 2, 4, 6}) meet the dword `quad(hi, w, 0)` and their high nibbles
// (8w + {1, 3, 5, 7}) `quad(hi, w, 1)`.
constexpr int kCodeMax = 32512;  // 127 * 256: hi stays within a signed byte
struct QueryCodes {
  float dq = 0.0f;
  int32_t centre = 0;  // 8 * sum_d xq_d: the codes are taken centred, c - 8
  alignas(64) int16_t xq[kMaxDim];
  alignas(64) int8_t hi[kMaxDim];  // x86: see above
  alignas(64) int8_t lo[kMaxDim];
};

// The dword of `bytes` (QueryCodes::hi or lo) for word w's low (odd = 0) or high nibbles.
inline int32_t quad(const int8_t* bytes, int w, int odd) {
  int32_t q;
  std::memcpy(&q, bytes + 16 * (w / 2) + 8 * odd + 4 * (w % 2), sizeof q);
  return q;
}

inline int32_t centre_of(const QueryCodes& c, int dim) {
  int32_t sum = 0;
  for (int d = 0; d < dim; ++d) {
    sum += c.xq[d];
  }
  return 8 * sum;
}

// dq from the query's largest magnitude `amax`; NaN where it is not finite (every score of
// the query then NaN, as the float path gives), 0 where the query is all zeros.
inline float code_step(float amax, float& inv) {
  if (!(amax <= std::numeric_limits<float>::max())) {  // NaN or Inf
    inv = 0.0f;
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (amax == 0.0f) {
    inv = 0.0f;
    return 0.0f;
  }
  inv = static_cast<float>(kCodeMax) / amax;
  return amax / static_cast<float>(kCodeMax);
}

// The fused attention's own lane operations on top of lanes.h's: unpacking quantized words.
struct Portable : lanes::Portable {
  // code_step of the largest magnitude of x[0 .. n) (NaN if one is NaN).
  static float step_of(const float* x, int n, float& inv) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) {
      amax = std::isnan(x[i]) ? x[i] : std::max(amax, std::fabs(x[i]));
    }
    return code_step(amax, inv);
  }
  // fq[0 .. dim) -> c (QueryCodes): round half to even, as the vector conversions do.
  static void quantize_query(const float* fq, int dim, QueryCodes& c) {
    float inv;
    c.dq = step_of(fq, dim, inv);
    for (int d = 0; d < dim; ++d) {
      c.xq[d] = inv == 0.0f ? 0 : static_cast<int16_t>(std::nearbyint(fq[d] * inv));
    }
    c.centre = centre_of(c, dim);  // the portable dots take xq whole
  }
  // scores[r][j] = fma(float(dot - centre), dq, score0[r]) for the 4-bit key rows j < rows
  // (row j's dim / 8 words start at words + w_off[j]) and query r < count (its codes qc[r]).
  template <int count>
  static void key_scores(const uint32_t* words, const int64_t* w_off, int rows, int dim,
                         const QueryCodes* const* qc, const float* score0, float (*scores)[kTile]) {
    for (int j = 0; j < rows; ++j) {
      const uint32_t* row = words + w_off[j];
      for (int r = 0; r < count; ++r) {
        int32_t dot = 0;
        for (int d = 0; d < dim; ++d) {
          dot += static_cast<int32_t>((row[d / 8] >> (4 * (d % 8))) & 0xF) * qc[r]->xq[d];
        }
        scores[r][j] = std::fma(static_cast<float>(dot - qc[r]->centre), qc[r]->dq, score0[r]);
      }
    }
  }
  // A query's value weights w[0 .. n) -> int16 codes wq (zeros from n to kTile), returning
  // their step dw (w_j ~ dw * wq_j), as quantize_query.
  static float quantize_weights(const float* w, int n, int16_t* wq) {
    float inv;
    const float dw = step_of(w, n, inv);
    for (int j = 0; j < kTile; ++j) {
      wq[j] = j >= n || inv == 0.0f ? 0 : static_cast<int16_t>(std::nearbyint(w[j] * inv));
    }
    return dw;
  }
  // dots[r][d] = sum_{j < rows} wq[r][j] * (code d of value row j): the 64 4-bit codes from
  // word `word0` of each row (row j's words start at words + w_off[j]), exact in int32.
  template <int count>
  static void value_dots(const uint32_t* words, const int64_t* w_off, int word0, int rows,
                         const int16_t* const* wq, int32_t (*dots)[64]) {
    for (int r = 0; r < count; ++r) {
      std::fill(dots[r], dots[r] + 64, 0);
    }
    for (int j = 0; j < rows; ++j) {
      const uint32_t* row = words + w_off[j] + word0;
      for (int r = 0; r < count; ++r) {
        for (int d = 0; d < 64; ++d) {
          dots[r][d] += static_cast<int32_t>((row[d / 8] >> (4 * (d % 8))) & 0xF) * wq[r][j];
        }
      }
    }
  }
  static V load_int(const int32_t* p) {
    V v;
    for (int i = 0; i < 8; ++i) {
      v.x[i] = static_cast<float>(p[i]);
    }
    return v;
  }
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
    if (at + (t1 - t0) <= bt && (ct == 0 || in_group + (t1 - t0) <= ct)) {
      // inside one block (and one channel group): the same offsets, in steps
      const int64_t row0 = first + at;
      for (int i = 0; i < t1 - t0; ++i) {
        w[i] = (row0 + i) * w_width;
        s[i] = (ct > 0 ? row0 - in_group : row0 + i) * s_width;
      }
      return;
    }
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

// Per-channel keys: where rows [t0, t1) of batch row b, KV head h lie in the float16 keys
// of the group starting at `own`, which this step completed (KVView::done), or -1 (outside
// that group). `from`: the first group the step completed.
void done_rows(const AttentionArgs& a, int b, int h, int own, int from, int t0, int t1,
               int64_t* out) {
  const int ct = a.k.channel_tokens;
  const int64_t entry = a.done_first[b] + static_cast<int64_t>(own - from) / ct * a.kv_heads + h;
  for (int t = t0; t < t1; ++t) {
    out[t - t0] = t >= own && t < own + ct ? (entry * ct + t - own) * a.k.dim : -1;
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
  // code_step of the largest magnitude of x[0 .. n) (n a multiple of 8).
  static float step_of(const float* x, int n, float& inv) {
    __m256 amax = _mm256_setzero_ps();
    __m256 bad = _mm256_setzero_ps();  // lanes that met a NaN or an infinity
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 top = _mm256_set1_ps(std::numeric_limits<float>::max());
    for (int i = 0; i < n; i += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, top, _CMP_NLE_UQ));
      amax = _mm256_max_ps(amax, a);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.0f;
    for (float v : lanes) {
      m = std::max(m, v);
    }
    return code_step(_mm256_movemask_ps(bad) != 0 ? std::numeric_limits<float>::quiet_NaN() : m,
                     inv);
  }
  static void quantize_query(const float* fq, int dim, QueryCodes& c) {
    float inv;
    c.dq = step_of(fq, dim, inv);
    const __m256 scale = _mm256_set1_ps(inv);
    for (int d = 0; d < dim; d += 8) {
      const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(fq + d), scale));
      const __m128i packed =
          _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c.xq + d),
                       inv == 0.0f ? _mm_setzero_si128() : packed);
    }
    split_codes(c, dim);
    c.centre = centre_of(c, dim);
  }
  // xq = 256 hi + lo: lo the sign-extended low byte, hi = (xq - lo) / 256, both packed to
  // bytes (16 channels: hi's in the low lane, lo's in the high one) and each lane's even
  // channels put before its odd ones
  static void split_codes(QueryCodes& c, int dim) {
    const __m256i evens_first =
        _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                         12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int d = 0; d < dim; d += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.xq + d));
      const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8);
      const __m256i hi = _mm256_srai_epi16(_mm256_sub_epi16(x, lo), 8);
      // packs: [hi 0-7, lo 0-7 | hi 8-15, lo 8-15] -> [hi 0-15 | lo 0-15]
      const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(hi, lo), 0xD8);
      const __m256i split = _mm256_shuffle_epi8(bytes, evens_first);
      _mm_store_si128(reinterpret_cast<__m128i*>(c.hi + d), _mm256_castsi256_si128(split));
      _mm_store_si128(reinterpret_cast<__m128i*>(c.lo + d), _mm256_extracti128_si256(split, 1));
    }
  }
  // Portable::key_scores, 8 rows at a time: the rows' word w side by side (`columns`), its
  // low and high nibbles as bytes, multiplied by the query's bytes in pairs (vpmaddubsw: at
  // most 2 * 15 * 128 per pair), the pairs summed into int32 (the same exact dot).
  template <int count>
  static void key_scores(const uint32_t* words, const int64_t* w_off, int rows, int dim,
                         const QueryCodes* const* qc, const float* score0, float (*scores)[kTile]) {
    for (int j0 = 0; j0 < rows; j0 += 8) {
      key_scores8<count>(words, w_off, j0, rows, dim, qc, score0, scores);
    }
  }
  template <int count>
  static void key_scores8(const uint32_t* words, const int64_t* w_off, int j0, int rows, int dim,
                          const QueryCodes* const* qc, const float* score0,
                          float (*scores)[kTile]) {
    int idx[8];
    for (int r = 0; r < 8; ++r) {
      idx[r] = std::min(j0 + r, rows - 1);  // the tail repeats the last row (never read)
    }
    alignas(32) uint32_t cols[kMaxDim];
    columns(words, w_off, idx, dim / 8, cols);
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i hi[count], lo[count];
    for (int r = 0; r < count; ++r) {
      hi[r] = lo[r] = _mm256_setzero_si256();
    }
    for (int w = 0; w < dim / 8; ++w) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(cols + w * 8));
      const __m256i even = _mm256_and_si256(x, nibbles);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 4), nibbles);
      for (int r = 0; r < count; ++r) {
        const QueryCodes& q = *qc[r];
        const __m256i h =
            _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_set1_epi32(quad(q.hi, w, 0))),
                             _mm256_maddubs_epi16(odd, _mm256_set1_epi32(quad(q.hi, w, 1))));
        const __m256i l =
            _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_set1_epi32(quad(q.lo, w, 0))),
                             _mm256_maddubs_epi16(odd, _mm256_set1_epi32(quad(q.lo, w, 1))));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(h, ones));
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(l, ones));
      }
    }
    for (int r = 0; r < count; ++r) {
      const __m256i dot = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(hi[r], 8), lo[r]),
                                           _mm256_set1_epi32(qc[r]->centre));
      _mm256_storeu_ps(scores[r] + j0,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qc[r]->dq),
                                       _mm256_set1_ps(score0[r])));
    }
  }
  static float quantize_weights(const float* w, int n, int16_t* wq) {
    const int padded = (n + 7) & ~7;  // w is zero from n to here (the softmax's padding)
    float inv;
    const float dw = step_of(w, padded, inv);
    const __m256 scale = _mm256_set1_ps(inv);
    int j = 0;
    for (; j < padded && inv != 0.0f; j += 8) {
      const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + j), scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + j),
                       _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
    }
    for (; j < kTile; j += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + j), _mm_setzero_si128());
    }
    return dw;
  }
  // Portable::value_dots: two rows at a time, each channel's two codes widened to an int16
  // pair beside the rows' two weights (vpmaddwd), 32 channels a pass.
  template <int count>
  static void value_dots(const uint32_t* words, const int64_t* w_off, int word0, int rows,
                         const int16_t* const* wq, int32_t (*dots)[64]) {
    const __m128i nibbles = _mm_set1_epi8(0x0F);
    for (int half = 0; half < 2; ++half) {
      __m256i acc[count][4];
      for (int r = 0; r < count; ++r) {
        for (int i = 0; i < 4; ++i) {
          acc[r][i] = _mm256_setzero_si256();
        }
      }
      for (int j = 0; j < rows; j += 2) {
        const int j1 = std::min(j + 1, rows - 1);  // an odd last row: itself, weight 0
        const __m128i a =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + w_off[j] + word0 + 4 * half));
        const __m128i b =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + w_off[j1] + word0 + 4 * half));
        const __m128i ea = _mm_and_si128(a, nibbles), eb = _mm_and_si128(b, nibbles);
        const __m128i oa = _mm_and_si128(_mm_srli_epi16(a, 4), nibbles);
        const __m128i ob = _mm_and_si128(_mm_srli_epi16(b, 4), nibbles);
        // pairs (row j, row j1) of channels 2k, 16 + 2k, 2k + 1, 17 + 2k (k < 8, this half)
        const __m256i pairs[4] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(ea, eb)),
                                  _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(ea, eb)),
                                  _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(oa, ob)),
                                  _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(oa, ob))};
        for (int r = 0; r < count; ++r) {
          int32_t both;
          std::memcpy(&both, wq[r] + j, sizeof both);
          const __m256i x = _mm256_set1_epi32(both);
          for (int i = 0; i < 4; ++i) {
            acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(pairs[i], x));
          }
        }
      }
      for (int r = 0; r < count; ++r) {  // back to channel order
        alignas(32) int32_t lanes[4][8];
        for (int i = 0; i < 4; ++i) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[i]), acc[r][i]);
        }
        int32_t* out = dots[r] + 32 * half;
        for (int k = 0; k < 8; ++k) {
          out[2 * k] = lanes[0][k];
          out[16 + 2 * k] = lanes[1][k];
          out[2 * k + 1] = lanes[2][k];
          out[17 + 2 * k] = lanes[3][k];
        }
      }
    }
  }
  static V load_int(const int32_t* p) {
    return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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

// AVX-512: the AVX2 operations, with 16 key rows to a vpdpbusd, all 64 channels of a value
// group to vpdpwssd, and 16-lane exponentials (the same bits).
struct Avx512 : Avx2 {
  // A tile's 4-bit codes laid out once for the integer dots, where several blocks of queries
  // fold the tile (a prefill chunk): each block then loads them instead of unpacking them
  // again (prepare_keys, prepare_values; the same integers, so the same bits).
  static constexpr bool kPreparesTiles = true;
  struct Tile {
    __m512i keys[kTile / 16][kMaxDim / 8][2];    // per 16 rows and word: even, odd nibbles
    __m512i values[kMaxDim / 64][kTile / 2][4];  // per value group and row pair: the pairs
  };
  static Tile& tile() {
    thread_local Tile t;
    return t;
  }
  // Avx2::step_of 16 lanes at a time: a maximum and the check for NaN or infinity are exact
  // in any order (n a multiple of 8: the last 8 lanes through a masked load of zeros).
  static float step_of(const float* x, int n, float& inv) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    const __m512 top = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int i = 0; i < n; i += 16) {
      const __mmask16 lanes = n - i >= 16 ? 0xFFFF : 0x00FF;
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, x + i));
      bad |= _mm512_cmp_ps_mask(a, top, _CMP_NLE_UQ);
      amax = _mm512_max_ps(amax, a);
    }
    return code_step(
        bad != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(amax), inv);
  }
  // Avx2::quantize_query with 16 lanes to a conversion (the same roundings and saturation).
  static void quantize_query(const float* fq, int dim, QueryCodes& c) {
    if (dim % 16 != 0) {
      return Avx2::quantize_query(fq, dim, c);
    }
    float inv;
    c.dq = step_of(fq, dim, inv);
    const __m512 scale = _mm512_set1_ps(inv);
    for (int d = 0; d < dim; d += 16) {
      const __m256i x =
          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(fq + d), scale)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.xq + d),
                          inv == 0.0f ? _mm256_setzero_si256() : x);
    }
    split_codes(c, dim);
    c.centre = centre_of(c, dim);
  }
  // Avx2::quantize_weights with 16 lanes to a conversion.
  static float quantize_weights(const float* w, int n, int16_t* wq) {
    const int padded = (n + 7) & ~7;  // w is zero from n to here (the softmax's padding)
    float inv;
    const float dw = step_of(w, padded, inv);
    const __m512 scale = _mm512_set1_ps(inv);
    int j = 0;
    for (; j < padded && inv != 0.0f; j += 16) {
      const __mmask16 lanes = padded - j >= 16 ? 0xFFFF : 0x00FF;
      const __m256i x = _mm512_cvtsepi32_epi16(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w + j), scale)));
      if (lanes == 0xFFFF) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + j), x);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + j), _mm256_castsi256_si128(x));
      }
    }
    for (j = inv != 0.0f ? padded : 0; j < kTile; j += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + j), _mm_setzero_si128());
    }
    return dw;
  }
  // lanes::Avx2::exp(scores - m) for the lane groups of 8 up to n, 16 lanes at a time where
  // two groups remain: every lane runs Avx2::exp's sequence (the same bits).
  static void exp_shifted(const float* scores, float m, int n, float* p) {
    int j0 = 0;
    const __m512 shift = _mm512_set1_ps(m);
    for (; j0 + 8 < n; j0 += 16) {
      __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + j0), shift);
      x = _mm512_max_ps(_mm512_set1_ps(kLow), x);  // NaN stays NaN, as Avx2::exp
      const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-kLn2Hi), x);
      r = _mm512_fmadd_ps(k, _mm512_set1_ps(-kLn2Lo), r);
      __m512 q = _mm512_set1_ps(kP0);
      q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP1));
      q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP2));
      q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP3));
      q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP4));
      q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP5));
      q = _mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r);
      q = _mm512_add_ps(q, _mm512_set1_ps(1.0f));
      const __m512i e =
          _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
      _mm512_storeu_ps(p + j0, _mm512_mul_ps(q, _mm512_castsi512_ps(e)));
    }
    for (; j0 < n; j0 += 8) {
      store(p + j0, exp(sub(load(scores + j0), set1(m))));
    }
  }
  // Whole 16-row runs of `rows` key rows (the runs key_scores takes with vpdpbusd) into t.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static bool prepare_keys(
      const uint32_t* words, const int64_t* w_off, int rows, int dim, Tile& t) {
    if (!cpu_has_avx512_vnni()) {
      return false;
    }
    for (int j0 = 0; j0 + 16 <= rows; j0 += 16) {
      key_nibbles16(words, w_off, j0, dim, t.keys[j0 / 16]);
    }
    return true;
  }
  // Every row pair of `rows` value rows, each group of 64 channels, into t.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static bool prepare_values(
      const uint32_t* words, const int64_t* w_off, int rows, int dim_v, Tile& t) {
    if (!cpu_has_avx512_vnni()) {
      return false;
    }
    for (int g = 0; g < dim_v / 64; ++g) {
      for (int j = 0; j < rows; j += 2) {
        value_pairs(words, w_off, g * 8, j, rows, t.values[g][j / 2]);
      }
    }
    return true;
  }
  // Avx2::key_scores, 16 rows to a register with vpdpbusd (AVX-512 VNNI) where the CPU has it:
  // the same exact dots. `prepared`: the tile's prepare_keys.
  template <int count>
  static void key_scores(const uint32_t* words, const int64_t* w_off, int rows, int dim,
                         const QueryCodes* const* qc, const float* score0, float (*scores)[kTile],
                         const Tile* prepared = nullptr) {
    int j0 = 0;
    if (cpu_has_avx512_vnni()) {  // (BW too: every such CPU has it)
      for (; j0 + 16 <= rows; j0 += 16) {
        if (prepared != nullptr) {
          key_scores16<count, true>(prepared->keys[j0 / 16], words, w_off, j0, dim, qc, score0,
                                    scores);
        } else {
          key_scores16<count, false>(nullptr, words, w_off, j0, dim, qc, score0, scores);
        }
      }
    }
    for (; j0 < rows; j0 += 8) {
      key_scores8<count>(words, w_off, j0, rows, dim, qc, score0, scores);
    }
  }
  template <int count>
  static void value_dots(const uint32_t* words, const int64_t* w_off, int word0, int rows,
                         const int16_t* const* wq, int32_t (*dots)[64],
                         const Tile* prepared = nullptr) {
    if (cpu_has_avx512_vnni()) {
      if (prepared != nullptr) {
        return value_dots64<count, true>(prepared->values[word0 / 8], words, w_off, word0, rows, wq,
                                         dots);
      }
      return value_dots64<count, false>(nullptr, words, w_off, word0, rows, wq, dots);
    }
    Avx2::value_dots<count>(words, w_off, word0, rows, wq, dots);
  }
  // Rows j and j + 1 (past the last row, the last row again) of 64 channels from
  // word `word0` as int16 pairs, (row j, row j + 1) per channel: channels (k < 8) 2k | 32 + 2k,
  // 16 + 2k | 48 + 2k, 2k + 1 | 33 + 2k, 17 + 2k | 49 + 2k (the two 128-bit halves of each
  // unpack).
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) static void
  value_pairs(const uint32_t* words, const int64_t* w_off, int word0, int j, int rows,
              __m512i* pairs) {
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    const int j1 = std::min(j + 1, rows - 1);
    const __m256i a =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + w_off[j] + word0));
    const __m256i b =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + w_off[j1] + word0));
    const __m256i ea = _mm256_and_si256(a, nibbles), eb = _mm256_and_si256(b, nibbles);
    const __m256i oa = _mm256_and_si256(_mm256_srli_epi16(a, 4), nibbles);
    const __m256i ob = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibbles);
    pairs[0] = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(ea, eb));
    pairs[1] = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(ea, eb));
    pairs[2] = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(oa, ob));
    pairs[3] = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(oa, ob));
  }
  // Avx2::value_dots with all 64 channels at once, 16 to a register (vpdpwssd); the row
  // pairs from `prepared` (prepare_values) or unpacked here. For an odd `rows` below the
  // tile's, the prepared last pair holds the next row of the tile where the unpacked one
  // repeats row rows - 1: the dots are the same because every weight from `rows` on is 0
  // (fold_n: `rows` is the block's most keys, and quantize_weights zeroes wq from each
  // query's n to kTile).
  template <int count, bool from_prepared>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) static void
  value_dots64(const __m512i (*prepared)[4], const uint32_t* words, const int64_t* w_off, int word0,
               int rows, const int16_t* const* wq, int32_t (*dots)[64]) {
    __m512i acc[count][4];
    for (int r = 0; r < count; ++r) {
      for (int i = 0; i < 4; ++i) {
        acc[r][i] = _mm512_setzero_si512();
      }
    }
    for (int j = 0; j < rows; j += 2) {
      __m512i unpacked[4];
      const __m512i* pairs = unpacked;
      if constexpr (from_prepared) {
        pairs = prepared[j / 2];
      } else {
        value_pairs(words, w_off, word0, j, rows, unpacked);
      }
      for (int r = 0; r < count; ++r) {
        int32_t both;
        std::memcpy(&both, wq[r] + j, sizeof both);
        const __m512i x = _mm512_set1_epi32(both);
        for (int i = 0; i < 4; ++i) {
          acc[r][i] = _mm512_dpwssd_epi32(acc[r][i], pairs[i], x);
        }
      }
    }
    // back to channel order: even channels from pairs 0/1, odd from 2/3
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int r = 0; r < count; ++r) {
      int32_t* out = dots[r];
      _mm512_storeu_si512(out, _mm512_permutex2var_epi32(acc[r][0], low, acc[r][2]));
      _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi32(acc[r][1], low, acc[r][3]));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi32(acc[r][0], high, acc[r][2]));
      _mm512_storeu_si512(out + 48, _mm512_permutex2var_epi32(acc[r][1], high, acc[r][3]));
    }
  }
  // Word w of 16 key rows side by side (`columns` of rows j0 .. j0 + 7 in `first`, of the
  // next 8 in `second`): its low nibbles (channels 8w + {0, 2, 4, 6}) and high nibbles
  // (8w + {1, 3, 5, 7}) as bytes, 16 rows to a register.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) static void
  split16(const uint32_t* first, const uint32_t* second, int w, __m512i& even, __m512i& odd) {
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i x = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(first + w * 8))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(second + w * 8)), 1);
    even = _mm512_and_si512(x, nibbles);
    odd = _mm512_and_si512(_mm512_srli_epi32(x, 4), nibbles);
  }
  // Rows j0 .. j0 + 15's `columns`, halves of 8.
  static void columns16(const uint32_t* words, const int64_t* w_off, int j0, int dim,
                        uint32_t* first, uint32_t* second) {
    int idx[16];
    for (int r = 0; r < 16; ++r) {
      idx[r] = j0 + r;
    }
    columns(words, w_off, idx, dim / 8, first);
    columns(words, w_off, idx + 8, dim / 8, second);
  }
  // Rows j0 .. j0 + 15 of 4-bit keys, every word split (split16): out[w] = {even, odd}.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static void key_nibbles16(
      const uint32_t* words, const int64_t* w_off, int j0, int dim, __m512i (*out)[2]) {
    alignas(64) uint32_t first[kMaxDim], second[kMaxDim];
    columns16(words, w_off, j0, dim, first, second);
    for (int w = 0; w < dim / 8; ++w) {
      split16(first, second, w, out[w][0], out[w][1]);
    }
  }
  // The scores of key rows j0 .. j0 + 15 for `count` queries: their nibbles from `prepared`
  // (prepare_keys) or split here, word by word.
  template <int count, bool from_prepared>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) static void
  key_scores16(const __m512i (*prepared)[2], const uint32_t* words, const int64_t* w_off, int j0,
               int dim, const QueryCodes* const* qc, const float* score0, float (*scores)[kTile]) {
    alignas(64) uint32_t first[from_prepared ? 1 : kMaxDim], second[from_prepared ? 1 : kMaxDim];
    if constexpr (!from_prepared) {
      columns16(words, w_off, j0, dim, first, second);
    }
    __m512i hi[count], lo[count];
    for (int r = 0; r < count; ++r) {
      hi[r] = lo[r] = _mm512_setzero_si512();
    }
    for (int w = 0; w < dim / 8; ++w) {
      __m512i even, odd;
      if constexpr (from_prepared) {
        even = prepared[w][0];
        odd = prepared[w][1];
      } else {
        split16(first, second, w, even, odd);
      }
      for (int r = 0; r < count; ++r) {
        const QueryCodes& q = *qc[r];
        hi[r] = _mm512_dpbusd_epi32(hi[r], even, _mm512_set1_epi32(quad(q.hi, w, 0)));
        hi[r] = _mm512_dpbusd_epi32(hi[r], odd, _mm512_set1_epi32(quad(q.hi, w, 1)));
        lo[r] = _mm512_dpbusd_epi32(lo[r], even, _mm512_set1_epi32(quad(q.lo, w, 0)));
        lo[r] = _mm512_dpbusd_epi32(lo[r], odd, _mm512_set1_epi32(quad(q.lo, w, 1)));
      }
    }
    for (int r = 0; r < count; ++r) {
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]),
                                           _mm512_set1_epi32(qc[r]->centre));
      _mm512_storeu_ps(scores[r] + j0,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qc[r]->dq),
                                       _mm512_set1_ps(score0[r])));
    }
  }
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
  static void quantize_query(const float* fq, int dim, QueryCodes& c) {
    Portable::quantize_query(fq, dim, c);
  }
  // Portable::key_scores: each row's 16 codes at a time widened to int16 in channel order
  // and multiplied by the query's codes into int32 lanes (the same exact dot).
  template <int count>
  static void key_scores(const uint32_t* words, const int64_t* w_off, int rows, int dim,
                         const QueryCodes* const* qc, const float* score0, float (*scores)[kTile]) {
    for (int j = 0; j < rows; ++j) {
      const auto* row = reinterpret_cast<const uint8_t*>(words + w_off[j]);
      int32x4_t acc[count];
      for (int r = 0; r < count; ++r) {
        acc[r] = vdupq_n_s32(0);
      }
      for (int d = 0; d < dim; d += 16) {
        int16x8_t c0, c1;
        codes16(row + d / 2, c0, c1);
        for (int r = 0; r < count; ++r) {
          const int16x8_t x0 = vld1q_s16(qc[r]->xq + d), x1 = vld1q_s16(qc[r]->xq + d + 8);
          acc[r] = vmlal_s16(acc[r], vget_low_s16(c0), vget_low_s16(x0));
          acc[r] = vmlal_high_s16(acc[r], c0, x0);
          acc[r] = vmlal_s16(acc[r], vget_low_s16(c1), vget_low_s16(x1));
          acc[r] = vmlal_high_s16(acc[r], c1, x1);
        }
      }
      for (int r = 0; r < count; ++r) {
        const int32_t dot = vaddvq_s32(acc[r]);
        scores[r][j] = std::fma(static_cast<float>(dot - qc[r]->centre), qc[r]->dq, score0[r]);
      }
    }
  }
  // Codes 0-7 and 8-15 of the 8 bytes at `p` (low nibble first) as int16.
  static void codes16(const uint8_t* p, int16x8_t& c0, int16x8_t& c1) {
    const uint8x8_t packed = vld1_u8(p);
    const uint8x8x2_t z = vzip_u8(vand_u8(packed, vdup_n_u8(0x0F)), vshr_n_u8(packed, 4));
    c0 = vreinterpretq_s16_u16(vmovl_u8(z.val[0]));
    c1 = vreinterpretq_s16_u16(vmovl_u8(z.val[1]));
  }
  static float quantize_weights(const float* w, int n, int16_t* wq) {
    return Portable::quantize_weights(w, n, wq);
  }
  // Portable::value_dots: 16 channels a pass, each row's codes times its weight into
  // int32 lanes (exact).
  template <int count>
  static void value_dots(const uint32_t* words, const int64_t* w_off, int word0, int rows,
                         const int16_t* const* wq, int32_t (*dots)[64]) {
    for (int part = 0; part < 4; ++part) {
      int32x4_t acc[count][4];
      for (int r = 0; r < count; ++r) {
        for (int i = 0; i < 4; ++i) {
          acc[r][i] = vdupq_n_s32(0);
        }
      }
      for (int j = 0; j < rows; ++j) {
        int16x8_t c0, c1;
        codes16(reinterpret_cast<const uint8_t*>(words + w_off[j] + word0) + 8 * part, c0, c1);
        for (int r = 0; r < count; ++r) {
          const int16_t x = wq[r][j];
          acc[r][0] = vmlal_n_s16(acc[r][0], vget_low_s16(c0), x);
          acc[r][1] = vmlal_high_n_s16(acc[r][1], c0, x);
          acc[r][2] = vmlal_n_s16(acc[r][2], vget_low_s16(c1), x);
          acc[r][3] = vmlal_high_n_s16(acc[r][3], c1, x);
        }
      }
      for (int r = 0; r < count; ++r) {
        for (int i = 0; i < 4; ++i) {
          vst1q_s32(dots[r] + 16 * part + 4 * i, acc[r][i]);
        }
      }
    }
  }
  static V load_int(const int32_t* p) {
    return {vcvtq_f32_s32(vld1q_s32(p)), vcvtq_f32_s32(vld1q_s32(p + 4))};
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

// One implementation's streaming steps (its namespace's stream_chunk and stream_finish).
using StreamFn = void (*)(const AttentionArgs&, int, int, int, int, int, float*);
using StreamFinishFn = void (*)(const AttentionArgs&, int, int, int, int, float*);

struct StreamImpl {
  StreamFn chunk;
  StreamFinishFn finish;
};

StreamImpl stream_impl() {
#if defined(AGENTKV_ATTENTION_X86)
  if (use_avx512()) {
    return {&avx512::stream_chunk, &avx512::stream_finish};
  }
  if (use_avx2()) {
    return {&avx2::stream_chunk, &avx2::stream_finish};
  }
#endif
#if defined(__aarch64__)
  if (!portable_only()) {
    return {&neon::stream_chunk, &neon::stream_finish};
  }
#endif
  return {&portable::stream_chunk, &portable::stream_finish};
}

// Each (KV head, query block) of a streamed row, on the thread pool: `run(kvh, i0, i1, states)`.
template <typename Run>
void stream_tasks(const AttentionArgs& a, std::vector<float>& states, Run run) {
  const int blocks = (a.queries + kQueryBlock - 1) / kQueryBlock;
  const size_t stride = static_cast<size_t>(a.q_heads / a.kv_heads) *
                        std::min(a.queries, kQueryBlock) * (a.v.dim + 2);
  const std::function<void(size_t)> task = [&](size_t t) {
    const int kvh = static_cast<int>(t / blocks), block = static_cast<int>(t % blocks);
    const int i0 = block * kQueryBlock, i1 = std::min(a.queries, i0 + kQueryBlock);
    run(kvh, i0, i1, states.data() + t * stride);
  };
  ThreadPool::shared().run(static_cast<size_t>(a.kv_heads) * blocks, task);
}

}  // namespace

int attention_chunk_keys() {
  return kChunk;
}

void attention_stream_start(const AttentionArgs& a, std::vector<float>& states) {
  const int blocks = (a.queries + kQueryBlock - 1) / kQueryBlock;
  const size_t entries = static_cast<size_t>(a.kv_heads) * blocks * (a.q_heads / a.kv_heads) *
                         std::min(a.queries, kQueryBlock);
  states.assign(entries * (a.v.dim + 2), 0.0f);
  for (size_t n = 0; n < entries; ++n) {
    states[n * (a.v.dim + 2)] = -std::numeric_limits<float>::infinity();
  }
}

void attention_stream_chunk(const AttentionArgs& a, int b, int chunk, std::vector<float>& states) {
  const StreamImpl impl = stream_impl();
  stream_tasks(a, states,
               [&](int kvh, int i0, int i1, float* s) { impl.chunk(a, b, kvh, i0, i1, chunk, s); });
}

void attention_stream_finish(const AttentionArgs& a, int b, std::vector<float>& states) {
  const StreamImpl impl = stream_impl();
  stream_tasks(a, states,
               [&](int kvh, int i0, int i1, float* s) { impl.finish(a, b, kvh, i0, i1, s); });
}

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
  if (use_avx512()) {  // with VNNI the integer key and value dots take vpdpbusd / vpdpwssd
    return cpu_has_avx512_vnni() ? "avx512-vnni" : "avx512";
  }
  return use_avx2() ? "avx2-fma-f16c" : "portable";
}

}  // namespace agentkv
