// Exposes the launch plan to Python (tests, the emulator runner).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "csrc/launch_plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

void bind_launch_plan(nb::module_& m) {
  m.def(
      "metal_launch_plan",
      [](const AttentionProblem& problem) {
        LaunchPlan plan = plan_attention(problem);
        nb::dict out;
        out["supported"] = plan.supported;
        out["reason"] = plan.reason;
        out["params"] = nb::bytes(reinterpret_cast<const char*>(&plan.params), sizeof(AttentionParams));
        nb::list dispatches;
        for (const auto& d : plan.dispatches) {
          nb::dict entry;
          entry["kernel"] = d.kernel;
          entry["grid"] = d.grid;
          entry["threadgroup"] = d.threadgroup;
          entry["buffers"] = d.buffers;
          entry["threadgroup_memory_bytes"] = d.threadgroup_memory_bytes;
          dispatches.append(entry);
        }
        out["dispatches"] = dispatches;
        out["splits"] = plan.splits;
        nb::dict scratch;
        for (const auto& buffer : plan.scratch) scratch[buffer.name.c_str()] = buffer.elements;
        out["scratch"] = scratch;
        return out;
      },
      "problem"_a,
      "The Metal launch plan for a problem (_ext.describe_attention): kernels, grids, threadgroups, "
      "params bytes, bindings.");
  m.attr("MASK_NONE") = MLX_ATTN_MASK_NONE;
  m.attr("MASK_BOOL") = MLX_ATTN_MASK_BOOL;
  m.attr("MASK_ADDITIVE") = MLX_ATTN_MASK_ADDITIVE;
  m.attr("ATTENTION_PARAMS_BYTES") = int(sizeof(AttentionParams));
}

}  // namespace mlx_attn
