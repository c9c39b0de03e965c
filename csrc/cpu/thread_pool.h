// A small persistent pool: parallel_for hands indices [0, n) to the calling
// thread and the workers through one atomic counter (dynamic scheduling, so
// uneven causal work items balance themselves). A call ends when its indices
// are done, not when every worker has woken: on a loaded machine a worker
// the OS has not scheduled yet costs nothing (the others take its share).
//
// Between calls a worker spins a short while (yielding the core to any other
// runnable thread) before it sleeps, and the calling thread spins on the last
// indices before it sleeps: a decode step's products follow one another tens
// of microseconds apart, about what a wake-up through the kernel costs, so a
// sleeping pool would run each small product on the calling thread alone.
//
// A contiguous call gives each thread its own run of consecutive indices
// first (a weight-streaming product then reads one stretch of memory per
// thread, its prefetches running into the thread's next index) and lets a
// thread whose run is done take indices from the others' runs.
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
  // spin_microseconds: how long a worker waits for the next call, and the
  // caller for its call's last indices, before sleeping.
  ThreadPool(int threads, int spin_microseconds);
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  // body(index, thread_slot); thread_slot < size() identifies scratch memory.
  // contiguous: each thread starts on its own run of indices (see above);
  // otherwise all threads take indices in order from one counter.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& body, bool contiguous = false);

 private:
  void worker_loop(int slot);
  // The generation of the next call after `seen`, or `seen` when stopping.
  uint32_t next_call(uint32_t seen);
  // Claims one index of call `generation` for thread `slot` (its own run
  // first, then the others'); false when that call has none left or a newer
  // call began.
  bool claim(uint32_t generation, int slot, int64_t* index);
  void finished_one(int64_t total);
  std::vector<std::thread> workers_;
  const int spin_microseconds_;
  std::mutex mutex_;
  std::mutex run_mutex_;  // one parallel_for at a time
  std::condition_variable wake_, done_;
  // the current call, published before generation_ (release)
  std::atomic<const std::function<void(int64_t, int)>*> body_{nullptr};
  std::atomic<int64_t> total_{0};
  // One run of indices per thread slot: (generation << 32) | next index, and
  // the run's end. The generation tag keeps a worker late for one call from
  // taking an index of the next.
  struct alignas(64) Run {
    std::atomic<uint64_t> next{0};
    std::atomic<int64_t> end{0};
  };
  std::vector<Run> runs_;
  std::atomic<int64_t> done_count_{0};  // indices finished in the current call
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

// The process-wide pool: MLX_ATTN_NUM_THREADS threads, else all cores;
// MLX_ATTN_SPIN_US microseconds of spinning (default 200; 0 sleeps at once).
ThreadPool& thread_pool();

}  // namespace mlx_attn::cpu
