// The host kernels' thread pool (csrc/core/thread_pool.cpp) when a task throws: run()
// rethrows the first exception, on whichever thread it was thrown, only once no thread runs
// a task of that job, and the pool serves the next jobs. Prints "ok" and exits 0, or names
// what failed and exits 1 (a worker's exception that escaped ends the process: abort).
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "core/thread_pool.h"

namespace {

int fail(const std::string& what) {
  std::fprintf(stderr, "thread pool: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main() {
  agentkv::ThreadPool pool(3);  // three workers and the caller, whatever this machine has
  std::atomic<int> running{0};
  for (int round = 0; round < 2000; ++round) {
    const size_t tasks = 64 + round % 64;
    const size_t throws_at = static_cast<size_t>(round) % tasks;  // any task, any thread
    std::atomic<size_t> ran{0};
    try {
      pool.run(tasks, [&](size_t i) {
        ++running;
        ++ran;
        volatile double spin = 0;
        for (int k = 0; k < 200; ++k) {
          spin = spin + k;  // long enough for the workers to take tasks too
        }
        --running;
        if (i == throws_at || (round % 7 == 0 && i % 5 == 0)) {
          throw std::runtime_error("task " + std::to_string(i));
        }
      });
      return fail("round " + std::to_string(round) + ": run() returned without the exception");
    } catch (const std::runtime_error& e) {
      if (std::string(e.what()).rfind("task ", 0) != 0) {
        return fail(std::string("an exception that no task threw: ") + e.what());
      }
    }
    if (running.load() != 0) {
      return fail("run() returned while a task of its job still ran");
    }
    if (ran.load() == 0 || ran.load() > tasks) {
      return fail("round " + std::to_string(round) + ": " + std::to_string(ran.load()) +
                  " tasks ran of " + std::to_string(tasks));
    }
    // The next job, with no exception, runs every task once.
    std::atomic<size_t> sum{0};
    pool.run(1000, [&](size_t i) { sum += i; });
    if (sum.load() != 999 * 1000 / 2) {
      return fail("a job after a failed one summed " + std::to_string(sum.load()));
    }
  }
  std::puts("ok");
  return 0;
}
