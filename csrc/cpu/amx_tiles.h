// AMX bf16 tile products for the avx512amx copy (kernel_avx512amx.cpp, which
// defines MLX_ATTN_AMX_BF16): TDPBF16PS multiplies a 16 x 32 bf16 tile by a
// 16-pair x 16 pair-interleaved tile into 16 x 16 float32 accumulators, the
// same pair sums as vdpbf16ps (micro_kernel.h Bf16PairProduct), so the same
// exactness guard (kernel_impl.h bf16_pair_scale) covers both.
//
// Tile registers: 0-3 accumulators (a 2 x 2 block of 16 x 16 float32 tiles),
// 4-5 A tiles (16 rows x 32 bf16), 6-7 B tiles (16 pairs x 16 columns x 2).
// A thread configures them per work item (amx_configure) and releases them
// after it (amx_release), so no tile state outlives the kernel. The backward's
// avx512amx copy (backward_impl.h) uses the same products and panels.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "amx_tiles.h needs -mamx-tile -mamx-bf16 (CMakeLists.txt)"
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// Elements of the reduction dimension one tile product takes (32 bf16: 16
// pairs, one 64-byte tile row), and rows / columns of an accumulator tile.
inline constexpr int kAmxDepth = 32;
inline constexpr int kAmxTile = 16;

struct AmxTileConfig {  // the LDTILECFG memory layout, palette 1
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t column_bytes[16];
  uint8_t rows[16];
};
static_assert(sizeof(AmxTileConfig) == 64, "LDTILECFG reads 64 bytes");

inline void amx_configure() {
  AmxTileConfig config;
  memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.column_bytes[t] = 64;
    config.rows[t] = kAmxTile;
  }
  _tile_loadconfig(&config);
}

inline void amx_release() {
  _tile_release();
}

// C[16 m][16 n] (+)= A[16 m][depth] . B, depth a multiple of kAmxDepth, every
// tile whole: A row-major bf16 (row stride a_stride elements), B the pair
// panel Bp[depth / 2][n][2] (row stride b_stride elements), C row-major float32
// (row stride c_stride floats), overwritten or (kAccumulate) added to.
// Register-blocked 2 x 2 tiles of C.
template <bool kAccumulate>
inline void amx_matmul(const uint16_t* A, int64_t a_stride, const uint16_t* B, int64_t b_stride, float* C,
                       int64_t c_stride, int row_tiles, int column_tiles, int depth) {
  const int64_t a_bytes = 2 * a_stride, b_bytes = 2 * b_stride, c_bytes = 4 * c_stride;
  for (int mt = 0; mt < row_tiles; mt += 2) {
    const bool two_rows = mt + 1 < row_tiles;
    for (int nt = 0; nt < column_tiles; nt += 2) {
      const bool two_columns = nt + 1 < column_tiles;
      float* c = C + mt * kAmxTile * c_stride + nt * kAmxTile;
      if constexpr (kAccumulate) {
        _tile_loadd(0, c, c_bytes);
        if (two_columns) _tile_loadd(1, c + kAmxTile, c_bytes);
        if (two_rows) _tile_loadd(2, c + kAmxTile * c_stride, c_bytes);
        if (two_rows && two_columns) _tile_loadd(3, c + kAmxTile * c_stride + kAmxTile, c_bytes);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int k = 0; k < depth; k += kAmxDepth) {
        const uint16_t* a = A + mt * kAmxTile * a_stride + k;
        const uint16_t* b = B + (k / 2) * b_stride + nt * kAmxTile * 2;
        _tile_loadd(4, a, a_bytes);
        _tile_loadd(6, b, b_bytes);
        _tile_dpbf16ps(0, 4, 6);
        if (two_columns) {
          _tile_loadd(7, b + kAmxTile * 2, b_bytes);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
          _tile_loadd(5, a + kAmxTile * a_stride, a_bytes);
          _tile_dpbf16ps(2, 5, 6);
          if (two_columns) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, c_bytes);
      if (two_columns) _tile_stored(1, c + kAmxTile, c_bytes);
      if (two_rows) {
        _tile_stored(2, c + kAmxTile * c_stride, c_bytes);
        if (two_columns) _tile_stored(3, c + kAmxTile * c_stride + kAmxTile, c_bytes);
      }
    }
  }
}

// Two 16-row vectors of P^T (keys 2j and 2j + 1) as one pair panel row
// segment: bf16 e0 o0 e1 o1 ... (round to nearest even).
inline void amx_store_probability_pairs(uint16_t* dst, __m512 e, __m512 o) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // low 16 halves: e, high 16: o; then e0 o0 e1 o1 ...
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(o, e);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
}

