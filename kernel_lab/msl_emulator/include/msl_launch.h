// Binding kernel parameters and running a dispatch: the launchers the
// translator appends to each kernel source call into this, and the exported
// C functions at the bottom are what the Python side loads with ctypes.
//
// A dispatch copies every buffer into guarded memory (an inaccessible page on
// either side), runs the threadgroups on worker threads (each threadgroup's
// threads as fibers on one worker), and copies written buffers back. Faults
// inside a kernel (out-of-bounds access, writes to const buffers, stack
// overflow, integer division by zero) and kernels that never finish are
// reported as errors instead of killing the process.
#pragma once

#include "metal_shim.h"

// This file is plain C++: the Metal keyword macros stay out of it.
#pragma push_macro("device")
#pragma push_macro("constant")
#pragma push_macro("threadgroup")
#pragma push_macro("thread")
#undef device
#undef constant
#undef threadgroup
#undef thread

namespace msl_rt {

// ------------------------------------------------------------------ parameters
enum ParamKind : int {
  kBuffer = 0,  // [[buffer(index)]]
  kThreadPositionInGrid = 1,
  kThreadgroupPositionInGrid = 2,
  kThreadPositionInThreadgroup = 3,
  kThreadIndexInThreadgroup = 4,
  kThreadsPerThreadgroup = 5,
  kThreadgroupsPerGrid = 6,
  kThreadsPerGrid = 7,
  kSimdgroupIndexInThreadgroup = 8,
  kThreadIndexInSimdgroup = 9,
  kThreadsPerSimdgroup = 10,
  kSimdgroupsPerThreadgroup = 11,
  kThreadgroupMemory = 12,  // [[threadgroup(index)]]
};

struct Param {
  int kind;
  int index;
  int condition;  // id of the bool function constant that must be true for the parameter to exist, or -1
};

// What the Python side needs to check a dispatch before running it.
struct ParamInfo {
  int kind;
  int index;
  uint32_t bytes;     // sizeof the referenced object, or of a pointer's element
  uint32_t align;     // alignof the same
  int is_pointer;
  int writable;       // the kernel may write through it (not const, not constant)
  const char* type;   // the C++ type, as clang prints it
  int condition;      // Param::condition
};

struct Entry {
  const char* name;
  void (*body)();
  int (*describe)(ParamInfo* out, int capacity);
};

inline void builtin_value(int kind, uint32_t out[3]) {
  const Geometry& geo = current_group->geometry;
  uint32_t index = uint32_t(self().index);
  uint32_t local[3] = {index % geo.group_size[0], (index / geo.group_size[0]) % geo.group_size[1],
                       index / (geo.group_size[0] * geo.group_size[1])};
  out[0] = out[1] = out[2] = 0;
  switch (kind) {
    case kThreadPositionInGrid:
      for (int i = 0; i < 3; ++i) out[i] = geo.group_id[i] * geo.nominal_size[i] + local[i];
      break;
    case kThreadgroupPositionInGrid:
      for (int i = 0; i < 3; ++i) out[i] = geo.group_id[i];
      break;
    case kThreadPositionInThreadgroup:
      for (int i = 0; i < 3; ++i) out[i] = local[i];
      break;
    case kThreadIndexInThreadgroup: out[0] = index; break;
    case kThreadsPerThreadgroup:
      for (int i = 0; i < 3; ++i) out[i] = geo.group_size[i];
      break;
    case kThreadgroupsPerGrid:
      for (int i = 0; i < 3; ++i) out[i] = geo.threadgroups[i];
      break;
    case kThreadsPerGrid:
      for (int i = 0; i < 3; ++i) out[i] = geo.grid_threads[i];
      break;
    case kSimdgroupIndexInThreadgroup: out[0] = index / kSimdWidth; break;
    case kThreadIndexInSimdgroup: out[0] = index % kSimdWidth; break;
    case kThreadsPerSimdgroup: out[0] = kSimdWidth; break;
    case kSimdgroupsPerThreadgroup: out[0] = uint32_t(simdgroup_count()); break;
  }
}

template <typename T>
inline const char* type_name() {
  return __PRETTY_FUNCTION__;  // "... [T = <type>]"; the Python side extracts <type>
}

// ------------------------------------------------------------------ function constants
// `constant T name [[function_constant(n)]];` becomes a FunctionConstant<T>.
// Metal fixes the values when it builds a pipeline; here one build serves
// every set of values: each dispatch sets them (msl_set_function_constants)
// before the kernel runs, and reading one it did not set is an error.
struct FunctionConstantSlot {
  int id;
  const char* name;
  const char* type;  // as type_name prints it
  uint32_t bytes;
  void* value;
  bool* set;
};
inline std::vector<FunctionConstantSlot>& function_constant_slots() {
  static std::vector<FunctionConstantSlot> slots;
  return slots;
}

template <typename T>
struct FunctionConstant {
  int id;
  const char* name;
  bool set = false;
  T value{};

