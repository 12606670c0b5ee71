// KVSwap (docs/kvswap.md): one agent's KV kept mostly on disk while it decodes.
//
// The agent's leading blocks are *evicted*: their KV lives only in their block files
// (store format: per layer and component a tensor [heads, 256, width], docs/storage.md).
// Per layer a few *staging* blocks of the pool hold a reuse buffer of 64-token groups read
// back from those files: slot s is rows [64 (s % 4), 64 (s % 4) + 64) of staging block
// s / 4, and slot 0 always holds group 0 (the attention sinks). At each decode step and
// layer, `stage` scores every evicted group from a low-rank copy of its keys (per KV head,
// int8 [rank, tokens] with a float scale per 64-token group) and the step's query (see
// group_scores in kvswap.cpp), keeps the best
// `demand` groups resident (hits stay, misses are read with pread into the least recently
// demanded slots) and checks every read against a CRC-32C taken from the pool before the
// blocks were evicted. Attention then runs over the staging blocks followed by the agent's
// resident blocks, as one ordinary block table (every slot is a whole channel group, and
// positions live in the stored keys).
//
// Reading ahead: `predict(layer, q)` ranks a layer's groups one layer early, from a predicted
// query (the seed: the previous layer's input through this layer's norm and query
// projection), and reads the missing ones (on the set's own I/O thread where the page cache
// lacks them) while the previous layer computes; the next `stage` of that layer still ranks
// its own query and takes the groups it chose from what was read ahead.
//
// Plain C++: no Python, no MLX. Not thread-safe: one step at a time (the model thread);
// the I/O thread only reads files into a buffer the set hands it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace agentkv {

// One layer's arena as `stage` writes into it: each component's base and row bytes.
struct SwapArena {
  std::vector<uint8_t*> base;
  std::vector<int64_t> row_bytes;
  int64_t rows = 0;  // rows of each component
};

struct SwapStats {
  uint64_t steps = 0;       // stage calls (layers x decode steps)
  uint64_t hits = 0;        // demanded groups already resident
  uint64_t misses = 0;      // demanded groups read from disk
  uint64_t fills = 0;       // groups read to fill empty slots (the first step)
  uint64_t bytes_read = 0;  // bytes pread from the block files
  uint64_t read_ns = 0;     // time in pread, checking and placing (on either thread)
  uint64_t wait_ns = 0;     // of it, the model thread's: its own reads, waiting for and
                            // placing those read ahead (read_ns - wait_ns was hidden)
  uint64_t select_ns = 0;   // time scoring and choosing groups
  uint64_t predicted = 0;   // stage calls that found reads ahead for their layer
  uint64_t read_ahead = 0;  // groups read ahead (chosen from a predicted query)
  uint64_t ahead_used = 0;  // of them, groups the layer's own query chose
  uint64_t disk_reads = 0;  // groups the page cache could not give (read from the file)
};

class IoThread;

class KVSwapSet {
 public:
  // `paths`: the evicted blocks' files (store version 3: groups layout), in block order;
  // `offsets` [blocks][layers]: where each layer's group extents start in its file;
  // `row_bytes` [layers][comps];
  // `crcs` [blocks][layers][groups per block]: CRC-32C of each group's runs (component-
  // major, then head) as the pool held them. Opens every file (throws on failure).
  KVSwapSet(int layers, int kv_heads, int q_heads, int head_dim, int block_tokens, int group,
            int rank, int slots, int demand, float attention_scale,
            const std::vector<std::string>& paths, std::vector<int64_t> offsets,
            std::vector<int64_t> row_bytes, int comps, std::vector<uint32_t> crcs);
  ~KVSwapSet();
  KVSwapSet(const KVSwapSet&) = delete;  // (the I/O thread holds `this`)
  KVSwapSet& operator=(const KVSwapSet&) = delete;

