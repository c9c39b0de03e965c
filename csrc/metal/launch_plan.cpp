#include "csrc/metal/launch_plan.h"

#include <algorithm>
#include <cmath>

namespace mlx_attn {

namespace {
constexpr int kThreadgroupMemoryLimit = 32 * 1024;

// The per-family table (docs/metal_kernels.md, "GPU family table"). BK for
// apple7/8 is MLX's steel_attention choice for fp16 (32 at D = 64, 16 at
// D = 128); apple9's larger BK for 2-byte dtypes and every core count and
// threadgroups-per-core figure are UNMEASURED (no Apple GPU here).
constexpr std::array<int, 5> kSteelKeyBlocks = {32, 16, 16, 16, 8};
constexpr std::array<int, 5> kApple9KeyBlocks = {32, 32, 32, 32, 16};
constexpr GpuTuning kGpuTable[] = {
    {GpuFamily::unknown, "unknown", 8, 4, kSteelKeyBlocks, kSteelKeyBlocks, 8},
    {GpuFamily::apple7, "apple7", 8, 4, kSteelKeyBlocks, kSteelKeyBlocks, 8},
    {GpuFamily::apple8, "apple8", 8, 4, kSteelKeyBlocks, kSteelKeyBlocks, 8},
    {GpuFamily::apple9, "apple9", 8, 4, kApple9KeyBlocks, kSteelKeyBlocks, 8},
    // M5: apple9's tiles (its SIMD pipes run them the same way); the matrix
    // units are not used (docs/metal_kernels.md, "M5 and matrix units").
    {GpuFamily::apple10, "apple10", 8, 4, kApple9KeyBlocks, kSteelKeyBlocks, 8},
};
// The prefill kernel is compiled for this many simdgroups per threadgroup.
constexpr bool table_matches_kernels() {
  for (const auto& row : kGpuTable) {
    if (row.prefill_simdgroups != MLX_ATTN_PREFILL_SIMDGROUPS) return false;
  }
  return true;
}
static_assert(table_matches_kernels(), "metal/attention_prefill.metal is instantiated for MLX_ATTN_PREFILL_SIMDGROUPS");

int head_dim_index(int head_dim) {
  for (int i = 0; i < int(kHeadDims.size()); ++i) {
    if (kHeadDims[i] == head_dim) return i;
  }
  return -1;
}
}  // namespace

const GpuTuning& gpu_tuning(GpuFamily family) {
  for (const auto& row : kGpuTable) {
    if (row.family == family) return row;
  }
  return kGpuTable[0];
}

const char* gpu_family_name(GpuFamily family) { return gpu_tuning(family).name; }

bool gpu_family_from_name(std::string_view name, GpuFamily& family) {
  for (const auto& row : kGpuTable) {
    if (name == row.name) {
      family = row.family;
      return true;
    }
  }
  return false;
}

GpuTarget gpu_target_from_architecture(std::string_view architecture) {
  // "applegpu_g13g": generation 13 (M1), tier g (base). Generations follow
  // Apple's G13 = M1, G14 = M2, G15 = M3, G16 = M4, G17 = M5; tiers p
  // (iPhone/iPad), g (base), s (Pro), c (Max), d (Ultra), with the tier's
  // smallest core count. A generation after 17 is not known yet: the
  // conservative family (its cores still follow the tier).
  constexpr std::string_view prefix = "applegpu_g";
  GpuTarget target;
  if (architecture.substr(0, prefix.size()) != prefix) return target;
  std::string_view rest = architecture.substr(prefix.size());
  int generation = 0;
  size_t digits = 0;
  while (digits < rest.size() && digits < 3 && rest[digits] >= '0' && rest[digits] <= '9') {
    generation = generation * 10 + (rest[digits] - '0');
    ++digits;
  }
  if (digits == 0) return target;
  if (generation == 13) target.family = GpuFamily::apple7;
  else if (generation == 14) target.family = GpuFamily::apple8;
  else if (generation == 15 || generation == 16) target.family = GpuFamily::apple9;
  else if (generation == 17) target.family = GpuFamily::apple10;
  if (rest.size() == digits + 1) {
    switch (rest[digits]) {
      case 'p': target.gpu_cores = 4; break;
      case 'g': target.gpu_cores = 8; break;
      case 's': target.gpu_cores = 14; break;
      case 'c': target.gpu_cores = 24; break;
      case 'd': target.gpu_cores = 48; break;
      default: break;
    }
  }
  return target;
}

int gpu_cores(const GpuTarget& target) {
  return target.gpu_cores > 0 ? target.gpu_cores : gpu_tuning(target.family).base_cores;
}

int prefill_key_block(int head_dim, ElemType dtype, const GpuTarget& target) {
  const int at = head_dim_index(head_dim);
  if (at < 0) return 0;
  const GpuTuning& row = gpu_tuning(target.family);
  return dtype == ElemType::float32 ? row.prefill_key_block_32[at] : row.prefill_key_block_16[at];
}

namespace {
// Simdgroups of the row shape per kDecodeHeadDims entry: as many as a core's
// registers hold at one row (the cost model's estimate, 34-86 registers a
// lane, against Apple7-9's 208 KB) and combine_simdgroup_states' threadgroup
// memory allows (32 KB); metal/attention_decode.metal instantiates the same.
constexpr std::array<int, 5> kDecodeRowSimdgroups = {32, 32, 32, 16, 16};
// A split of the group shape gives each of its simdgroups at least 16 keys; a
// split of the row shape, 32 (a merge dispatch costs about 16 key steps,
// decode_path below).
constexpr int kDecodeMinKeysPerSplit = 64;
constexpr int kDecodeRowMinKeysPerSimdgroup = 32;
constexpr int kDecodeMinKeysPerRow = 16;
// A dequantized key costs 2-2.5 float keys of issue and the row shape is
// issue-bound on them (the cost model), so a split's merge is paid for by a
// quarter of the keys, and on the row shape a part wave of threadgroups past
// a full one costs a whole wave's keys (latency-bound group-shape
// threadgroups overlap it): over the rule's grid of 4-bit problems the
// model puts this at 1.03x its best split count (worst 1.31x), the float
// floors at 1.13x (worst 2.20x) (kernel_lab/cost_checks.py quantized_rule_check).
constexpr int kDequantizedSplitFloorDivisor = 4;

int decode_head_dim_index(int head_dim) {
  const auto at = std::find(kDecodeHeadDims.begin(), kDecodeHeadDims.end(), head_dim);
  return at == kDecodeHeadDims.end() ? -1 : int(at - kDecodeHeadDims.begin());
}

// Threadgroups of `shape` the target runs at once: the family's figure
// counts threadgroups of MLX_ATTN_DECODE_SIMDGROUPS simdgroups; at least one
// per core.
int64_t decode_threadgroups_at_once(const DecodeShape& shape, const GpuTarget& target) {
  const int64_t cores = gpu_cores(target);
  return std::max<int64_t>(cores, cores * gpu_tuning(target.family).decode_threadgroups_per_core *
                                      MLX_ATTN_DECODE_SIMDGROUPS / shape.simdgroups);
}

// A problem's critical path on one shape, in key steps of one simdgroup: the
// waves of threadgroups times each one's keys per simdgroup, a key of
// several rows weighing 1.5 (the rows are independent chains: their issue
// time adds up, their latency does not), and a merge dispatch as 16 key steps
// (the cost model's dispatch cost over its chain per key).
// kernel_lab/cost_checks.py (decode_rule_check) holds the rule against the
// cost model's best shape and split count per problem.
double decode_path(int batch, int kv_heads, int rows, int kv_len, int splits, const DecodeShape& shape,
                   const GpuTarget& target) {
  const int64_t threadgroups = int64_t(batch) * kv_heads * ((rows + shape.rows - 1) / shape.rows) * splits;
  const int64_t at_once = decode_threadgroups_at_once(shape, target);
  const double waves = double(std::max<int64_t>(1, (threadgroups + at_once - 1) / at_once));
  const double keys = std::ceil(double(kv_len) / (double(splits) * shape.simdgroups));
  return waves * keys * (std::min(rows, shape.rows) > 1 ? 1.5 : 1.0) + (splits > 1 ? 16.0 : 0.0);
}
}  // namespace

KernelId& DecodeShape::add_fields(KernelId& id) const {
  return id.with("r", rows).with("sg", simdgroups);
}

DecodeShape decode_group_shape(int head_dim) {
  if (decode_head_dim_index(head_dim) < 0) return {};
  const int rows = std::min(MLX_ATTN_DECODE_GROUP_MAX_ROWS, MLX_ATTN_DECODE_ROW_FLOATS / (head_dim / 32));
  return {rows, MLX_ATTN_DECODE_SIMDGROUPS, kDecodeMinKeysPerSplit};
}

DecodeShape decode_row_shape(int head_dim) {
  const int at = decode_head_dim_index(head_dim);
  if (at < 0) return {};
  return {1, kDecodeRowSimdgroups[at], kDecodeRowMinKeysPerSimdgroup * kDecodeRowSimdgroups[at]};
}

bool prefill_splits_head_dims(int head_dim, int value_dim) {
  return head_dim > kRegisterPrefillMaxHeadDim || head_dim != value_dim;
}

int prefill_split_key_block(int head_dim, int value_dim, ElemType dtype, const GpuTarget& target) {
  for (const auto& dims : kSplitPrefillHeadDims) {
    if (dims[0] == head_dim && dims[1] == value_dim) return prefill_key_block(256, dtype, target);
  }
  return 0;
}

// A split costs, next to its K/V (4·keys·D bytes at fp16), about 2·rows·D·4
// bytes of partials in device memory and 6·rows·D·4 bytes of simdgroup
// combine in threadgroup memory: at least 16 keys per row keeps them at 1/8
// and 3/8 of the K/V bytes. The floor was 64 keys per row, which left large
// GPUs idle (B=1, Hkv=8, GQA 4, T=1024: 32 threadgroups on a 38-core M2 Max);
// the cost model (kernel_lab/metal_cost_model.py, docs/emulator_costs.md)
// put the new floor at 1.11x the best split count per problem where the old
// one was at 1.30x (geometric means over a grid of problems; now
// kernel_lab/cost_checks.py's decode_rule_check, with the shape choice).
int decode_splits(int batch, int kv_heads, int rows, int kv_len, const DecodeShape& shape,
                  const GpuTarget& target, DecodeKeys keys) {
  if (shape.rows <= 0) return 1;
  const bool dequantized = keys == DecodeKeys::dequantized;
  const int row_chunks = (rows + shape.rows - 1) / shape.rows;
  // At least one: an empty problem (no rows) must not divide by zero.
  const int64_t threadgroups = std::max<int64_t>(1, int64_t(batch) * kv_heads * row_chunks);
  const int64_t busy = decode_threadgroups_at_once(shape, target);
  const bool one_wave = dequantized && shape.rows == 1;
  const int64_t for_occupancy =
      one_wave ? std::max<int64_t>(1, busy / threadgroups) : (busy + threadgroups - 1) / threadgroups;
  const int64_t keys_per_split =
      std::max<int64_t>(1, std::max<int64_t>(shape.min_keys_per_split, int64_t(kDecodeMinKeysPerRow) * rows) /
                               (dequantized ? kDequantizedSplitFloorDivisor : 1));
  const int64_t for_traffic = (kv_len + keys_per_split - 1) / keys_per_split;
  return int(std::max<int64_t>(1, std::min(for_occupancy, for_traffic)));
}

DecodeShape decode_shape(int batch, int kv_heads, int rows, int kv_len, int head_dim, const GpuTarget& target,
                         DecodeShapeChoice choice, const std::function<int(const DecodeShape&)>& max_keys_per_split,
                         DecodeKeys keys) {
  const DecodeShape group = decode_group_shape(head_dim);
  const DecodeShape row = decode_row_shape(head_dim);
  if (group.rows == 0 || choice == DecodeShapeChoice::group) return group;
  if (choice == DecodeShapeChoice::row || (keys == DecodeKeys::dequantized && rows == 1)) return row;
  const auto path = [&](const DecodeShape& shape) {
    int splits = decode_splits(batch, kv_heads, rows, kv_len, shape, target, keys);
    if (max_keys_per_split) {
      const int most = std::max(1, max_keys_per_split(shape));
      splits = std::max(splits, (kv_len + most - 1) / most);
    }
    return decode_path(batch, kv_heads, rows, kv_len, splits, shape, target);
  };
  const double by_group = path(group), by_row = path(row);
  return by_row <= by_group ? row : group;
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
    case BufferRole::k_scales: return "k_scales";
    case BufferRole::k_biases: return "k_biases";
    case BufferRole::v_scales: return "v_scales";
    case BufferRole::v_biases: return "v_biases";
    case BufferRole::quantized_params: return "quantized_params";
    case BufferRole::d_out: return "d_out";
    case BufferRole::d_lse: return "d_lse";
    case BufferRole::dq: return "dq";
    case BufferRole::dk: return "dk";
    case BufferRole::dv: return "dv";
    case BufferRole::d_sinks: return "d_sinks";
    case BufferRole::delta: return "delta";
    case BufferRole::block_table: return "block_table";
    case BufferRole::sequences: return "sequences";
    case BufferRole::prefix_table: return "prefix_table";
    case BufferRole::cascade_groups: return "cascade_groups";
    case BufferRole::cascade_rows: return "cascade_rows";
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
    case Source::quantized_params: return "quantized_params";
    case Source::sequences: return "sequences";
    case Source::cascade_groups: return "cascade_groups";
    case Source::cascade_rows: return "cascade_rows";
  }
  return "?";
}