  FunctionConstant(int id_, const char* name_) : id(id_), name(name_) {
    function_constant_slots().push_back({id, name, type_name<T>(), uint32_t(sizeof(T)), &value, &set});
  }
  FunctionConstant(const FunctionConstant&) = delete;
  operator T() const {
    if (!set)
      fail(std::string("function constant ") + name + " [[function_constant(" + std::to_string(id) +
           ")]] is read but the dispatch did not set it (function_constants={...})");
    return value;
  }
};

inline bool function_constant_true(int id) {
  for (const FunctionConstantSlot& slot : function_constant_slots())
    if (slot.id == id) return *slot.set && *static_cast<const bool*>(slot.value);
  return false;
}

// Where a reference parameter that is absent from the pipeline points: a
// read-only page of zeros. References are dereferenceable, so the compiler
// may load through one before the kernel's `if (has_mask)`; writes fault.
__attribute__((noinline)) inline void* absent_parameter() {
  static void* page = mmap(nullptr, size_t(sysconf(_SC_PAGESIZE)), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return page;
}

template <typename P>
inline P bind(const Param& p) {
  if (p.condition >= 0 && !function_constant_true(p.condition)) {
    // Absent in this pipeline (Metal: [[function_constant(c)]] with c false):
    // pointers are null, references read zeros.
    if constexpr (std::is_pointer_v<P>) return nullptr;
    else if constexpr (std::is_reference_v<P>) return *(std::remove_reference_t<P>*)absent_parameter();
    else return P{};
  }
  if constexpr (std::is_pointer_v<P>) {
    if (p.kind == kThreadgroupMemory) return (P)threadgroup_argument(p.index);
    return (P)buffer(p.index);  // C-style cast: into the parameter's address space
  } else if constexpr (std::is_reference_v<P>) {
    return *(std::remove_reference_t<P>*)buffer(p.index);
  } else {
    if (p.kind == kBuffer) return *(P*)buffer(p.index);
    uint32_t v[3];
    builtin_value(p.kind, v);
    if constexpr (metal::is_msl_vector_v<P>) {
      P out;
      for (int i = 0; i < metal::vector_traits<P>::size; ++i) out[i] = v[i];
      return out;
    } else {
      return P(v[0]);
    }
  }
}

template <typename P>
inline ParamInfo describe_param(const Param& p) {
  ParamInfo info{p.kind, p.index, 0, 0, 0, 0, type_name<P>(), p.condition};
  if constexpr (std::is_pointer_v<P> || std::is_reference_v<P>) {
    using Pointee = std::remove_pointer_t<std::remove_reference_t<P>>;
    if constexpr (!std::is_void_v<std::remove_cv_t<Pointee>>) {
      info.bytes = uint32_t(sizeof(Pointee));
      info.align = uint32_t(alignof(Pointee));
    } else {
      info.bytes = info.align = 1;
    }
    info.is_pointer = std::is_pointer_v<P>;
    info.writable = !std::is_const_v<Pointee>;
  } else {
    info.bytes = uint32_t(sizeof(P));
    info.align = uint32_t(alignof(P));
  }
  return info;
}

template <typename... A>
constexpr int arity(void (*)(A...)) {
  return int(sizeof...(A));
}

template <typename... A, std::size_t... I>
inline void invoke_impl(void (*f)(A...), const Param* params, std::index_sequence<I...>) {
  f(bind<A>(params[I])...);
}
template <typename... A>
inline void invoke(void (*f)(A...), const Param* params) {
  invoke_impl(f, params, std::index_sequence_for<A...>{});
}

template <typename... A, std::size_t... I>
inline int describe_impl(void (*)(A...), const Param* params, ParamInfo* out, int capacity, std::index_sequence<I...>) {
  if (int(sizeof...(A)) <= capacity) ((out[I] = describe_param<A>(params[I])), ...);
  return int(sizeof...(A));
}
template <typename... A>
inline int describe(void (*f)(A...), const Param* params, ParamInfo* out, int capacity) {
  return describe_impl(f, params, out, capacity, std::index_sequence_for<A...>{});
}

// ------------------------------------------------------------------ workers, faults
constexpr std::size_t kThreadgroupMemoryLimit = 32 * 1024;  // every Apple GPU

// Per OS thread that runs threadgroups.
struct Worker {
  StackPool stacks;
  sigjmp_buf jump;                 // where a fault or fail() lands
  volatile sig_atomic_t armed = 0;
  int signal = 0;                  // the fault's signal, 0 for fail()
  void* address = nullptr;         // the faulting address
  uintptr_t pc = 0;                // the faulting instruction
  std::string failure;             // fail()'s message
};
inline thread_local Worker* current_worker = nullptr;

inline int timeout_signal() {
  return SIGRTMIN + 2;
}

[[noreturn]] inline void fail(const std::string& message) {
  Worker* w = current_worker;
  if (!w || !w->armed) {
    std::fprintf(stderr, "msl emulator: %s\n", message.c_str());
    std::abort();
  }
  w->armed = 0;
  w->signal = 0;
  w->failure = message;
  siglongjmp(w->jump, 1);
}

constexpr int kHandledSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

struct SavedHandlers {
  struct sigaction previous[std::size(kHandledSignals) + 1];
};
inline SavedHandlers saved_handlers;

inline const struct sigaction* previous_handler(int sig) {
  for (std::size_t i = 0; i < std::size(kHandledSignals); ++i)
    if (kHandledSignals[i] == sig) return &saved_handlers.previous[i];
  return nullptr;
}

inline void on_signal(int sig, siginfo_t* info, void* context) {
  Worker* w = current_worker;
  if (w && w->armed) {
    w->armed = 0;
    w->signal = sig;
    w->address = info->si_addr;
#if defined(__x86_64__)
    w->pc = uintptr_t(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
    w->pc = uintptr_t(static_cast<ucontext_t*>(context)->uc_mcontext.pc);
#endif
    siglongjmp(w->jump, 1);
  }
  if (sig == timeout_signal()) return;  // it arrived after the worker finished
  // Not ours: hand it to whoever had it before (Python's faulthandler, or the
  // default action when this returns and the instruction faults again).
  const struct sigaction* old = previous_handler(sig);
  if (old && (old->sa_flags & SA_SIGINFO) && old->sa_sigaction) {
    old->sa_sigaction(sig, info, context);
  } else if (old && old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
    old->sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);
  }
}

// Installs the fault handlers for the duration of a dispatch.
class FaultHandlers {
 public:
  FaultHandlers() {
    struct sigaction action {};
    action.sa_sigaction = on_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < std::size(kHandledSignals); ++i)
      sigaction(kHandledSignals[i], &action, &saved_handlers.previous[i]);
    sigaction(timeout_signal(), &action, &previous_timeout_);
  }
  ~FaultHandlers() {
    for (std::size_t i = 0; i < std::size(kHandledSignals); ++i)
      sigaction(kHandledSignals[i], &saved_handlers.previous[i], nullptr);
    sigaction(timeout_signal(), &previous_timeout_, nullptr);
  }

 private:
  struct sigaction previous_timeout_ {};
};

// An alternate signal stack for the calling thread, so a fiber's stack
// overflow can still be reported.
class AltStack {
 public:
  AltStack() : memory_(64 * 1024) {
    stack_t stack{};
    stack.ss_sp = memory_.data();
    stack.ss_size = memory_.size();
    sigaltstack(&stack, &previous_);
  }
  ~AltStack() {
    if (previous_.ss_sp && !(previous_.ss_flags & SS_DISABLE)) {
      sigaltstack(&previous_, nullptr);
    } else {
      stack_t off{};
      off.ss_flags = SS_DISABLE;
      sigaltstack(&off, nullptr);
    }
  }