  // A layer's query projection per KV head, B [kv_heads][head_dim][rank], and its evicted
  // tokens' low-rank keys (k - mean) A (A: the keys' projection, applied by the caller):
  // int8 [blocks][kv_heads][rank][block_tokens] and a scale per KV head and group
  // [blocks][kv_heads][groups per block].
  // A query q scores key k as (q B) . ((k - mean) A).
  void set_layer(int layer, const float* query_projection, const int8_t* keys, const float* scales);
  // One more evicted block (low-rank keys only), after the others: its file, its layers'
  // offsets [layers], its groups' checksums [layers][groups per block], and per layer
  // its low-rank keys [kv_heads][rank][block_tokens] and scales [kv_heads][groups per block].
  void add_block(const std::string& path, const std::vector<int64_t>& offsets,
                 const std::vector<uint32_t>& crcs, const std::vector<const int8_t*>& keys,
                 const std::vector<const float*>& scales);
  // Or a layer's per-channel bounds of each group's keys, lo and hi [kv_heads][groups][dim]
  // (format 2 stores them: a group's bias and bias + scale * levels); they take precedence.
  void set_bounds(int layer, const float* lo, const float* hi);
  // Keep the low-rank keys in a file instead of memory: an unlinked temporary file in `dir`
  // (the page cache's memory, not the process's), room for `capacity` evicted blocks; each
  // scoring reads its layer's keys back (one pread). Before set_layer; throws if the file
  // cannot be made.
  void keys_to_file(const std::string& dir, int capacity);
  bool keys_in_file() const {
    return keys_fd_ >= 0;
  }
  // The staging blocks (the pool blocks a row's table starts with while it decodes).
  void set_staging(std::vector<int32_t> staging);
  const std::vector<int32_t>& staging() const {
    return staging_;
  }
  // A prefill over the evicted blocks (docs/kvswap.md): evicted block `block`'s rows of
  // `layer` read back whole into staging block `which`, each group checked against its
  // checksum; the slots of that staging block hold these groups afterwards (the next stage
  // reads what it needs again). False (and `error()` set) if a read failed.
  bool load_block(int layer, int block, const SwapArena& arena, int which);

  // Make this layer's slots hold the groups `q` (rotated queries [q_heads, head_dim] of the
  // row's new token) needs, reading into `arena` at the staging blocks `staging`
  // (slots / groups-per-block of them). False (and `error()` set) if a read failed or did
  // not match its checksum; the row's attention must not run on it.
  bool stage(int layer, const float* q, const SwapArena& arena, const int32_t* staging);

  // Read ahead for `layer`: choose its groups now from a predicted query `q` (as stage's)
  // and start reading the missing ones (those in the page cache are copied at once, the
  // others read on the I/O thread). The next stage() call, if it is for `layer`, still
  // chooses from its own query, and takes the groups read ahead that it chose. False
  // (nothing started) below predict_from or after a failure.
  bool predict(int layer, const float* q);
  // Whether a step should read ahead for `layer`: at or above predict_from, and while
  // reads go to disk (a read in the last kAheadSteps steps missed the page cache): from the
  // page cache, reading costs less than predicting. With read_ahead_always, at or above
  // predict_from whatever the reads cost.
  bool predicts(int layer) const;
  static constexpr int kAheadSteps = 4;
  // The first layer read ahead (layers_: none, the default).
  int predict_from() const {
    return predict_from_;
  }
  void set_predict_from(int layer);
  // Read ahead whether or not reads go to disk. Off by default: whether a read "went to
  // disk" is RWF_NOWAIT's answer, and storage that serves a dropped page while the call
  // waits answers "cached"; the tests pin the read-ahead path with it.
  bool read_ahead_always() const {
    return ahead_always_;
  }
  void set_read_ahead_always(bool on) {
    ahead_always_ = on;
  }

  // Which evicted group each of a layer's slots holds (-1: empty).
  const std::vector<int32_t>& slot_groups(int layer) const {
    return layer_state_[layer].slot_group;
  }
  // The groups `stage` would demand for `q` (best first), for tests.
  std::vector<int32_t> ranked(int layer, const float* q) const;

  const SwapStats& stats() const {
    return stats_;
  }
  const std::string& error() const {
    return error_;
  }
  int failed_block() const {  // the evicted block whose read failed, or -1
    return failed_block_;
  }
  int blocks() const {
    return blocks_;
  }
  bool block_sizes_ok(size_t keys, size_t scales) const {
    return keys == static_cast<size_t>(kv_heads_) * rank_ * block_tokens_ &&
           scales == static_cast<size_t>(kv_heads_) * groups_per_block_;
  }
  bool query_size_ok(size_t n) const {
    return n == static_cast<size_t>(q_heads_) * head_dim_;
  }
  bool bounds_size_ok(size_t n) const {
    return n == static_cast<size_t>(kv_heads_) * blocks_ * groups_per_block_ * head_dim_;
  }
  bool layer_sizes_ok(size_t projection, size_t keys, size_t scales) const {
    const size_t tokens = static_cast<size_t>(blocks_) * block_tokens_;
    return projection == static_cast<size_t>(kv_heads_) * head_dim_ * rank_ &&
           keys == static_cast<size_t>(kv_heads_) * rank_ * tokens &&
           scales == static_cast<size_t>(kv_heads_) * blocks_ * groups_per_block_;
  }
  int slots() const {
    return slots_;
  }
  int demand() const {
    return demand_;
  }
  void set_demand(int demand);
  int64_t resident_bytes() const;  // the low-rank keys and the slot tables

