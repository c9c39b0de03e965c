// The Metal compiler's own builtins (`__metal_fabs(x, fast)`, `__metal_simd_sum(x)`,
// ...) that library headers such as MLX's bf16_math.h call directly; each
// forwards to the emulator's <metal_stdlib> function or computes in float.
#pragma once

#include "msl_simd.h"

// The math-mode argument of the builtins: the emulator's build flags decide.
#define __METAL_MAYBE_FAST_MATH__ 0
#define __METAL_FAST_MATH__ 1
#define __METAL_PRECISE_MATH__ 2

#define MSL_BUILTIN_UNARY(name, expr)                     \
  template <typename T, typename Mode>                    \
  inline T __metal_##name(T x, Mode) {                    \
    return metal::detail::map(x, [](auto e) {             \
      using E = decltype(e);                              \
      float v = float(e);                                 \
      return static_cast<E>(expr);                        \
    });                                                   \
  }
MSL_BUILTIN_UNARY(fabs, std::fabs(v))
MSL_BUILTIN_UNARY(acos, std::acos(v))
MSL_BUILTIN_UNARY(acosh, std::acosh(v))
MSL_BUILTIN_UNARY(asin, std::asin(v))
MSL_BUILTIN_UNARY(asinh, std::asinh(v))
MSL_BUILTIN_UNARY(atan, std::atan(v))
MSL_BUILTIN_UNARY(atanh, std::atanh(v))
MSL_BUILTIN_UNARY(ceil, std::ceil(v))
MSL_BUILTIN_UNARY(cos, std::cos(v))
MSL_BUILTIN_UNARY(cosh, std::cosh(v))
MSL_BUILTIN_UNARY(cospi, std::cos(float(M_PI) * v))
MSL_BUILTIN_UNARY(exp, float(metal::exp(v)))
MSL_BUILTIN_UNARY(exp10, std::pow(10.0f, v))
MSL_BUILTIN_UNARY(exp2, float(metal::exp2(v)))
MSL_BUILTIN_UNARY(floor, std::floor(v))
MSL_BUILTIN_UNARY(fract, std::fmin(v - std::floor(v), 0x1.fffffep-1f))
MSL_BUILTIN_UNARY(log, std::log(v))
MSL_BUILTIN_UNARY(log10, std::log10(v))
MSL_BUILTIN_UNARY(log2, std::log2(v))
MSL_BUILTIN_UNARY(rint, std::rint(v))
MSL_BUILTIN_UNARY(round, std::round(v))
MSL_BUILTIN_UNARY(rsqrt, 1.0f / std::sqrt(v))
MSL_BUILTIN_UNARY(sin, std::sin(v))
MSL_BUILTIN_UNARY(sinh, std::sinh(v))
MSL_BUILTIN_UNARY(sinpi, std::sin(float(M_PI) * v))
MSL_BUILTIN_UNARY(sqrt, std::sqrt(v))
MSL_BUILTIN_UNARY(tan, std::tan(v))
MSL_BUILTIN_UNARY(tanh, std::tanh(v))
MSL_BUILTIN_UNARY(tanpi, std::tan(float(M_PI) * v))
MSL_BUILTIN_UNARY(trunc, std::trunc(v))
#undef MSL_BUILTIN_UNARY

#define MSL_BUILTIN_BINARY(name, expr)                              \
  template <typename T, typename Mode>                              \
  inline T __metal_##name(T a, T b, Mode) {                         \
    return metal::detail::map(a, b, [](auto x, auto y) {            \
      using E = decltype(x);                                        \
      float u = float(x), w = float(y);                             \
      return static_cast<E>(expr);                                  \
    });                                                             \
  }
MSL_BUILTIN_BINARY(atan2, std::atan2(u, w))
MSL_BUILTIN_BINARY(divide, u / w)
MSL_BUILTIN_BINARY(fmax, std::fmax(u, w))
MSL_BUILTIN_BINARY(fmin, std::fmin(u, w))
MSL_BUILTIN_BINARY(fmod, std::fmod(u, w))
MSL_BUILTIN_BINARY(pow, std::pow(u, w))
MSL_BUILTIN_BINARY(powr, std::pow(u, w))
#undef MSL_BUILTIN_BINARY

template <typename T>
inline T __metal_fma(T a, T b, T c) {
  return metal::fma(a, b, c);
}
template <typename T>
inline T __metal_nextafter(T a, T b) {
  return T(std::nextafter(float(a), float(b)));
}
template <typename T, typename Mode>
inline T __metal_fmax3(T a, T b, T c, Mode m) {
  return __metal_fmax(__metal_fmax(a, b, m), c, m);
}
template <typename T, typename Mode>
inline T __metal_fmin3(T a, T b, T c, Mode m) {
  return __metal_fmin(__metal_fmin(a, b, m), c, m);
}
template <typename T, typename Mode>
inline T __metal_fmedian3(T a, T b, T c, Mode m) {
  return __metal_fmax(__metal_fmin(a, b, m), __metal_fmin(__metal_fmax(a, b, m), c, m), m);
}
template <typename T, typename E>
inline T __metal_frexp(T x, E* exponent) {
  int e = 0;
  T out = T(std::frexp(float(x), &e));
  *exponent = e;
  return out;
}
template <typename T, typename E, typename Mode>
inline T __metal_ldexp(T x, E exponent, Mode) {
  return T(std::ldexp(float(x), int(exponent)));
}