 private:
  std::vector<char> memory_;
  stack_t previous_{};
};

// ------------------------------------------------------------------ buffers
// The kernel's view of the dispatch's buffers: guarded copies, or the
// caller's memory itself where buffers overlap (views of one array).
class StagedBuffers {
 public:
  StagedBuffers(void* const* user, const uint64_t* bytes, const uint32_t* align, const int* writable, int count)
      : user_(user, user + count), bytes_(bytes, bytes + count), writable_(writable, writable + count),
        pointers_(count, nullptr), blocks_(count), owner_(count, -1) {
    for (int i = 0; i < count; ++i) {
      if (!user[i]) continue;
      int same = -1;
      bool overlaps = false;
      for (int j = 0; j < count; ++j) {
        if (j == i || !user[j]) continue;
        if (user[j] == user[i] && bytes[j] == bytes[i]) {
          if (j < i) same = j;
        } else if (overlap(i, j)) {
          overlaps = true;
        }
      }
      if (same >= 0) {
        pointers_[i] = pointers_[same];
        owner_[i] = owner_[same];
        continue;
      }
      if (overlaps) {
        pointers_[i] = user[i];
        continue;
      }
      bool written = writable[i];
      for (int j = i + 1; j < count; ++j)
        if (user[j] == user[i] && bytes[j] == bytes[i]) written |= bool(writable[j]);
      const uint32_t alignment = std::max<uint32_t>(align[i], 1);
      GuardedBlock block(bytes[i], alignment, reinterpret_cast<uintptr_t>(user[i]) % alignment);
      if (!block.ok()) {
        pointers_[i] = user[i];
        continue;
      }
      if (bytes[i]) std::memcpy(block.data(), user[i], bytes[i]);
      if (!written) block.protect_read_only();
      writable_[i] = written;
      pointers_[i] = block.data();
      blocks_[i] = std::move(block);
      owner_[i] = i;
    }
  }
  // Copies what the kernel may have written back to the caller's memory.
  void copy_back() {
    for (std::size_t i = 0; i < blocks_.size(); ++i)
      if (owner_[i] == int(i) && writable_[i] && bytes_[i]) std::memcpy(user_[i], blocks_[i].data(), bytes_[i]);
  }
  void* const* pointers() const { return pointers_.data(); }
  // "4 bytes past the end of buffer(2) (64 bytes)", or "".
  std::string describe(const void* address) const {
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (owner_[i] != int(i)) continue;
      std::string relation = blocks_[i].describe(address);
      if (!relation.empty())
        return relation + " buffer(" + std::to_string(i) + ") (" + std::to_string(bytes_[i]) + " bytes)";
    }
    return "";
  }