bool vector_loads_aligned(const AttentionProblem& s) {
  constexpr int64_t width = MLX_ATTN_VECTOR_WIDTH;
  const auto aligned = [](const int64_t strides[4], int64_t offset, int dim) {
    return strides[3] == 1 && dim % width == 0 && offset % width == 0 && strides[0] % width == 0 &&
        strides[1] % width == 0 && strides[2] % width == 0;
  };
  return aligned(s.q_strides, s.q_offset, s.head_dim) && aligned(s.k_strides, s.k_offset, s.head_dim) &&
      aligned(s.v_strides, s.v_offset, s.value_dim);
}

PrimitiveLayout forward_layout(const AttentionProblem& s, bool quantized) {
  using R = BufferRole;
  PrimitiveLayout layout;
  layout.inputs = quantized ? std::vector<R>{R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases}
                            : std::vector<R>{R::q, R::k, R::v};
  if (s.mask_kind != MaskKind::none) layout.inputs.push_back(R::mask);
  if (s.has_sinks) layout.inputs.push_back(R::sinks);
  layout.outputs = {R::out};
  if (s.output_lse) layout.outputs.push_back(R::lse);
  return layout;
}

std::vector<Binding> bind_roles(
    const PrimitiveLayout& layout, const std::vector<BufferRole>& roles, const std::vector<ScratchBuffer>& scratch,
    int dispatch_index) {
  const auto find = [](const std::vector<BufferRole>& list, BufferRole role) {
    for (int i = 0; i < int(list.size()); ++i) {
      if (list[i] == role) return i;
    }
    return -1;
  };
  std::vector<Binding> out;
  for (int i = 0; i < int(roles.size()); ++i) {
    Binding b;
    b.index = i;
    b.role = roles[i];
    int at = -1;
    if (b.role == BufferRole::params) {
      b.source = Source::params;
    } else if (b.role == BufferRole::splits) {
      b.source = Source::splits;
    } else if (b.role == BufferRole::quantized_params) {
      b.source = Source::quantized_params;
    } else if (b.role == BufferRole::sequences) {
      b.source = Source::sequences;
    } else if (b.role == BufferRole::cascade_groups) {
      b.source = Source::cascade_groups;
    } else if (b.role == BufferRole::cascade_rows) {
      b.source = Source::cascade_rows;
    } else if (std::any_of(scratch.begin(), scratch.end(), [&](const ScratchBuffer& x) { return x.role == b.role; })) {
      for (int j = 0; j < int(scratch.size()); ++j) {
        if (scratch[j].role == b.role) {
          b.source = Source::scratch;
          b.source_index = j;
          const bool writes = dispatch_index >= scratch[j].producer &&
              dispatch_index < scratch[j].producer + scratch[j].writers;
          b.access = writes ? Access::write : Access::read;
        }
      }
    } else if ((at = find(layout.outputs, b.role)) >= 0) {
      b.source = Source::output;
      b.access = Access::write;
      b.source_index = at;
    } else if ((at = find(layout.inputs, b.role)) >= 0) {
      b.source_index = at;
    }  // else: the placeholder, input 0, read
    out.push_back(b);
  }
  return out;
}

