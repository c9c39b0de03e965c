// The math part of <metal_stdlib>: scalar and element-wise vector forms.
//
// half and bfloat arguments are computed in float and rounded back, like the
// GPU's transcendental units; precise:: and fast:: name the same functions
// (the library is compiled with or without -ffast-math instead).
//
// Deliberate deviation: max/min propagate NaN (Metal's follow fmax/fmin and
// drop it) so that reading poisoned threadgroup memory stays visible; fmax and
// fmin keep the IEEE behaviour.
#pragma once

#include "msl_types.h"

namespace metal {
namespace detail {

template <typename T>
using element_t = typename vector_traits<T>::element;

template <typename E>
inline constexpr bool is_float_element_v = std::is_floating_point_v<E> || std::is_same_v<E, half> || std::is_same_v<E, bfloat>;

template <typename T>
concept FloatLike = is_float_element_v<element_t<T>>;
template <typename T>
concept Numeric = is_msl_scalar_v<element_t<T>> && !std::is_same_v<element_t<T>, bool>;
template <typename T>
concept Integral = std::is_integral_v<element_t<T>> && !std::is_same_v<element_t<T>, bool>;

// Element-wise application over a scalar or a vector.
template <typename T, typename F>
inline T map(const T& x, F f) {
  if constexpr (is_msl_vector_v<T>) {
    T out;
    for (int i = 0; i < vector_traits<T>::size; ++i) out[i] = f(x[i]);
    return out;
  } else {
    return f(x);
  }
}
template <typename T, typename F>
inline T map(const T& a, const T& b, F f) {
  if constexpr (is_msl_vector_v<T>) {
    T out;
    for (int i = 0; i < vector_traits<T>::size; ++i) out[i] = f(a[i], b[i]);
    return out;
  } else {
    return f(a, b);
  }
}
template <typename T, typename F>
inline T map(const T& a, const T& b, const T& c, F f) {
  if constexpr (is_msl_vector_v<T>) {
    T out;
    for (int i = 0; i < vector_traits<T>::size; ++i) out[i] = f(a[i], b[i], c[i]);
    return out;
  } else {
    return f(a, b, c);
  }
}
// A scalar argument next to a vector one is splatted (clamp(v, 0.0f, 1.0f)).
template <typename V, typename S>
inline V splat(const S& s) {
  if constexpr (is_msl_vector_v<V> && !is_msl_vector_v<S>) {
    V out;
    for (int i = 0; i < vector_traits<V>::size; ++i) out[i] = static_cast<element_t<V>>(s);
    return out;
  } else {
    return s;
  }
}
// `S` is `V` or its element type (in `template <SplatsTo<V> S>` S comes first).
template <typename S, typename V>
concept SplatsTo = std::is_same_v<S, V> || std::is_same_v<S, element_t<V>>;

inline float to_float(float x) {
  return x;
}
template <typename E>
inline auto to_float(E x) {
  if constexpr (std::is_same_v<E, double>) return x;
  else return static_cast<float>(x);
}

}  // namespace detail

#define MSL_FLOAT_UNARY(name, expr)                                                   \
  template <detail::FloatLike T>                                                    \
  inline T name(T x) {                                                              \
    using E = detail::element_t<T>;                                                 \
    return detail::map(x, [](E e) { auto v = detail::to_float(e); return static_cast<E>(expr); }); \
  }
MSL_FLOAT_UNARY(exp, (MSL_COUNT(exp_calls, 1), std::exp(v)))
MSL_FLOAT_UNARY(exp2, (MSL_COUNT(exp_calls, 1), std::exp2(v)))
MSL_FLOAT_UNARY(exp10, std::pow(decltype(v)(10), v))
MSL_FLOAT_UNARY(log, std::log(v))
MSL_FLOAT_UNARY(log2, std::log2(v))
MSL_FLOAT_UNARY(log10, std::log10(v))
MSL_FLOAT_UNARY(sqrt, std::sqrt(v))
MSL_FLOAT_UNARY(rsqrt, decltype(v)(1) / std::sqrt(v))
MSL_FLOAT_UNARY(sin, std::sin(v))
MSL_FLOAT_UNARY(cos, std::cos(v))
MSL_FLOAT_UNARY(tan, std::tan(v))
MSL_FLOAT_UNARY(asin, std::asin(v))
MSL_FLOAT_UNARY(acos, std::acos(v))
MSL_FLOAT_UNARY(atan, std::atan(v))
MSL_FLOAT_UNARY(sinh, std::sinh(v))
MSL_FLOAT_UNARY(cosh, std::cosh(v))
MSL_FLOAT_UNARY(tanh, std::tanh(v))
MSL_FLOAT_UNARY(erf, std::erf(v))
MSL_FLOAT_UNARY(floor, std::floor(v))
MSL_FLOAT_UNARY(ceil, std::ceil(v))
MSL_FLOAT_UNARY(round, std::round(v))
MSL_FLOAT_UNARY(rint, std::rint(v))
MSL_FLOAT_UNARY(trunc, std::trunc(v))
MSL_FLOAT_UNARY(fract, std::fmin(v - std::floor(v), decltype(v)(0x1.fffffep-1f)))
MSL_FLOAT_UNARY(fabs, std::fabs(v))
MSL_FLOAT_UNARY(saturate, std::fmin(std::fmax(v, decltype(v)(0)), decltype(v)(1)))
MSL_FLOAT_UNARY(sign, v > 0 ? decltype(v)(1) : v < 0 ? decltype(v)(-1) : v)
#undef MSL_FLOAT_UNARY

#define MSL_FLOAT_BINARY(name, expr)                                                  \
  template <detail::FloatLike T>                                                    \
  inline T name(T a, T b) {                                                         \
    using E = detail::element_t<T>;                                                 \
    return detail::map(a, b, [](E x, E y) {                                         \
      auto u = detail::to_float(x);                                                 \
      auto w = detail::to_float(y);                                                 \
      return static_cast<E>(expr);                                                  \
    });                                                                             \
  }
MSL_FLOAT_BINARY(pow, std::pow(u, w))
MSL_FLOAT_BINARY(powr, std::pow(u, w))
MSL_FLOAT_BINARY(fmin, std::fmin(u, w))
MSL_FLOAT_BINARY(fmax, std::fmax(u, w))
MSL_FLOAT_BINARY(fmod, std::fmod(u, w))
MSL_FLOAT_BINARY(atan2, std::atan2(u, w))
MSL_FLOAT_BINARY(copysign, std::copysign(u, w))
MSL_FLOAT_BINARY(step, w < u ? decltype(u)(0) : decltype(u)(1))  // step(edge, x)
MSL_FLOAT_BINARY(divide, u / w)
#undef MSL_FLOAT_BINARY

template <detail::Numeric T>
inline T abs(T x) {
  using E = detail::element_t<T>;
  if constexpr (detail::is_float_element_v<E>)
    return detail::map(x, [](E e) { return static_cast<E>(std::fabs(detail::to_float(e))); });
  else
    return detail::map(x, [](E e) { return e < 0 ? E(-e) : e; });
}

template <detail::Numeric T>
inline T max(T a, T b) {
  using E = detail::element_t<T>;
  return detail::map(a, b, [](E x, E y) {
    if constexpr (detail::is_float_element_v<E>)
      if (x != x || y != y) return E(x + y);  // NaN in, NaN out (see the top of this file)
    return x > y ? x : y;
  });
}
template <detail::Numeric T>
inline T min(T a, T b) {
  using E = detail::element_t<T>;
  return detail::map(a, b, [](E x, E y) {
    if constexpr (detail::is_float_element_v<E>)
      if (x != x || y != y) return E(x + y);
    return x < y ? x : y;
  });
}
template <detail::Numeric T, detail::SplatsTo<T> S>
  requires is_msl_vector_v<T> && (!std::is_same_v<S, T>)
inline T max(T a, S b) {
  return max(a, detail::splat<T>(b));
}
template <detail::Numeric T, detail::SplatsTo<T> S>
  requires is_msl_vector_v<T> && (!std::is_same_v<S, T>)
inline T min(T a, S b) {
  return min(a, detail::splat<T>(b));
}
template <detail::Numeric T>
inline T max3(T a, T b, T c) {
  return max(max(a, b), c);
}
template <detail::Numeric T>
inline T min3(T a, T b, T c) {
  return min(min(a, b), c);
}
template <detail::Numeric T, detail::SplatsTo<T> S>
inline T clamp(T x, S lo, S hi) {
  return min(max(x, detail::splat<T>(lo)), detail::splat<T>(hi));
}
template <detail::FloatLike T>
inline T fma(T a, T b, T c) {
  using E = detail::element_t<T>;
  return detail::map(a, b, c, [](E x, E y, E z) {
    return static_cast<E>(std::fma(detail::to_float(x), detail::to_float(y), detail::to_float(z)));
  });
}
template <detail::FloatLike T, detail::SplatsTo<T> S>
inline T mix(T x, T y, S a) {
  T t = detail::splat<T>(a);
  return x + (y - x) * t;
}
template <detail::FloatLike T>
inline detail::element_t<T> dot(T a, T b) {
  static_assert(is_msl_vector_v<T>, "dot takes vectors");
  detail::element_t<T> acc = 0;
  for (int i = 0; i < vector_traits<T>::size; ++i) acc += a[i] * b[i];
  return acc;
}

// select(a, b, c): c ? b : a, element-wise for vectors.
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T, typename C>
  requires(is_msl_vector_v<T> && is_msl_vector_v<C> && vector_traits<T>::size == vector_traits<C>::size)
inline T select(T a, T b, C c) {
  T out;
  for (int i = 0; i < vector_traits<T>::size; ++i) out[i] = c[i] ? b[i] : a[i];
  return out;
}

// Classification; for vectors these return a bool vector.
#define MSL_CLASSIFY(name, expr)                                                     \
  template <detail::FloatLike T>                                                   \
  inline auto name(T x) {                                                          \
    if constexpr (is_msl_vector_v<T>) {                                            \
      vec<bool, vector_traits<T>::size> out;                                       \
      for (int i = 0; i < vector_traits<T>::size; ++i) {                           \
        auto v = detail::to_float(x[i]);                                           \
        out[i] = (expr);                                                           \
      }                                                                            \
      return out;                                                                  \
    } else {                                                                       \
      auto v = detail::to_float(x);                                                \
      return bool(expr);                                                           \
    }                                                                              \
  }
MSL_CLASSIFY(isnan, std::isnan(v))
MSL_CLASSIFY(isinf, std::isinf(v))
MSL_CLASSIFY(isfinite, std::isfinite(v))
MSL_CLASSIFY(signbit, std::signbit(v))
#undef MSL_CLASSIFY

template <typename V>
  requires std::is_same_v<detail::element_t<V>, bool>
inline bool all(V v) {
  if constexpr (is_msl_vector_v<V>) {
    for (int i = 0; i < vector_traits<V>::size; ++i)
      if (!v[i]) return false;
    return true;
  } else {
    return v;
  }
}
template <typename V>
  requires std::is_same_v<detail::element_t<V>, bool>
inline bool any(V v) {
  if constexpr (is_msl_vector_v<V>) {
    for (int i = 0; i < vector_traits<V>::size; ++i)
      if (v[i]) return true;
    return false;
  } else {
    return v;
  }
}

template <detail::Integral T>
inline T popcount(T x) {
  using E = detail::element_t<T>;
  return detail::map(x, [](E e) { return E(__builtin_popcountll(static_cast<std::make_unsigned_t<E>>(e))); });
}
template <detail::Integral T>
inline T clz(T x) {
  using E = detail::element_t<T>;
  constexpr int bits = 8 * sizeof(E);
  return detail::map(x, [](E e) {
    auto u = static_cast<unsigned long long>(static_cast<std::make_unsigned_t<E>>(e));
    return E(u == 0 ? bits : __builtin_clzll(u) - (64 - bits));
  });
}
template <detail::Integral T>
inline T ctz(T x) {
  using E = detail::element_t<T>;
  constexpr int bits = 8 * sizeof(E);
  return detail::map(x, [](E e) {
    auto u = static_cast<unsigned long long>(static_cast<std::make_unsigned_t<E>>(e));
    return E(u == 0 ? bits : __builtin_ctzll(u));
  });
}

// metal::fast:: and metal::precise:: name the same functions here (the
// emulator computes in float either way; -ffast-math models Metal's default).
// Using-declarations, not a using-directive: a library that adds its own
// overloads to metal::fast (MLX adds bfloat ones) would otherwise hide these
// from qualified lookup, and fast::exp2(float) would round through bfloat.
#define MSL_MATH_FUNCTIONS                                                                                  \
  using ::metal::exp; using ::metal::exp2; using ::metal::exp10; using ::metal::log; using ::metal::log2;   \
  using ::metal::log10; using ::metal::sqrt; using ::metal::rsqrt; using ::metal::sin; using ::metal::cos;  \
  using ::metal::tan; using ::metal::asin; using ::metal::acos; using ::metal::atan; using ::metal::sinh;   \
  using ::metal::cosh; using ::metal::tanh; using ::metal::erf; using ::metal::floor; using ::metal::ceil;  \
  using ::metal::round; using ::metal::rint; using ::metal::trunc; using ::metal::fract;                    \
  using ::metal::fabs; using ::metal::saturate; using ::metal::sign; using ::metal::pow;                    \
  using ::metal::powr; using ::metal::fmin; using ::metal::fmax; using ::metal::fmod; using ::metal::atan2; \
  using ::metal::copysign; using ::metal::step; using ::metal::divide; using ::metal::abs;                  \
  using ::metal::max; using ::metal::min; using ::metal::max3; using ::metal::min3; using ::metal::clamp;   \
  using ::metal::fma; using ::metal::mix; using ::metal::dot;
namespace fast {
MSL_MATH_FUNCTIONS
}  // namespace fast
namespace precise {
MSL_MATH_FUNCTIONS
}  // namespace precise
#undef MSL_MATH_FUNCTIONS

}  // namespace metal