 private:
  bool overlap(int i, int j) const {
    auto a = static_cast<const char*>(user_[i]), b = static_cast<const char*>(user_[j]);
    return a < b + bytes_[j] && b < a + bytes_[i];
  }
  std::vector<void*> user_;
  std::vector<uint64_t> bytes_;
  std::vector<int> writable_;
  std::vector<void*> pointers_;
  std::vector<GuardedBlock> blocks_;
  std::vector<int> owner_;
};

// ------------------------------------------------------------------ dispatch
struct Failure {
  int code = 0;          // 1 deadlock, 2 error, 3 fault, 4 timeout
  long group = -1;       // linear threadgroup index, for picking the first
  std::string message;
  uintptr_t pc = 0;
};

struct Launch {
  const Entry* entry;
  Geometry geometry;     // group_id / group_size filled per group
  void* const* buffers;
  int buffer_count;
  const uint32_t* threadgroup_arg_bytes;
  int threadgroup_arg_count;
  const StagedBuffers* staged;
  long total_groups;
  std::atomic<long> next{0};
  std::atomic<bool> stop{false};
  std::mutex mutex;
  Failure failure;
  Counters counters;  // summed over the workers

  void add_counters(const Counters& c) {
    std::lock_guard<std::mutex> lock(mutex);
    for (int i = 0; i < Counters::kFields; ++i) {
      uint64_t& total = counters.fields()[i];
      total = &total == &counters.threadgroup_memory_bytes ? std::max(total, c.fields()[i]) : total + c.fields()[i];
    }
  }

