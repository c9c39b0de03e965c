// mlx_attn._ext entries of paged attention (csrc/ops/paged_attention.h): the op,
// its problem description and its support rule. mlx_attn/paged.py validates
// the public contract first; these check again (std::invalid_argument).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/ops/paged_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {
namespace {

AttentionOptions paged_options(float scale, bool causal, int window_size, bool output_lse, float softcap) {
  AttentionOptions options;
  options.scale = scale;
  options.softcap = softcap;
  options.causal = causal;
  options.window_size = window_size;
  options.output_lse = output_lse;
  return options;
}

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
         const mx::array& block_table, const mx::array& kv_lens, const mx::array& q_lens, float scale, bool causal,
         int window_size, std::optional<mx::array> sinks, bool output_lse, int bits, int group_size, float softcap,
         mx::StreamOrDevice s) {
        return paged_attention(q, k_parts, v_parts, block_table, kv_lens, q_lens, sinks,
                               paged_options(scale, causal, window_size, output_lse, softcap), {bits, group_size}, s);
      },
      "q"_a, "k_parts"_a, "v_parts"_a, "block_table"_a, "kv_lens"_a, "q_lens"_a, nb::kw_only(), "scale"_a,
      "causal"_a = true, "window_size"_a = 0, "sinks"_a = nb::none(), "output_lse"_a = false, "bits"_a = 0,
      "group_size"_a = 0, "softcap"_a = 0.0f, "stream"_a = nb::none(),
      "Fused paged attention; k_parts / v_parts are [pages] (bits=0) or (packed, scales, biases). Returns [out] "
      "or [out, lse]. Raises ValueError on any invalid input.");

  m.def(
      "paged_unsupported_reason",
      [](const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
         const mx::array& block_table, const mx::array& kv_lens, const mx::array& q_lens, float scale, bool causal,
         int window_size, std::optional<mx::array> sinks, bool output_lse, int bits, int group_size, float softcap,
         mx::Device::DeviceType device) -> std::optional<std::string> {
        AttentionOptions options = paged_options(scale, causal, window_size, output_lse, softcap);
        options.has_sinks = sinks.has_value();
        const auto description = describe_paged_attention(
            inputs_of(q, k_parts, v_parts, block_table, kv_lens, q_lens, sinks), options, {bits, group_size});
        std::string reason = paged_unsupported_reason(description, device);
        if (reason.empty()) return std::nullopt;
        return reason;
      },
      "q"_a, "k_parts"_a, "v_parts"_a, "block_table"_a, "kv_lens"_a, "q_lens"_a, nb::kw_only(), "scale"_a = 1.0f,
      "causal"_a = true, "window_size"_a = 0, "sinks"_a = nb::none(), "output_lse"_a = false, "bits"_a = 0,
      "group_size"_a = 0, "softcap"_a = 0.0f, "device"_a,
      "None when the fused paged kernels of `device` (mx.cpu or mx.gpu) handle the call, else why not.");
}

}  // namespace mlx_attn
