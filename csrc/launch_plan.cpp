#include "csrc/launch_plan.h"

#include <algorithm>
#include <cmath>

namespace mlx_attn {

namespace {
constexpr int kPrefillRows = 32;       // BQ: 4 simdgroups x 8 rows
constexpr int kPrefillThreads = 128;
constexpr int kThreadgroupMemoryLimit = 32 * 1024;
}  // namespace

int prefill_key_block(int head_dim) {
  switch (head_dim) {  // 2 * BK * (D * 4 + 16) bytes of float32 K/V tiles <= 18.5 KB
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    case 256: return 8;
    default: return 0;
  }
}

int decode_rows_per_threadgroup(int head_dim) {
  if (head_dim % 32 != 0 || prefill_key_block(head_dim) == 0) return 0;
  return MLX_ATTN_DECODE_ROW_FLOATS / (head_dim / 32);
}

namespace {
// Unmeasured (no Apple GPU here): 256 threadgroups of 128 threads keep
// 8 per core on a 32-core GPU (M1/M2/M3 Max class), more than enough for
// the 8-10 core base parts.
constexpr int kDecodeTargetThreadgroups = 256;
// A split's partial (D + 2 floats per row, written then read) costs about
// 2 * rows / keys of its K/V traffic: at least 16 keys per row keeps it
// <= 1/8 (fp16); at least 64 keys gives each of the 4 simdgroups 16.
constexpr int kDecodeMinKeysPerSplit = 64;
constexpr int kDecodeMinKeysPerRow = 16;
}  // namespace

int decode_splits(int batch, int kv_heads, int rows, int kv_len, int head_dim) {
  const int row_chunks = (rows + decode_rows_per_threadgroup(head_dim) - 1) / decode_rows_per_threadgroup(head_dim);
  const int64_t threadgroups = int64_t(batch) * kv_heads * row_chunks;
  const int64_t for_occupancy = (kDecodeTargetThreadgroups + threadgroups - 1) / threadgroups;
  const int64_t keys_per_split = std::max(kDecodeMinKeysPerSplit, kDecodeMinKeysPerRow * rows);
  const int64_t for_traffic = (kv_len + keys_per_split - 1) / keys_per_split;
  return int(std::max<int64_t>(1, std::min(for_occupancy, for_traffic)));
}

const char* role_name(BufferRole role) {
  switch (role) {
    case BufferRole::q: return "q";
    case BufferRole::k: return "k";
    case BufferRole::v: return "v";
    case BufferRole::mask: return "mask";
    case BufferRole::sinks: return "sinks";
    case BufferRole::out: return "out";
    case BufferRole::lse: return "lse";
    case BufferRole::params: return "params";
    case BufferRole::splits: return "splits";
    case BufferRole::partial_out: return "partial_out";
    case BufferRole::partial_stats: return "partial_stats";
    case BufferRole::d_out: return "d_out";
    case BufferRole::d_lse: return "d_lse";
    case BufferRole::dq: return "dq";
    case BufferRole::dk: return "dk";
    case BufferRole::dv: return "dv";
    case BufferRole::d_sinks: return "d_sinks";
    case BufferRole::delta: return "delta";
  }
  return "?";
}

const char* source_name(Source source) {
  switch (source) {
    case Source::input: return "input";
    case Source::output: return "output";
    case Source::scratch: return "scratch";
    case Source::params: return "params";
    case Source::splits: return "splits";
  }
  return "?";
}

namespace {
constexpr int kDecodeThreads = 32 * MLX_ATTN_DECODE_SIMDGROUPS;

// Turns the kernel's parameter list (buffer(i) = roles[i]) into bindings:
// inputs in the primitive's order (q, k, v, then mask and sinks when
// present), the outputs, scratch and bytes. An absent mask, sinks or lse
// binds q as a placeholder: the kernel never touches it (params.mask_kind /
// has_sinks / output_lse say so), but every buffer index must be bound.
std::vector<Binding> bindings_for(
    const AttentionProblem& s,
    const std::vector<BufferRole>& roles,
    const std::vector<ScratchBuffer>& scratch,
    int dispatch_index) {
  const bool has_mask = s.mask_kind != MaskKind::none;
  std::vector<Binding> out;
  for (int i = 0; i < int(roles.size()); ++i) {
    Binding b;
    b.index = i;
    b.role = roles[i];
    switch (b.role) {
      case BufferRole::q: b.source_index = 0; break;
      case BufferRole::k: b.source_index = 1; break;
      case BufferRole::v: b.source_index = 2; break;
      case BufferRole::mask: b.source_index = has_mask ? 3 : 0; break;
      case BufferRole::sinks: b.source_index = s.has_sinks ? 3 + has_mask : 0; break;
      case BufferRole::out:
        b.source = Source::output;
        b.access = Access::write;
        break;
      case BufferRole::lse:
        if (s.output_lse) {
          b.source = Source::output;
          b.access = Access::write;
          b.source_index = 1;
        }
        break;
      case BufferRole::params: b.source = Source::params; break;
      case BufferRole::splits: b.source = Source::splits; break;
      case BufferRole::partial_out:
      case BufferRole::partial_stats:
        b.source = Source::scratch;
        for (int j = 0; j < int(scratch.size()); ++j) {
          if (scratch[j].role == b.role) {
            b.source_index = j;
            b.access = scratch[j].producer == dispatch_index ? Access::write : Access::read;
          }
        }
        break;
    }
    out.push_back(b);
  }
  return out;
}

std::string kernel_name(const char* kind, const AttentionProblem& s) {
  return std::string(kind) + "_" + elem_type_name(s.dtype) + "_d" + std::to_string(s.head_dim);
}

void plan_decode(const AttentionProblem& s, LaunchPlan& plan) {
  using R = BufferRole;
  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  const int rows_per_threadgroup = decode_rows_per_threadgroup(s.head_dim);
  const int row_chunks = (rows + rows_per_threadgroup - 1) / rows_per_threadgroup;
  const int splits = decode_splits(s.batch, s.kv_heads, rows, s.kv_len, s.head_dim);
  const int64_t partials = int64_t(s.batch) * s.kv_heads * splits * rows;
  plan.splits = splits;
  // dispatch 0 (partial) writes them, dispatch 1 (merge) reads them
  plan.scratch = {{R::partial_out, partials * s.head_dim, 0, 1}, {R::partial_stats, partials * 2, 0, 1}};
  KernelDispatch partial;
  partial.kernel = kernel_name("attention_decode_partial", s);
  partial.grid = {splits, s.kv_heads * row_chunks, s.batch};
  partial.threadgroup = {kDecodeThreads, 1, 1};
  partial.bindings = bindings_for(
      s, {R::q, R::k, R::v, R::params, R::mask, R::partial_out, R::partial_stats}, plan.scratch, 0);
  // the simdgroups' output, max and sum per row, combined at the end
  partial.threadgroup_memory_bytes =
      MLX_ATTN_DECODE_SIMDGROUPS * rows_per_threadgroup * (s.head_dim + 2) * 4;
  KernelDispatch merge;
  merge.kernel = kernel_name("attention_decode_merge", s);
  merge.grid = {rows, s.kv_heads, s.batch};
  merge.threadgroup = {32, 1, 1};
  merge.bindings = bindings_for(
      s, {R::partial_out, R::partial_stats, R::sinks, R::out, R::params, R::splits, R::lse}, plan.scratch, 1);
  plan.dispatches = {partial, merge};
}
}  // namespace

LaunchPlan plan_attention(const AttentionProblem& s) {
  LaunchPlan plan;
  const int key_block = prefill_key_block(s.head_dim);
  if (key_block == 0) {
    plan.reason = "the Metal kernels support head dims 64, 80, 96, 128 and 256, got " + std::to_string(s.head_dim);
    return plan;
  }
  if (s.value_dim != s.head_dim) {
    plan.reason = "the Metal kernels need equal query/key and value head dims, got " + std::to_string(s.head_dim) +
        " and " + std::to_string(s.value_dim);
    return plan;
  }
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) {
    plan.reason = "q_heads must be a multiple of kv_heads";
    return plan;
  }
  AttentionParams& p = plan.params;
  for (int i = 0; i < 4; ++i) {
    p.q_strides[i] = s.q_strides[i];
    p.k_strides[i] = s.k_strides[i];
    p.v_strides[i] = s.v_strides[i];
    p.mask_strides[i] = s.mask_strides[i];
  }
  p.batch = s.batch;
  p.q_heads = s.q_heads;
  p.kv_heads = s.kv_heads;
  p.group = s.q_heads / s.kv_heads;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.causal = s.causal ? 1 : 0;
  p.window_size = s.window_size;
  p.mask_kind = int32_t(s.mask_kind);
  p.has_sinks = s.has_sinks ? 1 : 0;
  p.sinks_stride = s.sinks_stride;
  p.scale = s.scale;
  p.output_lse = s.output_lse ? 1 : 0;

  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  if (s.q_len <= kDecodeMaxQueries && rows <= kDecodeMaxRows && decode_rows_per_threadgroup(s.head_dim) != 0) {
    plan_decode(s, plan);
    plan.supported = true;
    return plan;
  }

  KernelDispatch prefill;
  prefill.kernel = kernel_name("attention_prefill", s);
  prefill.grid = {(s.q_len + kPrefillRows - 1) / kPrefillRows, s.q_heads, s.batch};
  prefill.threadgroup = {kPrefillThreads, 1, 1};
  using R = BufferRole;
  prefill.bindings = bindings_for(s, {R::q, R::k, R::v, R::out, R::params, R::mask, R::sinks, R::lse}, plan.scratch, 0);
  // K and V tiles in the input dtype, rows padded by 16 bytes
  const int element_bytes = s.dtype == ElemType::float32 ? 4 : 2;
  prefill.threadgroup_memory_bytes = 2 * key_block * (s.head_dim * element_bytes + 16);
  if (prefill.threadgroup_memory_bytes > kThreadgroupMemoryLimit) {
    plan.reason = "threadgroup memory over 32 KB";
    return plan;
  }
  plan.dispatches.push_back(prefill);
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
