// Exposes the fused Metal paged attention to Python (mlx_attn/paged.py) and
// its launch plan (the emulator tests, kernel_lab/metal_runner.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/ops/metal_paged_attention.h"
#include "csrc/python/options.h"
#include "metal/attention_paged_params.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

// csrc/python/launch_plan_bindings.cpp
DecodeShapeChoice decode_shape_choice(const std::string& name);

namespace {

// Paged attention is causal unless told otherwise.
constexpr AttentionOptions kPagedDefaults{.causal = true};

}  // namespace

void bind_paged_metal(nb::module_& m) {
  m.def(
      "paged_metal_launch_plan",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
         const std::string& gpu_family, int gpu_cores, const std::string& decode_shape, const nb::kwargs& kwargs) {
        GpuTarget target;
        if (!gpu_family_from_name(gpu_family, target.family)) {
          throw nb::value_error(("unknown gpu_family '" + gpu_family + "'").c_str());
        }
        target.gpu_cores = gpu_cores;
        const PagedProblem problem = describe_paged_attention(inputs, options_from(kwargs, kPagedDefaults), q_lens, kv_lens);
        return plan_paged_attention(problem, target, decode_shape_choice(decode_shape));
      },
      "inputs"_a, "q_lens"_a, "kv_lens"_a, nb::kw_only(), "gpu_family"_a = "unknown", "gpu_cores"_a = 0,
      "decode_shape"_a = "auto", "options"_a,
      "The Metal launch plan of paged attention for the primitive's inputs (q, k pages, v pages or the two "
      "quantized triples, block_table, [sinks]) and host lengths: a LaunchPlan with its "
      "sequences (the PagedSequence array bytes) and keys_per_split. decode_shape: 'auto' (the plan's "
      "rule), 'group' or 'row' (the decode kernel's threadgroup shape on float pages; tests run both).");
  m.def(
      "metal_paged_attention",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
         mx::StreamOrDevice s, const nb::kwargs& options) {
        return metal_paged_attention(inputs, options_from(options, kPagedDefaults), q_lens, kv_lens, s);
      },
      "inputs"_a, "q_lens"_a, "kv_lens"_a, nb::kw_only(), "stream"_a = nb::none(), "options"_a,
      "The fused Metal paged attention (GPU streams): [out] or [out, lse]. mlx_attn.paged_attention validates "
      "the arguments; this raises ValueError for broken invariants.");
  m.def(
      "cascade_metal_launch_plan",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens,
         const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
         const std::vector<int32_t>& prefix_groups, const std::string& gpu_family, int gpu_cores,
         const nb::kwargs& kwargs) {
        GpuTarget target;
        if (!gpu_family_from_name(gpu_family, target.family)) {
          throw nb::value_error(("unknown gpu_family '" + gpu_family + "'").c_str());
        }
        target.gpu_cores = gpu_cores;
        return plan_cascade_paged_attention(describe_cascade_paged_attention(
            inputs, options_from(kwargs, kPagedDefaults), q_lens, own_kv_lens, prefix_lens, prefix_groups), target);
      },
      "inputs"_a, "q_lens"_a, "own_kv_lens"_a, "prefix_lens"_a, "prefix_groups"_a, nb::kw_only(),
      "gpu_family"_a = "unknown", "gpu_cores"_a = 0, "options"_a,
      "The Metal launch plan of cascade attention for the primitive's inputs (the paged inputs with each "
      "sequence's own pages as block_table, then prefix_table) and host lengths (own_kv_lens: the keys after "
      "each sequence's group prefix): a LaunchPlan with its sequences, cascade_groups and cascade_rows bytes.");
  m.def(
      "metal_cascade_paged_attention",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens,
         const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
         const std::vector<int32_t>& prefix_groups, mx::StreamOrDevice s, const nb::kwargs& options) {
        return metal_cascade_paged_attention(inputs, options_from(options, kPagedDefaults), q_lens, own_kv_lens,
                                             prefix_lens, prefix_groups, s);
      },
      "inputs"_a, "q_lens"_a, "own_kv_lens"_a, "prefix_lens"_a, "prefix_groups"_a, nb::kw_only(),
      "stream"_a = nb::none(), "options"_a,
      "Cascade attention on the fused Metal kernels (GPU streams): [out] or [out, lse]; inputs as "
      "cascade_metal_launch_plan.");
  m.attr("PAGED_SEQUENCE_BYTES") = int(sizeof(PagedSequence));
  m.attr("CASCADE_GROUP_BYTES") = int(sizeof(CascadeGroup));
  m.attr("CASCADE_TILE_ROWS") = kCascadeTileRows;
  // the most pages a decode split covers on the row and the group shape
  m.attr("PAGED_MAX_PAGES_PER_SPLIT") =
      nb::make_tuple(paged_max_pages_per_split(decode_row_shape(128)), paged_max_pages_per_split(decode_group_shape(128)));
}

}  // namespace mlx_attn