namespace {

// "64, 80, 96, 128 (key = value), 192/128, 256/256, ...": the head dims the
// Metal prefill kernels are instantiated for, for reasons.
std::string supported_head_dims_text() {
  std::string text;
  for (int d : kHeadDims) {
    if (d <= kRegisterPrefillMaxHeadDim) text += std::to_string(d) + ", ";
  }
  text.replace(text.size() - 2, 2, " (key = value head dim)");
  for (const auto& dims : kSplitPrefillHeadDims) {
    text += ", " + std::to_string(dims[0]) + "/" + std::to_string(dims[1]);
  }
  return text;
}

void plan_decode(const AttentionProblem& s, const GpuTarget& target, DecodeShapeChoice choice, LaunchPlan& plan) {
  using R = BufferRole;
  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  const DecodeShape shape = decode_shape(s.batch, s.kv_heads, rows, s.kv_len, s.head_dim, target, choice);
  const int row_chunks = (rows + shape.rows - 1) / shape.rows;
  const int splits = decode_splits(s.batch, s.kv_heads, rows, s.kv_len, shape, target);
  plan.splits = splits;
  // one split: no scratch and no merge dispatch (add_decode_merge)
  plan.scratch = decode_partials_scratch(s, splits);
  KernelDispatch partial;
  partial.id = kernel_id(KernelFamily::decode_partial, s);
  shape.add_fields(partial.id);
  partial.grid = {splits, s.kv_heads * row_chunks, s.batch};
  partial.threadgroup = {shape.threads(), 1, 1};
  const PrimitiveLayout layout = forward_layout(s);
  // one split: partial_out / partial_stats are placeholders (not scratch)
  partial.bindings = bind_roles(
      layout, {R::q, R::k, R::v, R::params, R::mask, R::partial_out, R::partial_stats, R::sinks, R::out, R::lse},
      plan.scratch, 0);
  partial.threadgroup_memory_bytes = shape.states_bytes(s.head_dim);
  plan.dispatches = {partial};
  add_decode_merge(s, layout, plan);
}
}  // namespace

