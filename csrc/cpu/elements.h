// Element conversion and row loading for one per-ISA copy of the CPU kernels:
// float16/bfloat16 <-> float32 (F16C on x86, the baseline half conversion on
// arm64) and strided row loads into packed float32 buffers. Shared by the
// forward (kernel_impl.h) and the backward (backward_impl.h) of the same copy;
// like simd.h, everything sits in an anonymous namespace inside MLX_ATTN_ISA.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "csrc/cpu/kernels.h"
#include "csrc/cpu/simd.h"

#if defined(__F16C__)
#include <immintrin.h>  // intrinsics are always-inline: nothing leaks
#elif defined(__aarch64__)
#include <arm_neon.h>  // likewise
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return bits;
}
inline float float_of(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: renormalize
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  return float_of(bits);
}

inline uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000) {  // inf or nan
    return uint16_t(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  }
  if (abs >= 0x477ff000) return uint16_t(sign | 0x7c00);  // rounds to inf
  if (abs < 0x38800000) {  // subnormal or zero half: round to nearest even
    // 2^-24 is the half subnormal step: in [0.5, 1) the float ulp is 2^-24,
    // so adding 0.5 rounds to it with the FPU's round-to-nearest-even.
    uint32_t rounded = bits_of(float_of(abs) + 0.5f);
    return uint16_t(sign | (rounded - 0x3f000000u));
  }
  uint32_t mantissa_odd = (abs >> 13) & 1;
  abs += 0xc8000fffu + mantissa_odd;  // rebias exponent and round to even
  return uint16_t(sign | (abs >> 13));
}

inline float bfloat_to_float(uint16_t h) {
  return float_of(uint32_t(h) << 16);
}

inline uint16_t float_to_bfloat(float f) {
  uint32_t x = bits_of(f);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

template <ElemType T>
inline float load_elem(const void* base, int64_t i) {
  if constexpr (T == ElemType::float32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == ElemType::float16) {
    return half_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return bfloat_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <ElemType T>
inline void store_elem(void* base, int64_t i, float x) {
  if constexpr (T == ElemType::float32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (T == ElemType::float16) {
    static_cast<uint16_t*>(base)[i] = float_to_half(x);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_bfloat(x);
  }
}

// dst[i] = src[offset + i], i < n: the packing hot path, vectorized.
template <ElemType T>
inline void convert_contiguous(float* dst, const void* src, int64_t offset, int n) {
  if constexpr (T == ElemType::float32) {
    memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * n);
  } else if constexpr (T == ElemType::bfloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    // Through memcpy (bfloat_to_float): storing uint32_t into floats would
    // break strict aliasing (GCC then drops the stores into a local row).
    for (int i = 0; i < n; ++i) dst[i] = bfloat_to_float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#elif defined(__aarch64__)
    // Baseline arm64 converts half vectors natively (fcvtl); through the
    // intrinsic, as GCC before 13 has no _Float16 in C++.
    for (; i + 4 <= n; i += 4) {
      vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = half_to_float(s[i]);
  }
}

// dst[offset + i] = src[i] * factor in T, i < n: an output row. Float16
// rows convert 8 at a time on F16C (round to nearest even, as
// float_to_half; NaN payloads aside), not element by element.
template <ElemType T>
inline void store_row(void* dst, int64_t offset, const float* src, float factor, int n) {
  int i = 0;
#if defined(__F16C__)
  if constexpr (T == ElemType::float16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    const __m256 f = _mm256_set1_ps(factor);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + i), f);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#endif
  for (; i < n; ++i) store_elem<T>(dst, offset + i, src[i] * factor);
}

// dst[i * dst_stride] = factor * src[offset + i * stride], i < n <= kMaxHeadDim.
template <ElemType T>
inline void load_row(
    float* dst,
    int64_t dst_stride,
    const void* src,
    int64_t offset,
    int64_t stride,
    int n,
    float factor) {
  if (stride == 1) {
    if (dst_stride == 1) {
      convert_contiguous<T>(dst, src, offset, n);
      if (factor != 1.0f) {
        for (int i = 0; i < n; ++i) dst[i] *= factor;
      }
      return;
    }
    float row[kMaxHeadDim];
    convert_contiguous<T>(row, src, offset, n);
    for (int i = 0; i < n; ++i) dst[i * dst_stride] = row[i] * factor;
    return;
  }
  for (int i = 0; i < n; ++i) {
    dst[i * dst_stride] = load_elem<T>(src, offset + i * stride) * factor;
  }
}

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
