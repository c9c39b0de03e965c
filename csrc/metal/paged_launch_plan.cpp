#include "csrc/metal/paged_launch_plan.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "metal/attention_paged_params.h"
#include "metal/attention_quantized_params.h"

namespace mlx_attn {

namespace {

bool aligned_to_vectors(const int64_t (&strides)[4], int64_t offset, int dim) {
  constexpr int64_t width = MLX_ATTN_VECTOR_WIDTH;
  return strides[3] == 1 && dim % width == 0 && offset % width == 0 && strides[0] % width == 0 &&
      strides[1] % width == 0 && strides[2] % width == 0;
}

// Why the paged kernels cannot run this problem ("" when they can).
std::string unsupported_reason(const PagedProblem& s) {
  const AttentionProblem& a = s.attention;
  // metal/attention_paged.metal's instantiations (the dense decode's 80 and 512 are not among them)
  constexpr std::array<int, 4> kPagedHeadDims = {64, 96, 128, 256};
  if (std::find(kPagedHeadDims.begin(), kPagedHeadDims.end(), a.head_dim) == kPagedHeadDims.end()) {
    return "the paged Metal kernels support head dims 64, 96, 128 and 256, got " + std::to_string(a.head_dim);
  }
  if (a.value_dim != a.head_dim) {
    return "the paged Metal kernels need equal key and value head dims, got " + std::to_string(a.head_dim) + " and " +
        std::to_string(a.value_dim);
  }
  if (a.kv_heads < 1 || a.q_heads % a.kv_heads != 0) return "q_heads must be a multiple of kv_heads";
  if (s.page_size < 1) return "page_size must be >= 1";
  if (s.q_lens.size() != s.kv_lens.size()) return "q_lens and kv_lens need one entry per sequence";
  for (size_t b = 0; b < s.q_lens.size(); ++b) {
    if (s.q_lens[b] < 0 || s.q_lens[b] > s.kv_lens[b]) return "need 0 <= q_lens[b] <= kv_lens[b]";
  }
  if (s.quantized.bits != 0) {
    const int slice = a.head_dim / 32;
    if (s.quantized.bits != 4 && s.quantized.bits != 8) {
      return "the quantized paged kernels read 4- or 8-bit codes, got bits=" + std::to_string(s.quantized.bits);
    }
    if (a.head_dim == 96 || s.quantized.group_size <= 0 || s.quantized.group_size % slice != 0) {
      return "the quantized paged kernels need a head dim of 64, 128 or 256 that is a multiple of group_size";
    }
  }
  return "";
}

// The decode kernel's dispatches (partial, then merge) over the sequences it
// serves: the grid sized for the largest of them. A sequence of one split
// writes its rows in the partial dispatch (metal/attention_paged.h); when
// every sequence has one, there is no merge and no scratch.
void plan_paged_decode(const PagedProblem& s, const DecodeShape& shape, const PrimitiveLayout& layout, int max_rows,
                       int max_splits, int max_partials, int64_t partials, LaunchPlan& plan) {
  using R = BufferRole;
  const AttentionProblem& a = s.attention;
  const bool float_pages = s.quantized.bits == 0;
  const int sequences = int(s.q_lens.size());
  // dispatch 0 (partial) writes them, dispatch 1 (merge) reads them; a
  // sequence's partials: its splits' (and in a cascade its prefix's)
  const bool merges = max_partials > 1;
  if (merges) {
    plan.scratch = {{R::partial_out, std::max<int64_t>(1, partials) * a.head_dim, 0, 1},
                    {R::partial_stats, std::max<int64_t>(1, partials) * 2, 0, 1}};
  }
  plan.splits = max_splits;

  KernelDispatch partial;
  const int max_chunks = (max_rows + shape.rows - 1) / shape.rows;
  partial.grid = {max_splits, a.kv_heads * max_chunks, sequences};
  partial.threadgroup = {shape.threads(), 1, 1};
  if (float_pages) {
    partial.id = kernel_id(KernelFamily::paged_decode_partial, a);
    shape.add_fields(partial.id);
    partial.bindings = bind_roles(
        layout,
        {R::q, R::k, R::v, R::block_table, R::sequences, R::partial_out, R::partial_stats, R::sinks, R::out, R::lse},
        plan.scratch, 0);
  } else {
    partial.id = kernel_id(KernelFamily::paged_quantized_decode_partial, a).with("b", s.quantized.bits);
    shape.add_fields(partial.id);
    partial.bindings = bind_roles(layout,
                                  {R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases, R::block_table,
                                   R::sequences, R::quantized_params, R::partial_out, R::partial_stats, R::sinks,
                                   R::out, R::lse},
                                  plan.scratch, 0);
    QuantizedAttentionParams qp{};
    for (int i = 0; i < 4; ++i) {
      qp.k_scale_strides[i] = s.quantized.k_scale_strides[i];
      qp.k_bias_strides[i] = s.quantized.k_bias_strides[i];
      qp.v_scale_strides[i] = s.quantized.v_scale_strides[i];
      qp.v_bias_strides[i] = s.quantized.v_bias_strides[i];
    }
    qp.group_size = s.quantized.group_size;
    plan.quantized_params.resize(sizeof(qp));
    std::memcpy(plan.quantized_params.data(), &qp, sizeof(qp));
  }
  partial.threadgroup_memory_bytes = shape.states_bytes(a.head_dim);

  plan.dispatches = {partial};
  if (!merges) return;
  KernelDispatch merge;
  merge.id = kernel_id(KernelFamily::paged_decode_merge, a);
  merge.grid = {max_rows, a.kv_heads, sequences};
  merge.threadgroup = {32 * MLX_ATTN_DECODE_MERGE_SIMDGROUPS, 1, 1};  // one row
  // simdgroups 1.. hand their output, max and sum to simdgroup 0 (merge_splits)
  merge.threadgroup_memory_bytes = (MLX_ATTN_DECODE_MERGE_SIMDGROUPS - 1) * (a.head_dim + 2) * 4;
  merge.bindings =
      bind_roles(layout, {R::partial_out, R::partial_stats, R::sinks, R::out, R::sequences, R::lse}, plan.scratch, 1);
  plan.dispatches.push_back(merge);
}

// The prefill kernel's dispatch over the query blocks of the sequences it
// serves (PagedSequence::query_block_start / query_blocks), after the decode
// dispatches.
void plan_paged_prefill(const PagedProblem& s, const GpuTarget& target, const PrimitiveLayout& layout,
                        int query_blocks, LaunchPlan& plan) {
  using R = BufferRole;
  const AttentionProblem& a = s.attention;
  const int simdgroups = gpu_tuning(target.family).prefill_simdgroups;
  const int key_block = prefill_key_block(a.head_dim, a.dtype, target);
  KernelDispatch prefill;
  prefill.id = kernel_id(KernelFamily::paged_prefill, a).with("bk", key_block);
  prefill.grid = {query_blocks, a.q_heads, 1};
  prefill.threadgroup = {32 * simdgroups, 1, 1};
  prefill.bindings = bind_roles(layout, {R::q, R::k, R::v, R::block_table, R::sequences, R::sinks, R::out, R::lse},
                                plan.scratch, int(plan.dispatches.size()));
  // K and V tiles in the input dtype, rows padded by 16 bytes (as the dense
  // prefill), and two blocks' K and V row offsets (PagedKeyRows)
  const int element_bytes = a.dtype == ElemType::float32 ? 4 : 2;
  prefill.threadgroup_memory_bytes = 2 * key_block * (a.head_dim * element_bytes + 16) + 2 * 2 * key_block * 8;
  plan.dispatches.push_back(prefill);
}

}  // namespace

bool paged_rows_take_prefill(const PagedProblem& s, int q_len) {
  const AttentionProblem& a = s.attention;
  const bool long_chunk = q_len > kDecodeMaxQueries || a.group_size() * q_len > kDecodeMaxRows;
  const bool instantiated = a.head_dim <= kRegisterPrefillMaxHeadDim && a.head_dim == a.value_dim &&
      prefill_key_block(a.head_dim, a.dtype) != 0 && decode_group_shape(a.head_dim).rows != 0;
  return long_chunk && instantiated && s.quantized.bits == 0;
}

namespace {
// The decode kernel's rows as the split rule sees them: the sequences it
// serves as a batch of the longest one, with the most rows of any.
struct PagedDecodeExtent {
  int sequences = 1, rows = 1, longest = 0;
};

PagedDecodeExtent paged_decode_extent(const PagedProblem& s) {
  PagedDecodeExtent extent;
  int max_rows = 0;
  for (size_t b = 0; b < s.kv_lens.size(); ++b) {
    if (paged_rows_take_prefill(s, s.q_lens[b])) continue;  // not the decode kernel's
    extent.longest = std::max(extent.longest, s.kv_lens[b]);
    max_rows = std::max(max_rows, s.attention.group_size() * s.q_lens[b]);
  }
  extent.sequences = std::max<int>(1, int(s.kv_lens.size()));
  extent.rows = std::max(1, max_rows);
  return extent;
}

// quantized pages' keys are dequantized (decode_splits, decode_shape)
DecodeKeys paged_decode_keys(const PagedProblem& s) {
  return s.quantized.bits != 0 ? DecodeKeys::dequantized : DecodeKeys::plain;
}
}  // namespace

DecodeShape paged_decode_shape(const PagedProblem& s, const GpuTarget& target, DecodeShapeChoice choice) {
  const PagedDecodeExtent extent = paged_decode_extent(s);
  return decode_shape(extent.sequences, s.attention.kv_heads, extent.rows, extent.longest, s.attention.head_dim,
                      target, choice,
                      [&](const DecodeShape& shape) { return paged_max_pages_per_split(shape) * s.page_size; },
                      paged_decode_keys(s));
}

int paged_max_pages_per_split(const DecodeShape& shape) {
  return 32 * (shape.rows == 1 ? MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS : MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS) - 1;
}

int paged_keys_per_split(const PagedProblem& s, const DecodeShape& shape, const GpuTarget& target) {
  const PagedDecodeExtent extent = paged_decode_extent(s);
  const int longest = extent.longest;
  const int splits =
      decode_splits(extent.sequences, s.attention.kv_heads, extent.rows, longest, shape, target, paged_decode_keys(s));
  const int64_t wanted = (int64_t(longest) + splits - 1) / splits;
  const int64_t pages =
      std::clamp<int64_t>((wanted + s.page_size - 1) / s.page_size, 1, paged_max_pages_per_split(shape));
  return int(pages * s.page_size);
}

namespace {

// The paged plan, and in a cascade its suffix pass: `prefix_splits[b]` (empty:
// none) partials of sequence b's group prefix are merged after its own
// splits' (PagedSequence::prefix_splits, prefix_group).
LaunchPlan plan_paged(const PagedProblem& s, const GpuTarget& target, DecodeShapeChoice decode_choice,
                      const std::vector<int>& prefix_splits, const std::vector<int32_t>& prefix_groups,
                      std::vector<BufferRole> extra_inputs) {
  LaunchPlan plan;
  plan.target = {target.family, gpu_cores(target)};
  plan.problem = s.attention;
  plan.reason = unsupported_reason(s);
  if (!plan.reason.empty()) return plan;
  const AttentionProblem& a = s.attention;
  const int sequences = int(s.q_lens.size());
  const int group = a.group_size();
  const DecodeShape shape = paged_decode_shape(s, target, decode_choice);
  const int keys_per_split = paged_keys_per_split(s, shape, target);
  plan.keys_per_split = keys_per_split;

  // the batch's shared parameters; each sequence gets a copy with its lengths
  AttentionParams shared = a;
  shared.batch = 1;
  shared.mask_kind = MaskKind::none;
  shared.group = group;
  const bool float_pages = s.quantized.bits == 0;
  shared.vector_loads = aligned_to_vectors(a.q_strides, a.q_offset, a.head_dim) &&
                                (!float_pages || (aligned_to_vectors(a.k_strides, a.k_offset, a.head_dim) &&
                                                  aligned_to_vectors(a.v_strides, a.v_offset, a.value_dim)))
                            ? 1
                            : 0;
  plan.params = shared;

  const int query_block = 8 * gpu_tuning(target.family).prefill_simdgroups;  // BQ of the prefill kernel
  std::vector<PagedSequence> table(sequences);
  int64_t q_start = 0, partials = 0;
  int max_splits = 0, max_partials = 0, max_rows = 0, query_blocks = 0;
  for (int b = 0; b < sequences; ++b) {
    PagedSequence& seq = table[b];
    seq = {};
    seq.attn = shared;
    seq.attn.q_len = s.q_lens[b];
    seq.attn.kv_len = s.kv_lens[b];
    seq.q_start = q_start;
    seq.table_start = int64_t(b) * s.table_stride;
    seq.partial_start = partials;
    seq.page_size = s.page_size;
    seq.query_block_start = query_blocks;
    seq.prefix_group = prefix_groups.empty() ? -1 : prefix_groups[b];
    q_start += s.q_lens[b];
    if (paged_rows_take_prefill(s, s.q_lens[b])) {
      seq.query_blocks = (s.q_lens[b] + query_block - 1) / query_block;
      query_blocks += seq.query_blocks;
      continue;  // splits 0: the decode kernels skip it
    }
    const int rows = group * s.q_lens[b];
    seq.splits = rows == 0 ? 0 : (s.kv_lens[b] + keys_per_split - 1) / keys_per_split;
    seq.prefix_splits = rows == 0 || prefix_splits.empty() ? 0 : prefix_splits[b];
    partials += int64_t(a.kv_heads) * (seq.splits + seq.prefix_splits) * rows;
    max_splits = std::max(max_splits, seq.splits);
    max_partials = std::max(max_partials, seq.splits + seq.prefix_splits);
    max_rows = std::max(max_rows, rows);
  }
  plan.sequences.resize(table.size() * sizeof(PagedSequence));
  if (!table.empty()) std::memcpy(plan.sequences.data(), table.data(), plan.sequences.size());
  plan.supported = true;
  if (max_rows == 0 && query_blocks == 0) return plan;  // no query rows: nothing to launch

  using R = BufferRole;
  PrimitiveLayout layout;
  layout.inputs = float_pages ? std::vector<R>{R::q, R::k, R::v, R::block_table}
                              : std::vector<R>{R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases,
                                               R::block_table};
  if (a.has_sinks) layout.inputs.push_back(R::sinks);
  layout.inputs.insert(layout.inputs.end(), extra_inputs.begin(), extra_inputs.end());
  layout.outputs = {R::out};
  if (a.output_lse) layout.outputs.push_back(R::lse);
  if (max_rows > 0) plan_paged_decode(s, shape, layout, max_rows, max_splits, max_partials, partials, plan);
  if (query_blocks > 0) plan_paged_prefill(s, target, layout, query_blocks, plan);
  return plan;
}

}  // namespace

LaunchPlan plan_paged_attention(const PagedProblem& s, const GpuTarget& target, DecodeShapeChoice decode_choice) {
  return plan_paged(s, target, decode_choice, {}, {}, {});
}

namespace {

// Why the cascade plan cannot run this problem ("" when it can), past the paged plan's reasons.
std::string cascade_unsupported_reason(const CascadeProblem& c, const GpuTarget& target) {
  const PagedProblem& s = c.own;
  const AttentionProblem& a = s.attention;
  const int sequences = int(s.q_lens.size());
  if (int(c.prefix_groups.size()) != sequences) return "prefix_groups needs one entry per sequence";
  // metal/attention_paged_cascade.metal's instantiations: the paged prefill's head dims
  if (a.head_dim > kRegisterPrefillMaxHeadDim || prefill_key_block(a.head_dim, a.dtype, target) == 0) {
    return "the Metal cascade prefix kernel supports head dims 64, 96 and 128, got " + std::to_string(a.head_dim);
  }
  if (s.quantized.bits != 0 && a.head_dim == 96) {
    return "the quantized Metal cascade prefix kernel supports head dims 64 and 128";
  }
  for (int b = 0; b < sequences; ++b) {
    const int g = c.prefix_groups[b];
    if (g < -1 || g >= int(c.prefix_lens.size())) return "prefix_groups[b] must be a group or -1";
    if (paged_rows_take_prefill(s, s.q_lens[b])) {
      return "the Metal cascade serves decode rows (at most " + std::to_string(kDecodeMaxQueries) +
          " positions, " + std::to_string(kDecodeMaxRows) + " rows a sequence); a longer chunk takes the paged op";
    }
    if (g >= 0 && c.prefix_lens[g] > 0 && s.q_lens[b] > 0 && s.kv_lens[b] < s.q_lens[b]) {
      return "a cascade member's query rows must follow its group's prefix (q_lens[b] <= its own keys)";
    }
  }
  return "";
}

}  // namespace

namespace {

// The groups' records and member rows, and each sequence's prefix splits.
struct CascadeLevel {
  std::vector<CascadeGroup> groups;
  std::vector<CascadeRow> rows;
  std::vector<int> prefix_splits;  // per sequence
  int max_splits = 0, max_tiles = 0;
};

CascadeLevel cascade_level(const CascadeProblem& c, const GpuTarget& target) {
  const PagedProblem& s = c.own;
  const AttentionProblem& a = s.attention;
  const int sequences = int(s.q_lens.size());
  const int groups = int(c.prefix_lens.size());
  const int group = a.group_size();
  const int key_block = prefill_key_block(a.head_dim, a.dtype, target);
  // each group's member rows (sequence, query) and tiles of kCascadeTileRows rows
  std::vector<std::vector<CascadeRow>> members(groups);
  for (int b = 0; b < sequences; ++b) {
    const int g = c.prefix_groups[b];
    if (g < 0 || c.prefix_lens[g] == 0) continue;
    for (int i = 0; i < s.q_lens[b]; ++i) members[g].push_back({b, i});
  }
  int all_tiles = 0;
  for (const auto& rows : members) all_tiles += (int(rows.size()) * group + kCascadeTileRows - 1) / kCascadeTileRows;
  // prefix splits: enough threadgroups for the target, each split at least
  // kCascadeMinSplitKeys keys (its partial stays small next to its K/V), whole key blocks
  const int tiles = std::max(1, a.kv_heads * all_tiles);
  const int wanted = (gpu_cores(target) * gpu_tuning(target.family).decode_threadgroups_per_core + tiles - 1) / tiles;
  CascadeLevel level;
  level.groups.resize(groups);
  level.prefix_splits.assign(sequences, 0);
  for (int g = 0; g < groups; ++g) {
    CascadeGroup& record = level.groups[g];
    record = {};
    const int prefix = c.prefix_lens[g];
    const int tile_rows = int(members[g].size()) * group;
    record.row_start = int(level.rows.size());
    record.rows = int(members[g].size());
    record.page_size = s.page_size;
    record.table_start = int64_t(g) * c.prefix_table_stride;
    if (tile_rows == 0) continue;  // no member rows: no pass
    const int splits = std::clamp(wanted, 1, std::max(1, prefix / kCascadeMinSplitKeys));
    const int per_split = (prefix + splits - 1) / splits;
    record.keys_per_split = (per_split + key_block - 1) / key_block * key_block;
    record.splits = (prefix + record.keys_per_split - 1) / record.keys_per_split;
    record.tiles = (tile_rows + kCascadeTileRows - 1) / kCascadeTileRows;
    level.rows.insert(level.rows.end(), members[g].begin(), members[g].end());
    for (const CascadeRow& row : members[g]) level.prefix_splits[row.sequence] = record.splits;
    level.max_splits = std::max(level.max_splits, record.splits);
    level.max_tiles = std::max(level.max_tiles, record.tiles);
  }
  return level;
}

// The prefix pass's dispatch (index 1, between the suffix partial and the merge).
KernelDispatch cascade_prefix_dispatch(const CascadeProblem& c, const GpuTarget& target, const CascadeLevel& level,
                                       const std::vector<ScratchBuffer>& scratch) {
  using R = BufferRole;
  const PagedProblem& s = c.own;
  const AttentionProblem& a = s.attention;
  const bool float_pages = s.quantized.bits == 0;
  const int key_block = prefill_key_block(a.head_dim, a.dtype, target);
  PrimitiveLayout layout;
  layout.inputs = float_pages ? std::vector<R>{R::q, R::k, R::v, R::block_table}
                              : std::vector<R>{R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases,
                                               R::block_table};
  if (a.has_sinks) layout.inputs.push_back(R::sinks);
  layout.inputs.push_back(R::prefix_table);
  KernelDispatch prefix;
  prefix.grid = {level.max_splits, a.kv_heads * level.max_tiles, int(level.groups.size())};
  prefix.threadgroup = {32 * kCascadeSimdgroups, 1, 1};
  const int element_bytes = a.dtype == ElemType::float32 ? 4 : 2;
  const int tiles_bytes = 2 * key_block * (a.head_dim * element_bytes + 16);
  const int positions_bytes = 2 * kCascadeSimdgroups * 4;
  if (float_pages) {
    prefix.id = kernel_id(KernelFamily::paged_cascade_prefix, a).with("bk", key_block);
    prefix.bindings = bind_roles(layout,
                                 {R::q, R::k, R::v, R::prefix_table, R::sequences, R::cascade_groups, R::cascade_rows,
                                  R::partial_out, R::partial_stats},
                                 scratch, 1);
    prefix.threadgroup_memory_bytes = tiles_bytes + 2 * key_block * 8 + positions_bytes;  // PagedKeyRows
  } else {
    prefix.id =
        kernel_id(KernelFamily::paged_cascade_quantized_prefix, a).with("b", s.quantized.bits).with("bk", key_block);
    prefix.bindings = bind_roles(layout,
                                 {R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases,
                                  R::prefix_table, R::sequences, R::quantized_params, R::cascade_groups,
                                  R::cascade_rows, R::partial_out, R::partial_stats},
                                 scratch, 1);
    prefix.threadgroup_memory_bytes = tiles_bytes + key_block * 4 + positions_bytes;  // PagedKeyPages
  }
  return prefix;
}

}  // namespace

LaunchPlan plan_cascade_paged_attention(const CascadeProblem& c, const GpuTarget& target) {
  const PagedProblem& s = c.own;
  if (std::string reason = unsupported_reason(s); !reason.empty() || !(reason = cascade_unsupported_reason(c, target)).empty()) {
    LaunchPlan plan;
    plan.target = {target.family, gpu_cores(target)};
    plan.problem = s.attention;
    plan.reason = reason;
    return plan;
  }
  CascadeLevel level = cascade_level(c, target);
  // the suffix pass and the merge: the paged plan over the own keys, with
  // room for each member's prefix partials; the prefix table is the last input
  LaunchPlan plan = plan_paged(s, target, DecodeShapeChoice::automatic, level.prefix_splits, c.prefix_groups,
                               {BufferRole::prefix_table});
  if (!plan.supported || level.max_splits == 0) return plan;  // no member rows: the paged plan alone
  for (size_t g = 0; g < level.groups.size(); ++g) {
    CascadeGroup& record = level.groups[g];
    record.attn = plan.params;  // the shared parameters, with the prefix as the keys
    record.attn.kv_len = c.prefix_lens[g];
    record.attn.q_len = record.rows * s.attention.group_size();
  }
  plan.cascade_groups.resize(level.groups.size() * sizeof(CascadeGroup));
  std::memcpy(plan.cascade_groups.data(), level.groups.data(), plan.cascade_groups.size());
  plan.cascade_rows.resize(level.rows.size() * sizeof(CascadeRow));
  std::memcpy(plan.cascade_rows.data(), level.rows.data(), plan.cascade_rows.size());
  // dispatch 0 (suffix partial) and 1 (prefix) write the partials, 2 (merge) reads them
  for (ScratchBuffer& buffer : plan.scratch) {
    buffer.writers = 2;
    buffer.consumer = 2;
  }
  plan.dispatches.insert(plan.dispatches.begin() + 1, cascade_prefix_dispatch(c, target, level, plan.scratch));
  return plan;
}

}  // namespace mlx_attn
