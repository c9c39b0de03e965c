// The one options binder: every binding that takes attention options takes
// them as keyword arguments (**options) and turns them into the record here,
// by the record's own Python attributes (bind_options), so no binding lists
// the options again.
#pragma once

#include <nanobind/nanobind.h>

#include "csrc/core/attention_options.h"

namespace mlx_attn {

void bind_options(nanobind::module_& m);

// `defaults` with every keyword set by name; an unknown name raises TypeError.
AttentionOptions options_from(const nanobind::kwargs& options, AttentionOptions defaults = {});

}  // namespace mlx_attn
