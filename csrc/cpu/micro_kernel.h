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
//   matmul_overwrite_pairs<Product>(A, lda, Bp, ldbp, C, ldc, rows, Kp, N)
//       C = A . B on pairs of bf16 / fp16 elements with float32 accumulation,
//       where the copy has a native pair product (NativePairProduct below)
//
// A is row-major with row stride lda (any rows, any K), or for the _transposed_a
// form stored as At[K][rows] with row stride ldat. B is a packed panel:
// row-major, row stride ldb, N columns with N a multiple of kLanes (callers
// zero-pad), streamed row by row with plain vector loads (no gathers). C is
// row-major with stride ldc, read and written once per register tile.
//
// Register tile: kTileRows rows x kTileVectors vectors of accumulators, sized
// to the register file (MLX_ATTN_TILE_ROWS / MLX_ATTN_TILE_VECTORS from the
// copy's csrc/cpu/isa_<family>.h): per step of K it loads kTileVectors B vectors and broadcasts
// kTileRows A scalars for kTileRows * kTileVectors FMAs. Row and column tails
// use smaller tiles of the same code. What one step multiplies is a policy
// (FloatProduct; Bf16PairProduct: AVX512_BF16 vdpbf16ps or arm64 BFDOT;
// Fp16PairProduct: arm64 FMLAL/FMLAL2), so the tiling has one home.
#pragma once

#include <string.h>

#include "csrc/cpu/simd.h"

// A copy opts into native reduced-precision products by defining
// MLX_ATTN_NATIVE_BF16 / MLX_ATTN_NATIVE_FP16 (its kernel_<isa>.cpp); its
// compile flags (CMakeLists.txt) must then enable the instructions. Opting in
// explicitly keeps a baseline copy baseline where the compiler's default
// target already has them (Apple's arm64 default includes FEAT_FHM).
#if defined(MLX_ATTN_NATIVE_BF16) && !(defined(__AVX512BF16__) && MLX_ATTN_VEC_BYTES == 64) && \
    !(defined(__aarch64__) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC))
#error "MLX_ATTN_NATIVE_BF16 needs AVX512_BF16 or arm64 FEAT_BF16 in the compile flags (CMakeLists.txt)"
#endif
#if defined(MLX_ATTN_NATIVE_FP16) && !(defined(__aarch64__) && defined(__ARM_FEATURE_FP16_FML))
#error "MLX_ATTN_NATIVE_FP16 needs arm64 FEAT_FHM (+fp16fml) in the compile flags (CMakeLists.txt)"
#endif
#if defined(MLX_ATTN_NATIVE_BF16) && defined(__AVX512BF16__)
#include <immintrin.h>  // intrinsics are always-inline: nothing leaks
#elif defined(MLX_ATTN_NATIVE_BF16) || defined(MLX_ATTN_NATIVE_FP16)
#include <arm_neon.h>  // likewise
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

// Pair products: one step of K is a pair of 16-bit elements (k, k + 1),
// both summed into float32 accumulators. A holds the pair adjacently (row-
// major, a 32-bit load); B is a pair panel Bp[k / 2][...] whose layout within
// one pair row (2 N elements) is the product's panel_offset(n, half): where
// element B[k + half][n] goes (callers pack it, zero-padding an odd K).
inline uint32_t load_pair(const uint16_t* p) {
  uint32_t pair;
  memcpy(&pair, p, sizeof pair);
  return pair;
}

// What every pair product shares: 16-bit operands, 2 kLanes elements of the
// panel per vector of C.
struct PairOperands {
  using AElem = uint16_t;
  using BElem = uint16_t;
  static constexpr int kBVectorElems = 2 * kLanes;
};
// The pair-interleaved panel Bp[k / 2][n][2] (the bf16 dot products').
struct InterleavedPairPanel : PairOperands {
  static int panel_offset(int n, int half) { return 2 * n + half; }
};

