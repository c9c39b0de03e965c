// Execution model of the MSL emulator.
//
// One threadgroup runs on one OS thread; each of its threads is a fiber with
// its own stack. A fiber runs until it reaches a synchronisation point
// (threadgroup_barrier, simdgroup_barrier, a simd_* collective, a
// simdgroup_matrix load or product) or returns; the scheduler then releases
// the point once every thread that must reach it has, or reports a deadlock
// naming where threads wait.
//
// Scheduling is deliberately adversarial but deterministic: the lowest
// simdgroup that can make progress always runs (lane by lane, each lane until
// it blocks), so it races as far ahead of the others as synchronisation
// allows. A missing barrier then lets it read what others have not written
// yet (poisoned threadgroup memory) or overwrite what they still read.
//
// Fibers switch with _setjmp/_longjmp (no signal-mask syscalls); a fiber is
// entered the first time through a ucontext. Threadgroup memory is allocated
// per threadgroup and filled with 0xFF bytes (NaN as half/float/bfloat, -1 as
// an integer) so reads of uninitialised memory show up.
//
// Not modelled: memory ordering between threads (everything is sequentially
// consistent on one OS thread), atomics, textures, function constants.
#pragma once

// Every standard header the emulator needs comes first: the Metal keywords
// defined later as macros (device, constant, thread, threadgroup) must not
// reach them.
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace msl_rt {

constexpr int kSimdWidth = 32;
constexpr std::size_t kFiberStackBytes = 256 * 1024;
constexpr int kSlotBytes = 64;  // largest value one lane can pass to a simd function

enum class Wait : uint8_t { runnable, barrier, simd, done };

// A call site of a synchronisation function (from __builtin_FILE/LINE/COLUMN).
struct Site {
  const char* what = "";  // "threadgroup_barrier", "simd_sum", ...
  const char* file = "";
  int line = 0;
  int column = 0;

  bool same_as(const Site& o) const {
    return line == o.line && column == o.column && std::strcmp(file, o.file) == 0;
  }
  std::string where() const { return std::string(file) + ":" + std::to_string(line); }
};

// ------------------------------------------------------------------ cost counters
// Modelled costs of a dispatch, summed over its threads (libraries built with
// counters=True define MSL_COUNTERS; other builds count nothing and pay
// nothing). Device, constant and threadgroup bytes are counted by calls the
// build inserts before every load and store of those address spaces (see
// build.py); the rest by the shim functions below. Keep the field order in
// step with library.py's Counters.
struct Counters {
  uint64_t device_bytes_read = 0;
  uint64_t device_load_operations = 0;  // load instructions from device memory, of any width
  uint64_t device_bytes_written = 0;
  uint64_t constant_bytes_read = 0;
  uint64_t threadgroup_bytes_read = 0;
  uint64_t threadgroup_bytes_written = 0;
  uint64_t simdgroup_matrix_mmas = 0;   // 8x8x8 multiply-accumulates, per simdgroup
  uint64_t simd_ops = 0;                // shuffles, broadcasts, reductions, scans, per simdgroup
  uint64_t threadgroup_barriers = 0;    // released barriers, per threadgroup
  uint64_t simdgroup_barriers = 0;      // per simdgroup
  uint64_t exp_calls = 0;               // exp and exp2, per thread and vector element
  uint64_t threadgroup_memory_bytes = 0;  // allocated by one threadgroup (the largest)

  static constexpr int kFields = 12;
  uint64_t* fields() { return &device_bytes_read; }
  const uint64_t* fields() const { return &device_bytes_read; }
};
inline thread_local Counters* current_counters = nullptr;

#ifdef MSL_COUNTERS
#define MSL_COUNT(field, n) (msl_rt::current_counters->field += uint64_t(n))
#else
#define MSL_COUNT(field, n) ((void)0)
#endif

struct Fiber {
  jmp_buf resume;     // where the fiber continues once it has started
  ucontext_t start;   // its entry, used once
  bool started = false;
  Wait wait = Wait::runnable;
  Site site;          // where it waits, or last synchronised
  int index = 0;      // thread_index_in_threadgroup
};

// Fiber stacks for one OS thread, reused by every threadgroup it runs. Each
// stack has an inaccessible guard page below it so an overflow faults.
class StackPool {
 public:
  StackPool() = default;
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool() { release(); }

  bool reserve(int count) {
    if (count <= count_) return true;
    release();
    std::size_t bytes = stride() * std::size_t(count);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base_ = static_cast<char*>(p);
    count_ = count;
    for (int i = 0; i < count; ++i) mprotect(base_ + stride() * i, page(), PROT_NONE);
    return true;
  }
  char* stack(int i) const { return base_ + stride() * i + page(); }
  // The fiber whose guard page holds `address`, or -1.
  int overflowed_fiber(const void* address) const {
    auto a = reinterpret_cast<const char*>(address);
    if (!base_ || a < base_ || a >= base_ + stride() * count_) return -1;
    std::size_t offset = std::size_t(a - base_) % stride();
    return offset < page() ? int(std::size_t(a - base_) / stride()) : -1;
  }

 private:
  static std::size_t page() { return std::size_t(sysconf(_SC_PAGESIZE)); }
  static std::size_t stride() { return kFiberStackBytes + page(); }
  void release() {
    if (base_) munmap(base_, stride() * count_);
    base_ = nullptr;
    count_ = 0;
  }
  char* base_ = nullptr;
  int count_ = 0;
};

// Memory with an inaccessible page on either side, for buffers and
// threadgroup arrays: the payload ends where the trailing guard page starts
// (up to `align` - 1 bytes of slack), so running past its end faults.
class GuardedBlock {
 public:
  GuardedBlock() = default;
  // data() % align == phase (< align): a staged copy keeps the caller's
  // address modulo the alignment, as a buffer bound at a byte offset does.
  GuardedBlock(std::size_t bytes, std::size_t align, std::size_t phase = 0) : bytes_(bytes) {
    std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
    align = std::max<std::size_t>(align, 1);
    span_ = (bytes + phase + align - 1) / align * align - phase;
    body_ = (span_ + page - 1) / page * page;
    mapped_ = body_ + 2 * page;
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      mapped_ = 0;
      return;
    }
    region_ = static_cast<char*>(p);
    mprotect(region_, page, PROT_NONE);
    mprotect(region_ + page + body_, page, PROT_NONE);
    data_ = region_ + page + body_ - span_;
  }
  GuardedBlock(GuardedBlock&& o) noexcept { *this = std::move(o); }
  GuardedBlock& operator=(GuardedBlock&& o) noexcept {
    std::swap(region_, o.region_);
    std::swap(mapped_, o.mapped_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(span_, o.span_);
    std::swap(body_, o.body_);
    std::swap(read_only_, o.read_only_);
    return *this;
  }
  ~GuardedBlock() {
    if (region_) munmap(region_, mapped_);
  }

  char* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool ok() const { return region_ != nullptr; }
  void poison() { std::memset(data_, 0xFF, span_); }
  void protect_read_only() {
    std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
    mprotect(region_ + page, body_, PROT_READ);
    read_only_ = true;
  }
  // How `address` relates to this block ("" when it does not).
  std::string describe(const void* address) const {
    auto a = static_cast<const char*>(address);
    if (!region_ || a < region_ || a >= region_ + mapped_) return "";
    if (a < data_) return std::to_string(data_ - a) + " bytes before the start of";
    if (a >= data_ + bytes_) return std::to_string(a - (data_ + bytes_)) + " bytes past the end of";
    return read_only_ ? "read-only (const) memory of" : "inside";
  }

 private:
  char* region_ = nullptr;
  std::size_t mapped_ = 0;
  char* data_ = nullptr;
  std::size_t bytes_ = 0, span_ = 0, body_ = 0;
  bool read_only_ = false;
};

struct ThreadgroupArray {
  GuardedBlock block;
  const char* name;  // as declared in the kernel, for error messages
};

// The launch as the kernel sees it through its builtin attributes.
struct Geometry {
  uint32_t threadgroups[3];     // threadgroups_per_grid
  uint32_t nominal_size[3];     // the dispatch's threadgroup size
  uint32_t grid_threads[3];     // threads_per_grid
  uint32_t group_id[3];         // threadgroup_position_in_grid of this group
  uint32_t group_size[3];       // threads_per_threadgroup (smaller at a non-uniform edge)
};

// One threadgroup being executed.
struct Group {
  Geometry geometry;
  std::vector<Fiber> fibers;
  jmp_buf scheduler;
  int current = 0;
  std::map<int, ThreadgroupArray> threadgroup_memory;  // by declaration id, reused by every group
  const uint32_t* threadgroup_arg_bytes = nullptr;  // [[threadgroup(n)]] sizes
  int threadgroup_arg_count = 0;
  // simd exchange slots, double-buffered by generation parity:
  // [parity][simdgroup][lane][kSlotBytes]
  std::vector<char> simd_slots[2];
  std::vector<uint32_t> simd_generation;
  void* const* buffers = nullptr;
  int buffer_count = 0;
  std::string error;
};

inline thread_local Group* current_group = nullptr;

inline Fiber& self() {
  return current_group->fibers[current_group->current];
}
inline int simd_lane() {
  return self().index % kSimdWidth;
}
inline int simd_group() {
  return self().index / kSimdWidth;
}
inline int thread_count() {
  return int(current_group->fibers.size());
}
inline int simdgroup_count() {
  return (thread_count() + kSimdWidth - 1) / kSimdWidth;
}
// Lanes in simdgroup `group` (the last one of a threadgroup may be partial).
inline int lanes_in(int group) {
  return std::min(kSimdWidth, thread_count() - group * kSimdWidth);
}

// ------------------------------------------------------------------ switching
inline void yield_to_scheduler() {
  Group* g = current_group;
  if (_setjmp(g->fibers[g->current].resume) == 0) _longjmp(g->scheduler, 1);
}

inline void run_fiber(Group& g, int i) {
  g.current = i;
  Fiber& f = g.fibers[i];
  if (_setjmp(g.scheduler) == 0) {
    if (!f.started) {
      f.started = true;
      setcontext(&f.start);
    }
    _longjmp(f.resume, 1);
  }
}

inline void wait_at(Wait kind, const Site& site) {
  Fiber& f = self();
  f.wait = kind;
  f.site = site;
  yield_to_scheduler();
}

// ------------------------------------------------------------------ memory
[[noreturn]] inline void fail(const std::string& message);

inline void* buffer(int index) {
  Group* g = current_group;
  if (index < 0 || index >= g->buffer_count || g->buffers[index] == nullptr)
    fail("the kernel reads buffer(" + std::to_string(index) + "), which was not bound");
  return g->buffers[index];
}

// Shared storage for the threadgroup declaration `id` (`threadgroup T name[N];`):
// every thread of the group gets the same block, poisoned when the group starts.
inline void* threadgroup_alloc(int id, std::size_t bytes, std::size_t align, const char* name) {
  auto& arrays = current_group->threadgroup_memory;
  auto found = arrays.find(id);
  if (found == arrays.end()) {
    GuardedBlock block(bytes, align);
    if (!block.ok()) fail("cannot allocate threadgroup memory for " + std::string(name));
    block.poison();
    found = arrays.emplace(id, ThreadgroupArray{std::move(block), name}).first;
  } else if (found->second.block.size() != bytes) {
    fail("threadgroup declaration " + std::string(name) + " used with two sizes");
  }
  return found->second.block.data();
}

// Storage for a `threadgroup T* p [[threadgroup(n)]]` kernel argument.
inline void* threadgroup_argument(int n) {
  Group* g = current_group;
  if (n < 0 || n >= g->threadgroup_arg_count || g->threadgroup_arg_bytes[n] == 0)
    fail("the kernel takes [[threadgroup(" + std::to_string(n) +
         ")]] memory but the dispatch gave it no length (threadgroup_memory={" + std::to_string(n) + ": bytes})");
  return threadgroup_alloc(-1 - n, g->threadgroup_arg_bytes[n], 16, "a [[threadgroup(n)]] argument");
}

// ------------------------------------------------------------------ synchronisation
inline void barrier(const Site& site) {
  wait_at(Wait::barrier, site);
}

// Posts this lane's value, waits until every lane of the simdgroup has posted
// at the same call site, then returns all lanes' values (valid until this
// lane's next simd call).
template <typename T>
inline const T* simd_exchange(const T& value, const Site& site, bool is_simd_op = true) {
  static_assert(sizeof(T) <= kSlotBytes, "value too large for a simd function in the emulator");
  static_assert(std::is_trivially_copyable_v<T>);
  Group* g = current_group;
  int group = simd_group();
  uint32_t parity = g->simd_generation[group] & 1;
  char* slots = g->simd_slots[parity].data() + std::size_t(group) * kSimdWidth * kSlotBytes;
  if (is_simd_op && simd_lane() == 0) MSL_COUNT(simd_ops, 1);
  std::memcpy(slots + simd_lane() * kSlotBytes, &value, sizeof(T));
  wait_at(Wait::simd, site);
  static thread_local T lanes[kSimdWidth];
  for (int i = 0; i < lanes_in(group); ++i) std::memcpy(&lanes[i], slots + i * kSlotBytes, sizeof(T));
  return lanes;
}

// ------------------------------------------------------------------ scheduler
inline void fiber_entry(unsigned lo, unsigned hi) {
  auto body = reinterpret_cast<void (*)()>((uintptr_t(hi) << 32) | uintptr_t(lo));
  body();
  Group* g = current_group;
  g->fibers[g->current].wait = Wait::done;
  _longjmp(g->scheduler, 1);
}

inline std::string thread_name(const Fiber& f) {
  return "thread " + std::to_string(f.index) + " (simdgroup " + std::to_string(f.index / kSimdWidth) + ", lane " +
         std::to_string(f.index % kSimdWidth) + ")";
}

// After simdgroup `s` ran until all its lanes blocked: release a simd
// collective that all its lanes reached, or explain why it can never be.
// Returns false with g.error set on a deadlock.
inline bool settle_simdgroup(Group& g, int s) {
  int first = s * kSimdWidth, count = lanes_in(s);
  const Fiber* at_simd = nullptr;
  const Fiber* elsewhere = nullptr;
  for (int i = first; i < first + count; ++i) {
    const Fiber& f = g.fibers[i];
    if (f.wait == Wait::simd) {
      if (!at_simd) {
        at_simd = &f;
      } else if (!at_simd->site.same_as(f.site)) {
        g.error = "divergent simd call: " + thread_name(*at_simd) + " waits in " + at_simd->site.what + " at " +
                  at_simd->site.where() + ", " + thread_name(f) + " in " + f.site.what + " at " + f.site.where();
        return false;
      }
    } else if (!elsewhere) {
      elsewhere = &f;
    }
  }
  if (!at_simd) return true;
  if (elsewhere) {
    std::string other = elsewhere->wait == Wait::done
                            ? "returned"
                            : std::string("waits in ") + elsewhere->site.what + " at " + elsewhere->site.where();
    g.error = "simd function not reached by the whole simdgroup: " + thread_name(*at_simd) + " waits in " +
              at_simd->site.what + " at " + at_simd->site.where() + " while " + thread_name(*elsewhere) + " " + other;
    return false;
  }
  for (int i = first; i < first + count; ++i) g.fibers[i].wait = Wait::runnable;
  ++g.simd_generation[s];
  return true;
}

// Nothing can run: release the threadgroup barrier or explain the deadlock.
inline bool settle_threadgroup(Group& g) {
  const Fiber* waiting = nullptr;
  const Fiber* returned = nullptr;
  for (const Fiber& f : g.fibers) {
    if (f.wait == Wait::barrier) {
      if (!waiting) {
        waiting = &f;
      } else if (!waiting->site.same_as(f.site)) {
        g.error = "threads wait at different barriers: " + thread_name(*waiting) + " at " +
                  waiting->site.where() + ", " + thread_name(f) + " at " + f.site.where();
        return false;
      }
    } else if (f.wait == Wait::done) {
      if (!returned) returned = &f;
    } else {
      g.error = "deadlock: " + thread_name(f) + " waits in " + f.site.what + " at " + f.site.where();
      return false;
    }
  }
  if (!waiting) return true;  // all returned
  if (returned) {
    g.error = "barrier not reached by every thread: " + thread_name(*returned) + " returned while " +
              thread_name(*waiting) + " waits in " + waiting->site.what + " at " + waiting->site.where();
    return false;
  }
  for (Fiber& f : g.fibers) f.wait = Wait::runnable;
  MSL_COUNT(threadgroup_barriers, 1);
  return true;
}

// Runs one threadgroup of `body` (a launcher that reads its builtins from
// current_group). Returns false with g.error set on a deadlock.
inline bool run_threadgroup(Group& g, StackPool& stacks, void (*body)()) {
  const uint32_t* size = g.geometry.group_size;
  int n = int(size[0] * size[1] * size[2]);
  if (!stacks.reserve(n)) {
    g.error = "cannot allocate fiber stacks";
    return false;
  }
  g.fibers.assign(n, Fiber{});
  for (auto& [id, array] : g.threadgroup_memory) array.block.poison();
  int groups = (n + kSimdWidth - 1) / kSimdWidth;
  for (auto& slots : g.simd_slots) slots.assign(std::size_t(groups) * kSimdWidth * kSlotBytes, 0);
  g.simd_generation.assign(groups, 0);
  g.error.clear();
  auto entry = reinterpret_cast<uintptr_t>(body);
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.index = i;
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = stacks.stack(i);
    f.start.uc_stack.ss_size = kFiberStackBytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, reinterpret_cast<void (*)()>(fiber_entry), 2, unsigned(entry & 0xffffffffu),
                unsigned(entry >> 32));
  }
  current_group = &g;
  bool ok = true;
  while (ok) {
    int runnable_group = -1;
    for (int i = 0; i < n && runnable_group < 0; ++i)
      if (g.fibers[i].wait == Wait::runnable) runnable_group = i / kSimdWidth;
    if (runnable_group >= 0) {
      int first = runnable_group * kSimdWidth;
      for (int i = first; i < first + lanes_in(runnable_group); ++i)
        if (g.fibers[i].wait == Wait::runnable) run_fiber(g, i);
      ok = settle_simdgroup(g, runnable_group);
      continue;
    }
    bool all_done = std::all_of(g.fibers.begin(), g.fibers.end(), [](const Fiber& f) { return f.wait == Wait::done; });
    if (all_done) break;
    ok = settle_threadgroup(g);
  }
  current_group = nullptr;
  return ok;
}

}  // namespace msl_rt