std::vector<ScratchBuffer> decode_partials_scratch(const AttentionProblem& s, int splits) {
  if (splits == 1) return {};  // the partial kernel writes the output itself
  using R = BufferRole;
  const int64_t partials = int64_t(s.batch) * s.kv_heads * splits * (s.q_heads / s.kv_heads) * s.q_len;
  return {{R::partial_out, partials * s.head_dim, 0, 1}, {R::partial_stats, partials * 2, 0, 1}};
}

void add_decode_merge(const AttentionProblem& s, const PrimitiveLayout& layout, LaunchPlan& plan) {
  if (plan.splits == 1) return;
  using R = BufferRole;
  KernelDispatch merge;
  merge.id = kernel_id(KernelFamily::decode_merge, s);
  merge.grid = {(s.q_heads / s.kv_heads) * s.q_len, s.kv_heads, s.batch};
  merge.threadgroup = {32 * MLX_ATTN_DECODE_MERGE_SIMDGROUPS, 1, 1};  // one row
  // simdgroups 1.. hand their output, max and sum to simdgroup 0 (merge_splits)
  merge.threadgroup_memory_bytes = (MLX_ATTN_DECODE_MERGE_SIMDGROUPS - 1) * (s.head_dim + 2) * 4;
  merge.bindings = bind_roles(
      layout, {R::partial_out, R::partial_stats, R::sinks, R::out, R::params, R::splits, R::lse}, plan.scratch, 1);
  plan.dispatches.push_back(merge);
}

