// Exposes the fused Metal paged attention to Python (mlx_attn/paged.py) and
// its launch plan (the emulator tests, tests/metal_runner.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/ops/metal_paged_attention.h"
#include "metal/attention_paged_params.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

// csrc/python/launch_plan_bindings.cpp
nb::dict launch_plan_dict(const LaunchPlan& plan);
DecodeShapeChoice decode_shape_choice(const std::string& name);

namespace {

PagedOptions paged_options(float scale, bool causal, int window_size, bool has_sinks, bool output_lse, int bits,
                           int group_size, float softcap) {
  PagedOptions options;
  options.scale = scale;
  options.causal = causal || window_size > 0;
  options.window_size = window_size;
  options.has_sinks = has_sinks;
  options.output_lse = output_lse;
  options.bits = bits;
  options.group_size = group_size;
  options.softcap = softcap;
  return options;
}

}  // namespace

void bind_paged_metal(nb::module_& m) {
  m.def(
      "paged_metal_launch_plan",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
         float scale, bool causal, int window_size, bool has_sinks, bool output_lse, int bits, int group_size,
         float softcap, const std::string& gpu_family, int gpu_cores, const std::string& decode_shape) {
        GpuTarget target;
        if (!gpu_family_from_name(gpu_family, target.family)) {
          throw nb::value_error(("unknown gpu_family '" + gpu_family + "'").c_str());
        }
        target.gpu_cores = gpu_cores;
        const PagedOptions options =
            paged_options(scale, causal, window_size, has_sinks, output_lse, bits, group_size, softcap);
        const PagedProblem problem = describe_paged_attention(inputs, options, q_lens, kv_lens);
        const DecodeShapeChoice choice = decode_shape_choice(decode_shape);
        const LaunchPlan plan = plan_paged_attention(problem, target, choice);
        nb::dict out = launch_plan_dict(plan);
        out["keys_per_split"] =
            plan.supported ? paged_keys_per_split(problem, paged_decode_shape(problem, target, choice), target) : 0;
        out["q_offset"] = problem.attention.q_offset;
        out["k_offset"] = problem.attention.k_offset;
        out["v_offset"] = problem.attention.v_offset;
        return out;
      },
      "inputs"_a, "q_lens"_a, "kv_lens"_a, nb::kw_only(), "scale"_a = 1.0f, "causal"_a = true, "window_size"_a = 0,
      "has_sinks"_a = false, "output_lse"_a = false, "bits"_a = 0, "group_size"_a = 0, "softcap"_a = 0.0f,
      "gpu_family"_a = "unknown",
      "gpu_cores"_a = 0, "decode_shape"_a = "auto",
      "The Metal launch plan of paged attention for the primitive's inputs (q, k pages, v pages or the two "
      "quantized triples, block_table, [sinks]) and host lengths, in metal_launch_plan's format plus "
      "'sequences' (the PagedSequence array bytes) and 'keys_per_split'. decode_shape: 'auto' (the plan's "
      "rule), 'group' or 'row' (the decode kernel's threadgroup shape on float pages; tests run both).");
  m.def(
      "metal_paged_attention",
      [](const std::vector<mx::array>& inputs, const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
         float scale, bool causal, int window_size, bool has_sinks, bool output_lse, int bits, int group_size,
         float softcap, mx::StreamOrDevice s) {
        const PagedOptions options =
            paged_options(scale, causal, window_size, has_sinks, output_lse, bits, group_size, softcap);
        return metal_paged_attention(inputs, options, q_lens, kv_lens, s);
      },
      "inputs"_a, "q_lens"_a, "kv_lens"_a, nb::kw_only(), "scale"_a, "causal"_a = true, "window_size"_a = 0,
      "has_sinks"_a = false, "output_lse"_a = false, "bits"_a = 0, "group_size"_a = 0, "softcap"_a = 0.0f,
      "stream"_a = nb::none(),
      "The fused Metal paged attention (GPU streams): [out] or [out, lse]. mlx_attn.paged_attention validates "
      "the arguments; this raises ValueError for broken invariants.");
  m.attr("PAGED_SEQUENCE_BYTES") = int(sizeof(PagedSequence));
  // the most pages a decode split covers on the row and the group shape
  m.attr("PAGED_MAX_PAGES_PER_SPLIT") =
      nb::make_tuple(paged_max_pages_per_split(decode_row_shape(128)), paged_max_pages_per_split(decode_group_shape(128)));
}

}  // namespace mlx_attn
