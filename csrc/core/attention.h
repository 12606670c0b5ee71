// Fused attention over a quantized KV cache, for CPU.
//
// out[b, h, i] = softmax(scale * q[b, h, i] . K[b, h', j]) V[b, h', j] over the keys
// j a query may see, where K and V are stored as MLX affine quantization (packed
// words + float16 scale/bias per group) or float16, and h' = h / (Hq / Hkv).
// Keys and values are read tile by tile (64 tokens) and never exist whole in float, so
// one pass reads the cache once. The integers are not dequantized one by one: per-channel
// key scales and biases of a tile inside one channel group fold into the query (q_d s_d)
// and the score's start (sum_d q_d b_d); a value row's scale folds into its softmax weight
// (p_j s_j), its bias into one sum (sum_j p_j b_j). Where that leaves one scale per query
// (such key tiles; 4-bit values in groups of 64), the folded query and the weights become
// int16 codes and the 4-bit codes enter exact integer dot products (docs/compute.md).
//
// A query at buffer row p = T - L + i (its row's last L rows are the queries)
// sees keys j in [lo, p]: lo = the row's left padding, raised to p - window + 1
// for a sliding window. Every query's result depends only on its own q, its own
// key range and the cache, computed in one fixed order (the range cut into chunks
// of 512 keys from lo, each chunk an online softmax over tiles of 64 from its start,
// scores summed over d in order, values accumulated over j in order, then the chunks'
// partial softmaxes merged in order): the same whether it runs alone, in a prefill
// chunk or in a left-padded batch row, and whichever thread runs which chunk (one
// decoding agent spreads its chunks over the pool, as flash-decoding does). That is
// what lets agents batch without changing tokens.
//
// The cache is either contiguous ([B, H, T, ...] arrays with strides) or paged: fixed blocks
// of token rows found through each batch row's block table, rows of unequal lengths (a jagged
// batch, no padding). The same arithmetic runs on both; only where a token row lives differs.
#pragma once

#include <cstdint>
#include <vector>

namespace agentkv {

struct KVView {
  int bits = 4;                      // 2..8: quantized; 16: float16
  int group = 64;                    // values per scale/bias
  const uint32_t* words = nullptr;   // quantized: D * bits / 32 per token row
  const uint16_t* scales = nullptr;  // float16 bits: D / group per token row
  const uint16_t* biases = nullptr;
  const uint16_t* halves = nullptr;  // bits == 16: D per token row
  // Contiguous caches [B, H, T, ...]: strides in elements of the arrays above (batch, head,
  // token). Paged caches (AttentionArgs::tables): unused, rows are found through the table.
  int64_t w_strides[3] = {0, 0, 0};
  int64_t s_strides[3] = {0, 0, 0};
  int dim = 0;
  // Per-channel keys (format 2): > 0 is the channel group length. Scales and biases are per
  // channel per group of `channel_tokens` tokens (aligned from the row's token 0, after its
  // left padding), the group's `dim` values spread over its rows, dim / channel_tokens per
  // row. The group still filling is not in the cache but in `tail`: float16 rows
  //   ((slot * kv_heads + h) * channel_tokens + t - complete) * dim
  // for tokens t >= complete (the row's length rounded down to a whole group); slot is
  // tail_slots[b] (paged) or b (contiguous: tail [B, Hkv, channel_tokens, D]).
  int channel_tokens = 0;
  const uint16_t* tail = nullptr;
  // Per-channel keys of the groups this very step completed (paged caches; null: none), in
  // float16 rows ((entry * channel_tokens) + t - group start) * dim, entry =
  // AttentionArgs::done_first[b] + (group start - the step's first group start) /
  // channel_tokens * kv_heads + h. A query reads its own group in float16 until the group is
  // complete at the query (as one token at a time would), and quantized from its last token
  // on: so a query's result, and every key stored after it, depend on the tokens alone, never
  // on how a prompt was cut into steps or who wrote a shared prefix.
  const uint16_t* done = nullptr;
};

// Paged caches hold every token row of a block together, per head:
//   row(b, h, t) = ((tables[b * table_stride + t / block_tokens] * kv_heads) + h) * block_tokens
//                  + t % block_tokens
// and a row of words / scales / halves starts at row * (its width) in its array.
struct AttentionArgs {
  const float* q = nullptr;  // [B, Hq, L, D], strides below (in floats)
  int64_t q_strides[3] = {0, 0, 0};
  float* out = nullptr;  // [B, Hq, L, Dv], contiguous
  int batch = 0, q_heads = 0, kv_heads = 0, queries = 0, keys = 0;
  float scale = 1.0f;
  int window = 0;                         // 0: none
  const int32_t* left_padding = nullptr;  // [B] or null (no padding); contiguous caches only
  const float* sinks = nullptr;           // [Hq] or null
  float softcap = 0.0f;  // > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2)
  // Paged (jagged) batches: row b holds lengths[b] tokens (its queries are the last L of
  // them) whose blocks are tables[b * table_stride + i]. Null: contiguous caches of `keys`.
  const int32_t* tables = nullptr;
  const int32_t* lengths = nullptr;
  int table_stride = 0;
  int block_tokens = 256;
  const int32_t* tail_slots = nullptr;  // [B]: per-channel keys (KVView::channel_tokens)
  const int32_t* done_first = nullptr;  // [B]: row b's first entry of KVView::done, -1: none
  KVView k, v;
};

void quantized_attention(const AttentionArgs& args);

// Row b's attention streamed key chunk by key chunk (KVSwap's prefill: between two chunks the
// caller puts the next chunk's blocks where the row's table says, e.g. evicted blocks read
// back into staging blocks). Key chunk c is keys [c * attention_chunk_keys(), ...) of every
// query (no sliding window); `states` holds each query's running softmax, from
// attention_stream_start; attention_stream_chunk folds chunk c (in order, 0 first) into it;
// attention_stream_finish writes the row's outputs. The same operations in the same order
// as quantized_attention, so the same bits. `args` describes row b alone or with others.
int attention_chunk_keys();
void attention_stream_start(const AttentionArgs& args, std::vector<float>& states);
void attention_stream_chunk(const AttentionArgs& args, int b, int chunk,
                            std::vector<float>& states);
void attention_stream_finish(const AttentionArgs& args, int b, std::vector<float>& states);

// "avx512-vnni", "avx512", "avx2-fma-f16c", "neon" or "portable": the lanes this CPU runs.
const char* attention_implementation();

}  // namespace agentkv
