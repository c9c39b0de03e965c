// mlx_attn._ext entries of paged attention (csrc/ops/paged_attention.h): the op,
// its problem description and its support rule. mlx_attn/paged.py validates
// the public contract first; these check again (std::invalid_argument).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/ops/cascade_attention.h"
#include "csrc/ops/cascade_merge.h"
#include "csrc/ops/paged_attention.h"
#include "csrc/python/options.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {
namespace {

// Paged attention is causal unless told otherwise.
constexpr AttentionOptions kPagedDefaults{.causal = true};

std::vector<mx::array> inputs_of(const mx::array& q, const std::vector<mx::array>& k_parts,
                                 const std::vector<mx::array>& v_parts, const mx::array& block_table,
                                 const mx::array& kv_lens, const mx::array& q_lens,
                                 const std::optional<mx::array>& sinks) {
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), k_parts.begin(), k_parts.end());
  inputs.insert(inputs.end(), v_parts.begin(), v_parts.end());
  inputs.insert(inputs.end(), {block_table, kv_lens, q_lens});
  if (sinks) inputs.push_back(*sinks);
  return inputs;
}

}  // namespace

void bind_paged(nb::module_& m) {
  m.def(
      "paged_attention",
      [](const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
         const mx::array& block_table, const mx::array& kv_lens, const mx::array& q_lens,
         std::optional<mx::array> sinks, mx::StreamOrDevice s, const nb::kwargs& options) {
        return paged_attention(q, k_parts, v_parts, block_table, kv_lens, q_lens, sinks,
                               options_from(options, kPagedDefaults), s);
      },
      "q"_a, "k_parts"_a, "v_parts"_a, "block_table"_a, "kv_lens"_a, "q_lens"_a, nb::kw_only(),
      "sinks"_a = nb::none(), "stream"_a = nb::none(), "options"_a,
      "Fused paged attention; k_parts / v_parts are [pages] (bits=0) or (packed, scales, biases). Returns [out] "
      "or [out, lse]. Raises ValueError on any invalid input.");

  m.def(
      "cascade_merge", &cascade_merge, "suffix_out"_a, "suffix_lse"_a, "prefix_out"_a, "prefix_lse"_a,
      "direct_out"_a, "direct_lse"_a, "suffix_index"_a, "prefix_index"_a, "direct_index"_a, "sinks"_a, "dtype"_a,
      nb::kw_only(), "stream"_a = nb::none(),
      "The cascade's merge (csrc/ops/cascade_merge.h): [out, lse] of every call row from the passes' partials "
      "by log-sum-exp, sinks once, direct rows as they are. CPU only.");

  m.def(
      "cascade_paged_attention",
      [](const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
         const std::vector<mx::array>& passes, const mx::array& suffix_index, const mx::array& prefix_index,
         const mx::array& direct_index, const mx::array& merge_sinks, std::optional<mx::array> sinks,
         mx::StreamOrDevice s, const nb::kwargs& options) {
        return cascade_paged_attention(q, k_parts, v_parts, passes, suffix_index, prefix_index, direct_index,
                                       merge_sinks, sinks, options_from(options, kPagedDefaults), s);
      },
      "q"_a, "k_parts"_a, "v_parts"_a, "passes"_a, "suffix_index"_a, "prefix_index"_a, "direct_index"_a,
      "merge_sinks"_a, nb::kw_only(), "sinks"_a = nb::none(), "stream"_a = nb::none(), "options"_a,
      "Cascade paged attention in one primitive (csrc/ops/cascade_attention.h): the prefix, suffix and direct "
      "passes, each (block_table, kv_lens, q_lens, rows), then the merge. Returns [out, lse]. CPU only.");

  m.def(
      "paged_unsupported_reason",
      [](const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
         const mx::array& block_table, const mx::array& kv_lens, const mx::array& q_lens,
         std::optional<mx::array> sinks, mx::Device::DeviceType device,
         const nb::kwargs& kwargs) -> std::optional<std::string> {
        AttentionOptions options = options_from(kwargs, kPagedDefaults);
        options.has_sinks = sinks.has_value();
        const auto description = describe_paged_attention(
            inputs_of(q, k_parts, v_parts, block_table, kv_lens, q_lens, sinks), options);
        std::string reason = paged_unsupported_reason(description, device);
        if (reason.empty()) return std::nullopt;
        return reason;
      },
      "q"_a, "k_parts"_a, "v_parts"_a, "block_table"_a, "kv_lens"_a, "q_lens"_a, nb::kw_only(),
      "sinks"_a = nb::none(), "device"_a, "options"_a,
      "None when the fused paged kernels of `device` (mx.cpu or mx.gpu) handle the call, else why not.");
}

}  // namespace mlx_attn
