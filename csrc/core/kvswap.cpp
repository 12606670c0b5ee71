#include "kvswap.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "block_io.h"
#include "checksum.h"

namespace agentkv {
namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

KVSwapSet::KVSwapSet(int layers, int kv_heads, int q_heads, int head_dim, int block_tokens,
                     int group, int rank, int slots, int demand, float attention_scale,
                     const std::vector<std::string>& paths, std::vector<int64_t> offsets,
                     std::vector<int64_t> row_bytes, int comps, std::vector<uint32_t> crcs)
    : layers_(layers),
      kv_heads_(kv_heads),
      q_heads_(q_heads),
      head_dim_(head_dim),
      block_tokens_(block_tokens),
      group_(group),
      rank_(rank),
      slots_(slots),
      demand_(0),
      attention_scale_(attention_scale),
      groups_per_block_(group > 0 ? block_tokens / group : 0),
      blocks_(static_cast<int>(paths.size())),
      comps_(comps),
      paths_(paths),
      offsets_(std::move(offsets)),
      row_bytes_(std::move(row_bytes)),
      crcs_(std::move(crcs)) {
  if (layers < 1 || kv_heads < 1 || q_heads < kv_heads || q_heads % kv_heads || head_dim < 8 ||
      head_dim % 8 || group != static_cast<int>(kGroupTokens) || block_tokens % group || rank < 1 ||
      comps < 1 || q_heads / kv_heads > 8 || slots < 2 || slots % groups_per_block_) {
    throw std::invalid_argument("kvswap: bad geometry");
  }
  const size_t groups = static_cast<size_t>(blocks_) * groups_per_block_;
  if (blocks_ < 1 || offsets_.size() != static_cast<size_t>(blocks_) * layers ||
      row_bytes_.size() != static_cast<size_t>(layers) * comps || crcs_.size() != groups * layers) {
    throw std::invalid_argument("kvswap: offsets, row bytes or checksums of the wrong size");
  }
  for (const auto& path : paths_) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const std::string reason = std::strerror(errno);
      for (int open_fd : fds_) {
        ::close(open_fd);
      }
      throw std::runtime_error("kvswap: cannot open block file " + path + ": " + reason);
    }
    fds_.push_back(fd);
  }
  layer_state_.resize(layers);
  for (auto& l : layer_state_) {
    l.slot_group.assign(slots, -1);
    l.slot_used.assign(slots, 0);
    l.where.assign(groups, -1);
  }
  set_demand(demand);
}

KVSwapSet::~KVSwapSet() {
  for (int fd : fds_) {
    ::close(fd);
  }
}

void KVSwapSet::set_demand(int demand) {
  demand_ = std::max(1, std::min(demand, slots_ - 1));
}

void KVSwapSet::set_layer(int layer, const float* query_projection, const int8_t* keys,
                          const float* scales) {
  if (layer < 0 || layer >= layers_) {
    throw std::out_of_range("kvswap: no such layer");
  }
  auto& l = layer_state_[layer];
  const size_t tokens = static_cast<size_t>(blocks_) * block_tokens_;
  const size_t groups = static_cast<size_t>(blocks_) * groups_per_block_;
  l.projection.assign(query_projection,
                      query_projection + static_cast<size_t>(kv_heads_) * head_dim_ * rank_);
  l.keys.assign(keys, keys + static_cast<size_t>(kv_heads_) * rank_ * tokens);
  l.scales.assign(scales, scales + static_cast<size_t>(kv_heads_) * groups);
}

