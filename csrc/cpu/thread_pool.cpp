#include "csrc/cpu/thread_pool.h"

#include <chrono>
#include <cstdlib>
#include <exception>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace mlx_attn::cpu {
namespace {

inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Calls done() until it holds or `microseconds` have passed; whether it held.
template <typename Done>
bool spin_until(int microseconds, Done&& done) {
  if (microseconds <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(microseconds);
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      spin_pause();
    }
    // another runnable thread (the caller's serial work, another process) gets the core first
    std::this_thread::yield();
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads, int spin_microseconds)
    : spin_microseconds_(spin_microseconds), runs_(threads > 1 ? threads : 1) {
  for (int slot = 1; slot < threads; ++slot) {
    workers_.emplace_back([this, slot] { worker_loop(slot); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

bool ThreadPool::claim(uint32_t generation, int slot, int64_t* index) {
  const int count = int(runs_.size());
  for (int i = 0; i < count; ++i) {
    Run& run = runs_[(slot + i) % count];
    const int64_t end = run.end.load();
    uint64_t current = run.next.load();
    while (true) {
      if (uint32_t(current >> 32) != generation) return false;
      const int64_t at = int64_t(current & 0xffffffffu);
      if (at >= end) break;  // this run is done: the next one
      if (run.next.compare_exchange_weak(current, current + 1)) {
        *index = at;
        return true;
      }
    }
  }
  return false;
}

void ThreadPool::finished_one(int64_t total) {
  if (done_count_.fetch_add(1) + 1 == total) {
    // under the mutex: a caller that found the count short is waiting, or not yet checking again
    std::lock_guard<std::mutex> lock(mutex_);
    done_.notify_all();
  }
}

uint32_t ThreadPool::next_call(uint32_t seen) {
  const auto changed = [&] { return stop_.load() || generation_.load() != seen; };
  if (!spin_until(spin_microseconds_, changed)) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, changed);
  }
  return stop_.load() ? seen : generation_.load();
}

void ThreadPool::worker_loop(int slot) {
  uint32_t seen = 0;
  while (true) {
    const uint32_t generation = next_call(seen);
    if (generation == seen) return;  // stopping
    seen = generation;
    const std::function<void(int64_t, int)>* body = body_.load();
    const int64_t total = total_.load();
    // a body or total of a newer call than `generation` is never used: claim refuses
    for (int64_t i; claim(generation, slot, &i);) {
      (*body)(i, slot);
      finished_one(total);
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& body, bool contiguous) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  if (n > int64_t(0xffffffffu)) {
    throw std::invalid_argument("parallel_for over more than 2^32 - 1 indices");
  }
  uint32_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    total_ = n;
    done_count_ = 0;
    generation = generation_.load() + 1;
    const int64_t count = int64_t(runs_.size());
    for (int64_t s = 0; s < count; ++s) {
      // contiguous: slot s runs [n s / count, n (s + 1) / count); else slot 0 runs all
      const int64_t begin = contiguous ? n * s / count : (s == 0 ? 0 : n);
      // the tag first: a worker that reads this end then fails its older generation's claim
      runs_[s].next = (uint64_t(generation) << 32) | uint64_t(begin);
      runs_[s].end = contiguous ? n * (s + 1) / count : n;
    }
    generation_ = generation;  // publishes the call (after body_, total_ and the runs)
  }
  wake_.notify_all();
  for (int64_t i; claim(generation, 0, &i);) {
    body(i, 0);
    finished_one(n);
  }
  const auto all_done = [&] { return done_count_.load() == n; };
  if (!spin_until(spin_microseconds_, all_done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, all_done);
  }
}

ThreadPool& thread_pool() {
  static ThreadPool pool(
      [] {
        if (const char* env = std::getenv("MLX_ATTN_NUM_THREADS")) {
          int n = std::atoi(env);
          if (n > 0) return n;
        }
        unsigned hw = std::thread::hardware_concurrency();
        return hw > 0 ? int(hw) : 1;
      }(),
      [] {
        constexpr int kDefaultSpin = 200;
        const char* env = std::getenv("MLX_ATTN_SPIN_US");
        if (env == nullptr || *env == '\0') return kDefaultSpin;
        char* end = nullptr;
        const long us = std::strtol(env, &end, 10);
        return *end == '\0' && us >= 0 && us <= 1000000 ? int(us) : kDefaultSpin;
      }());
  return pool;
}

}  // namespace mlx_attn::cpu