inline ushort __metal_get_simdgroup_size(ushort) {
  return ushort(msl_rt::kSimdWidth);
}
inline ushort __metal_get_thread_index_in_simdgroup(ushort) {
  return ushort(msl_rt::simd_lane());
}

// The simd builtins are collectives like the <metal_simdgroup> functions they are.
#define MSL_BUILTIN_SIMD(name)                                   \
  template <typename T>                                         \
  inline T __metal_##name(T x, MSL_SITE(#name)) {               \
    return metal::name(x, msl_site);                            \
  }
MSL_BUILTIN_SIMD(simd_sum)
MSL_BUILTIN_SIMD(simd_product)
MSL_BUILTIN_SIMD(simd_max)
MSL_BUILTIN_SIMD(simd_min)
MSL_BUILTIN_SIMD(simd_prefix_inclusive_sum)
MSL_BUILTIN_SIMD(simd_prefix_exclusive_sum)
MSL_BUILTIN_SIMD(simd_prefix_inclusive_product)
MSL_BUILTIN_SIMD(simd_prefix_exclusive_product)
#undef MSL_BUILTIN_SIMD

// Bitwise, also for the float types MLX's bfloat overload passes.
template <typename T>
inline T __metal_simd_xor(T x, MSL_SITE("simd_xor")) {
  if constexpr (std::is_integral_v<T>) {
    return metal::simd_xor(x, msl_site);
  } else {
    using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
    return __builtin_bit_cast(T, metal::simd_xor(__builtin_bit_cast(Bits, x), msl_site));
  }
}

#define MSL_BUILTIN_SIMD_LANE(name)                                       \
  template <typename T>                                                  \
  inline T __metal_##name(T x, ushort lane_or_delta, MSL_SITE(#name)) {  \
    return metal::name(x, lane_or_delta, msl_site);                      \
  }
MSL_BUILTIN_SIMD_LANE(simd_broadcast)
MSL_BUILTIN_SIMD_LANE(simd_shuffle)
MSL_BUILTIN_SIMD_LANE(simd_shuffle_xor)
MSL_BUILTIN_SIMD_LANE(simd_shuffle_down)
MSL_BUILTIN_SIMD_LANE(simd_shuffle_up)
MSL_BUILTIN_SIMD_LANE(simd_shuffle_rotate_down)
MSL_BUILTIN_SIMD_LANE(simd_shuffle_rotate_up)
#undef MSL_BUILTIN_SIMD_LANE

namespace metal::detail {
// simd_shuffle_and_fill_{down,up}: shifts within segments of `modulo` lanes;
// lanes shifted past a segment's edge read `filling` instead.
template <typename T>
inline T shuffle_and_fill(T data, T filling, int delta, int modulo, const msl_rt::Site& site) {
  struct Pair {
    T data, filling;
  };
  const Pair* lanes = msl_rt::simd_exchange(Pair{data, filling}, site);
  int lane = msl_rt::simd_lane(), base = lane - lane % modulo, source = lane % modulo + delta;
  if (source >= modulo) return lanes[base + source - modulo].filling;
  if (source < 0) return lanes[base + source + modulo].filling;
  return lanes[base + source].data;
}
}  // namespace metal::detail

template <typename T>
inline T __metal_simd_shuffle_and_fill_down(T data, T filling, ushort delta, ushort modulo,
                                            MSL_SITE("simd_shuffle_and_fill_down")) {
  return metal::detail::shuffle_and_fill(data, filling, int(delta), int(modulo), msl_site);
}
template <typename T>
inline T __metal_simd_shuffle_and_fill_up(T data, T filling, ushort delta, ushort modulo,
                                          MSL_SITE("simd_shuffle_and_fill_up")) {
  return metal::detail::shuffle_and_fill(data, filling, -int(delta), int(modulo), msl_site);
}

namespace metal {
template <typename T>
inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta, ushort modulo,
                                    MSL_SITE("simd_shuffle_and_fill_down")) {
  return detail::shuffle_and_fill(data, filling, int(delta), int(modulo), msl_site);
}
template <typename T>
inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta, MSL_SITE("simd_shuffle_and_fill_down")) {
  return detail::shuffle_and_fill(data, filling, int(delta), msl_rt::kSimdWidth, msl_site);
}
template <typename T>
inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta, ushort modulo,
                                  MSL_SITE("simd_shuffle_and_fill_up")) {
  return detail::shuffle_and_fill(data, filling, -int(delta), int(modulo), msl_site);
}
template <typename T>
inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta, MSL_SITE("simd_shuffle_and_fill_up")) {
  return detail::shuffle_and_fill(data, filling, -int(delta), msl_rt::kSimdWidth, msl_site);
}
}  // namespace metal