 private:
  struct Layer {
    std::vector<float> projection;  // [kv_heads][head_dim][rank]
    // [blocks][kv_heads][rank / 4][block_tokens][4]: each token's int8 key + 128, four
    // ranks side by side (the operand order of vpdpbusd); in the keys file where there is one
    std::vector<uint8_t> keys;
    bool has_keys = false;
    std::vector<float> scales;  // [blocks][kv_heads][groups per block]
    std::vector<int32_t> slot_group;
    std::vector<uint64_t> slot_used;
    std::vector<int32_t> where;  // group -> slot, or -1
    std::vector<float> lo, hi;   // [kv_heads][groups][head_dim]
  };
  // A step's choice for a layer: the demanded groups (best first) and those to read (the
  // sinks' group 0 first if its slot lost it, then in group order).
  struct Plan {
    std::vector<int32_t> order, load;
    size_t misses = 0;  // of `load`, demanded groups (the rest fill empty slots)
    bool sink = false;
  };
  // One group's extent in its block file.
  struct Extent {
    int block = 0, fd = -1;
    int64_t offset = 0, size = 0;
    uint32_t crc = 0;
  };
  // Reads ahead for a layer: the groups of a predicted plan (`plan.load`), read into
  // `bytes` one extent after the other, each with how its read ended (read_extent's codes);
  // the I/O thread writes those not in the page cache, and the model thread reads them
  // only after wait().
  struct Ahead {
    int layer = -1;
    Plan plan;
    std::vector<Extent> extents;
    std::vector<uint8_t> bytes;
    std::vector<int> status;
    uint64_t read_ns = 0;  // on the I/O thread
  };

  std::vector<float> group_scores(int layer, const float* q) const;
  // A layer's low-rank keys (read back from the keys file where they are kept there, into a
  // buffer valid until the next call), or null if that read failed (keys_error_ says why).
  const uint8_t* layer_keys(int layer) const;
  int64_t block_key_bytes() const {
    return static_cast<int64_t>(kv_heads_) * rank_ * block_tokens_;
  }
  void write_keys(int layer, int block, const uint8_t* keys, int64_t bytes);
  std::vector<float> softmax_sum(const std::vector<float>& best, int groups) const;
  Plan plan(int layer, const float* q);
  Extent extent_of(int layer, int group) const;
  // How a read ended: kReadOk, kShort (the file ends first), kChecksum, kNotCached, or an
  // errno (> 0).
  static constexpr int kReadOk = 0, kShort = -1, kChecksum = -2, kNotCached = -3;
  static int read_extent(const Extent& e, uint8_t* out);
  static int read_cached(const Extent& e, uint8_t* out);
  void fail_read(int layer, int group, int how);
  bool place(int layer, int group, int slot, const uint8_t* src, const SwapArena& arena,
             const int32_t* staging);
  void settle();  // wait for a read ahead and drop it (before anything changes the set)

  int layers_, kv_heads_, q_heads_, head_dim_, block_tokens_, group_, rank_, slots_, demand_;
  float attention_scale_;
  int groups_per_block_, blocks_, comps_;
  std::vector<int> fds_;
  std::vector<std::string> paths_;
  std::vector<int64_t> offsets_, row_bytes_;
  std::vector<uint8_t> extent_;  // one group as read, before it goes to its rows
  std::vector<uint32_t> crcs_;
  std::vector<Layer> layer_state_;
  int predict_from_;
  uint64_t last_disk_tick_ = 0;  // the last stage call (tick) whose reads missed the page cache
  bool ahead_always_ = false;
  std::unique_ptr<Ahead> ahead_;
  std::unique_ptr<IoThread> io_;
  uint64_t tick_ = 0;
  SwapStats stats_;
  std::string error_;
  int failed_block_ = -1;
  std::vector<int32_t> staging_;
  int keys_fd_ = -1, keys_capacity_ = 0;
  mutable std::vector<uint8_t> keys_buffer_;
  mutable std::string keys_error_;
};

}  // namespace agentkv
