// Metal Shading Language as clang C++: enough of the language and of
// <metal_stdlib> to type-check and run compute kernels on the CPU.
//
// The address spaces are real clang address spaces, so passing a
// `threadgroup` pointer where a `device` one is expected, or writing through
// a `constant` pointer, is a compile error as in Metal.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "msl_runtime.h"

#define __METAL_VERSION__ 310

// libgcc 12 has no float -> bfloat16 conversion routine; clang may call it.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t h = (x & 0x7fffffff) > 0x7f800000 ? uint16_t((x >> 16) | 0x40)
                                              : uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
  __bf16 out;
  std::memcpy(&out, &h, 2);
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

#define MSL_VECTORS(T)                                   \
  typedef T T##2 __attribute__((ext_vector_type(2)));    \
  typedef T T##3 __attribute__((ext_vector_type(3)));    \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_VECTORS(float)
MSL_VECTORS(half)
MSL_VECTORS(int)
MSL_VECTORS(uint)
MSL_VECTORS(short)
MSL_VECTORS(ushort)
MSL_VECTORS(ulong)
#undef MSL_VECTORS

// Metal's vector constructors, float4(a, b, c, d) / float4(x) / float4(v2, z, w):
// the translator turns them into msl_make<float4>(...).
template <typename V>
struct msl_vector_traits {
  static constexpr int size = 1;
};
template <typename V>
  requires requires { __builtin_vectorelements(V); }
struct msl_vector_traits<V> {
  static constexpr int size = __builtin_vectorelements(V);
};
template <typename V, typename A>
inline void msl_fill(V& out, int& at, const A& arg) {
  if constexpr (msl_vector_traits<A>::size > 1) {
    for (int i = 0; i < msl_vector_traits<A>::size; ++i) out[at++] = arg[i];
  } else {
    out[at++] = static_cast<std::remove_reference_t<decltype(out[0])>>(arg);
  }
}
template <typename V, typename... A>
inline V msl_make(const A&... args) {
  V out;
  int at = 0;
  if constexpr (sizeof...(A) == 1 && ((msl_vector_traits<A>::size == 1) && ...)) {
    (msl_fill(out, at, args), ...);
    for (int i = 1; i < msl_vector_traits<V>::size; ++i) out[i] = out[0];  // splat
  } else {
    (msl_fill(out, at, args), ...);
  }
  return out;
}

#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38f
#endif

#define MSL_HERE const char *msl_file = __builtin_FILE(), int msl_line = __builtin_LINE()

namespace metal {

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(int(a) | int(b));
}

inline void threadgroup_barrier(mem_flags, MSL_HERE) {
  msl_rt::barrier(msl_file, msl_line);
}
inline void simdgroup_barrier(mem_flags, MSL_HERE) {
  // all lanes of a simdgroup meet: an exchange of nothing
  msl_rt::simd_exchange(0, msl_file, msl_line);
}

using std::numeric_limits;

template <typename T>
inline float msl_f(T x) {
  return static_cast<float>(x);
}

// Math: computed in float, returned in the argument type.
#define MSL_UNARY(name, expr)                                       \
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T> || std::is_same_v<T, half> || \
                                                    std::is_same_v<T, bfloat>>> \
  inline T name(T x) {                                              \
    float v = msl_f(x);                                             \
    return static_cast<T>(expr);                                    \
  }
MSL_UNARY(exp, std::exp(v))
MSL_UNARY(exp2, std::exp2(v))
MSL_UNARY(log, std::log(v))
MSL_UNARY(log2, std::log2(v))
MSL_UNARY(sqrt, std::sqrt(v))
MSL_UNARY(rsqrt, 1.0f / std::sqrt(v))
MSL_UNARY(floor, std::floor(v))
MSL_UNARY(ceil, std::ceil(v))
MSL_UNARY(abs, std::fabs(v))
#undef MSL_UNARY

template <typename T>
inline T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
inline T min(T a, T b) {
  return a < b ? a : b;
}
template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T>
inline T fma(T a, T b, T c) {
  return static_cast<T>(std::fma(msl_f(a), msl_f(b), msl_f(c)));
}
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T>
inline bool isinf(T x) {
  return std::isinf(msl_f(x));
}
template <typename T>
inline bool isnan(T x) {
  return std::isnan(msl_f(x));
}

// metal::fast:: and metal::precise:: name the same functions here (the
// emulator computes in float either way; -ffast-math models Metal's default).
namespace fast {
using namespace ::metal;
}  // namespace fast
namespace precise {
using namespace ::metal;
}  // namespace precise

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

