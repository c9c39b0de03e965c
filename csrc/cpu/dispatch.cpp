// Picks the widest kernel copy this CPU supports and runs a problem over the
// thread pool, each thread with its own scratch tile memory.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/cpu/copies.h"
#include "csrc/cpu/host.h"
#include "csrc/cpu/thread_pool.h"

namespace mlx_attn::cpu {
namespace {

const ForwardCopy* select_isa(const char* name) {
  for (const ForwardCopy& isa : kForwardCopies) {
    if ((name == nullptr || std::strcmp(name, isa.name) == 0) &&
        isa.available()) {
      return &isa;
    }
  }
  return nullptr;
}

const ForwardCopy* default_isa() {
  const char* env = std::getenv("MLX_ATTN_CPU_ISA");
  const ForwardCopy* isa = env ? select_isa(env) : nullptr;
  return isa ? isa : select_isa(nullptr);
}

const ForwardCopy*& active_isa() {
  static const ForwardCopy* isa = default_isa();
  return isa;
}

}  // namespace

const char* current_isa() {
  return active_isa()->name;
}

const BackwardCopy& active_backward_copy() {
  return *active_isa()->backward;
}

const char* current_backward_copy() {
  return active_backward_copy().name;
}

void set_isa(const char* name) {
  const ForwardCopy* isa = select_isa(name);
  if (!isa) {
    throw std::invalid_argument(
        std::string("[mlx_attn] CPU instruction set '") + name +
        "' is not available on this machine or build");
  }
  active_isa() = isa;
}

const char* const* supported_isas(int* count) {
  static std::vector<const char*> names = [] {
    std::vector<const char*> v;
    for (const ForwardCopy& isa : kForwardCopies) {
      if (isa.available()) v.push_back(isa.name);
    }
    return v;
  }();
  *count = int(names.size());
  return names.data();
}

std::string unsupported_reason(const AttentionProblem& p) {
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim || p.value_dim < 1 ||
      p.value_dim > kMaxHeadDim) {
    return "the fused CPU kernel supports head dims 1.." + std::to_string(kMaxHeadDim) +
        ", got D=" + std::to_string(p.head_dim) + ", Dv=" + std::to_string(p.value_dim);
  }
  return {};
}

// Rows per work item: kMaxRows, twice that for the AMX products (bf16,
// avx512amx), whose tiles multiply so fast that the per-item packing of each
// K/V block (V^T above all) is what more rows amortize.
int max_rows(const AttentionProblem& p) {
  const bool amx = std::strcmp(active_isa()->name, "avx512amx") == 0 && p.dtype == ElemType::bfloat16;
  return amx ? 2 * kMaxRows : kMaxRows;
}

void plan_work(KernelCall& call) {
  const AttentionProblem& p = call.problem;
  const int group = p.group_size();
  int qb = max_rows(p) / group;
  qb = qb < 1 ? 1 : (qb < p.q_len ? qb : p.q_len);
  call.query_block = qb;
  // Small problems: smaller blocks so every thread gets work (rows >= 16).
  const int64_t enough = 2 * int64_t(thread_pool().size());
  while (call.work_items() < enough && qb > 1 && (qb / 2) * group >= 16) {
    qb /= 2;
    call.query_block = qb;
  }
}

namespace {
int64_t scratch_stride(const KernelCall& call) {
  return round_up(scratch_floats(call, active_isa()->lanes()), 16);
}
}  // namespace

int64_t scratch_size(const KernelCall& call) {
  return scratch_stride(call) * thread_pool().size() + 16;
}

void run_attention(const KernelCall& call, float* scratch) {
  const ForwardCopy* isa = active_isa();
  const int64_t stride = scratch_stride(call);
  // Align each thread's block to 64 bytes.
  float* base = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  thread_pool().parallel_for(call.work_items(), [&](int64_t item, int slot) {
    isa->process(call, item, base + stride * slot);
  });
}

void run_attention_calls(const KernelCall* calls, int count, float* scratch) {
  const ForwardCopy* isa = active_isa();
  std::vector<int64_t> first(count + 1, 0);  // calls[i]'s items are first[i] .. first[i + 1] - 1
  int64_t stride = 0;
  for (int i = 0; i < count; ++i) {
    first[i + 1] = first[i] + calls[i].work_items();
    stride = std::max(stride, scratch_stride(calls[i]));
  }
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  thread_pool().parallel_for(first[count], [&](int64_t item, int slot) {
    int i = 0;
    while (item >= first[i + 1]) ++i;
    isa->process(calls[i], item - first[i], base + stride * slot);
  });
}

}  // namespace mlx_attn::cpu
