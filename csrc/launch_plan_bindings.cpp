// Exposes the launch plan to Python (tests, mlx_attn/metal_support.py).
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
      "attention_launch_plan",
      [](int batch, int q_heads, int kv_heads, int q_len, int kv_len, int head_dim, int value_dim,
         const std::string& dtype, std::array<int64_t, 4> q_strides, std::array<int64_t, 4> k_strides,
         std::array<int64_t, 4> v_strides, std::array<int64_t, 4> mask_strides, int mask_kind, bool causal,
         int window_size, bool has_sinks, float scale) {
        AttentionShape s{batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim, dtype,
                         q_strides, k_strides, v_strides, mask_strides, mask_kind, causal,
                         window_size, has_sinks, scale};
        LaunchPlan plan = plan_attention(s);
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
      "batch"_a, "q_heads"_a, "kv_heads"_a, "q_len"_a, "kv_len"_a, "head_dim"_a, "value_dim"_a,
      "dtype"_a, "q_strides"_a, "k_strides"_a, "v_strides"_a, "mask_strides"_a = std::array<int64_t, 4>{},
      "mask_kind"_a = 0, "causal"_a = false, "window_size"_a = 0, "has_sinks"_a = false, "scale"_a = 1.0f,
      "The Metal launch plan for a problem: kernels, grids, threadgroups, params bytes, bindings.");
  m.attr("MASK_NONE") = MLX_ATTN_MASK_NONE;
  m.attr("MASK_BOOL") = MLX_ATTN_MASK_BOOL;
  m.attr("MASK_ADDITIVE") = MLX_ATTN_MASK_ADDITIVE;
  m.attr("ATTENTION_PARAMS_BYTES") = int(sizeof(AttentionParams));
}

}  // namespace mlx_attn
