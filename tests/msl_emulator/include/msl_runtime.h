// Execution model of the MSL emulator: one threadgroup at a time, each of its
// threads a ucontext fiber on one OS thread. A fiber runs until it reaches a
// synchronisation point (threadgroup_barrier, a simd_* collective) or returns;
// the scheduler then releases the point once every thread that must reach it
// has, or reports a deadlock with the waiting locations. The lowest simdgroup
// that can progress always runs first, so it gets as far ahead of the others
// as the synchronisation allows: a missing barrier lets it read what others
// have not written yet, or overwrite what they still read.
//
// Threadgroup memory is allocated per threadgroup and poisoned with 0xFF
// bytes (NaN as float/half) so reads of uninitialised memory show up.
// Not modelled: memory ordering, atomics, textures, function constants.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace msl_rt {

constexpr int kSimdWidth = 32;
constexpr int kStackBytes = 256 * 1024;
constexpr int kSlotBytes = 64;

enum class Wait { none, barrier, simd, done };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  Wait wait = Wait::none;
  const char* file = "";
  int line = 0;
  int index = 0;  // thread_index_in_threadgroup
};

struct Builtins {
  uint32_t grid_threads[3];     // threads_per_grid
  uint32_t tg_count[3];         // threadgroups_per_grid
  uint32_t tg_size[3];          // threads_per_threadgroup
  uint32_t tg_id[3];            // threadgroup_position_in_grid
};

struct Group {
  Builtins builtins;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  std::map<int, std::vector<char>> threadgroup_memory;
  // simd exchange: [generation parity][simdgroup][lane][bytes]
  std::vector<char> simd_slots[2];
  std::vector<uint32_t> simd_generation;
  std::string error;
  void* const* buffers = nullptr;
  int buffer_count = 0;
};

inline thread_local Group* current_group = nullptr;

inline Fiber& self() {
  return current_group->fibers[current_group->current];
}

inline void yield_to_scheduler() {
  Group* g = current_group;
  swapcontext(&g->fibers[g->current].context, &g->scheduler);
}

inline void* buffer(int index) {
  Group* g = current_group;
  if (index < 0 || index >= g->buffer_count || g->buffers[index] == nullptr) {
    std::fprintf(stderr, "msl emulator: kernel reads buffer(%d), which was not bound\n", index);
    std::abort();
  }
  return g->buffers[index];
}

// Shared threadgroup storage for a `threadgroup T x[N];` declaration: every
// thread of the group gets the same (poisoned) block for the same id.
inline void* threadgroup_alloc(int id, std::size_t bytes) {
  auto& block = current_group->threadgroup_memory[id];
  if (block.empty()) block.assign(bytes + 64, char(0xFF));
  auto p = reinterpret_cast<std::uintptr_t>(block.data());
  return reinterpret_cast<void*>((p + 63) & ~std::uintptr_t(63));
}

inline void barrier(const char* file, int line) {
  Fiber& f = self();
  f.wait = Wait::barrier;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
}

inline int simd_lane() {
  return self().index % kSimdWidth;
}
inline int simd_group() {
  return self().index / kSimdWidth;
}

// Posts this lane's value, waits until every live lane of the simdgroup has
// posted at the same call site, then returns all lanes' values.
template <typename T>
inline const T* simd_exchange(const T& value, const char* file, int line) {
  static_assert(sizeof(T) <= kSlotBytes, "simd value too large for the emulator");
  Group* g = current_group;
  Fiber& f = self();
  int group = simd_group();
  uint32_t parity = g->simd_generation[group] & 1;
  char* slots = g->simd_slots[parity].data() + std::size_t(group) * kSimdWidth * kSlotBytes;
  std::memcpy(slots + simd_lane() * kSlotBytes, &value, sizeof(T));
  f.wait = Wait::simd;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
  static thread_local T lanes[kSimdWidth];
  for (int i = 0; i < kSimdWidth; ++i) std::memcpy(&lanes[i], slots + i * kSlotBytes, sizeof(T));
  return lanes;
}

inline int simd_lanes_in_group(int group) {
  int total = int(current_group->fibers.size());
  int first = group * kSimdWidth;
  return total - first < kSimdWidth ? total - first : kSimdWidth;
}

inline void fiber_entry(unsigned lo, unsigned hi) {
  auto body = reinterpret_cast<void (*)()>((uintptr_t(hi) << 32) | uintptr_t(lo));
  body();
  self().wait = Wait::done;
  yield_to_scheduler();
}

inline std::string where(const Fiber& f) {
  return std::string(f.file) + ":" + std::to_string(f.line);
}