#if defined(MLX_ATTN_NATIVE_BF16) && defined(__AVX512BF16__)
// AVX512_BF16 vdpbf16ps: acc[n] += A[k] B[k][n] + A[k+1] B[k+1][n], B
// pair-interleaved, Bp[k / 2][n][2].
struct Bf16PairProduct : InterleavedPairPanel {
  using BVector = __m512bh;
  using AVector = __m512bh;
  static BVector load_b(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static AVector broadcast_a(const uint16_t* p) { return (__m512bh)_mm512_set1_epi32(int(load_pair(p))); }
  static vfloat multiply_add(vfloat acc, AVector a, BVector b) {
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, a, b);
  }
};
#elif defined(MLX_ATTN_NATIVE_BF16)
// arm64 FEAT_BF16 BFDOT: the same pair-interleaved panel as AVX512_BF16.
struct Bf16PairProduct : InterleavedPairPanel {
  using BVector = bfloat16x8_t;
  using AVector = bfloat16x8_t;
  static BVector load_b(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }
  static AVector broadcast_a(const uint16_t* p) { return vreinterpretq_bf16_u32(vdupq_n_u32(load_pair(p))); }
  static vfloat multiply_add(vfloat acc, AVector a, BVector b) {
    return (vfloat)vbfdotq_f32((float32x4_t)acc, b, a);
  }
};
#endif

#if defined(MLX_ATTN_NATIVE_FP16)
// arm64 FEAT_FHM FMLAL/FMLAL2 (by element): widening float16 multiply-adds
// into float32, exact products, one rounding per add. FMLAL takes the low 4
// halves of a B vector, FMLAL2 the high 4, each times one A lane, so a pair
// row of the panel holds per vector of kLanes columns row k's kLanes
// halves, then row k + 1's: acc[n] += A[k] B[k][n] + A[k+1] B[k+1][n].
struct Fp16PairProduct : PairOperands {
  using BVector = float16x8_t;
  using AVector = float16x4_t;
  static int panel_offset(int n, int half) { return (n / kLanes) * 2 * kLanes + half * kLanes + n % kLanes; }
  static BVector load_b(const uint16_t* p) { return vreinterpretq_f16_u16(vld1q_u16(p)); }
  static AVector broadcast_a(const uint16_t* p) { return vreinterpret_f16_u32(vdup_n_u32(load_pair(p))); }
  static vfloat multiply_add(vfloat acc, AVector a, BVector b) {
    return (vfloat)vfmlalq_lane_high_f16(vfmlalq_lane_low_f16((float32x4_t)acc, b, a, 0), b, a, 1);
  }
};
#endif

// The native pair product of element type T in this copy, if any:
// NativePairProduct<T>::kAvailable, and ::Product when it is.
template <ElemType T>
struct NativePairProduct {
  static constexpr bool kAvailable = false;
};
template <class P>
struct NativeProduct {
  static constexpr bool kAvailable = true;
  using Product = P;
};
#if defined(MLX_ATTN_NATIVE_BF16)
template <>
struct NativePairProduct<ElemType::bfloat16> : NativeProduct<Bf16PairProduct> {};
#endif
#if defined(MLX_ATTN_NATIVE_FP16)
template <>
struct NativePairProduct<ElemType::float16> : NativeProduct<Fp16PairProduct> {};
#endif

// The operands of C (+)= A . B: A[r][k] is A[r * a_row + k * a_k] ((lda, 1)
// row-major, (1, ldat) transposed); B a packed panel of row stride ldb whose
// columns step by Product::kBVectorElems elements per vector of C; C
// row-major with row stride ldc.
template <class Product>
struct Operands {
  const typename Product::AElem* A;
  int64_t a_row, a_k;
  const typename Product::BElem* B;
  int64_t ldb;
  float* C;
  int64_t ldc;

  Operands from_row(int r) const { return {A + r * a_row, a_row, a_k, B, ldb, C + r * ldc, ldc}; }
  Operands from_column(int n) const {
    return {A, a_row, a_k, B + n / kLanes * Product::kBVectorElems, ldb, C + n, ldc};
  }
};

