#include "csrc/python/options.h"

#include <nanobind/stl/string.h>

#include <string>

namespace nb = nanobind;

namespace mlx_attn {

void bind_options(nb::module_& m) {
  nb::class_<AttentionOptions>(m, "AttentionOptions",
                               "The one options record of an attention call (csrc/core/attention_options.h).")
      .def(nb::init<>())
      .def_rw("scale", &AttentionOptions::scale)
      .def_rw("causal", &AttentionOptions::causal)
      .def_rw("window_size", &AttentionOptions::window_size)
      .def_rw("has_mask", &AttentionOptions::has_mask)
      .def_rw("has_sinks", &AttentionOptions::has_sinks)
      .def_rw("output_lse", &AttentionOptions::output_lse)
      .def_rw("lse_for_backward", &AttentionOptions::lse_for_backward)
      .def_rw("metal_backward_trusted", &AttentionOptions::metal_backward_trusted)
      .def_rw("softcap", &AttentionOptions::softcap)
      .def_prop_rw(
          "bits", [](const AttentionOptions& o) { return o.quantization.bits; },
          [](AttentionOptions& o, int bits) { o.quantization.bits = bits; })
      .def_prop_rw(
          "group_size", [](const AttentionOptions& o) { return o.quantization.group_size; },
          [](AttentionOptions& o, int group_size) { o.quantization.group_size = group_size; });
}

AttentionOptions options_from(const nb::kwargs& options, AttentionOptions defaults) {
  nb::object record = nb::cast(defaults);
  const nb::handle type = record.type();
  for (auto [name, value] : options) {
    const std::string key = nb::cast<std::string>(name);
    if (key.starts_with("_") || !nb::hasattr(type, key.c_str())) {
      throw nb::type_error(("unexpected keyword argument '" + key + "' (not an attention option)").c_str());
    }
    nb::setattr(record, name, value);
  }
  return nb::cast<AttentionOptions>(record);
}

}  // namespace mlx_attn
