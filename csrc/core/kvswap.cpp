#include "kvswap.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "block_io.h"
#include "checksum.h"
#include "cpu_features.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace agentkv {
namespace {

// int8 [kv_heads][rank][tokens] -> biased u8 [kv_heads][rank / 4][tokens][4].
void interleave_keys(const int8_t* keys, int kv_heads, int rank, int tokens, uint8_t* out) {
  for (int g = 0; g < kv_heads; ++g) {
    const int8_t* src = keys + static_cast<size_t>(g) * rank * tokens;
    uint8_t* dst = out + static_cast<size_t>(g) * rank * tokens;
    for (int r = 0; r < rank; ++r) {
      for (int t = 0; t < tokens; ++t) {
        dst[(static_cast<size_t>(r / 4) * tokens + t) * 4 + r % 4] =
            static_cast<uint8_t>(src[static_cast<size_t>(r) * tokens + t] + 128);
      }
    }
  }
}

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

// One thread that runs the set's reads ahead, one job at a time.
class IoThread {
 public:
  IoThread() : thread_([this] { loop(); }) {}
  ~IoThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;

  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      busy_ = true;
    }
    wake_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return !busy_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || job_; });
      if (stop_) {
        return;
      }
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::function<void()> job_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // last: it starts once the rest is built
};

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
      crcs_(std::move(crcs)),
      predict_from_(layers) {
  if (layers < 1 || kv_heads < 1 || q_heads < kv_heads || q_heads % kv_heads || head_dim < 8 ||
      head_dim % 8 || group != static_cast<int>(kGroupTokens) || block_tokens % group || rank < 4 ||
      rank % 4 || comps < 1 || q_heads / kv_heads > 8 || slots < 2 || slots % groups_per_block_) {
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
  settle();
  io_.reset();
  for (int fd : fds_) {
    ::close(fd);
  }
  if (keys_fd_ >= 0) {
    ::close(keys_fd_);
  }
}

void KVSwapSet::keys_to_file(const std::string& dir, int capacity) {
  if (keys_fd_ >= 0 || capacity < blocks_) {
    throw std::invalid_argument("kvswap: keys already in a file, or a capacity below the blocks");
  }
  for (const auto& l : layer_state_) {
    if (l.has_keys) {
      throw std::invalid_argument("kvswap: keys_to_file comes before set_layer");
    }
  }
  int fd = -1;
#if defined(O_TMPFILE)
  fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
  if (fd < 0) {  // no O_TMPFILE here: a named file, unlinked at once
    std::string path = dir + "/.kvswap-keys-XXXXXX";
    fd = ::mkstemp(path.data());
    if (fd >= 0) {
      ::unlink(path.c_str());
    }
  }
  if (fd < 0) {
    throw std::runtime_error("kvswap: cannot make a file for the low-rank keys in " + dir + ": " +
                             std::strerror(errno));
  }
  keys_fd_ = fd;
  keys_capacity_ = capacity;
}

void KVSwapSet::set_staging(std::vector<int32_t> staging) {
  if (staging.size() * groups_per_block_ != static_cast<size_t>(slots_)) {
    throw std::invalid_argument("kvswap: one staging block per groups-per-block slots");
  }
  staging_ = std::move(staging);
}

void KVSwapSet::write_keys(int layer, int block, const uint8_t* keys, int64_t bytes) {
  const int64_t at = (static_cast<int64_t>(layer) * keys_capacity_ + block) * block_key_bytes();
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(keys_fd_, keys + done, bytes - done, at + done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      throw std::runtime_error(std::string("kvswap: cannot write the low-rank keys: ") +
                               std::strerror(errno));
    }
    done += n;
  }
}

const uint8_t* KVSwapSet::layer_keys(int layer) const {
  const auto& l = layer_state_[layer];
  if (keys_fd_ < 0) {
    return l.keys.data();
  }
  const int64_t bytes = static_cast<int64_t>(blocks_) * block_key_bytes();
  const int64_t at = static_cast<int64_t>(layer) * keys_capacity_ * block_key_bytes();
  keys_buffer_.resize(static_cast<size_t>(bytes));
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(keys_fd_, keys_buffer_.data() + done, bytes - done, at + done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      keys_error_ = std::string("kvswap: cannot read the low-rank keys back: ") +
                    (n == 0 ? "the file is short" : std::strerror(errno));
      return nullptr;
    }
    done += n;
  }
  return keys_buffer_.data();
}

