// mlx_attn._ext.decode_attention (csrc/ops/decode_attention.h): one decode
// step's attention block of a layer as one CPU primitive.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/ops/decode_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

void bind_decode_attention(nb::module_& m) {
  m.def("decode_attention", &decode_attention, "q"_a, "k"_a, "v"_a, "key_cache"_a, "value_cache"_a, "position"_a,
        "cos"_a, "sin"_a, nb::kw_only(), "scale"_a, "window_size"_a = 0, "traditional"_a = false,
        "stream"_a = nb::none(),
        "One decode step's attention block on the CPU: q [B, 1, Hq * D], k [B, 1, Hkv * D], v [B, 1, Hkv * Dv] "
        "(the projections' rows); RoPE of q and k by cos / sin (float32 [rotated_dims / 2]; interleaved pairs "
        "when traditional, else halves); k and v written into key_cache / value_cache [B, Hkv, S, D or Dv] at "
        "`position` (an integer scalar array); q attends slots [0, position] (window_size > 0: the last "
        "window_size of them). Returns (out [B, 1, Hq * Dv], key_cache, value_cache) in the caches' dtype; a "
        "cache input nothing else holds is updated in place.");
  m.def("paged_rows_write", &paged_rows_write, "pages"_a, "rows"_a, "write_pages"_a, "write_slots"_a,
        "cos"_a = nb::none(), "sin"_a = nb::none(), nb::kw_only(), "traditional"_a = false, "stream"_a = nb::none(),
        "pages [num_pages, Hkv, page_size, D] with rows [T, Hkv * D] (or [1, T, Hkv * D]) written at "
        "(write_pages[t], write_slots[t]) (int32 [T]), each rotated first by its cos / sin row (float32 "
        "[T, rotated_dims / 2]) when given; a row outside the pool is not written; a pool nothing else holds is "
        "updated in place.");
  m.def("rotated_rows", &rotated_rows, "rows"_a, "cos"_a, "sin"_a, nb::kw_only(), "heads"_a,
        "traditional"_a = false, "stream"_a = nb::none(),
        "rows [T, heads * D] (or [1, T, heads * D]) as [T, heads, D] in their dtype, each token's first rotated_dims "
        "features rotated by its cos / sin row (float32 [T, rotated_dims / 2]).");
}

}  // namespace mlx_attn
