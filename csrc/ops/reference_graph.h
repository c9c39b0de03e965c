// The reference path (mlx_attn/reference.py) as a graph of MLX ops, step by
// step with the same names: what the fused primitive's derivatives
// differentiate when its fused backward does not run, so no derivative calls
// back into Python.
#pragma once

#include <vector>

#include "csrc/core/attention_options.h"
#include "mlx/array.h"
#include "mlx/stream.h"

namespace mlx_attn {

namespace mx = mlx::core;

// inputs: q, k, v, then the mask and sinks as the options say (the
// primitive's inputs). Returns [out] or, with options.output_lse, [out, lse].
std::vector<mx::array> reference_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, mx::Stream s);

// The derivatives of reference_attention: one gradient per argnum for
// `forward_mode` false (vectors: the outputs' cotangents), else the outputs'
// tangents (vectors: one tangent per argnum). A bool mask is a constant: its
// gradient is zero and its tangent is ignored; an additive mask's gradient
// is the score gradient reduced over its broadcast dimensions.
std::vector<mx::array> reference_derivatives(
    bool forward_mode,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& vectors,
    const std::vector<int>& argnums,
    const AttentionOptions& options,
    mx::Stream s);

}  // namespace mlx_attn