  void report(Failure f) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failure.code == 0 || f.group < failure.group) failure = std::move(f);
    stop = true;
  }
};

inline std::string group_name(const Geometry& geo) {
  return "threadgroup (" + std::to_string(geo.group_id[0]) + ", " + std::to_string(geo.group_id[1]) + ", " +
         std::to_string(geo.group_id[2]) + ")";
}

// " in thread 5 (simdgroup 0, lane 5), last synchronised in ... at file:line"
inline std::string where_in(const Group& g) {
  if (g.fibers.empty()) return "";
  const Fiber& f = g.fibers[g.current];
  std::string text = "; in " + thread_name(f);
  if (f.site.line) text += ", last synchronised in " + std::string(f.site.what) + " at " + f.site.where();
  return text;
}

inline std::string describe_fault(const Worker& w, const Group& g, const StackPool& stacks, const StagedBuffers& staged) {
  std::string what;
  switch (w.signal) {
    case SIGSEGV: case SIGBUS: what = "invalid memory access"; break;
    case SIGFPE: what = "arithmetic fault (integer division by zero?)"; break;
    case SIGILL: what = "illegal instruction (undefined behaviour trap?)"; break;
    case SIGABRT: what = "abort"; break;
    default: what = "signal " + std::to_string(w.signal);
  }
  std::string message = what;
  if (w.signal == SIGSEGV || w.signal == SIGBUS) {
    std::string where = staged.describe(w.address);
    for (const auto& [id, array] : g.threadgroup_memory) {
      if (!where.empty()) break;
      std::string relation = array.block.describe(w.address);
      if (!relation.empty())
        where = relation + " threadgroup array " + array.name + " (" + std::to_string(array.block.size()) + " bytes)";
    }
    int overflowed = stacks.overflowed_fiber(w.address);
    if (overflowed >= 0) where = "the stack guard of thread " + std::to_string(overflowed) + " (stack overflow)";
    if (where.empty() || where.rfind("inside", 0) == 0) {
      char text[64];
      std::snprintf(text, sizeof text, "address %p", w.address);
      where = text;
    }
    message += " at " + where;
  }
  return message + where_in(g);
}

inline void run_worker(Launch& launch) {
  Worker worker;
  current_worker = &worker;
  Counters counters;
  current_counters = &counters;
  AltStack alt_stack;
  Group group;
  group.geometry = launch.geometry;
  group.buffers = launch.buffers;
  group.buffer_count = launch.buffer_count;
  group.threadgroup_arg_bytes = launch.threadgroup_arg_bytes;
  group.threadgroup_arg_count = launch.threadgroup_arg_count;
  Geometry& geo = group.geometry;
  while (!launch.stop) {
    long index = launch.next++;
    if (index >= launch.total_groups) break;
    geo.group_id[0] = uint32_t(index % geo.threadgroups[0]);
    geo.group_id[1] = uint32_t((index / geo.threadgroups[0]) % geo.threadgroups[1]);
    geo.group_id[2] = uint32_t(index / (long(geo.threadgroups[0]) * geo.threadgroups[1]));
    for (int i = 0; i < 3; ++i)
      geo.group_size[i] = std::min(geo.nominal_size[i], geo.grid_threads[i] - geo.group_id[i] * geo.nominal_size[i]);
    if (sigsetjmp(worker.jump, 1) == 0) {
      worker.armed = 1;
      bool ok = run_threadgroup(group, worker.stacks, launch.entry->body);
      worker.armed = 0;
      std::size_t shared = 0;
      for (const auto& [id, array] : group.threadgroup_memory) shared += array.block.size();
      counters.threadgroup_memory_bytes = std::max<uint64_t>(counters.threadgroup_memory_bytes, shared);
      if (!ok) {
        launch.report({1, index, group_name(geo) + ": " + group.error});
      } else if (shared > kThreadgroupMemoryLimit) {
        launch.report({2, index, "the kernel uses " + std::to_string(shared) +
                                     " bytes of threadgroup memory; Metal allows " +
                                     std::to_string(kThreadgroupMemoryLimit)});
      }
    } else {
      current_group = nullptr;
      Failure f;
      f.group = index;
      if (worker.signal == 0) {
        f.code = 2;
        f.message = group_name(geo) + ": " + worker.failure + where_in(group);
      } else if (worker.signal == timeout_signal()) {
        f.code = 4;
        f.message = group_name(geo) + ": the kernel did not finish in time (an endless loop?)" + where_in(group);
      } else {
        f.code = 3;
        f.pc = worker.pc;
        f.message = group_name(geo) + ": " + describe_fault(worker, group, worker.stacks, *launch.staged);
      }
      launch.report(std::move(f));
      // The fibers' state is lost; a fresh group for any further work.
      group.fibers.clear();
    }
  }
  current_worker = nullptr;
  current_counters = nullptr;
  launch.add_counters(counters);
}

