// Barriers and SIMD-group functions (<metal_compute>, <metal_simdgroup>).
//
// Every simd function is a collective here: all lanes of the simdgroup must
// call it at the same call site, else the dispatch reports a deadlock (Metal
// allows inactive lanes; this emulator is stricter so that divergence is
// visible). SIMD width is 32; a partial last simdgroup has fewer lanes.
#pragma once

#include "msl_math.h"

#define MSL_SITE(name) \
  msl_rt::Site msl_site = msl_rt::Site{name, __builtin_FILE(), __builtin_LINE(), __builtin_COLUMN()}

namespace metal {

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(int(a) | int(b));
}

inline void threadgroup_barrier(mem_flags, MSL_SITE("threadgroup_barrier")) {
  msl_rt::barrier(msl_site);
}
inline void simdgroup_barrier(mem_flags, MSL_SITE("simdgroup_barrier")) {
  if (msl_rt::simd_lane() == 0) MSL_COUNT(simdgroup_barriers, 1);
  msl_rt::simd_exchange(char(0), msl_site, false);  // all lanes meet, nothing is exchanged
}

namespace detail {
template <typename T, typename F>
inline T simd_reduce(const T* lanes, F combine) {
  T acc = lanes[0];
  for (int i = 1; i < msl_rt::lanes_in(msl_rt::simd_group()); ++i) acc = combine(acc, lanes[i]);
  return acc;
}
template <typename T, typename F>
inline T simd_scan(const T* lanes, T identity, bool inclusive, F combine) {
  T acc = identity;
  int last = msl_rt::simd_lane() + (inclusive ? 1 : 0);
  for (int i = 0; i < last; ++i) acc = combine(acc, lanes[i]);
  return acc;
}
template <typename T>
inline T simd_read(const T* lanes, int lane, const msl_rt::Site& site) {
  if (lane < 0 || lane >= msl_rt::lanes_in(msl_rt::simd_group()))
    msl_rt::fail(std::string(site.what) + " at " + site.where() + " reads lane " + std::to_string(lane) +
                 ", which is not in the simdgroup");
  return lanes[lane];
}
}  // namespace detail

// ------------------------------------------------------------------ reductions
template <typename T>
inline T simd_sum(T x, MSL_SITE("simd_sum")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return T(a + b); });
}
template <typename T>
inline T simd_product(T x, MSL_SITE("simd_product")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return T(a * b); });
}
template <typename T>
inline T simd_max(T x, MSL_SITE("simd_max")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return max(a, b); });
}
template <typename T>
inline T simd_min(T x, MSL_SITE("simd_min")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return min(a, b); });
}
template <typename T>
inline T simd_and(T x, MSL_SITE("simd_and")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return T(a & b); });
}
template <typename T>
inline T simd_or(T x, MSL_SITE("simd_or")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return T(a | b); });
}
template <typename T>
inline T simd_xor(T x, MSL_SITE("simd_xor")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](T a, T b) { return T(a ^ b); });
}
inline bool simd_all(bool x, MSL_SITE("simd_all")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x, MSL_SITE("simd_any")) {
  return detail::simd_reduce(msl_rt::simd_exchange(x, msl_site), [](bool a, bool b) { return a || b; });
}

// ------------------------------------------------------------------ scans
template <typename T>
inline T simd_prefix_inclusive_sum(T x, MSL_SITE("simd_prefix_inclusive_sum")) {
  return detail::simd_scan(msl_rt::simd_exchange(x, msl_site), T(0), true, [](T a, T b) { return T(a + b); });
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x, MSL_SITE("simd_prefix_exclusive_sum")) {
  return detail::simd_scan(msl_rt::simd_exchange(x, msl_site), T(0), false, [](T a, T b) { return T(a + b); });
}
template <typename T>
inline T simd_prefix_inclusive_product(T x, MSL_SITE("simd_prefix_inclusive_product")) {
  return detail::simd_scan(msl_rt::simd_exchange(x, msl_site), T(1), true, [](T a, T b) { return T(a * b); });
}
template <typename T>
inline T simd_prefix_exclusive_product(T x, MSL_SITE("simd_prefix_exclusive_product")) {
  return detail::simd_scan(msl_rt::simd_exchange(x, msl_site), T(1), false, [](T a, T b) { return T(a * b); });
}

// ------------------------------------------------------------------ permutes
template <typename T>
inline T simd_shuffle(T x, ushort lane, MSL_SITE("simd_shuffle")) {
  return detail::simd_read(msl_rt::simd_exchange(x, msl_site), lane, msl_site);
}
template <typename T>
inline T simd_broadcast(T x, ushort lane, MSL_SITE("simd_broadcast")) {
  return detail::simd_read(msl_rt::simd_exchange(x, msl_site), lane, msl_site);
}
template <typename T>
inline T simd_broadcast_first(T x, MSL_SITE("simd_broadcast_first")) {
  return msl_rt::simd_exchange(x, msl_site)[0];
}
inline bool simd_is_first() {
  return msl_rt::simd_lane() == 0;  // every lane is active in the emulator
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask, MSL_SITE("simd_shuffle_xor")) {
  return detail::simd_read(msl_rt::simd_exchange(x, msl_site), msl_rt::simd_lane() ^ mask, msl_site);
}
// shuffle_down/up do not wrap: lanes with no source keep their own value.
template <typename T>
inline T simd_shuffle_down(T x, ushort delta, MSL_SITE("simd_shuffle_down")) {
  const T* lanes = msl_rt::simd_exchange(x, msl_site);
  int source = msl_rt::simd_lane() + delta;
  return source < msl_rt::lanes_in(msl_rt::simd_group()) ? lanes[source] : x;
}
template <typename T>
inline T simd_shuffle_up(T x, ushort delta, MSL_SITE("simd_shuffle_up")) {
  const T* lanes = msl_rt::simd_exchange(x, msl_site);
  int source = msl_rt::simd_lane() - int(delta);
  return source >= 0 ? lanes[source] : x;
}
template <typename T>
inline T simd_shuffle_rotate_down(T x, ushort delta, MSL_SITE("simd_shuffle_rotate_down")) {
  const T* lanes = msl_rt::simd_exchange(x, msl_site);
  int n = msl_rt::lanes_in(msl_rt::simd_group());
  return lanes[(msl_rt::simd_lane() + delta) % n];
}
template <typename T>
inline T simd_shuffle_rotate_up(T x, ushort delta, MSL_SITE("simd_shuffle_rotate_up")) {
  const T* lanes = msl_rt::simd_exchange(x, msl_site);
  int n = msl_rt::lanes_in(msl_rt::simd_group());
  return lanes[((msl_rt::simd_lane() - int(delta)) % n + n) % n];
}

}  // namespace metal
