#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace agentkv {
namespace {

constexpr int kSpinMicros = 200;  // how long an idle worker watches for the next job

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Wait for `done()`: spin, then give the core away now and then (a worker may have been
// descheduled in the middle of its task).
template <typename Done>
void spin_until(Done done) {
  for (int i = 1; !done(); ++i) {
    if (i % 1024 == 0) {
      std::this_thread::yield();
    } else {
      relax();
    }
  }
}

}  // namespace

ThreadPool::ThreadPool(int workers) {
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] { work(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    ++generation_;
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void ThreadPool::drain(Job& job) {
  for (size_t i = job.next++; i < job.count; i = job.next++) {
    if (!job.failed.load(std::memory_order_relaxed)) {
      try {
        (*job.f)(i);
      } catch (...) {  // (a worker's exception would end the process)
        if (!job.failed.exchange(true)) {
          job.error = std::current_exception();
        }
      }
    }
    job.finished.fetch_add(1, std::memory_order_release);  // publishes `error` too
  }
}

void ThreadPool::work() {
  uint64_t seen = 0;
  while (true) {
    // Spin a little for the next job, then sleep until one comes.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 0; generation_.load() == seen; ++i) {
      if (i % 64 == 63 && std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        ++sleepers_;
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        --sleepers_;
        break;
      }
      relax();
    }
    if (stop_) {
      return;
    }
    seen = generation_.load();
    ++inside_;
    if (Job* job = current_.load()) {
      drain(*job);
    }
    --inside_;
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
  Job job;
  job.f = &f;
  job.count = n;
  current_.store(&job);
  ++generation_;
  if (sleepers_.load() > 0) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
    }  // a worker between its check and its wait
    wake_.notify_all();
  }
  drain(job);
  spin_until([&] { return job.finished.load(std::memory_order_acquire) == n; });
  current_.store(nullptr);
  spin_until([&] { return inside_.load() == 0; });  // a late worker may hold the job's address
  if (job.error) {
    std::rethrow_exception(job.error);
  }
}

int ThreadPool::default_threads() {
  if (const char* env = std::getenv("AGENTKV_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1) {
      return static_cast<int>(std::min<long>(n, kMaxThreads));
    }
  }
#if defined(__linux__)
  cpu_set_t set;  // the CPUs this process may run on (taskset, a container's cpuset)
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, std::min(CPU_COUNT(&set), kMaxThreads));
  }
#endif
  return static_cast<int>(
      std::clamp(std::thread::hardware_concurrency(), 1u, static_cast<unsigned>(kMaxThreads)));
}

ThreadPool& ThreadPool::shared() {
  static ThreadPool* pool = new ThreadPool(default_threads() - 1);  // never destroyed
  return *pool;
}

}  // namespace agentkv
