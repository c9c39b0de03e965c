// Portable description of how the fused Metal kernels are launched for a
// problem: kernel names, grids, threadgroup sizes, the parameter struct and
// every buffer binding (its role, access and where its memory comes from,
// placeholders and scratch producers/consumers included). The plan decides
// everything; the Mac host (csrc/metal/) only encodes it, and the MSL
// emulator tests (kernel_lab/metal_runner.py) launch the identical plan.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "csrc/core/attention_problem.h"
#include "csrc/metal/kernel_id.h"

namespace mlx_attn {

// Apple GPU families of Metal's feature set tables: apple7 = M1 (A14),
// apple8 = M2 (A15, A16), apple9 = M3, M4 (A17 Pro, A18), apple10 = M5 (A19;
// matrix units, which these kernels do not use: docs/metal_kernels.md).
enum class GpuFamily : int32_t { unknown = 0, apple7 = 7, apple8 = 8, apple9 = 9, apple10 = 10 };

// The GPU a plan is made for. The default is the conservative target: an
// unknown family (tiled as apple7) with the cores of a base M1.
struct GpuTarget {
  GpuFamily family = GpuFamily::unknown;
  int gpu_cores = 0;  // 0: the family's base Mac part (GpuTuning::base_cores)
};

// One row of the per-family table (docs/metal_kernels.md, "GPU family
// table"): every tile and split choice the plan makes for a family.
inline constexpr std::array<int, 5> kHeadDims = {64, 80, 96, 128, 256};
// Head dims the register-resident prefill kernel serves (Q and O in
// registers, D/4 floats each per lane); past it, or with key dim != value
// dim, the D-split prefill kernel (metal/attention_prefill_split.h) serves
// these (key, value) pairs, with the BK of the D = 256 column.
inline constexpr int kRegisterPrefillMaxHeadDim = 128;
inline constexpr std::array<std::array<int, 2>, 4> kSplitPrefillHeadDims = {{{192, 128}, {256, 256}, {512, 512}, {576, 512}}};
// Head dims the decode kernels are instantiated for (key = value).
inline constexpr std::array<int, 5> kDecodeHeadDims = {64, 96, 128, 256, 512};
struct GpuTuning {
  GpuFamily family;
  const char* name;
  int base_cores;                            // GPU cores of the family's base Mac chip
  int prefill_simdgroups;                    // per threadgroup; BQ = 8 x this
  std::array<int, 5> prefill_key_block_16;   // BK per kHeadDims, 2-byte dtypes
  std::array<int, 5> prefill_key_block_32;   // BK per kHeadDims, float32
  int decode_threadgroups_per_core;          // decode threadgroups that keep a core busy
};


// What a kernel parameter is.
enum class BufferRole : int32_t {
  q, k, v, mask, sinks, out, lse, params, splits, partial_out, partial_stats,
  // kernels over quantized K/V (csrc/metal/quantized_launch_plan.h): k and v are
  // then their packed words
  k_scales, k_biases, v_scales, v_biases, quantized_params,
  // the backward's (csrc/metal/backward_launch_plan.h)
  d_out, d_lse, dq, dk, dv, d_sinks, delta,
  // the paged kernels' (csrc/metal/paged_launch_plan.h)
  block_table, sequences,
  // cascade attention's (csrc/metal/paged_launch_plan.h plan_cascade_paged_attention)
  prefix_table, cascade_groups, cascade_rows,
};
enum class Access : int32_t { read, write };
// Where the bound memory comes from.
enum class Source : int32_t {
  input,    // the primitive's inputs[source_index] (q, k, v, then mask, sinks)
  output,   // the primitive's outputs[source_index]
  scratch,  // LaunchPlan::scratch[source_index], allocated for the call
  params,   // LaunchPlan::params, as bytes
  splits,   // LaunchPlan::splits (int32), as bytes
  quantized_params,  // LaunchPlan::quantized_params, as bytes
  sequences,  // LaunchPlan::sequences, as a buffer (may exceed setBytes' 4 KB)
  cascade_groups,  // LaunchPlan::cascade_groups, as a buffer
  cascade_rows,    // LaunchPlan::cascade_rows, as a buffer
};

struct Binding {
  int index = 0;  // [[buffer(index)]]
  BufferRole role = BufferRole::q;
  Access access = Access::read;
  Source source = Source::input;
  int source_index = 0;
};

struct KernelDispatch {
  KernelId id;                         // the kernel; id.name(): its host name in mlx_attn.metallib
  std::array<int, 3> grid{};           // threadgroups
  std::array<int, 3> threadgroup{};    // threads per threadgroup
  std::vector<Binding> bindings;
  int threadgroup_memory_bytes = 0;
};

// A float32 buffer allocated for the duration of the call: written by
// dispatches[producer] (and the `writers` - 1 after it: a cascade's suffix
// and prefix passes write one partial buffer), read by dispatches[consumer].
struct ScratchBuffer {
  BufferRole role = BufferRole::partial_out;
  int64_t elements = 0;
  int producer = 0;
  int consumer = 0;
  int writers = 1;
};

struct LaunchPlan {
  bool supported = false;
  GpuTarget target;    // the GPU it was made for, cores resolved
  AttentionProblem problem{};  // the problem it was made for (paged: every sequence's shared description)
  std::string reason;  // why not, when unsupported
  AttentionParams params{};
  int32_t splits = 1;  // decode: threadgroups along the key/value length
  std::vector<ScratchBuffer> scratch;
  std::vector<KernelDispatch> dispatches;
  // QuantizedAttentionParams (metal/attention_quantized_params.h) of a plan
  // over quantized K/V; empty otherwise
  std::vector<uint8_t> quantized_params;
  // the PagedSequence array (metal/attention_paged_params.h) of a paged plan
  std::vector<uint8_t> sequences;
  // a cascade plan's CascadeGroup and CascadeRow arrays (metal/attention_paged_params.h)
  std::vector<uint8_t> cascade_groups;
  std::vector<uint8_t> cascade_rows;
  int keys_per_split = 0;  // a paged plan's keys per decode split
};

const char* role_name(BufferRole role);
const char* source_name(Source source);
// Every BufferRole, in declaration order (for role_names() and the doc check).
inline constexpr int kBufferRoleCount = int(BufferRole::cascade_rows) + 1;

// The primitive's inputs and outputs by role, in order: what a binding's
// source_index points at. One table drives the bindings of every plan
// (forward, quantized, backward): bind_roles.
struct PrimitiveLayout {
  std::vector<BufferRole> inputs;
  std::vector<BufferRole> outputs;
};
// The forward primitive: q, k, v (quantized: k, k_scales, k_biases, v,
// v_scales, v_biases), then mask and sinks when present; out, then lse when
// asked.
PrimitiveLayout forward_layout(const AttentionProblem& problem, bool quantized = false);
// Turns a kernel's parameter list (buffer(i) = roles[i]) into bindings:
// params / splits / quantized_params as bytes, scratch roles (written by
// their producer dispatch, read by the others), then the layout's outputs
// and inputs. A role the primitive does not carry (an absent mask, sinks or
// lse) binds input 0 as a placeholder: the kernel never touches it
// (params.mask_kind / has_sinks / output_lse say so), but every buffer index
// must be bound.
std::vector<Binding> bind_roles(
    const PrimitiveLayout& layout, const std::vector<BufferRole>& roles, const std::vector<ScratchBuffer>& scratch,
    int dispatch_index);
// The decode kernels serve at most this many query positions and rows
// (query heads of a GQA group x positions).
inline constexpr int kDecodeMaxQueries = 8;
inline constexpr int kDecodeMaxRows = 32;

const GpuTuning& gpu_tuning(GpuFamily family);
const char* gpu_family_name(GpuFamily family);
// Name -> family ("apple7", "apple8", "apple9", "apple10", "unknown"); false if unknown name.
bool gpu_family_from_name(std::string_view name, GpuFamily& family);
// MLX's Device::get_architecture() ("applegpu_g<generation><tier>", e.g.
// "applegpu_g14g" = M2) -> family and the tier's smallest core count.
GpuTarget gpu_target_from_architecture(std::string_view architecture);
// gpu_cores resolved (0 -> the family's base part).
int gpu_cores(const GpuTarget& target);

// Keys per staged block of the prefill kernel (0: unsupported head dim).
int prefill_key_block(int head_dim, ElemType dtype, const GpuTarget& target = {});
// Whether a problem's head dims take the D-split prefill kernel.
bool prefill_splits_head_dims(int head_dim, int value_dim);
// Keys per staged block of the D-split prefill kernel (0: unsupported pair).
int prefill_split_key_block(int head_dim, int value_dim, ElemType dtype, const GpuTarget& target = {});
// The shape of a decode partial threadgroup (metal/attention_decode.h
// decode_split): it serves `rows` rows (query heads x positions of one KV
// head) and deals its split's keys out to `simdgroups` simdgroups.
struct DecodeShape {
  int rows = 0;                // R; 0: the head dim has no decode kernel
  int simdgroups = 0;          // NSG
  int min_keys_per_split = 0;  // the split rule's floor (decode_splits)
  int threads() const { return 32 * simdgroups; }
  // combine_simdgroup_states' threadgroup memory: simdgroups 1.. hand
  // simdgroup 0 each row's output, max and sum (DecodeStates<D, NSG, R>)
  int states_bytes(int head_dim) const { return (simdgroups - 1) * rows * (head_dim + 2) * 4; }
  // "_r<R>_sg<NSG>": the dense decode kernel's host-name fields
  // The decode kernels' _r<R>_sg<NSG> fields.
  KernelId& add_fields(KernelId& id) const;
};
// The group shape of a head dim: the register budget's rows
// (MLX_ATTN_DECODE_ROW_FLOATS / (D / 32), at most
// MLX_ATTN_DECODE_GROUP_MAX_ROWS) on MLX_ATTN_DECODE_SIMDGROUPS
// simdgroups, reading each key once for all of them. {}: D has no decode
// kernel.
DecodeShape decode_group_shape(int head_dim);
// The row shape: one row per threadgroup, its keys on as many simdgroups as
// a core's registers hold (up to 32, as MLX's sdpa_vector), for contexts too
// short to keep many split threadgroups busy. {}: D has no decode kernel.
DecodeShape decode_row_shape(int head_dim);
// The keys a decode reads: float K/V, or dequantized from packed codes (the
// quantized decodes), whose keys cost issue time, not only latency.
enum class DecodeKeys : int32_t { plain, dequantized };
// Threadgroups along the key/value length for a decode problem on threadgroups
// of `shape`: enough to keep the target GPU's cores busy, while each split
// keeps enough keys (shape.min_keys_per_split, 16 per row) that its partial
// and its simdgroup combine stay small next to its K/V (docs/metal_kernels.md).
// Over dequantized keys a split keeps a quarter of those keys, and the row
// shape's splits fill at most one wave of threadgroups.
int decode_splits(int batch, int kv_heads, int rows, int kv_len, const DecodeShape& shape,
                  const GpuTarget& target = {}, DecodeKeys keys = DecodeKeys::plain);
// Which shape a decode plan takes: the rule's (automatic), or one named
// (tests and benchmarks run every case on both; the rule decides in use).
enum class DecodeShapeChoice : int32_t { automatic, group, row };
// The decode's shape for a problem (the float, quantized and paged decodes
// alike): the one `choice` names, else the rule's: the row shape where its
// chain of keys per simdgroup (and merge) is no longer than the group
// shape's. `max_keys_per_split` (none: no cap) is a caller's own cap on a
// split of each shape (the paged decode's page window), which may add splits.
// `keys`: each shape's splits by decode_splits over those keys; over
// dequantized keys at one row per KV head the group shape shares no
// dequantization and holds R rows' registers for one, so such a problem
// takes the row shape.
DecodeShape decode_shape(int batch, int kv_heads, int rows, int kv_len, int head_dim, const GpuTarget& target = {},
                         DecodeShapeChoice choice = DecodeShapeChoice::automatic,
                         const std::function<int(const DecodeShape&)>& max_keys_per_split = {},
                         DecodeKeys keys = DecodeKeys::plain);
// The split-K decode's partials and merge (metal/attention_decode.h), for
// the float and quantized decode plans alike: with several splits
// (plan.splits) the partial dispatch (0) writes the partial_out /
// partial_stats scratch and a merge dispatch (1) combines them; with one
// split neither exists: the partial kernel writes out and lse itself
// (decode_launch_outputs). The scratch before binding the partial, the merge
// after it.
std::vector<ScratchBuffer> decode_partials_scratch(const AttentionProblem& problem, int splits);
void add_decode_merge(const AttentionProblem& problem, const PrimitiveLayout& layout, LaunchPlan& plan);

// Whether the kernels may read q, k and v as MLX_ATTN_VECTOR_WIDTH-element
// vectors: contiguous last dim, and head dims, batch / head / position
// strides and buffer offsets all multiples of the width (metal/attention_params.h).
bool vector_loads_aligned(const AttentionProblem& problem);

LaunchPlan plan_attention(const AttentionProblem& problem, const GpuTarget& target = {},
                          DecodeShapeChoice decode_choice = DecodeShapeChoice::automatic);

}  // namespace mlx_attn