// Releases what can be released; returns false (with g.error) on a deadlock.
inline bool resolve(Group& g, bool& released) {
  released = false;
  int n = int(g.fibers.size());
  int groups = (n + kSimdWidth - 1) / kSimdWidth;
  for (int s = 0; s < groups; ++s) {
    int first = s * kSimdWidth, count = simd_lanes_in_group(s);
    int at_simd = 0, done = 0;
    const Fiber* site = nullptr;
    for (int i = first; i < first + count; ++i) {
      const Fiber& f = g.fibers[i];
      if (f.wait == Wait::simd) {
        ++at_simd;
        if (!site) site = &f;
        else if (site->line != f.line || std::strcmp(site->file, f.file) != 0) {
          g.error = "divergent simd call: lane " + std::to_string(site->index % kSimdWidth) + " waits at " +
              where(*site) + ", lane " + std::to_string(f.index % kSimdWidth) + " at " + where(f);
          return false;
        }
      } else if (f.wait == Wait::done) {
        ++done;
      }
    }
    if (at_simd && at_simd + done == count && done == 0) {
      for (int i = first; i < first + count; ++i) g.fibers[i].wait = Wait::none;
      ++g.simd_generation[s];
      released = true;
    } else if (at_simd && done) {
      g.error = std::to_string(done) + " lanes of simdgroup " + std::to_string(s) +
          " returned while lane " + std::to_string(site->index % kSimdWidth) + " waits in a simd function at " +
          where(*site);
      return false;
    }
  }
  if (released) return true;
  for (const Fiber& f : g.fibers) {
    if (f.wait == Wait::none) return true;  // someone can still run
  }
  int at_barrier = 0, done = 0;
  const Fiber* waiting = nullptr;
  for (const Fiber& f : g.fibers) {
    if (f.wait == Wait::barrier) {
      ++at_barrier;
      if (!waiting) waiting = &f;
    } else if (f.wait == Wait::done) {
      ++done;
    }
  }
  if (at_barrier == n) {
    for (Fiber& f : g.fibers) f.wait = Wait::none;
    released = true;
    return true;
  }
  if (at_barrier && at_barrier + done == n) {
    g.error = std::to_string(done) + " of " + std::to_string(n) + " threads returned, thread " +
        std::to_string(waiting->index) + " waits in threadgroup_barrier at " + where(*waiting);
    return false;
  }
  // Fibers blocked on different kinds of synchronisation.
  for (const Fiber& f : g.fibers) {
    if (f.wait == Wait::barrier || f.wait == Wait::simd) {
      g.error = "deadlock: thread " + std::to_string(f.index) + " waits at " + where(f) +
          " while other threads wait elsewhere";
      break;
    }
  }
  return g.error.empty();
}

// Runs one threadgroup of `body` (a launcher that reads its builtins from
// current_group). Returns false and fills `error` on a deadlock.
inline bool run_threadgroup(Group& g, void (*body)(), std::string& error) {
  int n = int(g.builtins.tg_size[0] * g.builtins.tg_size[1] * g.builtins.tg_size[2]);
  g.fibers.assign(n, Fiber{});
  g.threadgroup_memory.clear();
  int groups = (n + kSimdWidth - 1) / kSimdWidth;
  for (auto& slots : g.simd_slots) slots.assign(std::size_t(groups) * kSimdWidth * kSlotBytes, 0);
  g.simd_generation.assign(groups, 0);
  g.error.clear();
  auto entry = reinterpret_cast<uintptr_t>(body);
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.index = i;
    f.stack.resize(kStackBytes);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_entry), 2, unsigned(entry & 0xffffffffu),
                unsigned(entry >> 32));
  }
  current_group = &g;
  while (true) {
    // Only the lowest simdgroup that can progress runs (each lane until it
    // blocks): one simdgroup races as far ahead of the others as the
    // synchronisation allows, which exposes missing barriers both ways.
    bool ran = false;
    for (int s = 0; s < groups && !ran; ++s) {
      for (int i = s * kSimdWidth; i < n && i < (s + 1) * kSimdWidth; ++i) {
        if (g.fibers[i].wait != Wait::none) continue;
        g.current = i;
        swapcontext(&g.scheduler, &g.fibers[i].context);
        ran = true;
      }
    }
    bool all_done = true;
    for (const Fiber& f : g.fibers) all_done &= f.wait == Wait::done;
    if (all_done) break;
    bool released = false;
    if (!resolve(g, released) || (!released && !ran)) {
      error = g.error.empty() ? "deadlock: no thread can make progress" : g.error;
      current_group = nullptr;
      return false;
    }
  }
  current_group = nullptr;
  return true;
}

// The thread's position, derived from its index and the group's builtins.
inline void thread_position(uint32_t out[3]) {
  const Builtins& b = current_group->builtins;
  uint32_t i = uint32_t(self().index);
  out[0] = i % b.tg_size[0];
  out[1] = (i / b.tg_size[0]) % b.tg_size[1];
  out[2] = i / (b.tg_size[0] * b.tg_size[1]);
}

}  // namespace msl_rt
