// A small persistent pool: parallel_for hands indices [0, n) to the calling
// thread and the workers through one atomic counter (dynamic scheduling, so
// uneven causal work items balance themselves). A call ends when its indices
// are done, not when every worker has woken: on a loaded machine a worker
// the OS has not scheduled yet costs nothing (the others take its share).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_attn::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  // body(index, thread_slot); thread_slot < size() identifies scratch memory.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& body);

 private:
  void worker_loop(int slot);
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex run_mutex_;  // one parallel_for at a time
  std::condition_variable wake_, done_;
  // Claims one index of call `generation`; false when that call has none
  // left or a newer call began.
  bool claim(uint32_t generation, int64_t total, int64_t* index);
  void finished_one();
  const std::function<void(int64_t, int)>* body_ = nullptr;
  int64_t total_ = 0;
  // (generation << 32) | next index: a worker late for one call cannot take
  // an index of the next
  std::atomic<uint64_t> next_{0};
  int64_t done_count_ = 0;  // indices finished in the current call (under mutex_)
  uint32_t generation_ = 0;
  bool stop_ = false;
};

// The process-wide pool: MLX_ATTN_NUM_THREADS threads, else all cores.
ThreadPool& thread_pool();

}  // namespace mlx_attn::cpu
