// Exposes the launch plan to Python (tests, the emulator runner).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "csrc/backward_launch_plan.h"
#include "csrc/launch_plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

namespace {

// A plan as a dict: what the emulator runner and the tests read.
nb::dict plan_dict(const LaunchPlan& plan) {
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
    nb::list bindings;
    for (const auto& b : d.bindings) {
      nb::dict binding;
      binding["index"] = b.index;
      binding["role"] = role_name(b.role);
      binding["access"] = b.access == Access::write ? "write" : "read";
      binding["source"] = source_name(b.source);
      binding["source_index"] = b.source_index;
      bindings.append(binding);
    }
    entry["bindings"] = bindings;
    entry["threadgroup_memory_bytes"] = d.threadgroup_memory_bytes;
    dispatches.append(entry);
  }
  out["dispatches"] = dispatches;
  out["splits"] = plan.splits;
  nb::list scratch;
  for (const auto& buffer : plan.scratch) {
    nb::dict entry;
    entry["role"] = role_name(buffer.role);
    entry["elements"] = buffer.elements;
    entry["producer"] = buffer.producer;
    entry["consumer"] = buffer.consumer;
    scratch.append(entry);
  }
  out["scratch"] = scratch;
  return out;
}

}  // namespace

void bind_launch_plan(nb::module_& m) {
  m.def(
      "metal_launch_plan",
      [](const AttentionProblem& problem) { return plan_dict(plan_attention(problem)); },
      "problem"_a,
      "The Metal launch plan for a problem (_ext.describe_attention): kernels, grids, threadgroups, "
      "params bytes, and per dispatch its bindings (index, role, access, source, source_index) "
      "exactly as the Mac host encodes them.");
  m.def(
      "metal_backward_launch_plan",
      [](const AttentionProblem& problem) { return plan_dict(plan_attention_backward(problem)); },
      "problem"_a,
      "The Metal backward's launch plan for a forward problem (_ext.describe_attention), in "
      "metal_launch_plan's format; bindings index the backward primitive's inputs (q, k, v, [mask], "
      "[sinks], out, lse, d_out, d_lse) and outputs (dq, dk, dv, [d_sinks]).");
  m.attr("MASK_NONE") = MLX_ATTN_MASK_NONE;
  m.attr("MASK_BOOL") = MLX_ATTN_MASK_BOOL;
  m.attr("MASK_ADDITIVE") = MLX_ATTN_MASK_ADDITIVE;
  m.attr("ATTENTION_PARAMS_BYTES") = int(sizeof(AttentionParams));
}

}  // namespace mlx_attn
