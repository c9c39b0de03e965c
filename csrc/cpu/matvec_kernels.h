// What the per-ISA copies of the quantized matrix-vector product see (no STL,
// no MLX): y[r, n] = sum_k x[r, k] * (scale[n, g] * code[n, k] + bias[n, g]),
// g = k / group_size, for a few rows r of float32 activations and an MLX
// affine-quantized weight (mx.quantize: codes packed little-endian in uint32
// words, `bits` 4 or 8). The weight is dequantized in registers as it is
// read, so a decode step reads 4 or 8 bits per weight, not 32.
#pragma once

#include <stdint.h>

#include "csrc/core/attention_problem.h"

namespace mlx_attn::cpu {

// Rows up to this many are one pass over the weight (each weight read once
// for all rows); the caller splits larger row counts.
inline constexpr int kMatvecMaxRows = 8;

struct MatvecCall {
  const float* x;          // [rows, k] row-contiguous; 4-bit: [rows, 2, k / 2], even then odd columns
  int rows;
  int64_t k;               // input features (a multiple of group_size)
  int64_t n;               // output features
  const uint32_t* codes;   // [n, k * bits / 32]
  const void* scales;      // [n, k / group_size], scale_type
  const void* biases;      // likewise
  ElemType scale_type;
  int group_size;          // 32, 64 or 128
  int bits;                // 4 or 8
  float* out;              // [rows, n] row-contiguous
};

// Output features [begin, end) of the call.
namespace generic {
void quantized_matvec(const MatvecCall& call, int64_t begin, int64_t end);
}
#ifdef MLX_ATTN_X86_KERNELS
namespace avx2 {
void quantized_matvec(const MatvecCall& call, int64_t begin, int64_t end);
}
#endif

// A SwiGLU MLP's activations, the down projection's input: out[i] =
// (gate[i] * sigmoid(gate[i])) * up[i] (MLX's nn.silu(gate) * up, in that
// order), sigmoid through the kernels' vector exp2 (relative error ~3e-7);
// gate = -inf gives NaN as MLX's does (-inf * 0). out may alias up.
namespace generic {
void swiglu(const float* gate, const float* up, int64_t count, float* out);
}
#ifdef MLX_ATTN_X86_KERNELS
namespace avx2 {
void swiglu(const float* gate, const float* up, int64_t count, float* out);
}
#endif

}  // namespace mlx_attn::cpu
