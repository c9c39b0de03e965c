// simdgroup_matrix<T, 8, 8> (<metal_simdgroup_matrix>).
//
// On Apple GPUs a matrix is spread over the 32 lanes of a simdgroup: each
// lane owns two horizontally adjacent elements (thread_elements()). Lane l
// owns row  (l / 16) * 4 + (l / 2) % 4  and columns  c, c + 1  with
// c = ((l / 8) % 2) * 4 + (l % 2) * 2  -- the layout Apple silicon uses.
//
// Here every lane also keeps a replica of the whole tile (stored in that
// ownership order, so a lane's own pair is elements[2 * lane], [2 * lane + 1]).
// Loads are simdgroup collectives: each lane reads only its own two elements
// from memory, then the lanes exchange them, so a load that runs before the
// rest of the simdgroup wrote its part of the source reads stale or poisoned
// data, as on the GPU. Products are computed from the replicas without
// synchronising, so a lane can race ahead past a multiply (exposing a missing
// simdgroup_barrier). Stores write the lane's own elements. A lane that
// changed its elements through thread_elements() re-syncs the replicas (a
// collective) at the next product.
#pragma once

#include "msl_simd.h"

namespace metal {

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices");
  alignas(2 * sizeof(T)) T elements[64];  // the replica, in ownership order
  bool lane_modified = false;             // thread_elements() may have changed this lane's pair

  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `diagonal` on the diagonal, zero elsewhere.
  explicit simdgroup_matrix(T diagonal);

