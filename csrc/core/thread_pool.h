// A small persistent thread pool for the hot kernels (a GEMM runs ~200 times per
// decode step; spawning threads for each would cost more than the work).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace agentkv {

class ThreadPool {
 public:
  explicit ThreadPool(int workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Run f(0) .. f(n - 1) on the workers and the calling thread; returns when
  // all are done. Jobs from different callers run one after another.
  void run(size_t n, const std::function<void(size_t)>& f);
  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }

  // min(4, hardware threads) threads in all, the caller included.
  static ThreadPool& shared();

 private:
  void work();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex caller_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t next_ = 0;
  size_t count_ = 0;
  size_t finished_ = 0;
  size_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace agentkv
