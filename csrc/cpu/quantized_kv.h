// Keys and values in mx.quantize's affine format, as the fused CPU kernel
// reads them. Plain C++ (no STL, no MLX): the per-ISA kernels include it.
#pragma once

#include <stdint.h>

namespace mlx_attn::cpu {

// Quantized K/V: KernelCall::k / ::v point at packed uint32 words read
// through AttentionProblem::k_strides / v_strides (in words). Feature i of a
// row is code_i * scale[i / group_size] + bias[i / group_size], code_i the
// `bits`-bit field at bit (i % (32 / bits)) * bits of word i / (32 / bits).
struct QuantizedKV {
  int bits = 0;  // 4 or 8; 0: K and V are plain float arrays
  int group_size = 0;
  const void* k_scales = nullptr;  // in the problem's dtype
  const void* k_biases = nullptr;
  const void* v_scales = nullptr;
  const void* v_biases = nullptr;
  // [B, H, T, groups] strides in elements of each scales and biases array
  int64_t k_scale_strides[4] = {};
  int64_t k_bias_strides[4] = {};
  int64_t v_scale_strides[4] = {};
  int64_t v_bias_strides[4] = {};

  // Element offset of row (b, h, t) in an array of these strides.
  static int64_t row_offset(const int64_t (&s)[4], int64_t b, int64_t h, int64_t t) {
    return b * s[0] + h * s[1] + t * s[2];
  }
};

}  // namespace mlx_attn::cpu
