// A small persistent thread pool for the hot kernels (a matmul runs ~200 times per
// decode step, tens of microseconds apart; waking sleeping threads for each would cost
// as much as the work).
//
// Workers that finish a job spin for a short while (kSpinMicros) watching for the next
// one before they sleep on a condition variable, and the caller spins until the job's
// last task is done: between the kernels of one forward pass nobody sleeps, and an idle
// pool costs nothing after the spin.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
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

  // Run f(0) .. f(n - 1) on the workers and the calling thread; returns when all are
  // done. Jobs from different callers run one after another. Where a task throws (on any
  // thread), the tasks not yet started are skipped and run() rethrows the first exception,
  // once no thread runs a task of the job any more: the pool goes on serving.
  void run(size_t n, const std::function<void(size_t)>& f);
  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }

  // default_threads() threads in all, the caller included.
  static ThreadPool& shared();
  // AGENTKV_THREADS where it is set (an integer >= 1), else the CPUs this process may run on
  // (its affinity: taskset, a container's cpuset), at most kMaxThreads.
  static int default_threads();
  static constexpr int kMaxThreads = 256;

 private:
  struct Job {
    const std::function<void(size_t)>* f;
    size_t count;
    std::atomic<size_t> next{0};
    std::atomic<size_t> finished{0};  // tasks run or skipped
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // the first task's exception (written by whoever set `failed`)
  };

  void work();
  static void drain(Job& job);

  std::vector<std::thread> workers_;
  std::mutex caller_mutex_;  // one job at a time
  // The job being run (null between jobs). A worker counts itself in `inside_` before it
  // reads `current_` and out when done with it; the caller clears `current_` and waits for
  // `inside_` to reach zero before its Job (on its stack) goes away.
  std::atomic<Job*> current_{nullptr};
  std::atomic<int> inside_{0};
  std::atomic<uint64_t> generation_{0};  // one more per job: what spinning workers watch
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;  // for sleeping workers only
  std::condition_variable wake_;
};

}  // namespace agentkv