LaunchPlan plan_attention(const AttentionProblem& s, const GpuTarget& target, DecodeShapeChoice decode_choice) {
  LaunchPlan plan;
  plan.target = {target.family, gpu_cores(target)};
  plan.problem = s;
  // Past the register budget (or with Dk != Dv) the D-split prefill kernel
  // serves every query length (docs/metal_kernels.md, "Head dims").
  const bool split = prefill_splits_head_dims(s.head_dim, s.value_dim);
  const int key_block = split ? prefill_split_key_block(s.head_dim, s.value_dim, s.dtype, target)
                              : prefill_key_block(s.head_dim, s.dtype, target);
  if (key_block == 0) {
    plan.reason = "the Metal kernels support head dims (key/value) " + supported_head_dims_text() + ", got " +
        std::to_string(s.head_dim) + "/" + std::to_string(s.value_dim);
    return plan;
  }
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) {
    plan.reason = "q_heads must be a multiple of kv_heads";
    return plan;
  }
  AttentionParams& p = plan.params;
  p = s;  // the problem extends the kernels' parameters
  p.vector_loads = vector_loads_aligned(s) ? 1 : 0;

  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  if (s.q_len <= kDecodeMaxQueries && rows <= kDecodeMaxRows && s.head_dim == s.value_dim &&
      decode_group_shape(s.head_dim).rows != 0) {
    plan_decode(s, target, decode_choice, plan);
    plan.supported = true;
    return plan;
  }

  KernelDispatch prefill;
  const int simdgroups = gpu_tuning(target.family).prefill_simdgroups;
  const int query_block = 8 * simdgroups;  // BQ: 8 rows per simdgroup
  prefill.id = kernel_id(split ? KernelFamily::prefill_split : KernelFamily::prefill, s);
  if (split) prefill.id.with("dv", s.value_dim);
  prefill.id.with("bk", key_block);
  prefill.grid = {(s.q_len + query_block - 1) / query_block, s.q_heads, s.batch};
  prefill.threadgroup = {32 * simdgroups, 1, 1};
  using R = BufferRole;
  prefill.bindings =
      bind_roles(forward_layout(s), {R::q, R::k, R::v, R::out, R::params, R::mask, R::sinks, R::lse}, plan.scratch, 0);
  // K and V tiles in the input dtype, rows padded by 16 bytes (split: V's
  // tile holds one pass's MLX_ATTN_SPLIT_VALUE_CHUNK value dims)
  const int element_bytes = s.dtype == ElemType::float32 ? 4 : 2;
  const int staged_value_dim = split ? std::min(s.value_dim, MLX_ATTN_SPLIT_VALUE_CHUNK) : s.value_dim;
  prefill.threadgroup_memory_bytes =
      key_block * (s.head_dim * element_bytes + 16) + key_block * (staged_value_dim * element_bytes + 16);
  if (prefill.threadgroup_memory_bytes > kThreadgroupMemoryLimit) {
    plan.reason = "threadgroup memory over 32 KB";
    return plan;
  }
  plan.dispatches.push_back(prefill);
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