inline Counters last_counters;  // of the latest dispatch of this library

inline int dispatch(const Entry* entries, int count, const char* name, const uint32_t* threadgroups,
                    const uint32_t* threadgroup_size, const uint32_t* grid_threads, void* const* buffers,
                    const uint64_t* buffer_bytes, const uint32_t* buffer_align, const int* buffer_writable,
                    int buffer_count, const uint32_t* threadgroup_arg_bytes, int threadgroup_arg_count, int workers,
                    double timeout_s, char* error, int error_capacity, uint64_t* fault_pc) {
  *fault_pc = 0;
  const Entry* entry = nullptr;
  for (int i = 0; i < count; ++i)
    if (std::strcmp(entries[i].name, name) == 0) entry = &entries[i];
  if (!entry) {
    std::snprintf(error, error_capacity, "unknown kernel %s", name);
    return 2;
  }
  StagedBuffers staged(buffers, buffer_bytes, buffer_align, buffer_writable, buffer_count);
  Launch launch;
  launch.entry = entry;
  for (int i = 0; i < 3; ++i) {
    launch.geometry.threadgroups[i] = threadgroups[i];
    launch.geometry.nominal_size[i] = threadgroup_size[i];
    launch.geometry.grid_threads[i] = grid_threads[i];
  }
  launch.buffers = staged.pointers();
  launch.buffer_count = buffer_count;
  launch.threadgroup_arg_bytes = threadgroup_arg_bytes;
  launch.threadgroup_arg_count = threadgroup_arg_count;
  launch.staged = &staged;
  launch.total_groups = long(threadgroups[0]) * threadgroups[1] * threadgroups[2];
  workers = int(std::max(1L, std::min<long>(workers, launch.total_groups)));
  {
    FaultHandlers handlers;
    std::vector<std::thread> threads;
    std::vector<pthread_t> handles;
    std::atomic<int> running{workers};
    std::mutex done_mutex;
    std::condition_variable done;
    for (int i = 0; i < workers; ++i) {
      threads.emplace_back([&] {
        run_worker(launch);
        std::lock_guard<std::mutex> lock(done_mutex);
        --running;
        done.notify_all();
      });
      handles.push_back(threads.back().native_handle());
    }
    std::unique_lock<std::mutex> lock(done_mutex);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    if (!done.wait_until(lock, deadline, [&] { return running == 0; })) {
      launch.stop = true;  // workers between threadgroups stop by themselves
      if (!done.wait_for(lock, std::chrono::milliseconds(200), [&] { return running == 0; })) {
        for (pthread_t handle : handles) pthread_kill(handle, timeout_signal());
      }
    }
    lock.unlock();
    for (auto& t : threads) t.join();
  }
  staged.copy_back();
  last_counters = launch.counters;
  if (launch.failure.code == 0) return 0;
  std::snprintf(error, error_capacity, "%s", launch.failure.message.c_str());
  // The faulting instruction as an offset into this library, for symbolizing.
  Dl_info fault{}, self_info{};
  *fault_pc = 0;
  if (launch.failure.pc && dladdr(reinterpret_cast<void*>(launch.failure.pc), &fault) &&
      dladdr(reinterpret_cast<void*>(&run_worker), &self_info) && fault.dli_fbase == self_info.dli_fbase)
    *fault_pc = launch.failure.pc - reinterpret_cast<uintptr_t>(fault.dli_fbase);
  return launch.failure.code;
}

}  // namespace msl_rt

