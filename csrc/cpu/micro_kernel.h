// The register-blocked matrix micro-kernel of the CPU kernels, used for both
// products of attention (forward: S = Q K^T and O += P V; a backward pass:
// dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q):
//
//   matmul_accumulate(A, lda, B, ldb, C, ldc, rows, K, N)
//       C[rows][N] += A[rows][K] . B[K][N]
//   matmul_overwrite(A, lda, B, ldb, C, ldc, rows, K, N)
//       C[rows][N]  = A[rows][K] . B[K][N]   (C is not read: no zeroing pass)
//   matmul_accumulate_transposed_a(At, ldat, B, ldb, C, ldc, rows, K, N)
//       C[rows][N] += At[K][rows]^T . B[K][N] (A stored transposed: no
//       transposing pass; the forward's P^T and a backward's P^T, dS^T)
//   matmul_overwrite_bf16_pairs(A, lda, Bp, ldbp, C, ldc, rows, Kp, N)
//       C = A . B on bf16 pairs with float32 accumulation, where the copy has
//       AVX512_BF16 (kNativeBf16); see its definition for the layouts
//
// A is row-major with row stride lda (any rows, any K), or for the _transposed_a
// form stored as At[K][rows] with row stride ldat. B is a packed panel:
// row-major, row stride ldb, N columns with N a multiple of kLanes (callers
// zero-pad), streamed row by row with plain vector loads (no gathers). C is
// row-major with stride ldc, read and written once per register tile.
//
// Register tile: kTileRows rows x kTileVectors vectors of accumulators, sized
// to the register file (MLX_ATTN_TILE_ROWS / MLX_ATTN_TILE_VECTORS from the
// per-ISA unit): per step of K it loads kTileVectors B vectors and broadcasts
// kTileRows A scalars for kTileRows * kTileVectors FMAs. Row and column tails
// use smaller tiles of the same code. What one step multiplies is a policy
// (FloatProduct, Bf16PairProduct), so the tiling has one home.
#pragma once

#include <string.h>

#include "csrc/cpu/simd.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>  // intrinsics are always-inline: nothing leaks
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// What one step of K multiplies: float A scalars times float B vectors.
struct FloatProduct {
  using AElem = float;
  using BElem = float;
  using BVector = vfloat;
  using AVector = vfloat;
  static constexpr int kBVectorElems = kLanes;  // B elements per vector of C
  static BVector load_b(const float* p) { return load(p); }
  static AVector broadcast_a(const float* p) { return splat(*p); }
  static vfloat multiply_add(vfloat acc, AVector a, BVector b) { return acc + a * b; }
};

#if defined(__AVX512BF16__) && MLX_ATTN_VEC_BYTES == 64
// AVX512_BF16: one step of K is a pair of bf16 elements (k, k + 1), summed
// into float32 accumulators by vdpbf16ps. A holds the pair adjacently (a
// 32-bit broadcast); B is a pair-interleaved panel, Bp[k / 2][n][2].
struct Bf16PairProduct {
  using AElem = uint16_t;
  using BElem = uint16_t;
  using BVector = __m512bh;
  using AVector = __m512bh;
  static constexpr int kBVectorElems = 2 * kLanes;
  static BVector load_b(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static AVector broadcast_a(const uint16_t* p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static vfloat multiply_add(vfloat acc, AVector a, BVector b) {
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, a, b);
  }
};
#endif

// C[MR rows][NV vectors] (+)= A[MR][K] . B[K][NV vectors], accumulators in
// registers; kAccumulate = false overwrites C without reading it.
// A[r][k] is A[r * a_row + k * a_k]: (lda, 1) row-major, (1, ldat) transposed.
// Product: FloatProduct, or a native reduced-precision product (one step of
// K is then whatever it multiplies at once, e.g. a bf16 pair).
template <class Product, bool kAccumulate, int MR, int NV>
inline void matmul_tile(
    const typename Product::AElem* __restrict A,
    int64_t a_row,
    int64_t a_k,
    const typename Product::BElem* __restrict B,
    int64_t ldb,
    float* __restrict C,
    int64_t ldc,
    int K) {
  vfloat acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = kAccumulate ? load(C + r * ldc + v * kLanes) : splat(0.0f);
    }
  for (int k = 0; k < K; ++k) {
    typename Product::BVector b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = Product::load_b(B + k * ldb + v * Product::kBVectorElems);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const typename Product::AVector a = Product::broadcast_a(A + r * a_row + k * a_k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Product::multiply_add(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kLanes, acc[r][v]);
}

// Register tile: kTileRows rows x kTileVectors vectors of accumulators
// (wider with 32 vector registers, as on AVX-512 and NEON).
#ifndef MLX_ATTN_TILE_ROWS
#define MLX_ATTN_TILE_ROWS 6
#endif
#ifndef MLX_ATTN_TILE_VECTORS
#define MLX_ATTN_TILE_VECTORS 2
#endif
constexpr int kTileRows = MLX_ATTN_TILE_ROWS;
constexpr int kTileVectors = MLX_ATTN_TILE_VECTORS;
static_assert(kTileRows >= 1 && kTileRows <= 8, "tails below handle up to 7 rows");
static_assert(kTileVectors >= 1 && kTileVectors <= 4, "tails below handle up to 3 vectors");

template <class Product, bool kAccumulate, int NV>
inline void matmul_rows(
    const typename Product::AElem* A,
    int64_t a_row,
    int64_t a_k,
    const typename Product::BElem* B,
    int64_t ldb,
    float* C,
    int64_t ldc,
    int rows,
    int K) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    matmul_tile<Product, kAccumulate, kTileRows, NV>(A + r * a_row, a_row, a_k, B, ldb, C + r * ldc, ldc, K);
  }
  const typename Product::AElem* a = A + r * a_row;
  float* c = C + r * ldc;
  switch (rows - r) {
    case 7: matmul_tile<Product, kAccumulate, 7, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 6: matmul_tile<Product, kAccumulate, 6, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 5: matmul_tile<Product, kAccumulate, 5, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 4: matmul_tile<Product, kAccumulate, 4, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 3: matmul_tile<Product, kAccumulate, 3, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 2: matmul_tile<Product, kAccumulate, 2, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    case 1: matmul_tile<Product, kAccumulate, 1, NV>(a, a_row, a_k, B, ldb, c, ldc, K); break;
    default: break;
  }
}