// ------------------------------------------------------------ simd functions
template <typename T>
inline T simd_sum(T x, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  T acc = T(0);
  int n = msl_rt::simd_lanes_in_group(msl_rt::simd_group());
  for (int i = 0; i < n; ++i) acc += lanes[i];
  return acc;
}
template <typename T>
inline T simd_max(T x, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  T acc = lanes[0];
  int n = msl_rt::simd_lanes_in_group(msl_rt::simd_group());
  for (int i = 1; i < n; ++i) acc = lanes[i] > acc ? lanes[i] : acc;
  return acc;
}
template <typename T>
inline T simd_min(T x, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  T acc = lanes[0];
  int n = msl_rt::simd_lanes_in_group(msl_rt::simd_group());
  for (int i = 1; i < n; ++i) acc = lanes[i] < acc ? lanes[i] : acc;
  return acc;
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  T acc = T(0);
  for (int i = 0; i < msl_rt::simd_lane(); ++i) acc += lanes[i];
  return acc;
}
template <typename T>
inline T simd_prefix_inclusive_sum(T x, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  T acc = T(0);
  for (int i = 0; i <= msl_rt::simd_lane(); ++i) acc += lanes[i];
  return acc;
}
template <typename T>
inline T simd_shuffle(T x, ushort lane, MSL_HERE) {
  return msl_rt::simd_exchange(x, msl_file, msl_line)[lane % msl_rt::kSimdWidth];
}
template <typename T>
inline T simd_broadcast(T x, ushort lane, MSL_HERE) {
  return msl_rt::simd_exchange(x, msl_file, msl_line)[lane % msl_rt::kSimdWidth];
}
template <typename T>
inline T simd_broadcast_first(T x, MSL_HERE) {
  return msl_rt::simd_exchange(x, msl_file, msl_line)[0];
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask, MSL_HERE) {
  return msl_rt::simd_exchange(x, msl_file, msl_line)[(msl_rt::simd_lane() ^ mask) % msl_rt::kSimdWidth];
}
template <typename T>
inline T simd_shuffle_down(T x, ushort delta, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  int src = msl_rt::simd_lane() + delta;
  return src < msl_rt::kSimdWidth ? lanes[src] : x;
}
template <typename T>
inline T simd_shuffle_up(T x, ushort delta, MSL_HERE) {
  const T* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  int src = msl_rt::simd_lane() - int(delta);
  return src >= 0 ? lanes[src] : x;
}
inline bool simd_all(bool x, MSL_HERE) {
  const bool* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  bool acc = true;
  for (int i = 0; i < msl_rt::simd_lanes_in_group(msl_rt::simd_group()); ++i) acc &= lanes[i];
  return acc;
}
inline bool simd_any(bool x, MSL_HERE) {
  const bool* lanes = msl_rt::simd_exchange(x, msl_file, msl_line);
  bool acc = false;
  for (int i = 0; i < msl_rt::simd_lanes_in_group(msl_rt::simd_group()); ++i) acc |= lanes[i];
  return acc;
}

// ------------------------------------------------------------ simdgroup_matrix
// A simdgroup-wide 8x8 matrix. On the GPU each lane holds two elements; here
// every lane keeps a copy of the whole tile for the arithmetic, while loads
// and stores move only the lane's own elements (see simdgroup_load).
template <typename T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "only 8x8 simdgroup matrices are emulated");
  T elements[Rows * Cols];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T value) {
    for (auto& e : elements) e = value;
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  return simdgroup_matrix<T, R, C>(value);
}

// Like the hardware, each lane moves only the two elements it owns (2 * lane,
// 2 * lane + 1); a load is a simdgroup collective that gives every lane the
// whole tile. So a lane that loads before the others have written their part
// of the source reads stale or poisoned values, as on a GPU.
// src: a device/threadgroup/constant pointer; element (r, c) of the tile is at
// src[(origin.y + r) * elements_per_row + origin.x + c] (transposed: r <-> c).
template <typename T>
struct msl_pair {
  T first, second;
};
template <typename T, typename P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, P src, ulong elements_per_row = 8,
                           ulong2 origin = ulong2(0), bool transpose = false, MSL_HERE) {
  msl_pair<T> mine;
  T* own[2] = {&mine.first, &mine.second};
  for (int i = 0; i < 2; ++i) {
    int e = 2 * msl_rt::simd_lane() + i, r = e / 8, c = e % 8;
    ulong row = transpose ? c : r, col = transpose ? r : c;
    *own[i] = static_cast<T>(src[(origin.y + row) * elements_per_row + origin.x + col]);
  }
  const msl_pair<T>* lanes = msl_rt::simd_exchange(mine, msl_file, msl_line);
  for (int lane = 0; lane < 32; ++lane) {
    m.elements[2 * lane] = lanes[lane].first;
    m.elements[2 * lane + 1] = lanes[lane].second;
  }
}
template <typename T, typename P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst, ulong elements_per_row = 8,
                            ulong2 origin = ulong2(0), bool transpose = false) {
  for (int i = 0; i < 2; ++i) {
    int e = 2 * msl_rt::simd_lane() + i, r = e / 8, c = e % 8;
    ulong row = transpose ? c : r, col = transpose ? r : c;
    dst[(origin.y + row) * elements_per_row + origin.x + col] =
        static_cast<std::remove_reference_t<decltype(dst[0])>>(m.elements[e]);
  }
}
template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  simdgroup_matrix<TD, 8, 8> out;
  for (int r = 0; r < 8; ++r)
    for (int col = 0; col < 8; ++col) {
      float acc = msl_f(c.elements[r * 8 + col]);
      for (int k = 0; k < 8; ++k) acc += msl_f(a.elements[r * 8 + k]) * msl_f(b.elements[k * 8 + col]);
      out.elements[r * 8 + col] = static_cast<TD>(acc);
    }
  d = out;
}
template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal
