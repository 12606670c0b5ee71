// Runs a kernel body written for a GPU threadgroup on the host, with its lanes as a loop.
//
// A body (kernels/*.metal) that shares data between its threads names three operations,
// spelled per backend (kernels/README.md): a threadgroup barrier, an exchange of a value
// between the lanes of a SIMD group (`KV_SHUFFLE_XOR`), and threadgroup memory. Here each
// thread of a threadgroup is a C++20 coroutine: the body runs as written until it reaches
// one of those points, where the thread suspends. `Group::run` resumes the threads in order;
// once every thread a point concerns has reached it (all 32 lanes of a SIMD group for an
// exchange, every thread for a barrier), it resolves the point and the threads go on. A
// body that reaches these points out of step (an exchange some lanes skip, a barrier inside
// a branch some threads do not take: undefined on a GPU) throws `std::logic_error` here, so
// the CPU tests catch what a GPU would only get wrong.
#pragma once

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <vector>

namespace agentkv::simt {

constexpr int kSimdWidth = 32;  // Apple GPUs' SIMD groups and NVIDIA's warps

enum class Wait : uint8_t { kNone, kBarrier, kShuffle, kDone };

struct Thread {
  struct promise_type {
    Wait wait = Wait::kNone;
    uint32_t value = 0;  // the bits a shuffle offers, then the bits it receives
    int mask = 0;
    std::exception_ptr error;

    Thread get_return_object() {
      return Thread{std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    std::suspend_always initial_suspend() noexcept {
      return {};
    }
    std::suspend_always final_suspend() noexcept {
      wait = Wait::kDone;
      return {};
    }
    void return_void() {}
    void unhandled_exception() {
      error = std::current_exception();
      wait = Wait::kDone;
    }
  };

  explicit Thread(std::coroutine_handle<promise_type> h) : handle(h) {}
  Thread(Thread&& other) noexcept : handle(other.handle) {
    other.handle = nullptr;
  }
  Thread(const Thread&) = delete;
  Thread& operator=(const Thread&) = delete;
  Thread& operator=(Thread&&) = delete;
  ~Thread() {
    if (handle) {
      handle.destroy();
    }
  }

  std::coroutine_handle<promise_type> handle;
};

// What a suspended thread waits at.
struct Barrier {
  bool await_ready() const noexcept {
    return false;
  }
  void await_suspend(std::coroutine_handle<Thread::promise_type> h) const noexcept {
    h.promise().wait = Wait::kBarrier;
  }
  void await_resume() const noexcept {}
};

template <typename T>
struct Shuffle {
  static_assert(sizeof(T) == 4, "lanes exchange 32-bit values");
  T value;
  int mask;
  Thread::promise_type* promise = nullptr;

  bool await_ready() const noexcept {
    return false;
  }
  void await_suspend(std::coroutine_handle<Thread::promise_type> h) noexcept {
    promise = &h.promise();
    promise->wait = Wait::kShuffle;
    promise->mask = mask;
    std::memcpy(&promise->value, &value, 4);
  }
  T await_resume() const noexcept {
    T out;
    std::memcpy(&out, &promise->value, 4);
    return out;
  }
};

// One threadgroup: its threads and its threadgroup memory.
class Group {
 public:
  // Threadgroup memory: the n-th array a thread declares is the group's n-th array (every
  // thread declares the same arrays in the same order), zeroed (a GPU's is undefined: a
  // body must write before it reads).
  template <typename T>
  T* shared(int& index, size_t count) {
    const size_t at = static_cast<size_t>(index++);
    if (at == arrays_.size()) {
      arrays_.emplace_back(new std::byte[count * sizeof(T)]());
    }
    return reinterpret_cast<T*>(arrays_[at].get());
  }

  // Runs threads made by `start(tid)` (a coroutine of the body) to completion.
  template <typename Start>
  void run(int threads, const Start& start) {
    std::vector<Thread> group;
    group.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      group.push_back(start(t));
    }
    std::vector<char> runnable(threads, 1);
    for (;;) {
      for (int t = 0; t < threads; ++t) {
        if (runnable[t]) {
          runnable[t] = 0;
          group[t].handle.promise().wait = Wait::kNone;
          group[t].handle.resume();
          if (auto error = group[t].handle.promise().error) {
            std::rethrow_exception(error);
          }
        }
      }
      if (!resolve(group, runnable)) {
        return;
      }
    }
  }

 private:
  // Releases the points every concerned thread has reached; false when all are done.
  static bool resolve(std::vector<Thread>& group, std::vector<char>& runnable) {
    const int threads = static_cast<int>(group.size());
    auto wait = [&](int t) { return group[t].handle.promise().wait; };
    int done = 0;
    int at_barrier = 0;
    bool released = false;
    for (int first = 0; first < threads; first += kSimdWidth) {
      const int last = first + kSimdWidth < threads ? first + kSimdWidth : threads;
      int shuffles = 0;
      for (int t = first; t < last; ++t) {
        shuffles += wait(t) == Wait::kShuffle;
        done += wait(t) == Wait::kDone;
        at_barrier += wait(t) == Wait::kBarrier;
      }
      if (shuffles == 0) {
        continue;
      }
      if (shuffles != last - first) {
        throw std::logic_error("kernel body: a SIMD shuffle that some lanes did not reach");
      }
      std::vector<uint32_t> offered(last - first);
      for (int t = first; t < last; ++t) {
        offered[t - first] = group[t].handle.promise().value;
      }
      for (int t = first; t < last; ++t) {
        auto& p = group[t].handle.promise();
        const int from = (t - first) ^ p.mask;
        if (from >= last - first) {
          throw std::logic_error("kernel body: a shuffle from a lane outside the SIMD group");
        }
        p.value = offered[from];
        runnable[t] = 1;
      }
      released = true;
    }
    if (released) {
      return true;
    }
    if (done == threads) {
      return false;
    }
    if (at_barrier + done == threads && done == 0) {
      for (int t = 0; t < threads; ++t) {
        runnable[t] = 1;
      }
      return true;
    }
    throw std::logic_error("kernel body: a barrier that some threads did not reach");
  }

  std::vector<std::unique_ptr<std::byte[]>> arrays_;
};

}  // namespace agentkv::simt
