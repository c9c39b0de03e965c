// Vector basics for one per-ISA copy of the CPU kernels: the float vector
// type of MLX_ATTN_VEC_BYTES bytes, loads/stores, saturation, a vectorized
// exp2 and tanh. GCC/Clang vector extensions (no STL; intrinsics only for
// exp2's rounding on AVX2 / AVX-512), everything in an anonymous namespace inside the copy's namespace
// MLX_ATTN_ISA, so nothing compiled for a wide instruction set can be linked
// into code that runs on an older CPU. Shared by the forward (kernel_impl.h)
// and any other kernel of the same copy.
#pragma once

#include <stdint.h>

#include "csrc/cpu/kernels.h"
#if (defined(__AVX512F__) && MLX_ATTN_VEC_BYTES == 64) || (defined(__AVX__) && MLX_ATTN_VEC_BYTES == 32)
#include <immintrin.h>  // exp2_vec's rounding (and scaling), vmax / vmin; always-inline, nothing leaks
#endif

#if !defined(MLX_ATTN_ISA) || !defined(MLX_ATTN_VEC_BYTES)
#error "define MLX_ATTN_ISA and MLX_ATTN_VEC_BYTES before including simd.h"
#endif

// A step of a kernel's loop body, split out only to name it: always
// inlined, so the split changes no generated loop.
#define MLX_ATTN_STEP inline __attribute__((always_inline))

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

constexpr int kLanes = MLX_ATTN_VEC_BYTES / 4;

typedef float vfloat __attribute__((vector_size(MLX_ATTN_VEC_BYTES)));
typedef float vfloat_unaligned
    __attribute__((vector_size(MLX_ATTN_VEC_BYTES), aligned(4)));
typedef int32_t vint __attribute__((vector_size(MLX_ATTN_VEC_BYTES)));

inline vfloat load(const float* p) {
  return *reinterpret_cast<const vfloat_unaligned*>(p);
}
inline void store(float* p, vfloat x) {
  *reinterpret_cast<vfloat_unaligned*>(p) = x;
}
// x - 0 is x for every x (0 + x is not, for x = -0), so this folds to a
// plain broadcast, with no add in the micro-kernel's inner loop.
inline vfloat splat(float x) {
  return x - vfloat{};
}
// b where either is NaN (or both are zeros), so vmax(bound, x) and
// vmin(bound, x) keep a NaN x. AVX2: the max / min instructions, whose
// definition this is (GCC writes a compare and a blend for the conditional).
inline vfloat vmax(vfloat a, vfloat b) {
#if defined(__AVX__) && MLX_ATTN_VEC_BYTES == 32
  return (vfloat)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}
inline vfloat vmin(vfloat a, vfloat b) {
#if defined(__AVX__) && MLX_ATTN_VEC_BYTES == 32
  return (vfloat)_mm256_min_ps((__m256)a, (__m256)b);
#else
  return a < b ? a : b;
#endif
}
// saturate_logit (metal/attention_rules.h) on a vector: clamps to
// [-kLogitLimit, kLogitLimit]; NaN stays NaN.
inline vfloat saturate(vfloat x) {
  return vmin(splat(kLogitLimit), vmax(splat(-kLogitLimit), x));
}

// 2^xc for xc in [-126, 0] (or NaN): round-to-nearest range reduction,
// then a degree-6 polynomial on [-0.5, 0.5] (rel. error ~2e-7).
inline vfloat exp2_reduced(vfloat xc) {
#if defined(__AVX512F__) && MLX_ATTN_VEC_BYTES == 64
  // One rounding and one scaling instruction (vrndscaleps, vscalefps) for
  // the floor and the exponent bits: the softmax's exp is a third of the
  // bf16 AMX path. Nearest differs from floor(x + 0.5) only at ties, where
  // f = +-0.5 are both in the polynomial's range.
  const vfloat whole = (vfloat)_mm512_roundscale_ps((__m512)xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX__) && MLX_ATTN_VEC_BYTES == 32
  // vroundps: one instruction for the five of the floor below (a fifth of
  // the AVX2 softmax's exp loop); nearest, as on AVX-512.
  const vfloat whole = (vfloat)_mm256_round_ps((__m256)xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  vfloat shifted = xc + 0.5f;
  vfloat whole = __builtin_convertvector(
      __builtin_convertvector(shifted, vint), vfloat);
  whole = whole > shifted ? whole - 1.0f : whole;  // floor
#endif
  vfloat f = xc - whole;
  vfloat p = splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
#if defined(__AVX512F__) && MLX_ATTN_VEC_BYTES == 64
  const vfloat r = (vfloat)_mm512_scalef_ps((__m512)p, (__m512)whole);
#else
  vint bits = (__builtin_convertvector(whole, vint) + 127) << 23;
  vfloat r = p * (vfloat)bits;
#endif
  return r;
}

// 2^x for x <= 0 (all softmax arguments here are <= 0); arguments below
// -126 (including -inf) give exactly 0.
inline vfloat exp2_vec(vfloat x) {
  const vfloat lo = splat(-126.0f);
  const vfloat xc = vmin(splat(0.0f), vmax(lo, x));
  return x < lo ? splat(0.0f) : exp2_reduced(xc);
}

// 2^x for x <= ceiling (ceiling >= 0, at most 127): exp2_vec with a higher
// clamp, for the online softmax whose reference max may trail the row's max
// (kernel_impl.h kRescaleSlack); arguments below -126 give exactly 0.
inline vfloat exp2_below(vfloat x, float ceiling) {
  const vfloat lo = splat(-126.0f);
  const vfloat xc = vmin(splat(ceiling), vmax(lo, x));
  return x < lo ? splat(0.0f) : exp2_reduced(xc);
}

// tanh on a vector, for softcap_logit (metal/attention_rules.h through
// csrc/cpu/rules.h); any x: +-inf give +-1, NaN stays NaN. Where |x| < 0.5
// the odd Taylor series to x^15 (truncation < 1e-8 relative; no
// cancellation near 0), else (1 - e) / (1 + e) with e = exp(-2|x|) <= 1/e
// from exp2_vec (relative error ~3e-7).
inline vfloat tanh_vec(vfloat x) {
  const vfloat magnitude = x < 0.0f ? -x : x;
  const vfloat e = exp2_vec(magnitude * (-2.0f * kLog2e));
  vfloat far = (1.0f - e) / (1.0f + e);
  far = x < 0.0f ? -far : far;
  const vfloat x2 = x * x;
  vfloat series = splat(-929569.0f / 638512875.0f);
  series = series * x2 + 21844.0f / 6081075.0f;
  series = series * x2 - 1382.0f / 155925.0f;
  series = series * x2 + 62.0f / 2835.0f;
  series = series * x2 - 17.0f / 315.0f;
  series = series * x2 + 2.0f / 15.0f;
  series = series * x2 - 1.0f / 3.0f;
  const vfloat near = x + x * x2 * series;
  return magnitude < 0.5f ? near : far;
}

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