void KVSwapSet::add_block(const std::string& path, const std::vector<int64_t>& offsets,
                          const std::vector<uint32_t>& crcs, const std::vector<const int8_t*>& keys,
                          const std::vector<const float*>& scales) {
  if (offsets.size() != static_cast<size_t>(layers_) ||
      crcs.size() != static_cast<size_t>(layers_) * groups_per_block_ ||
      keys.size() != static_cast<size_t>(layers_) || scales.size() != keys.size()) {
    throw std::invalid_argument("kvswap: a block's offsets, checksums or keys have bad sizes");
  }
  for (const auto& l : layer_state_) {
    if (l.keys.empty()) {
      throw std::invalid_argument("kvswap: blocks join only a set with low-rank keys");
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error("kvswap: cannot open block file " + path + ": " +
                             std::strerror(errno));
  }
  fds_.push_back(fd);
  paths_.push_back(path);
  offsets_.insert(offsets_.end(), offsets.begin(), offsets.end());
  crcs_.insert(crcs_.end(), crcs.begin(), crcs.end());
  const size_t block_keys = static_cast<size_t>(kv_heads_) * rank_ * block_tokens_;
  const size_t block_scales = static_cast<size_t>(kv_heads_) * groups_per_block_;
  for (int layer = 0; layer < layers_; ++layer) {
    auto& l = layer_state_[layer];
    l.keys.insert(l.keys.end(), keys[layer], keys[layer] + block_keys);
    l.scales.insert(l.scales.end(), scales[layer], scales[layer] + block_scales);
    l.where.resize(l.where.size() + groups_per_block_, -1);
  }
  ++blocks_;
}

int64_t KVSwapSet::resident_bytes() const {
  int64_t total = 0;
  for (const auto& l : layer_state_) {
    total += static_cast<int64_t>(l.keys.size() + l.scales.size() * sizeof(float) +
                                  (l.lo.size() + l.hi.size()) * sizeof(float) +
                                  l.projection.size() * sizeof(float) +
                                  l.slot_group.size() * (sizeof(int32_t) + sizeof(uint64_t)) +
                                  l.where.size() * sizeof(int32_t));
  }
  return total;
}

namespace {

// The scoring loop in AVX2 where the CPU has it (GCC picks the clone when the library loads).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define AGENTKV_SCORE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AGENTKV_SCORE_CLONES
#endif

// out[h] = max over the group's tokens t of sum_j q[h][j] * keys[j][t] for `per` queries at
// once (keys: int8 [rank][tokens] of one KV head). Plain loops the compiler vectorizes; each
// row of keys is converted once for every query.
AGENTKV_SCORE_CLONES void group_maxima(const int8_t* keys, int64_t tokens, int rank, const float* q,
                                       int per, int64_t first, int group, float* out) {
  constexpr int kMaxPer = 8, kMaxGroup = 64;
  float acc[kMaxPer][kMaxGroup];
  for (int h = 0; h < per; ++h) {
    std::fill_n(acc[h], group, 0.0f);
  }
  float kf[kMaxGroup];
  for (int j = 0; j < rank; ++j) {
    const int8_t* k = keys + j * tokens + first;
    for (int t = 0; t < group; ++t) {
      kf[t] = static_cast<float>(k[t]);
    }
    for (int h = 0; h < per; ++h) {
      const float c = q[h * rank + j];
      float* a = acc[h];
      for (int t = 0; t < group; ++t) {
        a[t] += c * kf[t];
      }
    }
  }
  for (int h = 0; h < per; ++h) {
    float m[8];
    std::copy_n(acc[h], 8, m);
    for (int t = 8; t < group; t += 8) {
      for (int l = 0; l < 8; ++l) {
        m[l] = std::max(m[l], acc[h][t + l]);
      }
    }
    out[h] = *std::max_element(m, m + 8);
  }
}

// The largest q . k any key inside per-channel bounds [lo, hi] can give (Quest's bound).
AGENTKV_SCORE_CLONES float bound_score(const float* q, const float* lo, const float* hi, int dim) {
  float acc[8] = {};
  for (int d = 0; d < dim; d += 8) {
    for (int l = 0; l < 8; ++l) {
      acc[l] += std::max(q[d + l] * lo[d + l], q[d + l] * hi[d + l]);
    }
  }
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

}  // namespace

// Each evicted group's score for the query: per query head, the softmax over the groups of
// each group's best token score (low-rank keys: (k - mean) A per KV head, the head's query
// projected through the same A), summed over the query heads. A head that attends to one
// place gives that group ~1, a head that attends everywhere gives each group little.
std::vector<float> KVSwapSet::group_scores(int layer, const float* q) const {
  const auto& l = layer_state_[layer];
  const int per = q_heads_ / kv_heads_;
  const int groups = blocks_ * groups_per_block_;
  if (l.keys.empty() && l.lo.empty()) {
    return std::vector<float>(groups, 0.0f);
  }
  std::vector<float> best(static_cast<size_t>(q_heads_) * groups);  // [q head][group]
  if (!l.lo.empty()) {  // per-channel bounds of each group's keys
    std::vector<float> qs(head_dim_);
    for (int h = 0; h < q_heads_; ++h) {
      for (int d = 0; d < head_dim_; ++d) {
        qs[d] = q[static_cast<size_t>(h) * head_dim_ + d] * attention_scale_;
      }
      const size_t head = static_cast<size_t>(h / per) * groups * head_dim_;
      for (int G = 0; G < groups; ++G) {
        const size_t at = head + static_cast<size_t>(G) * head_dim_;
        best[static_cast<size_t>(h) * groups + G] =
            bound_score(qs.data(), l.lo.data() + at, l.hi.data() + at, head_dim_);
      }
    }
    return softmax_sum(best, groups);
  }
  std::vector<float> qt(static_cast<size_t>(q_heads_) * rank_, 0.0f);  // [q head][rank]
  for (int h = 0; h < q_heads_; ++h) {
    const float* a = l.projection.data() + static_cast<size_t>(h / per) * head_dim_ * rank_;
    float* out = qt.data() + static_cast<size_t>(h) * rank_;
    for (int d = 0; d < head_dim_; ++d) {
      const float v = q[static_cast<size_t>(h) * head_dim_ + d] * attention_scale_;
      for (int j = 0; j < rank_; ++j) {
        out[j] += v * a[static_cast<size_t>(d) * rank_ + j];
      }
    }
  }
  std::vector<float> maxima(per);
  for (int block = 0; block < blocks_; ++block) {
    for (int g = 0; g < kv_heads_; ++g) {
      const size_t head = static_cast<size_t>(block) * kv_heads_ + g;
      const int8_t* keys = l.keys.data() + head * rank_ * block_tokens_;
      const float* q_group = qt.data() + static_cast<size_t>(g) * per * rank_;
      for (int in_block = 0; in_block < groups_per_block_; ++in_block) {
        group_maxima(keys, block_tokens_, rank_, q_group, per,
                     static_cast<int64_t>(in_block) * group_, group_, maxima.data());
        const float scale = l.scales[head * groups_per_block_ + in_block];
        const int G = block * groups_per_block_ + in_block;
        for (int h = 0; h < per; ++h) {
          best[static_cast<size_t>(g * per + h) * groups + G] = maxima[h] * scale;
        }
      }
    }
  }
  return softmax_sum(best, groups);
}

// Per query head, the softmax of its group scores (group 0, always resident, left out),
// summed over the heads.
std::vector<float> KVSwapSet::softmax_sum(const std::vector<float>& best, int groups) const {
  std::vector<float> scores(groups, 0.0f);
  for (int h = 0; h < q_heads_; ++h) {
    const float* b = best.data() + static_cast<size_t>(h) * groups;
    const float top = *std::max_element(b + 1, b + groups);
    double total = 0.0;
    for (int G = 1; G < groups; ++G) {
      total += std::exp(static_cast<double>(b[G] - top));
    }
    for (int G = 1; G < groups; ++G) {
      scores[G] += static_cast<float>(std::exp(static_cast<double>(b[G] - top)) / total);
    }
  }
  return scores;
}

void KVSwapSet::set_bounds(int layer, const float* lo, const float* hi) {
  if (layer < 0 || layer >= layers_) {
    throw std::out_of_range("kvswap: no such layer");
  }
  auto& l = layer_state_[layer];
  const size_t n = static_cast<size_t>(kv_heads_) * blocks_ * groups_per_block_ * head_dim_;
  l.lo.assign(lo, lo + n);
  l.hi.assign(hi, hi + n);
}

std::vector<int32_t> KVSwapSet::ranked(int layer, const float* q) const {
  const std::vector<float> scores = group_scores(layer, q);
  std::vector<int32_t> order(scores.size() - 1);
  std::iota(order.begin(), order.end(), 1);  // group 0 is always resident (the sinks)
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  return order;
}

bool KVSwapSet::read_group(int layer, int group, int slot, const SwapArena& arena,
                           const int32_t* staging) {
  auto& l = layer_state_[layer];
  if (l.slot_group[slot] >= 0) {
    l.where[l.slot_group[slot]] = -1;
    l.slot_group[slot] = -1;
  }
  const int block = group / groups_per_block_, in_block = group % groups_per_block_;
  const int64_t staged = staging[slot / groups_per_block_];
  const int64_t first = static_cast<int64_t>(slot % groups_per_block_) * group_;
  if (staged < 0) {
    error_ = "kvswap: a staging block lies outside the pool";
    return false;
  }
  // The group is one extent of its block file (store version 3, groups layout): every
  // component's rows of this group, head by head, in the order the checksum covers them.
  int64_t extent = 0;
  for (int c = 0; c < comps_; ++c) {
    extent += static_cast<int64_t>(kv_heads_) * group_ *
              row_bytes_[static_cast<size_t>(layer) * comps_ + c];
  }
  const uint64_t start = now_ns();
  extent_.resize(static_cast<size_t>(extent));
  const int64_t offset = offsets_[static_cast<size_t>(block) * layers_ + layer] + in_block * extent;
  int64_t done = 0;
  while (done < extent) {
    const ssize_t n = ::pread(fds_[block], extent_.data() + done, extent - done, offset + done);
    if (n <= 0) {
      failed_block_ = block;
      error_ = "block file " + paths_[block] + ": " +
               (n == 0 ? std::string("file is shorter than its layout")
                       : std::string(std::strerror(errno)));
      return false;
    }
    done += n;
  }
  stats_.bytes_read += extent;
  const uint32_t crc = crc32c(extent_.data(), extent_.size());
  if (crc != crcs_[(static_cast<size_t>(block) * layers_ + layer) * groups_per_block_ + in_block]) {
    stats_.read_ns += now_ns() - start;
    failed_block_ = block;
    error_ = "block file " + paths_[block] + ": layer " + std::to_string(layer) + ", tokens " +
             std::to_string(in_block * group_) + "-" + std::to_string((in_block + 1) * group_) +
             " do not match their checksum";
    return false;
  }
  const uint8_t* src = extent_.data();
  for (int c = 0; c < comps_; ++c) {
    const int64_t rb = row_bytes_[static_cast<size_t>(layer) * comps_ + c];
    for (int h = 0; h < kv_heads_; ++h) {
      const int64_t row = (staged * kv_heads_ + h) * block_tokens_ + first;
      if (row + group_ > arena.rows) {
        error_ = "kvswap: a staging block lies outside the pool";
        return false;
      }
      std::memcpy(arena.base[c] + row * rb, src, group_ * rb);
      src += group_ * rb;
    }
  }
  stats_.read_ns += now_ns() - start;
  l.slot_group[slot] = group;
  l.where[group] = slot;
  return true;
}

bool KVSwapSet::stage(int layer, const float* q, const SwapArena& arena, const int32_t* staging) {
  if (!error_.empty()) {
    return false;
  }
  if (layer < 0 || layer >= layers_ || arena.base.size() != static_cast<size_t>(comps_)) {
    error_ = "kvswap: bad layer or arena";
    return false;
  }
  auto& l = layer_state_[layer];
  const uint64_t start = now_ns();
  const std::vector<int32_t> order = ranked(layer, q);
  stats_.select_ns += now_ns() - start;
  ++stats_.steps;
  const uint64_t tick = ++tick_;
  if (l.slot_group[0] != 0) {
    if (!read_group(layer, 0, 0, arena, staging)) {
      return false;
    }
    ++stats_.fills;
  }
  l.slot_used[0] = tick;
  const size_t want = std::min(static_cast<size_t>(demand_), order.size());
  for (size_t i = 0; i < want; ++i) {
    const int32_t at = l.where[order[i]];
    if (at >= 0) {
      l.slot_used[at] = tick;
      ++stats_.hits;
    }
  }
  // What to read: the demanded groups missing, and while slots are empty (the first step)
  // the next best groups too, since attention reads every slot. In group order, so a
  // buffer that holds every evicted group holds them as the table did.
  std::vector<int32_t> load;
  for (size_t i = 0; i < want; ++i) {
    if (l.where[order[i]] < 0) {
      load.push_back(order[i]);
    }
  }
  const size_t misses = load.size();
  const size_t empty = static_cast<size_t>(
      std::count(l.slot_group.begin() + 1, l.slot_group.end(), static_cast<int32_t>(-1)));
  for (size_t i = want; i < order.size() && load.size() < empty; ++i) {
    if (l.where[order[i]] < 0) {
      load.push_back(order[i]);
    }
  }
  std::sort(load.begin(), load.end());
  for (int32_t g : load) {
    int victim = -1;  // an empty slot, else the least recently demanded one
    for (int s = 1; s < slots_; ++s) {
      if (l.slot_group[s] < 0) {
        victim = s;
        break;
      }
      if (l.slot_used[s] != tick && (victim < 0 || l.slot_used[s] < l.slot_used[victim])) {
        victim = s;
      }
    }
    if (victim < 0 || !read_group(layer, g, victim, arena, staging)) {
      if (error_.empty()) {
        error_ = "kvswap: no slot to read a group into";
      }
      return false;
    }
    l.slot_used[victim] = tick;
  }
  stats_.misses += misses;
  stats_.fills += load.size() - misses;
  for (int s = 0; s < slots_; ++s) {
    if (l.slot_group[s] < 0) {
      error_ = "kvswap: fewer evicted groups than staging slots";
      return false;
    }
  }
  return true;
}

}  // namespace agentkv