void KVSwapSet::set_demand(int demand) {
  settle();
  demand_ = std::max(1, std::min(demand, slots_ - 1));
}

void KVSwapSet::set_layer(int layer, const float* query_projection, const int8_t* keys,
                          const float* scales) {
  if (layer < 0 || layer >= layers_) {
    throw std::out_of_range("kvswap: no such layer");
  }
  settle();
  auto& l = layer_state_[layer];
  const size_t tokens = static_cast<size_t>(blocks_) * block_tokens_;
  const size_t groups = static_cast<size_t>(blocks_) * groups_per_block_;
  l.projection.assign(query_projection,
                      query_projection + static_cast<size_t>(kv_heads_) * head_dim_ * rank_);
  std::vector<uint8_t> interleaved(static_cast<size_t>(kv_heads_) * rank_ * tokens);
  for (int b = 0; b < blocks_; ++b) {
    const size_t block = static_cast<size_t>(b) * kv_heads_ * rank_ * block_tokens_;
    interleave_keys(keys + block, kv_heads_, rank_, block_tokens_, interleaved.data() + block);
  }
  if (keys_fd_ >= 0) {
    write_keys(layer, 0, interleaved.data(), static_cast<int64_t>(interleaved.size()));
  } else {
    l.keys = std::move(interleaved);
  }
  l.has_keys = true;
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
  settle();
  for (const auto& l : layer_state_) {
    if (!l.has_keys) {
      throw std::invalid_argument("kvswap: blocks join only a set with low-rank keys");
    }
  }
  if (keys_fd_ >= 0 && blocks_ >= keys_capacity_) {
    throw std::invalid_argument("kvswap: the low-rank keys' file holds no more blocks");
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
  std::vector<uint8_t> interleaved(block_keys);
  for (int layer = 0; layer < layers_; ++layer) {
    auto& l = layer_state_[layer];
    interleave_keys(keys[layer], kv_heads_, rank_, block_tokens_, interleaved.data());
    if (keys_fd_ >= 0) {
      write_keys(layer, blocks_, interleaved.data(), static_cast<int64_t>(block_keys));
    } else {
      l.keys.insert(l.keys.end(), interleaved.begin(), interleaved.end());
    }
    l.scales.insert(l.scales.end(), scales[layer], scales[layer] + block_scales);
    l.where.resize(l.where.size() + groups_per_block_, -1);
  }
  ++blocks_;
}

int64_t KVSwapSet::resident_bytes() const {
  int64_t total = 0;
  for (const auto& l : layer_state_) {
    total += static_cast<int64_t>(l.keys.capacity() + l.scales.size() * sizeof(float) +
                                  (l.lo.size() + l.hi.size()) * sizeof(float) +
                                  l.projection.size() * sizeof(float) +
                                  l.slot_group.size() * (sizeof(int32_t) + sizeof(uint64_t)) +
                                  l.where.size() * sizeof(int32_t));
  }
  return total + static_cast<int64_t>(keys_buffer_.capacity());
}

namespace {

// The scoring loop: AVX-512 VNNI where the CPU has it, else plain loops the compiler
// vectorizes (AVX2 where GCC can clone them). Integers throughout, so every path gives the
// same sums, hence the same scores and choices.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define AGENTKV_SCORE_CLONES __attribute__((target_clones("avx2", "default")))
#define AGENTKV_SCORE_VNNI 1
#else
#define AGENTKV_SCORE_CLONES
#endif

constexpr int kMaxPer = 8;  // query heads per KV head the scoring handles

// out[h] = max over the group's tokens t of sum_r q[h][r] * (key[r][t] + 128) for `per`
// queries at once. `keys`: one KV head's [rank / 4][block_tokens][4] biased keys, `q`:
// [per][rank] int8.
AGENTKV_SCORE_CLONES void group_maxima(const uint8_t* keys, int64_t tokens, int rank,
                                       const int8_t* q, int per, int64_t first, int group,
                                       int32_t* out) {
  constexpr int kMaxGroup = 64;
  int32_t acc[kMaxPer][kMaxGroup];
  for (int h = 0; h < per; ++h) {
    std::fill_n(acc[h], group, 0);
  }
  for (int r4 = 0; r4 < rank / 4; ++r4) {
    const uint8_t* k = keys + (r4 * tokens + first) * 4;
    for (int h = 0; h < per; ++h) {
      const int8_t* c = q + h * rank + r4 * 4;
      int32_t* a = acc[h];
      for (int t = 0; t < group; ++t) {
        a[t] += k[4 * t] * c[0] + k[4 * t + 1] * c[1] + k[4 * t + 2] * c[2] + k[4 * t + 3] * c[3];
      }
    }
  }
  for (int h = 0; h < per; ++h) {
    out[h] = *std::max_element(acc[h], acc[h] + group);
  }
}

#ifdef AGENTKV_SCORE_VNNI
// The same sums, 16 tokens x 4 ranks per vpdpbusd (u8 keys x s8 queries -> s32).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void group_maxima_vnni(
    const uint8_t* keys, int64_t tokens, int rank, const int8_t* q, int per, int64_t first,
    int group, int32_t* out) {
  for (int h0 = 0; h0 < per; h0 += 4) {
    const int n = std::min(4, per - h0);
    __m512i acc[4][4];
    for (int h = 0; h < 4; ++h) {
      for (int v = 0; v < 4; ++v) {
        acc[h][v] = _mm512_setzero_si512();
      }
    }
    for (int r4 = 0; r4 < rank / 4; ++r4) {
      const uint8_t* k = keys + (r4 * tokens + first) * 4;
      __m512i kv[4];
      for (int v = 0; v < group / 16; ++v) {
        kv[v] = _mm512_loadu_si512(k + 64 * v);
      }
      for (int h = 0; h < n; ++h) {
        int32_t word;
        std::memcpy(&word, q + (h0 + h) * rank + r4 * 4, 4);
        const __m512i c = _mm512_set1_epi32(word);
        for (int v = 0; v < group / 16; ++v) {
          acc[h][v] = _mm512_dpbusd_epi32(acc[h][v], kv[v], c);
        }
      }
    }
    for (int h = 0; h < n; ++h) {
      __m512i m = acc[h][0];
      for (int v = 1; v < group / 16; ++v) {
        m = _mm512_max_epi32(m, acc[h][v]);
      }
      out[h0 + h] = _mm512_reduce_max_epi32(m);
    }
  }
}
#endif

using GroupMaxima = void (*)(const uint8_t*, int64_t, int, const int8_t*, int, int64_t, int,
                             int32_t*);

// The scoring path this CPU runs (AGENTKV_CPU=portable: the plain loops).
GroupMaxima group_maxima_kernel() {
#ifdef AGENTKV_SCORE_VNNI
  static const GroupMaxima kernel =
      cpu_has_avx512_vnni() && !cpu_forced_portable() ? &group_maxima_vnni : &group_maxima;
  return kernel;
#else
  return &group_maxima;
#endif
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
  if (!l.has_keys && l.lo.empty()) {
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
  // Each head's projected query in int8 (a scale per head): the keys are int8 too, so a
  // group's sums are exact integers whichever path computes them.
  std::vector<int8_t> q8(qt.size());
  std::vector<float> q_scale(q_heads_);
  std::vector<int32_t> bias(q_heads_);  // 128 * sum of the head's int8 query: the keys' bias
  for (int h = 0; h < q_heads_; ++h) {
    const float* v = qt.data() + static_cast<size_t>(h) * rank_;
    float top = 0.0f;
    for (int j = 0; j < rank_; ++j) {
      top = std::max(top, std::fabs(v[j]));
    }
    q_scale[h] = top > 0.0f ? top / 127.0f : 1.0f;
    int32_t sum = 0;
    for (int j = 0; j < rank_; ++j) {
      const auto c = static_cast<int8_t>(std::lrint(v[j] / q_scale[h]));
      q8[static_cast<size_t>(h) * rank_ + j] = c;
      sum += c;
    }
    bias[h] = 128 * sum;
  }
  const uint8_t* all_keys = layer_keys(layer);
  if (all_keys == nullptr) {
    return {};  // (plan() fails the stage)
  }
  const GroupMaxima maxima_of = group_maxima_kernel();
  ThreadPool::shared().run(static_cast<size_t>(blocks_), [&](size_t block) {
    int32_t maxima[kMaxPer];
    for (int g = 0; g < kv_heads_; ++g) {
      const size_t head = block * kv_heads_ + g;
      const uint8_t* keys = all_keys + head * rank_ * block_tokens_;
      const int8_t* q_group = q8.data() + static_cast<size_t>(g) * per * rank_;
      for (int in_block = 0; in_block < groups_per_block_; ++in_block) {
        const int64_t first = static_cast<int64_t>(in_block) * group_;
        maxima_of(keys, block_tokens_, rank_, q_group, per, first, group_, maxima);
        const float scale = l.scales[head * groups_per_block_ + in_block];
        const size_t G = block * groups_per_block_ + in_block;
        for (int h = 0; h < per; ++h) {
          const int qh = g * per + h;
          best[static_cast<size_t>(qh) * groups + G] =
              static_cast<float>(maxima[h] - bias[qh]) * q_scale[qh] * scale;
        }
      }
    }
  });
  return softmax_sum(best, groups);
}

// Per query head, the softmax of its group scores (group 0, always resident, left out),
// summed over the heads.
std::vector<float> KVSwapSet::softmax_sum(const std::vector<float>& best, int groups) const {
  std::vector<float> scores(groups, 0.0f);
  std::vector<double> e(groups);
  for (int h = 0; h < q_heads_; ++h) {
    const float* b = best.data() + static_cast<size_t>(h) * groups;
    const float top = *std::max_element(b + 1, b + groups);
    double total = 0.0;
    for (int G = 1; G < groups; ++G) {
      e[G] = std::exp(static_cast<double>(b[G] - top));
      total += e[G];
    }
    for (int G = 1; G < groups; ++G) {
      scores[G] += static_cast<float>(e[G] / total);
    }
  }
  return scores;
}

void KVSwapSet::set_bounds(int layer, const float* lo, const float* hi) {
  if (layer < 0 || layer >= layers_) {
    throw std::out_of_range("kvswap: no such layer");
  }
  settle();
  auto& l = layer_state_[layer];
  const size_t n = static_cast<size_t>(kv_heads_) * blocks_ * groups_per_block_ * head_dim_;
  l.lo.assign(lo, lo + n);
  l.hi.assign(hi, hi + n);
}

std::vector<int32_t> KVSwapSet::ranked(int layer, const float* q) const {
  const std::vector<float> scores = group_scores(layer, q);
  if (scores.empty()) {
    return {};
  }
  std::vector<int32_t> order(scores.size() - 1);
  std::iota(order.begin(), order.end(), 1);  // group 0 is always resident (the sinks)
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  return order;
}

// The group is one extent of its block file (store version 3, groups layout): every
// component's rows of this group, head by head, in the order the checksum covers them.
KVSwapSet::Extent KVSwapSet::extent_of(int layer, int group) const {
  const int block = group / groups_per_block_, in_block = group % groups_per_block_;
  Extent e;
  for (int c = 0; c < comps_; ++c) {
    e.size += static_cast<int64_t>(kv_heads_) * group_ *
              row_bytes_[static_cast<size_t>(layer) * comps_ + c];
  }
  e.block = block;
  e.fd = fds_[block];
  e.offset = offsets_[static_cast<size_t>(block) * layers_ + layer] + in_block * e.size;
  e.crc = crcs_[(static_cast<size_t>(block) * layers_ + layer) * groups_per_block_ + in_block];
  return e;
}

// pread and check one extent into `out` (either thread: it touches nothing of the set):
// kReadOk when it matches its checksum, else kShort, kChecksum or errno.
int KVSwapSet::read_extent(const Extent& e, uint8_t* out) {
  int64_t done = 0;
  while (done < e.size) {
    const ssize_t n = ::pread(e.fd, out + done, e.size - done, e.offset + done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return n == 0 ? kShort : (errno > 0 ? errno : EIO);
    }
    done += n;
  }
  return crc32c(out, static_cast<size_t>(e.size)) == e.crc ? kReadOk : kChecksum;
}

// As read_extent where the whole extent is in the page cache (Linux: preadv2 with
// RWF_NOWAIT), else kNotCached and nothing read.
int KVSwapSet::read_cached(const Extent& e, uint8_t* out) {
#if defined(__linux__) && defined(RWF_NOWAIT)
  iovec io = {out, static_cast<size_t>(e.size)};
  const ssize_t n = ::preadv2(e.fd, &io, 1, e.offset, RWF_NOWAIT);
  if (n == e.size) {
    return crc32c(out, static_cast<size_t>(e.size)) == e.crc ? kReadOk : kChecksum;
  }
  if (n < 0 && errno != EAGAIN && errno != EOPNOTSUPP && errno != EINVAL && errno != ENOSYS) {
    return errno;
  }
#else
  (void)e;
  (void)out;
#endif
  return kNotCached;
}

void KVSwapSet::fail_read(int layer, int group, int how) {
  const int block = group / groups_per_block_, in_block = group % groups_per_block_;
  failed_block_ = block;
  error_ = "block file " + paths_[block] + ": ";
  if (how == kChecksum) {
    error_ += "layer " + std::to_string(layer) + ", tokens " + std::to_string(in_block * group_) +
              "-" + std::to_string((in_block + 1) * group_) + " do not match their checksum";
  } else {
    error_ += how == kShort ? std::string("file is shorter than its layout") : std::strerror(how);
  }
}

// Copy a group's extent (as read) into its slot's staging rows.
bool KVSwapSet::place(int layer, int group, int slot, const uint8_t* src, const SwapArena& arena,
                      const int32_t* staging) {
  auto& l = layer_state_[layer];
  if (l.slot_group[slot] >= 0) {
    l.where[l.slot_group[slot]] = -1;
    l.slot_group[slot] = -1;
  }
  const int64_t staged = staging[slot / groups_per_block_];
  const int64_t first = static_cast<int64_t>(slot % groups_per_block_) * group_;
  if (staged < 0) {
    error_ = "kvswap: a staging block lies outside the pool";
    return false;
  }
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
  l.slot_group[slot] = group;
  l.where[group] = slot;
  return true;
}

// The demanded groups missing, and while slots are empty (the first step) the next best
// groups too, since attention reads every slot; in group order, so a buffer that holds
// every evicted group holds them as the table did.
KVSwapSet::Plan KVSwapSet::plan(int layer, const float* q) {
  const auto& l = layer_state_[layer];
  const uint64_t start = now_ns();
  Plan p;
  p.order = ranked(layer, q);
  stats_.select_ns += now_ns() - start;
  p.sink = l.slot_group[0] != 0;
  const size_t want = std::min(static_cast<size_t>(demand_), p.order.size());
  for (size_t i = 0; i < want; ++i) {
    if (l.where[p.order[i]] < 0) {
      p.load.push_back(p.order[i]);
    }
  }
  p.misses = p.load.size();
  const size_t empty = static_cast<size_t>(
      std::count(l.slot_group.begin() + 1, l.slot_group.end(), static_cast<int32_t>(-1)));
  for (size_t i = want; i < p.order.size() && p.load.size() < empty; ++i) {
    if (l.where[p.order[i]] < 0) {
      p.load.push_back(p.order[i]);
    }
  }
  std::sort(p.load.begin(), p.load.end());
  if (p.sink) {
    p.load.insert(p.load.begin(), 0);
  }
  return p;
}

bool KVSwapSet::stage(int layer, const float* q, const SwapArena& arena, const int32_t* staging) {
  if (!error_.empty()) {
    return false;
  }
  if (layer < 0 || layer >= layers_ || arena.base.size() != static_cast<size_t>(comps_)) {
    settle();
    error_ = "kvswap: bad layer or arena";
    return false;
  }
  if (ahead_ && ahead_->layer != layer) {
    settle();  // a prediction this layer does not take (a step that stopped early)
  }
  // The layer's own query chooses (the same groups whether or not reads ran ahead), while
  // the reads ahead finish; they stay the set's (`settle` waits for them) until then.
  const Plan p = plan(layer, q);
  if (!keys_error_.empty()) {
    settle();
    error_ = keys_error_;
    return false;
  }
  std::unique_ptr<Ahead> ahead;
  if (ahead_) {
    const uint64_t start = now_ns();
    if (io_) {
      io_->wait();
    }
    ahead = std::move(ahead_);
    stats_.wait_ns += now_ns() - start;
    stats_.read_ns += ahead->read_ns;
    stats_.read_ahead += ahead->plan.load.size();
    stats_.bytes_read += ahead->bytes.size();
    ++stats_.predicted;
  }
  auto& l = layer_state_[layer];
  ++stats_.steps;
  const uint64_t tick = ++tick_;
  const uint64_t start = now_ns();
  const size_t want = std::min(static_cast<size_t>(demand_), p.order.size());
  for (size_t i = 0; i < want; ++i) {
    const int32_t at = l.where[p.order[i]];
    if (at >= 0) {
      l.slot_used[at] = tick;
      ++stats_.hits;
    }
  }
  l.slot_used[0] = tick;
  for (size_t i = 0; i < p.load.size(); ++i) {
    const int32_t g = p.load[i];
    const uint8_t* src = nullptr;
    int got = kNotCached;
    if (ahead) {  // read ahead? (both lists are in group order, the sinks' group first)
      const auto& read = ahead->plan.load;
      const auto it = std::find(read.begin(), read.end(), g);
      if (it != read.end()) {
        const size_t k = static_cast<size_t>(it - read.begin());
        got = ahead->status[k];
        src = ahead->bytes.data() + k * static_cast<size_t>(ahead->extents[0].size);
        stats_.ahead_used += got == kReadOk;
      }
    }
    if (got == kNotCached) {
      const Extent e = extent_of(layer, g);
      extent_.resize(static_cast<size_t>(e.size));
      got = read_cached(e, extent_.data());
      if (got == kNotCached) {
        got = read_extent(e, extent_.data());
        last_disk_tick_ = tick;
        ++stats_.disk_reads;
      }
      stats_.bytes_read += e.size;
      src = extent_.data();
    }
    if (got != kReadOk) {
      fail_read(layer, g, got);
      return false;
    }
    int victim = 0;  // the sinks' slot, else an empty slot or the least recently demanded
    if (g != 0 || !p.sink || i != 0) {
      victim = -1;
      for (int s = 1; s < slots_; ++s) {
        if (l.slot_group[s] < 0) {
          victim = s;
          break;
        }
        if (l.slot_used[s] != tick && (victim < 0 || l.slot_used[s] < l.slot_used[victim])) {
          victim = s;
        }
      }
    }
    if (victim < 0) {
      error_ = "kvswap: no slot to read a group into";
      return false;
    }
    if (!place(layer, g, victim, src, arena, staging)) {
      return false;
    }
    l.slot_used[victim] = tick;
  }
  const uint64_t spent = now_ns() - start;
  stats_.read_ns += spent;
  stats_.wait_ns += spent;
  stats_.misses += p.misses;
  stats_.fills += p.load.size() - p.misses;
  for (int s = 0; s < slots_; ++s) {
    if (l.slot_group[s] < 0) {
      error_ = "kvswap: fewer evicted groups than staging slots";
      return false;
    }
  }
  return true;
}

bool KVSwapSet::load_block(int layer, int block, const SwapArena& arena, int which) {
  if (!error_.empty()) {
    return false;
  }
  settle();
  if (layer < 0 || layer >= layers_ || block < 0 || block >= blocks_ || which < 0 ||
      static_cast<size_t>(which) >= staging_.size() ||
      arena.base.size() != static_cast<size_t>(comps_)) {
    error_ = "kvswap: bad layer, block, staging block or arena";
    return false;
  }
  const uint64_t start = now_ns();
  for (int in_block = 0; in_block < groups_per_block_; ++in_block) {
    const int group = block * groups_per_block_ + in_block;
    const Extent e = extent_of(layer, group);
    extent_.resize(static_cast<size_t>(e.size));
    int got = read_cached(e, extent_.data());
    if (got == kNotCached) {
      got = read_extent(e, extent_.data());
      ++stats_.disk_reads;
    }
    stats_.bytes_read += e.size;
    if (got != kReadOk) {
      fail_read(layer, group, got);
      return false;
    }
    const int slot = which * groups_per_block_ + in_block;
    if (!place(layer, group, slot, extent_.data(), arena, staging_.data())) {
      return false;
    }
    layer_state_[layer].slot_used[slot] = 0;  // the first a stage replaces
  }
  const uint64_t spent = now_ns() - start;
  stats_.read_ns += spent;
  stats_.wait_ns += spent;
  return true;
}

bool KVSwapSet::predicts(int layer) const {
  // only while reads go to disk: from the page cache, reading costs less than predicting
  if (!error_.empty() || layer < predict_from_ || layer >= layers_) {
    return false;
  }
  return ahead_always_ || (last_disk_tick_ > 0 &&
                           tick_ < last_disk_tick_ + static_cast<uint64_t>(kAheadSteps) * layers_);
}

bool KVSwapSet::predict(int layer, const float* q) {
  if (!error_.empty() || layer < predict_from_ || layer >= layers_) {
    return false;
  }
  settle();
  auto ahead = std::make_unique<Ahead>();
  ahead->layer = layer;
  ahead->plan = plan(layer, q);
  const size_t n = ahead->plan.load.size();
  ahead->status.assign(n, kNotCached);
  if (n > 0) {
    for (int32_t g : ahead->plan.load) {
      ahead->extents.push_back(extent_of(layer, g));
    }
    const size_t size = static_cast<size_t>(ahead->extents[0].size);
    ahead->bytes.resize(n * size);
    // Extents already in the page cache are copied here and now (a hand-off to the I/O
    // thread would cost more than the copy); the others are read on the I/O thread.
    std::vector<size_t> later;
    const uint64_t start = now_ns();
    for (size_t i = 0; i < n; ++i) {
      ahead->status[i] = read_cached(ahead->extents[i], ahead->bytes.data() + i * size);
      if (ahead->status[i] == kNotCached) {
        later.push_back(i);
      }
    }
    const uint64_t spent = now_ns() - start;
    stats_.read_ns += spent;
    stats_.wait_ns += spent;
    if (!later.empty()) {
      last_disk_tick_ = tick_;
      stats_.disk_reads += later.size();
      if (!io_) {
        io_ = std::make_unique<IoThread>();
      }
      io_->submit([a = ahead.get(), later = std::move(later), size] {
        const uint64_t begin = now_ns();
        for (size_t i : later) {
          a->status[i] = read_extent(a->extents[i], a->bytes.data() + i * size);
        }
        a->read_ns = now_ns() - begin;
      });
    }
  }
  ahead_ = std::move(ahead);
  return true;
}

void KVSwapSet::settle() {
  if (ahead_) {
    if (io_) {
      io_->wait();
    }
    // read, though no stage took them: they count as read
    stats_.read_ns += ahead_->read_ns;
    stats_.read_ahead += ahead_->plan.load.size();
    stats_.bytes_read += ahead_->bytes.size();
    ahead_.reset();
  }
}

void KVSwapSet::set_predict_from(int layer) {
  if (layer < 1) {
    throw std::invalid_argument("kvswap: layer 0 has no layer before it to predict it");
  }
  settle();
  predict_from_ = std::min(layer, layers_);
}

}  // namespace agentkv