// P^T[keys][rp] float32 (row stride rp) into the bf16 pair panel
// Pp[keys / 2][rp][2] in place (pair row j overwrites float rows <= 2 j + 1
// only after reading them), keys n .. round_up(n, kAmxDepth) zero.
inline void amx_pack_probabilities(float* p_t, int rp, int n) {
  uint16_t* pairs = reinterpret_cast<uint16_t*>(p_t);
  const int padded = (n + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
  const __m512 zero = _mm512_setzero_ps();
  for (int j = 0; j < padded / 2; ++j) {
    const float* even = p_t + int64_t(2 * j) * rp;
    const float* odd = even + rp;
    for (int c = 0; c < rp; c += 16) {
      const __m512 e = 2 * j < n ? _mm512_loadu_ps(even + c) : zero;
      const __m512 o = 2 * j + 1 < n ? _mm512_loadu_ps(odd + c) : zero;
      amx_store_probability_pairs(pairs + int64_t(j) * 2 * rp + 2 * c, e, o);
    }
  }
}

// Sixteen 16 x 32-bit vectors transposed in registers: in[i][x] -> in[x][i].
inline void amx_transpose_words(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // b[4g + k], lane L: column 4L + k of rows 4g .. 4g + 3
    b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i u0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), u1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

// amx_pack_value_words for 32 features e0 .. e0 + 31 at once, with no word
// permute: a 16-bit unpack of rows 2 jp and 2 jp + 1 pairs their features
// in each 128-bit lane (low unpack: features 8 L + 0..3 of lane L, high:
// 8 L + 4..7), and each transposed vector is stored as the row of its
// feature.
inline void amx_pack_value_words_32(const uint16_t* const* rows, int n, int jp0, int e0, uint32_t* words,
                                    int64_t word_stride) {
  __m512i low[16], high[16];
  for (int i = 0; i < 16; ++i) {
    const int j = 2 * (jp0 + i);
    const __m512i even = j < n ? _mm512_loadu_si512(rows[j] + e0) : _mm512_setzero_si512();
    const __m512i odd = j + 1 < n ? _mm512_loadu_si512(rows[j + 1] + e0) : _mm512_setzero_si512();
    low[i] = _mm512_unpacklo_epi16(even, odd);
    high[i] = _mm512_unpackhi_epi16(even, odd);
  }
  amx_transpose_words(low);
  amx_transpose_words(high);
  for (int x = 0; x < 16; ++x) {
    const int e = e0 + 8 * (x / 4) + x % 4;
    _mm512_storeu_si512(words + e * word_stride + jp0, low[x]);
    _mm512_storeu_si512(words + (e + 4) * word_stride + jp0, high[x]);
  }
}

// V^T pair words from key rows with unit feature stride: words[e][jp] =
// (rows[2 jp][e], rows[2 jp + 1][e]) for features e0 .. e0 + 15 and key pairs
// jp0 .. jp0 + 15, keys from n on zero. Row stride of words: word_stride.
inline void amx_pack_value_words(const uint16_t* const* rows, int n, int jp0, int e0, uint32_t* words,
                                 int64_t word_stride) {
  const __m512i key_pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                             6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    const int j = 2 * (jp0 + i);
    const __m256i even = j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + e0))
                               : _mm256_setzero_si256();
    const __m256i odd = j + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j + 1] + e0))
                                  : _mm256_setzero_si256();
    r[i] = _mm512_permutexvar_epi16(key_pairs, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
  }
  amx_transpose_words(r);
  for (int e = 0; e < 16; ++e) _mm512_storeu_si512(words + (e0 + e) * word_stride + jp0, r[e]);
}

// Rows as pairs of features, a B panel whose depth is the feature axis (the
// backward's K and V): words[p][j] = (rows[j][2p], rows[j][2p + 1]) for
// feature pairs p0 .. p0 + 15 and rows j0 .. j0 + 15 (unit feature stride),
// rows from n on zero. Row stride of words: word_stride.
inline void amx_pack_feature_pairs(const uint16_t* const* rows, int n, int j0, int p0, uint32_t* words,
                                   int64_t word_stride) {
  __m512i row_words[16];
  for (int i = 0; i < 16; ++i) {
    row_words[i] = j0 + i < n ? _mm512_loadu_si512(rows[j0 + i] + 2 * p0) : _mm512_setzero_si512();
  }
  amx_transpose_words(row_words);
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(words + (p0 + p) * word_stride + j0, row_words[p]);
}

// Two rows as one pair panel row, a B panel whose depth is the row axis (the
// backward's K for dQ += dS . K): words[e] = (even[e], odd[e]) for e < count,
// a multiple of 16; a null row reads as zeros.
inline void amx_pack_row_pairs(const uint16_t* even, const uint16_t* odd, int count, uint32_t* words) {
  const __m512i row_pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                             6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int e = 0; e < count; e += 16) {
    const __m256i lo = even ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + e)) : _mm256_setzero_si256();
    const __m256i hi = odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + e)) : _mm256_setzero_si256();
    _mm512_storeu_si512(words + e,
                        _mm512_permutexvar_epi16(row_pairs, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
  }
}

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