// C[MR rows][NV vectors] (+)= A[MR][K] . B[K][NV vectors], accumulators in
// registers; kAccumulate = false overwrites C without reading it.
// Product: FloatProduct, or a native reduced-precision product (one step of
// K is then whatever it multiplies at once, e.g. a bf16 pair).
template <class Product, bool kAccumulate, int MR, int NV>
inline void matmul_tile(const Operands<Product>& o, int K) {
  const typename Product::AElem* __restrict A = o.A;
  const typename Product::BElem* __restrict B = o.B;
  float* __restrict C = o.C;
  const int64_t a_row = o.a_row, a_k = o.a_k, ldb = o.ldb, ldc = o.ldc;
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
static_assert(kTileRows >= 1 && kTileRows <= 8, "a register tile holds at most 8 rows");
static_assert(kTileVectors >= 1 && kTileVectors <= 4, "a register tile holds at most 4 vectors");

template <int N>
struct Count {
  static constexpr int value = N;
};

// Calls body(Count<count>{}) for a run-time count in 1..Max (nothing for 0):
// a tail of the tiling loops below, as a compile-time size.
template <int Max, class Body>
inline void with_count(int count, Body body) {
  if constexpr (Max > 0) {
    if (count == Max) {
      body(Count<Max>{});
    } else {
      with_count<Max - 1>(count, body);
    }
  }
}

// C[rows][NV vectors] (+)= A . B: whole register tiles, then the rows left.
template <class Product, bool kAccumulate, int NV>
inline void matmul_rows(const Operands<Product>& o, int rows, int K) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    matmul_tile<Product, kAccumulate, kTileRows, NV>(o.from_row(r), K);
  }
  with_count<kTileRows - 1>(rows - r, [&](auto tail_rows) {
    matmul_tile<Product, kAccumulate, decltype(tail_rows)::value, NV>(o.from_row(r), K);
  });
}

// C[rows][N] (+)= A . B, N counting columns of C (a multiple of kLanes).
template <class Product, bool kAccumulate>
inline void matmul(const Operands<Product>& o, int rows, int K, int N) {
  int n = 0;
  for (; n + kTileVectors * kLanes <= N; n += kTileVectors * kLanes) {
    matmul_rows<Product, kAccumulate, kTileVectors>(o.from_column(n), rows, K);
  }
  with_count<kTileVectors - 1>((N - n) / kLanes, [&](auto tail_vectors) {
    matmul_rows<Product, kAccumulate, decltype(tail_vectors)::value>(o.from_column(n), rows, K);
  });
}

// C[rows][N] += A[rows][K] . B[K][N] with N a multiple of kLanes.
inline void matmul_accumulate(
    const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, true>({A, lda, 1, B, ldb, C, ldc}, rows, K, N);
}

// C[rows][N] = A[rows][K] . B[K][N] with N a multiple of kLanes (C not read).
inline void matmul_overwrite(
    const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, false>({A, lda, 1, B, ldb, C, ldc}, rows, K, N);
}

// C[rows][N] += At[K][rows]^T . B[K][N] with N a multiple of kLanes.
inline void matmul_accumulate_transposed_a(
    const float* At, int64_t ldat, const float* B, int64_t ldb, float* C, int64_t ldc,
    int rows, int K, int N) {
  matmul<FloatProduct, true>({At, 1, ldat, B, ldb, C, ldc}, rows, K, N);
}

// C[rows][N] = A[rows][2 Kp] . B[2 Kp][N] in pairs of 16-bit elements with
// float32 accumulation (a pair Product above): A row-major with row stride
// lda (elements), pairs adjacent; Bp the Product's pair panel [Kp][2 N],
// row stride ldbp (elements).
template <class Product>
inline void matmul_overwrite_pairs(
    const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t ldbp, float* C, int64_t ldc,
    int rows, int Kp, int N) {
  matmul<Product, false>({A, lda, 2, Bp, ldbp, C, ldc}, rows, Kp, N);
}

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
