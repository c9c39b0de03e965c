#include "csrc/cpu/thread_pool.h"

#include <cstdlib>
#include <exception>

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

void ThreadPool::worker_loop(int slot) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int64_t, int)>* body;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      body = body_;
    }
    for (int64_t i; (i = next_.fetch_add(1)) < total_;) (*body)(i, slot);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_all();
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
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    total_ = n;
    next_ = 0;
    busy_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  for (int64_t i; (i = next_.fetch_add(1)) < n;) body(i, 0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return busy_ == 0; });
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