#ifdef MSL_COUNTERS
// Called before every load and store of device (1), constant (2) and
// threadgroup (3) memory in kernel code; build.py inserts the calls with the
// accessed address and the alignment the instruction assumes (1 for copies).
// A device access off that alignment (a half4 read 2 bytes into a vector)
// is undefined on the GPU: it fails the dispatch here.
extern "C" __attribute__((used, noinline, visibility("hidden"))) void msl_count_access(
    int space, uint64_t bytes, int is_store, uint64_t address, uint64_t alignment) {
  msl_rt::Counters* c = msl_rt::current_counters;
  if (!c) return;
  if (space == 1 && alignment > 1 && address % alignment != 0) {
    msl_rt::fail("misaligned device " + std::string(is_store ? "store" : "load") + " of " + std::to_string(bytes) +
                 " bytes at an address " + std::to_string(address % alignment) + " bytes past a multiple of " +
                 std::to_string(alignment));
  }
  if (space == 1 && !is_store) ++c->device_load_operations;
  if (space == 1) (is_store ? c->device_bytes_written : c->device_bytes_read) += bytes;
  else if (space == 2) c->constant_bytes_read += bytes;
  else if (space == 3) (is_store ? c->threadgroup_bytes_written : c->threadgroup_bytes_read) += bytes;
}
#endif

// Metal's is_function_constant_defined(name).
template <typename T>
inline bool is_function_constant_defined(const msl_rt::FunctionConstant<T>& constant_) {
  return constant_.set;
}

#pragma pop_macro("device")
#pragma pop_macro("constant")
#pragma pop_macro("threadgroup")
#pragma pop_macro("thread")

// The C interface of every translated library.
#define MSL_EMULATOR_EXPORTS(count)                                                                           \
  extern "C" __attribute__((visibility("default"))) int msl_kernel_count() { return count; }                                                       \
  extern "C" __attribute__((visibility("default"))) const char* msl_kernel_name(int i) { return msl_entries[i].name; }                             \
  extern "C" __attribute__((visibility("default"))) int msl_kernel_params(int i, msl_rt::ParamInfo* out, int capacity) {                           \
    return msl_entries[i].describe(out, capacity);                                                          \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) int msl_function_constant_count() {                       \
    return int(msl_rt::function_constant_slots().size());                                                   \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) void msl_function_constant_info(                          \
      int i, int* id, const char** name, const char** type) {                                               \
    const auto& slot = msl_rt::function_constant_slots()[i];                                                \
    *id = slot.id;                                                                                          \
    *name = slot.name;                                                                                      \
    *type = slot.type;                                                                                      \
  }                                                                                                         \
  /* Unsets every constant, then sets constant i (slot order) to values[i] where given. */                  \
  extern "C" __attribute__((visibility("default"))) void msl_set_function_constants(const void* const* values) { \
    int i = 0;                                                                                              \
    for (auto& slot : msl_rt::function_constant_slots()) {                                                  \
      *slot.set = values[i] != nullptr;                                                                     \
      if (values[i]) std::memcpy(slot.value, values[i], slot.bytes);                                        \
      ++i;                                                                                                  \
    }                                                                                                       \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) int msl_last_counters(uint64_t* out) {                   \
    std::memcpy(out, msl_rt::last_counters.fields(), sizeof(uint64_t) * msl_rt::Counters::kFields);        \
    return msl_rt::Counters::kFields;                                                                       \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) int msl_dispatch(const char* name, const uint32_t* threadgroups, const uint32_t* threadgroup_size, \
                              const uint32_t* grid_threads, void* const* buffers, const uint64_t* buffer_bytes, \
                              const uint32_t* buffer_align, const int* buffer_writable, int buffer_count,   \
                              const uint32_t* threadgroup_arg_bytes, int threadgroup_arg_count, int workers, \
                              double timeout_s, char* error, int error_capacity, uint64_t* fault_pc) {      \
    return msl_rt::dispatch(msl_entries, count, name, threadgroups, threadgroup_size, grid_threads, buffers,  \
                            buffer_bytes, buffer_align, buffer_writable, buffer_count, threadgroup_arg_bytes, \
                            threadgroup_arg_count, workers, timeout_s, error, error_capacity, fault_pc);    \
  }