  thread vec<T, 2>& thread_elements() {
    lane_modified = true;
    return *reinterpret_cast<thread vec<T, 2>*>(&elements[2 * msl_rt::simd_lane()]);
  }
  const thread vec<T, 2>& thread_elements() const {
    return *reinterpret_cast<const thread vec<T, 2>*>(&elements[2 * msl_rt::simd_lane()]);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

namespace detail {
// (row, first column) of the two elements lane `lane` owns.
inline int matrix_row(int lane) {
  return (lane / 16) * 4 + (lane / 2) % 4;
}
inline int matrix_col(int lane) {
  return ((lane / 8) % 2) * 4 + (lane % 2) * 2;
}
// Index of element (row, col) in the replica: the inverse of the layout.
inline int matrix_slot(int row, int col) {
  int lane = (row / 4) * 16 + ((col / 4) % 2) * 8 + (row % 4) * 2 + (col % 4) / 2;
  return 2 * lane + col % 2;
}
}  // namespace detail

template <typename T, int C, int R>
simdgroup_matrix<T, C, R>::simdgroup_matrix(T diagonal) {
  for (int row = 0; row < 8; ++row)
    for (int col = 0; col < 8; ++col) elements[detail::matrix_slot(row, col)] = row == col ? diagonal : T(0);
}

template <typename T, int C, int R>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  for (T& e : m.elements) e = value;
  return m;
}

namespace detail {
// Element (row, col) of the matrix lives at src[(origin.y + row) * stride +
// origin.x + col]; transposed, at src[(origin.y + col) * stride + origin.x + row].
inline ulong matrix_offset(int row, int col, ulong stride, ulong2 origin, bool transpose) {
  return transpose ? (origin.y + col) * stride + origin.x + row : (origin.y + row) * stride + origin.x + col;
}

// Every lane posts its own pair and receives everybody's: the replica.
template <typename T>
inline void share_pairs(simdgroup_matrix<T, 8, 8>& m, vec<T, 2> own, const msl_rt::Site& site) {
  const vec<T, 2>* lanes = msl_rt::simd_exchange(own, site, false);
  for (int lane = 0; lane < msl_rt::kSimdWidth; ++lane) {
    m.elements[2 * lane] = lanes[lane][0];
    m.elements[2 * lane + 1] = lanes[lane][1];
  }
  m.lane_modified = false;
}

template <typename T, typename Pointer>
inline void load(simdgroup_matrix<T, 8, 8>& m, Pointer src, ulong stride, ulong2 origin, bool transpose,
                 const msl_rt::Site& site) {
  if (msl_rt::lanes_in(msl_rt::simd_group()) != msl_rt::kSimdWidth)
    msl_rt::fail("simdgroup_load at " + site.where() + " in a simdgroup with fewer than 32 threads");
  int lane = msl_rt::simd_lane(), row = matrix_row(lane), col = matrix_col(lane);
  vec<T, 2> own;
  for (int i = 0; i < 2; ++i) own[i] = src[matrix_offset(row, col + i, stride, origin, transpose)];
  share_pairs(m, own, site);
}

template <typename T, typename Pointer>
inline void store(const simdgroup_matrix<T, 8, 8>& m, Pointer dst, ulong stride, ulong2 origin, bool transpose) {
  int lane = msl_rt::simd_lane(), row = matrix_row(lane), col = matrix_col(lane);
  for (int i = 0; i < 2; ++i) dst[matrix_offset(row, col + i, stride, origin, transpose)] = m.elements[2 * lane + i];
}
}  // namespace detail

// The source element type must be the matrix's (no conversion), as in Metal.
template <typename T>
inline void simdgroup_load(thread simdgroup_matrix<T, 8, 8>& m, const device T* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                           MSL_SITE("simdgroup_load")) {
  detail::load(m, src, elements_per_row, matrix_origin, transpose_matrix, msl_site);
}
template <typename T>
inline void simdgroup_load(thread simdgroup_matrix<T, 8, 8>& m, const threadgroup T* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                           MSL_SITE("simdgroup_load")) {
  detail::load(m, src, elements_per_row, matrix_origin, transpose_matrix, msl_site);
}
template <typename T>
inline void simdgroup_store(const thread simdgroup_matrix<T, 8, 8>& m, device T* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  detail::store(m, dst, elements_per_row, matrix_origin, transpose_matrix);
}
template <typename T>
inline void simdgroup_store(const thread simdgroup_matrix<T, 8, 8>& m, threadgroup T* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  detail::store(m, dst, elements_per_row, matrix_origin, transpose_matrix);
}

namespace detail {
template <typename T>
inline const simdgroup_matrix<T, 8, 8>& synced(const simdgroup_matrix<T, 8, 8>& m, simdgroup_matrix<T, 8, 8>& copy,
                                               const msl_rt::Site& site) {
  if (!m.lane_modified) return m;
  int lane = msl_rt::simd_lane();
  copy = m;
  share_pairs(copy, vec<T, 2>{m.elements[2 * lane], m.elements[2 * lane + 1]}, site);
  return copy;
}

template <typename TD, typename TA, typename TB, typename TC>
inline void multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a_in,
                                const simdgroup_matrix<TB, 8, 8>& b_in, const simdgroup_matrix<TC, 8, 8>& c_in,
                                const msl_rt::Site& site) {
  simdgroup_matrix<TA, 8, 8> a_copy;
  simdgroup_matrix<TB, 8, 8> b_copy;
  simdgroup_matrix<TC, 8, 8> c_copy;
  if (msl_rt::simd_lane() == 0) MSL_COUNT(simdgroup_matrix_mmas, 1);
  const auto& a = synced(a_in, a_copy, site);
  const auto& b = synced(b_in, b_copy, site);
  const auto& c = synced(c_in, c_copy, site);
  float a_rows[8][8], b_rows[8][8];
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 8; ++k) {
      a_rows[r][k] = float(a.elements[matrix_slot(r, k)]);
      b_rows[r][k] = float(b.elements[matrix_slot(r, k)]);
    }
  simdgroup_matrix<TD, 8, 8> out;
  for (int r = 0; r < 8; ++r)
    for (int col = 0; col < 8; ++col) {
      float acc = float(c.elements[matrix_slot(r, col)]);
      for (int k = 0; k < 8; ++k) acc += a_rows[r][k] * b_rows[k][col];
      out.elements[matrix_slot(r, col)] = static_cast<TD>(acc);
    }
  d = out;
}
}  // namespace detail

// d = a * b + c
template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d, const thread simdgroup_matrix<TA, 8, 8>& a,
                                          const thread simdgroup_matrix<TB, 8, 8>& b,
                                          const thread simdgroup_matrix<TC, 8, 8>& c,
                                          MSL_SITE("simdgroup_multiply_accumulate")) {
  detail::multiply_accumulate(d, a, b, c, msl_site);
}
// d = a * b
template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d, const thread simdgroup_matrix<TA, 8, 8>& a,
                               const thread simdgroup_matrix<TB, 8, 8>& b, MSL_SITE("simdgroup_multiply")) {
  detail::multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)), msl_site);
}

}  // namespace metal
