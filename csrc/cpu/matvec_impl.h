// The quantized matrix-vector product (csrc/cpu/matvec_kernels.h) for one
// instruction set: include after defining MLX_ATTN_ISA and its isa_*.h.
//
// Per output feature, per group: the group's codes become kLanes-wide float
// vectors, are dequantized with one fused multiply-add (scale * code + bias,
// the value mx.dequantize gives in float32) and multiplied into one vector
// accumulator per row. 4-bit words hold two codes per byte (low nibble: even
// column, high nibble: odd column), so the caller hands x over with its even
// columns first and its odd columns after: both nibble halves of a byte
// vector then meet contiguous x.
#pragma once

#include "csrc/cpu/elements.h"
#include "csrc/cpu/matvec_kernels.h"
#include "csrc/cpu/simd.h"

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

typedef uint8_t vbytes __attribute__((vector_size(kLanes)));
typedef uint8_t vbytes_unaligned __attribute__((vector_size(kLanes), aligned(1)));

inline vfloat codes_of(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vbytes_unaligned*>(p), vfloat);
}

inline float lanes_sum(vfloat v) {
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// Scales and biases are converted to float32 this many groups at a time.
constexpr int kScaleChunk = 256;

template <int Bits, int GroupSize, int Rows, ElemType S>
void matvec_rows(const MatvecCall& c, int64_t begin, int64_t end) {
  const int64_t groups = c.k / GroupSize;
  const int64_t row_bytes = c.k * Bits / 8;
  const int64_t half = c.k / 2;
  float scales[kScaleChunk], biases[kScaleChunk];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(c.codes) + n * row_bytes;
    vfloat acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = vfloat{};
    for (int64_t g0 = 0; g0 < groups; g0 += kScaleChunk) {
      const int chunk = int(groups - g0 < kScaleChunk ? groups - g0 : kScaleChunk);
      convert_contiguous<S>(scales, c.scales, n * groups + g0, chunk);
      convert_contiguous<S>(biases, c.biases, n * groups + g0, chunk);
      for (int j = 0; j < chunk; ++j) {
        const int64_t g = g0 + j;
        const vfloat scale = splat(scales[j]);
        const vfloat bias = splat(biases[j]);
        if constexpr (Bits == 8) {
#pragma unroll
          for (int i = 0; i < GroupSize; i += kLanes) {
            const int64_t col = g * GroupSize + i;
            const vfloat w = codes_of(codes + col) * scale + bias;
            for (int r = 0; r < Rows; ++r) acc[r] += w * load(c.x + r * c.k + col);
          }
        } else {
          // kLanes bytes: kLanes even and kLanes odd columns
#pragma unroll
          for (int i = 0; i < GroupSize / 2; i += kLanes) {
            const int64_t pair = g * (GroupSize / 2) + i;
            const vbytes b = *reinterpret_cast<const vbytes_unaligned*>(codes + pair);
            const vfloat even = __builtin_convertvector(b & uint8_t(15), vfloat) * scale + bias;
            const vfloat odd = __builtin_convertvector(b >> uint8_t(4), vfloat) * scale + bias;
            for (int r = 0; r < Rows; ++r) {
              const float* xr = c.x + r * c.k;
              acc[r] += even * load(xr + pair) + odd * load(xr + half + pair);
            }
          }
        }
      }
    }
    for (int r = 0; r < Rows; ++r) c.out[r * c.n + n] = lanes_sum(acc[r]);
  }
}

template <int Bits, int GroupSize, int Rows>
void matvec_scales(const MatvecCall& c, int64_t begin, int64_t end) {
  switch (c.scale_type) {
    case ElemType::float32: return matvec_rows<Bits, GroupSize, Rows, ElemType::float32>(c, begin, end);
    case ElemType::float16: return matvec_rows<Bits, GroupSize, Rows, ElemType::float16>(c, begin, end);
    case ElemType::bfloat16: return matvec_rows<Bits, GroupSize, Rows, ElemType::bfloat16>(c, begin, end);
  }
}

template <int Bits, int GroupSize>
void matvec_group(const MatvecCall& c, int64_t begin, int64_t end) {
  switch (c.rows) {
    case 1: return matvec_scales<Bits, GroupSize, 1>(c, begin, end);
    case 2: return matvec_scales<Bits, GroupSize, 2>(c, begin, end);
    case 3: return matvec_scales<Bits, GroupSize, 3>(c, begin, end);
    case 4: return matvec_scales<Bits, GroupSize, 4>(c, begin, end);
    case 5: return matvec_scales<Bits, GroupSize, 5>(c, begin, end);
    case 6: return matvec_scales<Bits, GroupSize, 6>(c, begin, end);
    case 7: return matvec_scales<Bits, GroupSize, 7>(c, begin, end);
    default: return matvec_scales<Bits, GroupSize, 8>(c, begin, end);
  }
}

template <int Bits>
void matvec_bits(const MatvecCall& c, int64_t begin, int64_t end) {
  switch (c.group_size) {
    case 32: return matvec_group<Bits, 32>(c, begin, end);
    case 64: return matvec_group<Bits, 64>(c, begin, end);
    default: return matvec_group<Bits, 128>(c, begin, end);
  }
}

}  // namespace

void quantized_matvec(const MatvecCall& call, int64_t begin, int64_t end) {
  if (call.bits == 8) {
    matvec_bits<8>(call, begin, end);
  } else {
    matvec_bits<4>(call, begin, end);
  }
}

void swiglu(const float* gate, const float* up, int64_t count, float* out) {
  const auto step = [](vfloat g, vfloat u) {
    // sigmoid(g) = 1 / (1 + 2^(-g log2 e)); past 2^126 it is 0 (exp2_below's clamp would give 2^-127)
    const vfloat power = -g * kLog2e;
    const vfloat sigmoid = power > 126.0f ? splat(0.0f) : 1.0f / (1.0f + exp2_below(power, 126.0f));
    return (g * sigmoid) * u;
  };
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) store(out + i, step(load(gate + i), load(up + i)));
  if (i < count) {  // the tail through one padded vector
    float g[kLanes] = {}, u[kLanes] = {}, o[kLanes];
    for (int64_t j = i; j < count; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    store(o, step(load(g), load(u)));
    for (int64_t j = i; j < count; ++j) out[j] = o[j - i];
  }
}

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
