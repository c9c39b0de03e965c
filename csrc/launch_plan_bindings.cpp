#include <nanobind/nanobind.h>

#include "csrc/launch_plan.h"

namespace mlx_attn {
void bind_launch_plan(nanobind::module_&) {}
}  // namespace mlx_attn
