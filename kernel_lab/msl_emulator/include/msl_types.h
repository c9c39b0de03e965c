// Metal's address spaces, scalar and vector types as clang C++.
//
// The address spaces are real clang address spaces, so passing a
// `threadgroup` pointer where a `device` one is expected, or writing through
// a `constant` pointer, is a compile error as in Metal.
#pragma once

#include "msl_runtime.h"

// libgcc 12 has no float -> bfloat16 conversion routine and clang may call
// it; round to nearest even, quiet NaNs.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t bits = (x & 0x7fffffff) > 0x7f800000 ? uint16_t((x >> 16) | 0x40)
                                                 : uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
  __bf16 out;
  std::memcpy(&out, &bits, 2);
  return out;
}

#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))  // read-only, as in Metal
#define threadgroup __attribute__((address_space(3)))
#define thread

typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

#define MSL_VECTORS(T)                                \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_VECTORS(float)
MSL_VECTORS(half)
MSL_VECTORS(bfloat)
MSL_VECTORS(int)
MSL_VECTORS(uint)
MSL_VECTORS(short)
MSL_VECTORS(ushort)
MSL_VECTORS(char)
MSL_VECTORS(uchar)
MSL_VECTORS(long)
MSL_VECTORS(ulong)
MSL_VECTORS(bool)
#undef MSL_VECTORS

// <metal_stdlib>'s inlining macro (MLX's kernels use it for every helper).
#define METAL_FUNC inline __attribute__((always_inline))

// <metal_math>'s float constants.
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38f
#endif
#ifndef HUGE_VALH
#define HUGE_VALH ((half)INFINITY)
#endif

namespace metal {

template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));

// Scalar and vector traits used by the library below.
template <typename T>
inline constexpr bool is_msl_scalar_v = std::is_arithmetic_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <typename V>
struct vector_traits {
  static constexpr int size = 1;
  using element = V;
};
template <typename V>
  requires requires { __builtin_vectorelements(V); }
struct vector_traits<V> {
  static constexpr int size = __builtin_vectorelements(V);
  using element = std::remove_cvref_t<decltype(std::declval<V>()[0])>;
};
template <typename V>
inline constexpr bool is_msl_vector_v = vector_traits<V>::size > 1;

// numeric_limits, also for half and bfloat (libstdc++ 12 knows neither).
template <typename T>
struct numeric_limits : std::numeric_limits<T> {};

template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half denorm_min() { return half(5.960464477539063e-08f); }
};

template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat from_bits(uint16_t bits) { return __builtin_bit_cast(bfloat, bits); }
  static constexpr bfloat min() { return from_bits(0x0080); }
  static constexpr bfloat max() { return from_bits(0x7f7f); }
  static constexpr bfloat lowest() { return from_bits(0xff7f); }
  static constexpr bfloat epsilon() { return from_bits(0x3c00); }
  static constexpr bfloat infinity() { return from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return from_bits(0x7fc0); }
  static constexpr bfloat denorm_min() { return from_bits(0x0001); }
};

// <metal_type_traits>: the standard traits, under metal::.
using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay_t;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_arithmetic_v;
using std::is_convertible;
using std::is_convertible_v;
using std::is_floating_point_v;
using std::is_integral;
using std::is_integral_v;
using std::is_pointer_v;
using std::is_same;
using std::is_same_v;
using std::is_signed_v;
using std::is_unsigned_v;
using std::make_signed_t;
using std::make_unsigned_t;
using std::remove_const_t;
using std::remove_cv_t;
using std::remove_pointer_t;
using std::remove_reference_t;
using std::true_type;

template <typename T>
struct remove_addrspace {
  using type = T;
};
template <typename T>
struct remove_addrspace<__attribute__((address_space(1))) T> {
  using type = T;
};
template <typename T>
struct remove_addrspace<__attribute__((address_space(2))) T> {
  using type = T;
};
template <typename T>
struct remove_addrspace<__attribute__((address_space(3))) T> {
  using type = T;
};
template <typename T>
using remove_addrspace_t = typename remove_addrspace<T>::type;

// Reinterprets the bits of `x` (sizes must match, as in Metal).
template <typename To, typename From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of equal size");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

}  // namespace metal

// Metal's vector constructors, float4(a, b, c, d) / float4(x) / float4(v2, z, w)
// / float4(half4): the translator turns them into msl_make<float4>(...).
template <typename V, typename A>
inline void msl_fill(V& out, int& at, const A& arg) {
  using E = typename metal::vector_traits<V>::element;
  if constexpr (metal::is_msl_vector_v<A>) {
    for (int i = 0; i < metal::vector_traits<A>::size; ++i) out[at++] = static_cast<E>(arg[i]);
  } else {
    out[at++] = static_cast<E>(arg);
  }
}
template <typename V, typename... A>
inline V msl_make(const A&... args) {
  constexpr int size = metal::vector_traits<V>::size;
  constexpr int given = (0 + ... + metal::vector_traits<A>::size);
  V out{};
  int at = 0;
  if constexpr (sizeof...(A) == 0) {
    return out;  // float4() is zero
  } else if constexpr (sizeof...(A) == 1 && given == 1) {
    (msl_fill(out, at, args), ...);
    for (int i = 1; i < size; ++i) out[i] = out[0];  // splat
  } else {
    static_assert(given == size, "vector constructor: the arguments do not have as many components as the vector");
    (msl_fill(out, at, args), ...);
  }
  return out;
}
