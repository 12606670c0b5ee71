#include "thread_pool.h"

#include <algorithm>

namespace agentkv {

ThreadPool::ThreadPool(int workers) {
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] { work(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void ThreadPool::drain() {
  while (true) {
    size_t i;
    const std::function<void(size_t)>* job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (job_ == nullptr || next_ >= count_) {
        return;
      }
      i = next_++;
      job = job_;
    }
    (*job)(i);
    std::lock_guard<std::mutex> lock(mutex_);
    if (++finished_ == count_) {
      done_.notify_all();
    }
  }
}

void ThreadPool::work() {
  size_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) {
        return;
      }
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& f) {
  if (n <= 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  std::lock_guard<std::mutex> caller(caller_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &f;
    next_ = 0;
    count_ = n;
    finished_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return finished_ == count_; });
  job_ = nullptr;
}

ThreadPool& ThreadPool::shared() {
  static ThreadPool* pool = [] {
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    return new ThreadPool(static_cast<int>(std::min(4u, hw)) - 1);  // never destroyed
  }();
  return *pool;
}

}  // namespace agentkv
