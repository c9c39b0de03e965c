#include "csrc/cpu/thread_pool.h"

#include <cstdlib>
#include <exception>
#include <stdexcept>

namespace mlx_attn::cpu {

ThreadPool::ThreadPool(int threads) {
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

bool ThreadPool::claim(uint32_t generation, int64_t total, int64_t* index) {
  uint64_t current = next_.load();
  while (true) {
    if (uint32_t(current >> 32) != generation) return false;
    const int64_t i = int64_t(current & 0xffffffffu);
    if (i >= total) return false;
    if (next_.compare_exchange_weak(current, current + 1)) {
      *index = i;
      return true;
    }
  }
}

void ThreadPool::finished_one() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (++done_count_ == total_) done_.notify_all();
}

void ThreadPool::worker_loop(int slot) {
  uint32_t seen = 0;
  while (true) {
    const std::function<void(int64_t, int)>* body;
    int64_t total;
    uint32_t generation;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation = generation_;
      body = body_;
      total = total_;
    }
    for (int64_t i; claim(generation, total, &i);) {
      (*body)(i, slot);
      finished_one();
    }
  }
}

void ThreadPool::parallel_for(
    int64_t n,
    const std::function<void(int64_t, int)>& body) {
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
    generation = ++generation_;
    next_ = uint64_t(generation) << 32;
  }
  wake_.notify_all();
  for (int64_t i; claim(generation, n, &i);) {
    body(i, 0);
    finished_one();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return done_count_ == n; });
}

ThreadPool& thread_pool() {
  static ThreadPool pool([] {
    if (const char* env = std::getenv("MLX_ATTN_NUM_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw > 0 ? int(hw) : 1;
  }());
  return pool;
}

}  // namespace mlx_attn::cpu
