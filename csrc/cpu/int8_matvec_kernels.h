// What the per-ISA copies of the integer-dot quantized matrix-vector product
// see (no STL, no MLX): y[r, n] ~= sum_k x[r, k] * (scale[n, g] * code[n, k] +
// bias[n, g]) for a few rows of activations already quantized to int8 or
// int16 per block of 32 columns (quantize_activations, below) and an MLX
// affine-quantized weight (4 or 8 bits). Per block the weight codes (unsigned)
// and the activation codes (signed) meet in an integer dot product (int8:
// AVX512-VNNI or AVX-VNNI vpdpbusd, AVX2 vpmaddubsw, arm64 USMMLA or SDOT;
// int16: vpdpwssd, vpmaddwd, NEON SMLAL; or plain C++), which is scaled once by the weight's
// group scale times the block's activation scale; the bias term uses the
// activations' exact float sums.
//
// Error against the float product of the same weights: only the activations
// are rounded, |x - d * xq| <= d / 2 with d = max|x over the block| / 127
// (int8) or / 32767 (int16), so
//   |y_int - y_float| <= sum_k |scale[n, g(k)] * code[n, k]| * d[r, b(k)] / 2
// plus float32 rounding of the sums (tests/test_int8_matvec.py checks it).
#pragma once

#include <stdint.h>

#include "csrc/core/attention_problem.h"

namespace mlx_attn::cpu {

// Columns per activation block (one int8 scale each); divides every group size.
inline constexpr int kInt8Block = 32;
// Rows up to this many are one pass over the weight (each copy takes any
// count; the caller splits more so its buffers stay small).
inline constexpr int kInt8MatvecMaxRows = 128;

struct Int8MatvecCall {
  int activation_bits;     // 8 (xq int8) or 16 (xq int16)
  // [rows, k] int8 or int16 codes. Within each 32-column block, 4-bit weights: the 16
  // even columns, then the 16 odd ones (the order a byte's low and high
  // nibbles unpack to); 8-bit weights: the columns in order.
  const void* xq;
  // [rows, k / 32 * 8]: each block's scale d, repeated 8 times (one float
  // lane per int32 lane of the block's dot product).
  const float* xd;
  // [rows, k / 32 * 8]: each block's float sum of x divided by 8, repeated
  // 8 times (the bias term, spread over the same lanes).
  const float* xsum;
  int rows;
  int64_t k;               // input features (a multiple of group_size)
  int64_t n;               // output features
  const uint32_t* codes;   // [n, k * bits / 32], MLX's little-endian packing
  const void* scales;      // [n, k / group_size], scale_type
  const void* biases;      // likewise
  ElemType scale_type;
  int group_size;          // 32, 64 or 128
  int bits;                // 4 or 8
  float* out;              // [rows, n] row-contiguous
};

// One row x [k] (finite or not) into xq [k] (Code: int8_t or int16_t), xd and
// xsum [k / 32 * 8] in the layout above. A block holding inf or NaN gets the
// scale NaN (so its outputs are NaN, as the float product's would be).
template <typename Code>
inline void quantize_activations(const float* x, int64_t k, int bits, Code* xq, float* xd, float* xsum) {
  constexpr float kLargest = sizeof(Code) == 1 ? 127.0f : 32767.0f;
  for (int64_t b = 0; b < k / kInt8Block; ++b) {
    const float* xb = x + b * kInt8Block;
    float amax = 0.0f, sum = 0.0f;
    bool finite = true;
    for (int i = 0; i < kInt8Block; ++i) {
      const float a = xb[i] < 0 ? -xb[i] : xb[i];
      finite = finite && a <= 3.4028234663852886e38f;  // false for inf and NaN
      amax = a > amax ? a : amax;
      sum += xb[i];
    }
    const float d = finite ? amax / kLargest : __builtin_nanf("");
    const float inverse = finite && amax > 0.0f ? kLargest / amax : 0.0f;
    for (int j = 0; j < 8; ++j) {
      xd[b * 8 + j] = d;
      xsum[b * 8 + j] = sum * 0.125f;
    }
    Code* qb = xq + b * kInt8Block;
    for (int i = 0; i < kInt8Block; ++i) {
      float v = __builtin_nearbyintf(xb[i] * inverse);
      v = v > kLargest ? kLargest : (v < -kLargest ? -kLargest : v);
      const int at = bits == 4 ? (i % 2) * 16 + i / 2 : i;
      qb[at] = Code(v);
    }
  }
}

// Output features [begin, end) of the call.
namespace generic {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
#ifdef MLX_ATTN_X86_KERNELS
namespace avx2 {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
namespace avxvnni {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
namespace avx512vnni {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
namespace neon {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
namespace neondot {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
namespace neoni8mm {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
#endif

}  // namespace mlx_attn::cpu