// N counts columns of C; B's column offset scales with Product::kBVectorElems.
template <class Product, bool kAccumulate>
inline void matmul(
    const typename Product::AElem* A,
    int64_t a_row,
    int64_t a_k,
    const typename Product::BElem* B,
    int64_t ldb,
    float* C,
    int64_t ldc,
    int rows,
    int K,
    int N) {
  int n = 0;
  for (; n + kTileVectors * kLanes <= N; n += kTileVectors * kLanes) {
    matmul_rows<Product, kAccumulate, kTileVectors>(
        A, a_row, a_k, B + n / kLanes * Product::kBVectorElems, ldb, C + n, ldc, rows, K);
  }
  const typename Product::BElem* b = B + n / kLanes * Product::kBVectorElems;
  float* c = C + n;
  switch ((N - n) / kLanes) {
    case 3: matmul_rows<Product, kAccumulate, 3>(A, a_row, a_k, b, ldb, c, ldc, rows, K); break;
    case 2: matmul_rows<Product, kAccumulate, 2>(A, a_row, a_k, b, ldb, c, ldc, rows, K); break;
    case 1: matmul_rows<Product, kAccumulate, 1>(A, a_row, a_k, b, ldb, c, ldc, rows, K); break;
    default: break;
  }
}

// C[rows][N] += A[rows][K] . B[K][N] with N a multiple of kLanes.
inline void matmul_accumulate(
    const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, true>(A, lda, 1, B, ldb, C, ldc, rows, K, N);
}

// C[rows][N] = A[rows][K] . B[K][N] with N a multiple of kLanes (C not read).
inline void matmul_overwrite(
    const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, false>(A, lda, 1, B, ldb, C, ldc, rows, K, N);
}

// C[rows][N] += At[K][rows]^T . B[K][N] with N a multiple of kLanes.
inline void matmul_accumulate_transposed_a(
    const float* At, int64_t ldat, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, true>(At, 1, ldat, B, ldb, C, ldc, rows, K, N);
}

#if defined(__AVX512BF16__) && MLX_ATTN_VEC_BYTES == 64
constexpr bool kNativeBf16 = true;
// C[rows][N] = A[rows][2 Kp] . B[2 Kp][N] in bf16 pairs (vdpbf16ps, float32
// accumulation): A row-major bf16 with row stride lda (elements), pairs
// adjacent; Bp the pair-interleaved panel [Kp][N][2], row stride ldbp (elements).
inline void matmul_overwrite_bf16_pairs(
    const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t ldbp, float* C, int64_t ldc,
    int rows, int Kp, int N) {
  matmul<Bf16PairProduct, false>(A, lda, 2, Bp, ldbp, C, ldc, rows, Kp, N);
}
#else
constexpr bool kNativeBf16 = false;
// Declared for name lookup only: callers guard it with `if constexpr (kNativeBf16)`.
void matmul_overwrite_bf16_pairs(
    const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t ldbp, float* C, int64_t ldc,
    int rows, int Kp, int N);
#endif

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
