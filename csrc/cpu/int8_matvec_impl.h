// The integer-dot quantized matrix-vector product (csrc/cpu/int8_matvec_kernels.h)
// for one instruction set: include after defining MLX_ATTN_ISA and its isa_*.h.
//
// Per output feature, per unit of columns (64 with AVX512-VNNI: two blocks,
// 32 otherwise: one block), for every row at once: the weight codes are
// unpacked to one byte each (4-bit: a block's 16 bytes give its even columns
// from the low nibbles, then its odd columns from the high ones, the order
// the activations were quantized in), dotted with the row's int8 codes into
// int32 lanes, converted to float and accumulated as
//   acc += dot * (d * scale) + (block sum / 8) * bias
// lane by lane; the lanes are summed once per output. AVX512-VNNI's int16
// copy instead puts 16 outputs in the lanes (int16_tiles: each weight block
// unpacked once for every row); its int8 copy takes two blocks a step. AVX2
// multiplies a tile of rows times a few outputs (feature_tiles: each block's
// activations loaded once for the tile's outputs, each output's codes
// unpacked once for its rows), and so do AVX-VNNI (MLX_ATTN_INT8_AVX_VNNI:
// the block's dot by vpdpbusd / vpdpwssd) and the arm64 copies
// (MLX_ATTN_INT8_NEON: widening SMLAL, or SDOT for int8 activations with
// MLX_ATTN_INT8_DOTPROD); plain C++ one block at a time (block_rows).
#pragma once

#include "csrc/cpu/elements.h"
#include "csrc/cpu/int8_matvec_kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#if defined(MLX_ATTN_EMULATE_AVX_VNNI)
// Only the test driver's build of the avxvnni copy for CPUs without AVX-VNNI:
// its two instructions by exact AVX2 sequences.
#include "tests/cpu_harness/avx_vnni_emulation.h"
#endif
#elif defined(MLX_ATTN_INT8_NEON)
#include <arm_neon.h>
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// Scales and biases are converted to float32 this many groups at a time.
constexpr int kInt8ScaleChunk = 256;

inline void convert_scales(ElemType type, float* dst, const void* src, int64_t offset, int n) {
  switch (type) {
    case ElemType::float32: return convert_contiguous<ElemType::float32>(dst, src, offset, n);
    case ElemType::float16: return convert_contiguous<ElemType::float16>(dst, src, offset, n);
    case ElemType::bfloat16: return convert_contiguous<ElemType::bfloat16>(dst, src, offset, n);
  }
}

// What each copy's loop derives from the call once.
struct Int8Layout {
  int64_t groups;       // weight groups per output feature
  int group_shift;      // blocks per group (1, 2 or 4) as a shift: a division per block would cost more than the block
  int64_t row_bytes;    // one output feature's packed codes
  int64_t lane_stride;  // one row's entries of xd and xsum
  Int8Layout(const Int8MatvecCall& c, int bits)
      : groups(c.k / c.group_size), group_shift(c.group_size == 32 ? 0 : (c.group_size == 64 ? 1 : 2)),
        row_bytes(c.k * bits / 8), lane_stride(c.k / kInt8Block * 8) {}
};

// Output feature n's scales and biases of the chunk of groups from g0, in
// float32; returns the chunk's group count.
inline int convert_chunk(const Int8MatvecCall& c, int64_t groups, int64_t n, int64_t g0, float* scales,
                         float* biases) {
  const int chunk = int(groups - g0 < kInt8ScaleChunk ? groups - g0 : kInt8ScaleChunk);
  convert_scales(c.scale_type, scales, c.scales, n * groups + g0, chunk);
  convert_scales(c.scale_type, biases, c.biases, n * groups + g0, chunk);
  return chunk;
}

// Each row's sums of x over the groups [g0, g0 + chunk), row r in lane r:
// sums[g - g0][r] (xsum holds each block's sum / 8, repeated 8 times).
template <int Rows>
void row_group_sums(const Int8MatvecCall& c, const Int8Layout& layout, int64_t g0, int chunk, float (*sums)[8]) {
  for (int g = 0; g < chunk; ++g) {
    for (int r = 0; r < 8; ++r) sums[g][r] = 0.0f;
  }
  const int64_t first = g0 << layout.group_shift, last = (g0 + chunk) << layout.group_shift;
  for (int r = 0; r < Rows; ++r) {
    for (int64_t b = first; b < last; ++b) {
      sums[(b - first) >> layout.group_shift][r] += c.xsum[r * layout.lane_stride + b * 8] * 8.0f;
    }
  }
}

// A feature tile's scales and biases of the chunk of groups from g0 as
// [feature][group - g0] float32 (feature[f]: the tile's features, a short
// tile repeating its last): read in place when float32, the groups one chunk
// and the tile full (its features' rows lie together), else converted into
// scales and biases (a whole tile's at once when the groups are one chunk).
struct TileScales {
  const float* scales;
  const float* biases;
};
template <int Features>
MLX_ATTN_STEP TileScales tile_scale_chunk(const Int8MatvecCall& c, int64_t groups, const int64_t* feature, int features,
                                   int64_t g0, int chunk, float* scales, float* biases) {
  const bool one_chunk = groups <= kInt8ScaleChunk;
  const int64_t n0 = feature[0];
  if (one_chunk && features == Features && c.scale_type == ElemType::float32) {
    return {static_cast<const float*>(c.scales) + n0 * groups, static_cast<const float*>(c.biases) + n0 * groups};
  }
  if (one_chunk && features == Features) {
    convert_scales(c.scale_type, scales, c.scales, n0 * groups, Features * chunk);
    convert_scales(c.scale_type, biases, c.biases, n0 * groups, Features * chunk);
  } else {
    for (int f = 0; f < Features; ++f) convert_chunk(c, groups, feature[f], g0, scales + f * chunk, biases + f * chunk);
  }
  return {scales, biases};
}

#if defined(__AVX2__) || defined(MLX_ATTN_INT8_NEON)
// Weight tiles ahead of the one being multiplied whose codes are prefetched:
// a decode step streams every weight from memory once (they outgrow the
// caches), and a tile reads several rows at once.
constexpr int kPrefetchTiles = 2;

// The tile of Features outputs from n0 (before end) of the vector copies'
// feature_tiles: each output's index and codes (a short tile repeats its
// last, never stored), and the codes of the tile kPrefetchTiles ahead
// prefetched (they lie together). Returns the tile's own output count.
template <int Features>
MLX_ATTN_STEP int tile_outputs(const Int8MatvecCall& c, int64_t n0, int64_t end, int64_t row_bytes, int64_t* feature,
                               const uint8_t** w) {
  const int features = int(end - n0 < Features ? end - n0 : Features);
  for (int f = 0; f < Features; ++f) {
    feature[f] = n0 + (f < features ? f : features - 1);
    w[f] = reinterpret_cast<const uint8_t*>(c.codes) + feature[f] * row_bytes;
  }
  if (kPrefetchTiles > 0) {
    const char* ahead = reinterpret_cast<const char*>(w[0] + kPrefetchTiles * Features * row_bytes);
    for (int64_t at = 0; at < Features * row_bytes; at += 64) __builtin_prefetch(ahead + at);  // x86: prefetcht0
  }
  return features;
}

// Each vector copy's tile loop (below), the group size a shift known to the compiler.
template <typename Codes, int Bits, int Rows, int Features, int GroupShift>
void feature_tiles(const Int8MatvecCall& c, int64_t begin, int64_t end);

template <typename Codes, int Bits, int Rows, int Features>
void tiles_of_groups(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  switch (c.group_size) {
    case 32: return feature_tiles<Codes, Bits, Rows, Features, 0>(c, begin, end);
    case 64: return feature_tiles<Codes, Bits, Rows, Features, 1>(c, begin, end);
    default: return feature_tiles<Codes, Bits, Rows, Features, 2>(c, begin, end);
  }
}
#endif

#if defined(__AVX2__)
inline float lanes_sum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

#if defined(__AVX512VNNI__)

// Two blocks' weight codes as 64 bytes, block by block in the activations' order.
template <int Bits>
inline __m512i two_blocks(const uint8_t* w, int64_t block) {
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(w + block * 32);
  } else {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + block * 16));
    const __m256i low = _mm256_and_si256(raw, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    const __m512i lows_highs = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    return _mm512_shuffle_i64x2(lows_highs, lows_highs, _MM_SHUFFLE(3, 1, 2, 0));  // low0 high0 low1 high1
  }
}

template <int Bits>
inline __m256i one_block(const uint8_t* w, int64_t block) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + block * 32));
  } else {
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + block * 16));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), _mm_and_si128(raw, nibble));
  }
}

template <int Bits, int Rows>
void int8_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  const int8_t* xq = static_cast<const int8_t*>(c.xq);
  const Int8Layout layout(c, Bits);
  const int64_t groups = layout.groups, row_bytes = layout.row_bytes, lane_stride = layout.lane_stride;
  const int group_shift = layout.group_shift;
  float scales[kInt8ScaleChunk], biases[kInt8ScaleChunk];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(c.codes) + n * row_bytes;
    __m512 acc[Rows], bias_acc[Rows];
    __m256 tail[Rows];
    for (int r = 0; r < Rows; ++r) {
      acc[r] = _mm512_setzero_ps();
      bias_acc[r] = _mm512_setzero_ps();
      tail[r] = _mm256_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kInt8ScaleChunk) {
      const int chunk = convert_chunk(c, groups, n, g0, scales, biases);
      const int64_t first = (g0 << group_shift);
      const int64_t last = ((g0 + chunk) << group_shift);
      int64_t b = first;
      for (; b + 2 <= last; b += 2) {
        const __m512i codes = two_blocks<Bits>(w, b);
        const int64_t g = (b - first) >> group_shift;
        __m512 scale = _mm512_set1_ps(scales[g]);
        __m512 bias = _mm512_set1_ps(biases[g]);
        if ((b + 1 - first) >> group_shift != g) {  // the blocks straddle two groups
          scale = _mm512_insertf32x8(scale, _mm256_set1_ps(scales[g + 1]), 1);
          bias = _mm512_insertf32x8(bias, _mm256_set1_ps(biases[g + 1]), 1);
        }
        for (int r = 0; r < Rows; ++r) {
          const __m512i x = _mm512_loadu_si512(xq + r * c.k + b * kInt8Block);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x);
          const __m512 d = _mm512_loadu_ps(c.xd + r * lane_stride + b * 8);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, scale), acc[r]);
          bias_acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(c.xsum + r * lane_stride + b * 8), bias, bias_acc[r]);
        }
      }
      if (b < last) {
        const __m256i codes = one_block<Bits>(w, b);
        const int64_t g = (b - first) >> group_shift;
        const __m256 scale = _mm256_set1_ps(scales[g]);
        const __m256 bias = _mm256_set1_ps(biases[g]);
        for (int r = 0; r < Rows; ++r) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * c.k + b * kInt8Block));
          const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x);
          const __m256 d = _mm256_loadu_ps(c.xd + r * lane_stride + b * 8);
          tail[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, scale), tail[r]);
          tail[r] = _mm256_fmadd_ps(_mm256_loadu_ps(c.xsum + r * lane_stride + b * 8), bias, tail[r]);
        }
      }
    }
    for (int r = 0; r < Rows; ++r) {
      c.out[r * c.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], bias_acc[r])) + lanes_sum(tail[r]);
    }
  }
}


// int16 activations, many rows a weight pass: 16 output features in the 16
// lanes. Each 64 bytes of the 16 features' codes (4 blocks of 4-bit codes or
// 2 of 8-bit) are transposed once into a panel of weight vectors, one per
// (block, activation pair j): lane o holds feature o's two codes of pair j
// as words. Every row then takes one vpdpwssd per vector with its pair j
// broadcast, giving the block's int32 dot products of all 16 features, and
// the per-group scaling is vector work over the 16 features.
constexpr int kTileOutputs = 16;
constexpr int kTileRows = 8;      // 8 int32 + 8 float32 accumulators in registers
constexpr int kPassRows = 128;    // rows whose float sums one weight pass keeps (on the stack)
constexpr int kChunkBytes = 64;   // one feature's codes per panel

// r[o] holds feature o's 16 dwords; afterwards r[m] holds dword m of every feature (lane o).
inline void transpose_dwords(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4i + s], 128-bit lane l: dword 4l + s of features 4i .. 4i + 3
  __m512i u[16];
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int s = 0; s < 4; ++s) {
    const __m512i first_halves = _mm512_shuffle_i32x4(u[s], u[4 + s], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i last_halves = _mm512_shuffle_i32x4(u[s], u[4 + s], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i first_halves2 = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i last_halves2 = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], _MM_SHUFFLE(3, 2, 3, 2));
    r[s] = _mm512_shuffle_i32x4(first_halves, first_halves2, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + s] = _mm512_shuffle_i32x4(first_halves, first_halves2, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + s] = _mm512_shuffle_i32x4(last_halves, last_halves2, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + s] = _mm512_shuffle_i32x4(last_halves, last_halves2, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Per dword, bytes 0 and 1 (even) or 2 and 3 (odd) widened to two words.
inline __m512i even_byte_pairs(__m512i v) {
  return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9,
                                                                      -128, 12, -128, 13, -128)));
}
inline __m512i odd_byte_pairs(__m512i v) {
  return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(2, -128, 3, -128, 6, -128, 7, -128, 10, -128,
                                                                      11, -128, 14, -128, 15, -128)));
}

// The 16 features' weight vectors of the chunk at byte offset `offset`
// (`bytes` of codes, the rest read as zeros), block by block: use(block,
// weights) with weights[j] for the block's activation pairs j = 0 .. 15.
template <int Bits, typename Use>
inline void chunk_weights(const uint8_t* const features[kTileOutputs], int64_t offset, int bytes, Use&& use) {
  const __mmask64 valid = bytes == kChunkBytes ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1;
  const int blocks = bytes / (kInt8Block * Bits / 8);
  __m512i r[16];
  for (int o = 0; o < kTileOutputs; ++o) r[o] = _mm512_maskz_loadu_epi8(valid, features[o] + offset);
  transpose_dwords(r);
  __m512i weights[16];
  if constexpr (Bits == 8) {
    // dword m: columns 4m .. 4m + 3 of the chunk, pairs 2m, 2m + 1 of block m / 8
#pragma GCC unroll 2
    for (int block = 0; block < 2; ++block) {
      if (block >= blocks) return;
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        weights[2 * q] = even_byte_pairs(r[8 * block + q]);
        weights[2 * q + 1] = odd_byte_pairs(r[8 * block + q]);
      }
      use(block, weights);
    }
  } else {
    // dword m: bytes 4s .. 4s + 3 of block m / 4 (s = m % 4); their low
    // nibbles are the pairs 2s, 2s + 1 of even columns, high ones 8 + 2s, 9 + 2s
    const __m512i nibble = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int block = 0; block < 4; ++block) {
      if (block >= blocks) return;
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m512i dwords = r[4 * block + s];
        const __m512i low = _mm512_and_si512(dwords, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(dwords, 4), nibble);
        weights[2 * s] = even_byte_pairs(low);
        weights[2 * s + 1] = odd_byte_pairs(low);
        weights[8 + 2 * s] = even_byte_pairs(high);
        weights[9 + 2 * s] = odd_byte_pairs(high);
      }
      use(block, weights);
    }
  }
}

inline int32_t word_pair(const int16_t* x) {
  int32_t v;
  memcpy(&v, x, 4);
  return v;
}

// The 16 features' scales and biases of one chunk of groups, group-major.
struct TileGroups {
  const float* scales;  // [group - first][16]
  const float* biases;  // likewise, times 8 (xsum holds block sums / 8)
  int64_t first;
  int group_shift;
};

// Rows rows from `row` (Rows <= kTileRows) times block b's 16 weight
// vectors, added into total[Rows] (the 16 features' sums).
template <int Rows>
inline void block_product(const Int8MatvecCall& c, const __m512i* weights, int64_t b, const TileGroups& groups,
                          int64_t lane_stride, int row, __m512* total) {
  const int16_t* x = static_cast<const int16_t*>(c.xq) + int64_t(row) * c.k + b * kInt8Block;
  const float* xd = c.xd + row * lane_stride + b * 8;
  const float* xsum = c.xsum + row * lane_stride + b * 8;
  // a few rows split their pairs over several sums (exact integer adds), so
  // that enough independent vpdpwssd chains hide its latency
  constexpr int chains = Rows >= 6 ? 1 : (Rows >= 3 ? 2 : 4);
  __m512i dot[chains][Rows];
#pragma GCC unroll 4
  for (int h = 0; h < chains; ++h) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) dot[h][r] = _mm512_setzero_si512();
  }
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const __m512i w = weights[j];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      dot[j % chains][r] = _mm512_dpwssd_epi32(dot[j % chains][r], w, _mm512_set1_epi32(word_pair(x + r * c.k + 2 * j)));
    }
  }
#pragma GCC unroll 4
  for (int h = 1; h < chains; ++h) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) dot[0][r] = _mm512_add_epi32(dot[0][r], dot[h][r]);
  }
  const int64_t g = (b >> groups.group_shift) - groups.first;
  const __m512 scale = _mm512_load_ps(groups.scales + g * kTileOutputs);
  const __m512 bias = _mm512_load_ps(groups.biases + g * kTileOutputs);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * lane_stride]));
    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][r]), d, total[r]);
    total[r] = _mm512_fmadd_ps(bias, _mm512_set1_ps(xsum[r * lane_stride]), total[r]);
  }
}

// The blocks [first, first + blocks) of a panel (16 weight vectors a block)
// for Rows rows from `row`, added into sums [Rows][16].
template <int Rows>
inline void panel_rows(const Int8MatvecCall& c, const __m512i* panel, int64_t first, int blocks,
                       const TileGroups& groups, int64_t lane_stride, int row, float* sums) {
  __m512 total[Rows];
  for (int r = 0; r < Rows; ++r) total[r] = _mm512_load_ps(sums + r * kTileOutputs);
  for (int block = 0; block < blocks; ++block) {
    block_product<Rows>(c, panel + block * 16, first + block, groups, lane_stride, row, total);
  }
  for (int r = 0; r < Rows; ++r) _mm512_store_ps(sums + r * kTileOutputs, total[r]);
}

inline void panel_row_tiles(const Int8MatvecCall& c, const __m512i* panel, int64_t first, int blocks,
                            const TileGroups& groups, int64_t lane_stride, int row0, int rows, float* sums) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    panel_rows<kTileRows>(c, panel, first, blocks, groups, lane_stride, row0 + r, sums + r * kTileOutputs);
  }
  float* rest = sums + r * kTileOutputs;
  switch (rows - r) {
    case 1: return panel_rows<1>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 2: return panel_rows<2>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 3: return panel_rows<3>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 4: return panel_rows<4>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 5: return panel_rows<5>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 6: return panel_rows<6>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    case 7: return panel_rows<7>(c, panel, first, blocks, groups, lane_stride, row0 + r, rest);
    default: return;
  }
}

// One tile of up to 16 features: the codes of each, its scales and biases.
struct FeatureTile {
  const uint8_t* codes[kTileOutputs];  // a short tile repeats its last feature (never stored)
  int features;
  int64_t first;
};

// The tile's scales and biases of the groups from g0 into scales and biases
// [group - g0][16] (a short tile's missing features as zeros); returns the
// groups converted. Each feature's groups are converted in a row, then 16
// groups at a time are transposed to group-major in registers.
inline int tile_groups(const Int8MatvecCall& c, const FeatureTile& tile, int64_t groups, int64_t g0, float* scales,
                       float* biases) {
  alignas(64) float feature_scales[kTileOutputs][kInt8ScaleChunk], feature_biases[kTileOutputs][kInt8ScaleChunk];
  int chunk = 0;
  for (int o = 0; o < tile.features; ++o) {
    chunk = convert_chunk(c, groups, tile.first + o, g0, feature_scales[o], feature_biases[o]);
  }
  for (int g = 0; g < chunk; g += 16) {  // chunk <= kInt8ScaleChunk, a multiple of 16: rows past chunk stay in bounds
    const __mmask16 valid = chunk - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (chunk - g)) - 1);
    __m512i group_scales[16], group_biases[16];
    for (int o = 0; o < kTileOutputs; ++o) {
      const bool present = o < tile.features;
      group_scales[o] = present ? _mm512_castps_si512(_mm512_maskz_loadu_ps(valid, feature_scales[o] + g))
                                : _mm512_setzero_si512();
      group_biases[o] = present ? _mm512_castps_si512(_mm512_maskz_loadu_ps(valid, feature_biases[o] + g))
                                : _mm512_setzero_si512();
    }
    transpose_dwords(group_scales);
    transpose_dwords(group_biases);
    for (int m = 0; m < 16; ++m) {
      _mm512_store_ps(scales + (g + m) * kTileOutputs, _mm512_castsi512_ps(group_scales[m]));
      _mm512_store_ps(biases + (g + m) * kTileOutputs,
                      _mm512_mul_ps(_mm512_castsi512_ps(group_biases[m]), _mm512_set1_ps(8.0f)));
    }
  }
  return chunk;
}

inline void store_tile(const Int8MatvecCall& c, const FeatureTile& tile, int row, const __m512 total) {
  _mm512_mask_storeu_ps(c.out + int64_t(row) * c.n + tile.first, __mmask16((1u << tile.features) - 1), total);
}

// The tile's codes chunk by chunk, each chunk's groups' scales and biases
// converted before it: use(first block, blocks, groups).
template <int Bits, typename Use>
inline void tile_chunks(const Int8MatvecCall& c, const FeatureTile& tile, const Int8Layout& layout, float* scales,
                        float* biases, Use&& use) {
  constexpr int chunk_blocks = kChunkBytes / (kInt8Block * Bits / 8);
  for (int64_t g0 = 0; g0 < layout.groups; g0 += kInt8ScaleChunk) {
    const int chunk = tile_groups(c, tile, layout.groups, g0, scales, biases);
    const TileGroups groups{scales, biases, g0, layout.group_shift};
    const int64_t last = (g0 + chunk) << layout.group_shift;
    for (int64_t b = g0 << layout.group_shift; b < last; b += chunk_blocks) {
      use(b, int(last - b < chunk_blocks ? last - b : chunk_blocks), groups);
    }
  }
}

// Rows <= kTileRows: each block's weight vectors go from registers straight
// to the rows, whose sums stay in registers over the whole of k.
template <int Bits, int Rows>
void few_rows_tile(const Int8MatvecCall& c, const FeatureTile& tile, const Int8Layout& layout, float* scales,
                   float* biases) {
  constexpr int block_bytes = kInt8Block * Bits / 8;
  __m512 total[Rows];
  for (int r = 0; r < Rows; ++r) total[r] = _mm512_setzero_ps();
  tile_chunks<Bits>(c, tile, layout, scales, biases, [&](int64_t b, int blocks, const TileGroups& groups) {
    chunk_weights<Bits>(tile.codes, b * block_bytes, blocks * block_bytes, [&](int block, const __m512i* weights) {
      block_product<Rows>(c, weights, b + block, groups, layout.lane_stride, 0, total);
    });
  });
  for (int r = 0; r < Rows; ++r) store_tile(c, tile, r, total[r]);
}

// More rows: each chunk's weight vectors are kept in a panel that every row
// tile reads; the rows' sums wait in sums between chunks.
template <int Bits>
void many_rows_tile(const Int8MatvecCall& c, const FeatureTile& tile, const Int8Layout& layout, float* scales,
                    float* biases) {
  constexpr int block_bytes = kInt8Block * Bits / 8;
  alignas(64) __m512i panel[kChunkBytes / block_bytes * 16];
  alignas(64) float sums[kPassRows * kTileOutputs];
  for (int row0 = 0; row0 < c.rows; row0 += kPassRows) {
    const int rows = c.rows - row0 < kPassRows ? c.rows - row0 : kPassRows;
    for (int i = 0; i < rows * kTileOutputs; ++i) sums[i] = 0.0f;
    tile_chunks<Bits>(c, tile, layout, scales, biases, [&](int64_t b, int blocks, const TileGroups& groups) {
      chunk_weights<Bits>(tile.codes, b * block_bytes, blocks * block_bytes, [&](int block, const __m512i* weights) {
        for (int j = 0; j < 16; ++j) _mm512_store_si512(panel + block * 16 + j, weights[j]);
      });
      panel_row_tiles(c, panel, b, blocks, groups, layout.lane_stride, row0, rows, sums);
    });
    for (int r = 0; r < rows; ++r) store_tile(c, tile, row0 + r, _mm512_load_ps(sums + r * kTileOutputs));
  }
}

template <int Bits>
void int16_tiles(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  const Int8Layout layout(c, Bits);
  alignas(64) float scales[kInt8ScaleChunk * kTileOutputs], biases[kInt8ScaleChunk * kTileOutputs];
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs) {
    FeatureTile tile;
    tile.first = n0;
    tile.features = int(end - n0 < kTileOutputs ? end - n0 : kTileOutputs);
    for (int o = 0; o < kTileOutputs; ++o) {
      tile.codes[o] = reinterpret_cast<const uint8_t*>(c.codes) +
                      (n0 + (o < tile.features ? o : tile.features - 1)) * layout.row_bytes;
    }
    switch (c.rows) {
      case 1: few_rows_tile<Bits, 1>(c, tile, layout, scales, biases); break;
      case 2: few_rows_tile<Bits, 2>(c, tile, layout, scales, biases); break;
      case 3: few_rows_tile<Bits, 3>(c, tile, layout, scales, biases); break;
      case 4: few_rows_tile<Bits, 4>(c, tile, layout, scales, biases); break;
      case 5: few_rows_tile<Bits, 5>(c, tile, layout, scales, biases); break;
      case 6: few_rows_tile<Bits, 6>(c, tile, layout, scales, biases); break;
      case 7: few_rows_tile<Bits, 7>(c, tile, layout, scales, biases); break;
      case 8: few_rows_tile<Bits, 8>(c, tile, layout, scales, biases); break;
      default: many_rows_tile<Bits>(c, tile, layout, scales, biases); break;
    }
  }
}

// int16 activations take the tiles at every row count (int8_bits calls them
// before any split into 8-row passes).
template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  int16_tiles<Bits>(c, begin, end);
}

#elif defined(__AVX2__)

// AVX2 and AVX-VNNI: a tile of Rows rows times Features output features.
// Per block the rows' activations (scales d, sums) are loaded once for all
// the tile's features and each feature's codes are unpacked once for all its
// rows; each (row, feature) has its own float accumulator, so Rows * Features
// independent FMA chains hide their latency even at one row. Lane by lane,
//   acc += dot * (d * scale)
// (a block's int32 dot products: 8 lanes of 4 columns); the lanes are summed
// once per output, plus the bias term.

// The block's integer dot steps, the one thing the avx2 and avxvnni copies
// (int8_matvec_avxvnni.cpp) do differently. byte_dot: each int32 lane the
// sum of four products of unsigned codes (Int8Codes::unpack: low, and high
// when 8-bit codes are split into nibbles) and signed int8 activations;
// word_dot: sum plus, each lane, two products of int16 words (codes up to
// 255 times activations up to 32767 in magnitude, four to a lane: no
// overflow). whole_byte_codes: whether byte_dot takes 8-bit codes whole.
#if defined(MLX_ATTN_INT8_AVX_VNNI)
#if defined(MLX_ATTN_EMULATE_AVX_VNNI)
inline __m256i dpbusd(__m256i sum, __m256i u, __m256i s) { return avx_vnni_emulation::dpbusd(sum, u, s); }
inline __m256i dpwssd(__m256i sum, __m256i a, __m256i b) { return avx_vnni_emulation::dpwssd(sum, a, b); }
#elif defined(__AVXVNNI__)
inline __m256i dpbusd(__m256i sum, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(sum, u, s); }
inline __m256i dpwssd(__m256i sum, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(sum, a, b); }
#else
#error "the avxvnni copy needs AVX-VNNI (-mavxvnni)"
#endif
// vpdpbusd sums its four byte products into int32 without saturating.
constexpr bool whole_byte_codes = true;
template <int Bits>
inline __m256i byte_dot(__m256i low, __m256i, __m256i x) {
  return dpbusd(_mm256_setzero_si256(), low, x);
}
inline __m256i word_dot(__m256i sum, __m256i codes, __m256i x) { return dpwssd(sum, codes, x); }
#else
// vpmaddubsw's pair sums saturate at int16 (4-bit codes, 15 * 127 * 2, fit;
// 8-bit codes are split into nibbles, weighted 1 and 16 by vpmaddwd).
constexpr bool whole_byte_codes = false;
template <int Bits>
inline __m256i byte_dot(__m256i low, __m256i high, __m256i x) {
  const __m256i low_dot = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x), _mm256_set1_epi16(1));
  if constexpr (Bits == 4) return low_dot;
  return _mm256_add_epi32(low_dot, _mm256_madd_epi16(_mm256_maddubs_epi16(high, x), _mm256_set1_epi16(16)));
}
inline __m256i word_dot(__m256i sum, __m256i codes, __m256i x) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(codes, x));
}
#endif

// int16 activations: the block's 32 codes as two vectors of 16 words, each
// dotted with the row's words.
struct Int16Codes {
  using Code = int16_t;
  static constexpr int activation_bits = 16;
  struct Unpacked {
    __m256i first, last;  // the block's first and last 16 codes, in the activations' order
  };
  template <int Bits>
  static Unpacked unpack(const uint8_t* w, int64_t b) {
    if constexpr (Bits == 8) {
      return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 32))),
              _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 32 + 16)))};
    } else {
      // each byte widened to a word holds its low nibble (an even column) and
      // its high one (the odd column) in bits 0-3 and 4-7
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16)));
      return {_mm256_and_si256(bytes, _mm256_set1_epi16(15)), _mm256_srli_epi16(bytes, 4)};
    }
  }
  template <int Bits>
  static __m256i dot(const Unpacked& codes, const int16_t* x) {
    const __m256i first = word_dot(_mm256_setzero_si256(), codes.first,
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return word_dot(first, codes.last, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  }
};

// int8 activations: the unsigned codes times the row's signed bytes by
// byte_dot (8-bit codes split into nibbles unless it takes them whole).
struct Int8Codes {
  using Code = int8_t;
  static constexpr int activation_bits = 8;
  struct Unpacked {
    // the block's 32 codes in low (4-bit codes, or whole 8-bit ones); split
    // 8-bit codes: their low nibbles in low, high ones in high
    __m256i low, high;
  };
  template <int Bits>
  static Unpacked unpack(const uint8_t* w, int64_t b) {
    const __m256i nibble = _mm256_set1_epi8(15);
    if constexpr (Bits == 8) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
      if constexpr (whole_byte_codes) return {raw, _mm256_setzero_si256()};
      return {_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble)};
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      const __m128i low = _mm_and_si128(raw, _mm256_castsi256_si128(nibble));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm256_castsi256_si128(nibble));
      return {_mm256_set_m128i(high, low), _mm256_setzero_si256()};
    }
  }
  template <int Bits>
  static __m256i dot(const Unpacked& codes, const int8_t* xq) {
    return byte_dot<Bits>(codes.low, codes.high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  }
};

// Output features [begin, end) of Rows rows, Features at a time; per chunk
// of groups their scales and biases converted to float32 (a whole tile's at
// once when the groups are one chunk: they lie together). The bias term,
// sum over groups of bias * (the row's group sum of x), is one vector FMA
// per feature and group for all the rows (rows in the lanes). GroupShift:
// blocks per group (1, 2 or 4) as a shift, known to the compiler.
template <typename Codes, int Bits, int Rows, int Features, int GroupShift>
void feature_tiles(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  static_assert(Rows <= 8, "the bias term holds the rows in 8 lanes");
  using Code = typename Codes::Code;
  const Code* xq = static_cast<const Code*>(c.xq);
  const Int8Layout layout(c, Bits);
  const int64_t groups = layout.groups, row_bytes = layout.row_bytes, lane_stride = layout.lane_stride;
  const bool one_chunk = groups <= kInt8ScaleChunk;
  float scales[Features * kInt8ScaleChunk], biases[Features * kInt8ScaleChunk];  // [feature][group - g0]
  alignas(32) float group_sums[kInt8ScaleChunk][8];
  if (one_chunk) row_group_sums<Rows>(c, layout, 0, int(groups), group_sums);
  for (int64_t n0 = begin; n0 < end; n0 += Features) {
    int64_t feature[Features];
    const uint8_t* w[Features];
    const int features = tile_outputs<Features>(c, n0, end, row_bytes, feature, w);
    __m256 acc[Rows][Features], bias_terms[Features];
    for (int f = 0; f < Features; ++f) {
      bias_terms[f] = _mm256_setzero_ps();
      for (int r = 0; r < Rows; ++r) acc[r][f] = _mm256_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kInt8ScaleChunk) {
      const int chunk = int(groups - g0 < kInt8ScaleChunk ? groups - g0 : kInt8ScaleChunk);
      const TileScales tile = tile_scale_chunk<Features>(c, groups, feature, features, g0, chunk, scales, biases);
      const float* tile_scales = tile.scales;
      const float* tile_biases = tile.biases;
      if (!one_chunk) row_group_sums<Rows>(c, layout, g0, chunk, group_sums);
      const int64_t first = g0 << GroupShift, last = (g0 + chunk) << GroupShift;
      for (int64_t b = first; b < last; ++b) {
        const int64_t g = (b - first) >> GroupShift;
        const bool group_start = GroupShift == 0 || ((b - first) & ((1 << GroupShift) - 1)) == 0;
        __m256 d[Rows];
        for (int r = 0; r < Rows; ++r) d[r] = _mm256_loadu_ps(c.xd + r * lane_stride + b * 8);
        for (int f = 0; f < Features; ++f) {
          const typename Codes::Unpacked codes = Codes::template unpack<Bits>(w[f], b);
          const __m256 scale = _mm256_set1_ps(tile_scales[f * chunk + g]);
          for (int r = 0; r < Rows; ++r) {
            const __m256i dot = Codes::template dot<Bits>(codes, xq + r * c.k + b * kInt8Block);
            acc[r][f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[r], scale), acc[r][f]);
          }
          if (group_start) {
            bias_terms[f] = _mm256_fmadd_ps(_mm256_set1_ps(tile_biases[f * chunk + g]), _mm256_load_ps(group_sums[g]),
                                            bias_terms[f]);
          }
        }
      }
    }
    for (int f = 0; f < features; ++f) {
      alignas(32) float bias_term[8];
      _mm256_store_ps(bias_term, bias_terms[f]);
      for (int r = 0; r < Rows; ++r) c.out[r * c.n + n0 + f] = lanes_sum(acc[r][f]) + bias_term[r];
    }
  }
}

// Features a tile takes at Rows rows: enough accumulators to hide the FMA
// latency at few rows, few enough to stay in the 16 registers at more
// (measured on SmolLM2's layers, one thread, with AVX2: 4 at one row, then
// 2; int8 activations at 5 to 8 rows 1; AVX-VNNI takes the same, unmeasured).
template <int Rows, bool Int8>
constexpr int kTileFeatures = Rows == 1 ? 4 : (Rows <= 4 || !Int8 ? 2 : 1);

template <int Bits, int Rows>
void int8_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  tiles_of_groups<Int8Codes, Bits, Rows, kTileFeatures<Rows, true>>(c, begin, end);
}

template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  tiles_of_groups<Int16Codes, Bits, Rows, kTileFeatures<Rows, false>>(c, begin, end);
}

#elif defined(MLX_ATTN_INT8_NEON)

// arm64 (int8_matvec_neon.cpp, int8_matvec_neondot.cpp,
// int8_matvec_neoni8mm.cpp): the AVX2 copy's feature_tiles with four float
// lanes. Per block each output's codes are unpacked once for the tile's rows
// and multiplied with a row's codes into four int32 lanes, then, lane by lane,
//   acc += dot * (d * scale)
// (d * scale one scalar: FMLA by element); the lanes are summed once per
// output, plus the bias term (TileSums). Every (row, output) has its own
// accumulator and the same steps at any row count, so a row's result does not
// depend on the rows beside it. FEAT_I8MM's int8 step instead multiplies two
// rows by two outputs at once, each (row, output) one lane holding the
// block's whole dot product (MatrixCodes, TileSums<MatrixCodes>).

// Baseline NEON: the block's 32 codes widened to four int16x8 vectors, times
// the row's codes (int16, or int8 widened) by SMULL / SMLAL(2) into int32
// lanes (|15 or 255 x 32767| x 8 per lane fits easily).
template <typename CodeType>
struct WideningCodes {
  using Code = CodeType;
  static constexpr int activation_bits = int(sizeof(Code)) * 8;
  struct Unpacked {
    int16x8_t v[4];  // the block's 32 codes in the activations' order
  };
  template <int Bits>
  static Unpacked unpack(const uint8_t* w, int64_t b) {
    uint8x16_t first, last;  // the block's first and last 16 codes
    if constexpr (Bits == 8) {
      first = vld1q_u8(w + b * 32);
      last = vld1q_u8(w + b * 32 + 16);
    } else {
      const uint8x16_t raw = vld1q_u8(w + b * 16);
      first = vandq_u8(raw, vdupq_n_u8(15));  // low nibbles: the even columns
      last = vshrq_n_u8(raw, 4);              // high nibbles: the odd columns
    }
    return {{vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(first))), vreinterpretq_s16_u16(vmovl_high_u8(first)),
             vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(last))), vreinterpretq_s16_u16(vmovl_high_u8(last))}};
  }
  // Codes i * 8 .. i * 8 + 7 of the row's block as int16.
  static int16x8_t row_codes(const Code* x, int i) {
    if constexpr (sizeof(Code) == 2) {
      return vld1q_s16(x + 8 * i);
    } else {
      const int8x16_t sixteen = vld1q_s8(x + 16 * (i / 2));
      return i % 2 == 0 ? vmovl_s8(vget_low_s8(sixteen)) : vmovl_high_s8(sixteen);
    }
  }
  template <int Bits>
  static int32x4_t dot(const Unpacked& codes, const Code* x) {
    // two chains (the low and high halves) halve the dependent SMLALs
    int16x8_t xs = row_codes(x, 0);
    int32x4_t low = vmull_s16(vget_low_s16(codes.v[0]), vget_low_s16(xs));
    int32x4_t high = vmull_high_s16(codes.v[0], xs);
    for (int i = 1; i < 4; ++i) {
      xs = row_codes(x, i);
      low = vmlal_s16(low, vget_low_s16(codes.v[i]), vget_low_s16(xs));
      high = vmlal_high_s16(high, codes.v[i], xs);
    }
    return vaddq_s32(low, high);
  }
};

#if defined(MLX_ATTN_INT8_DOTPROD)
#if !defined(__ARM_FEATURE_DOTPROD)
#error "the dotprod copy needs FEAT_DotProd (-march=armv8.2-a+dotprod)"
#endif
// FEAT_DotProd, int8 activations: the codes as signed bytes (4-bit codes as
// they are; 8-bit ones split into nibbles, 0 .. 15, as SDOT has no unsigned x
// signed form) times the row's int8 codes by SDOT, four products a lane.
struct DotCodes {
  using Code = int8_t;
  static constexpr int activation_bits = 8;
  struct Unpacked {
    // 4-bit: v[0] the even columns, v[1] the odd ones; 8-bit: the low
    // nibbles of the block's two halves, then their high nibbles
    int8x16_t v[4];
  };
  template <int Bits>
  static Unpacked unpack(const uint8_t* w, int64_t b) {
    const uint8x16_t nibble = vdupq_n_u8(15);
    if constexpr (Bits == 8) {
      const uint8x16_t first = vld1q_u8(w + b * 32), last = vld1q_u8(w + b * 32 + 16);
      return {{vreinterpretq_s8_u8(vandq_u8(first, nibble)), vreinterpretq_s8_u8(vandq_u8(last, nibble)),
               vreinterpretq_s8_u8(vshrq_n_u8(first, 4)), vreinterpretq_s8_u8(vshrq_n_u8(last, 4))}};
    } else {
      const uint8x16_t raw = vld1q_u8(w + b * 16);
      const int8x16_t zero = vdupq_n_s8(0);
      return {{vreinterpretq_s8_u8(vandq_u8(raw, nibble)), vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), zero, zero}};
    }
  }
  template <int Bits>
  static int32x4_t dot(const Unpacked& codes, const int8_t* x) {
    const int8x16_t first = vld1q_s8(x), last = vld1q_s8(x + 16);
    const int32x4_t low = vdotq_s32(vdotq_s32(vdupq_n_s32(0), codes.v[0], first), codes.v[1], last);
    if constexpr (Bits == 8) {
      const int32x4_t high = vdotq_s32(vdotq_s32(vdupq_n_s32(0), codes.v[2], first), codes.v[3], last);
      return vaddq_s32(low, vshlq_n_s32(high, 4));
    } else {
      return low;
    }
  }
};
#endif

// A tile's Rows x Features sums over the blocks (feature_tiles), for the
// steps that dot one row with one output's codes (WideningCodes, DotCodes):
// four float lanes per (row, output), summed once at the end.
template <typename Codes, int Rows, int Features>
struct TileSums {
  using Code = typename Codes::Code;
  float32x4_t acc[Rows][Features];
  TileSums() {
    for (int r = 0; r < Rows; ++r) {
      for (int f = 0; f < Features; ++f) acc[r][f] = vdupq_n_f32(0.0f);
    }
  }
  // Block b of the outputs' codes w[f] (their scales scales[f * scale_stride]).
  template <int Bits>
  MLX_ATTN_STEP void add(const Int8MatvecCall& c, const uint8_t* const* w, int64_t b, int64_t lane_stride,
                         const float* scales, int scale_stride) {
    const Code* xq = static_cast<const Code*>(c.xq) + b * kInt8Block;
    for (int f = 0; f < Features; ++f) {
      const typename Codes::Unpacked codes = Codes::template unpack<Bits>(w[f], b);
      const float scale = scales[f * scale_stride];
      for (int r = 0; r < Rows; ++r) {
        const int32x4_t dot = Codes::template dot<Bits>(codes, xq + r * c.k);
        acc[r][f] = vfmaq_n_f32(acc[r][f], vcvtq_f32_s32(dot), c.xd[r * lane_stride + b * 8] * scale);
      }
    }
  }
  float total(int r, int f) const { return vaddvq_f32(acc[r][f]); }
};

#if defined(MLX_ATTN_INT8_I8MM)
#if !defined(__ARM_FEATURE_MATMUL_INT8)
#error "the i8mm copy needs FEAT_I8MM (-march=armv8.2-a+dotprod+i8mm)"
#endif
// FEAT_I8MM, int8 activations: USMMLA multiplies a 2 x 8 matrix of unsigned
// bytes (two outputs' codes over 8 columns) by an 8 x 2 matrix of signed
// bytes (two rows' codes over the same columns) into 2 x 2 int32 lanes,
// (output i, row j) in lane 2i + j: 32 products an instruction (SDOT: 16),
// and 8-bit codes go whole (unsigned times signed). Four give two outputs'
// block dot products with two rows.
struct MatrixCodes {
  using Code = int8_t;
  static constexpr int activation_bits = 8;
  // v[i]: columns 8i .. 8i + 7 of the block (the activations' order) of a
  // pair of outputs or rows, the first's 8 bytes then the second's
  struct Unpacked {
    uint8x16_t v[4];
  };
  struct RowPair {
    int8x16_t v[4];
  };
  static uint8x16_t first_halves(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip1q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
  }
  static uint8x16_t last_halves(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip2q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
  }
  template <int Bits>
  static Unpacked unpack(const uint8_t* w0, const uint8_t* w1, int64_t b) {
    uint8x16_t first[2], last[2];  // each output's first and last 16 codes of the block
    const uint8_t* w[2] = {w0, w1};
    for (int i = 0; i < 2; ++i) {
      if constexpr (Bits == 8) {
        first[i] = vld1q_u8(w[i] + b * 32);
        last[i] = vld1q_u8(w[i] + b * 32 + 16);
      } else {
        const uint8x16_t raw = vld1q_u8(w[i] + b * 16);
        first[i] = vandq_u8(raw, vdupq_n_u8(15));  // low nibbles: the even columns
        last[i] = vshrq_n_u8(raw, 4);              // high nibbles: the odd columns
      }
    }
    return {{first_halves(first[0], first[1]), last_halves(first[0], first[1]), first_halves(last[0], last[1]),
             last_halves(last[0], last[1])}};
  }
  // Two rows' codes of the block (x1 null: a row of zeros).
  static RowPair rows(const int8_t* x0, const int8_t* x1) {
    const uint8x16_t zero = vdupq_n_u8(0);
    const uint8x16_t first0 = vreinterpretq_u8_s8(vld1q_s8(x0)), last0 = vreinterpretq_u8_s8(vld1q_s8(x0 + 16));
    const uint8x16_t first1 = x1 ? vreinterpretq_u8_s8(vld1q_s8(x1)) : zero;
    const uint8x16_t last1 = x1 ? vreinterpretq_u8_s8(vld1q_s8(x1 + 16)) : zero;
    return {{vreinterpretq_s8_u8(first_halves(first0, first1)), vreinterpretq_s8_u8(last_halves(first0, first1)),
             vreinterpretq_s8_u8(first_halves(last0, last1)), vreinterpretq_s8_u8(last_halves(last0, last1))}};
  }
  static int32x4_t dot(const Unpacked& codes, const RowPair& x) {
    int32x4_t sums = vusmmlaq_s32(vdupq_n_s32(0), codes.v[0], x.v[0]);
    for (int i = 1; i < 4; ++i) sums = vusmmlaq_s32(sums, codes.v[i], x.v[i]);
    return sums;
  }
};

// The sums of pairs of rows and pairs of outputs: (row r, output f) is lane
// 2 * (f % 2) + r % 2 of acc[r / 2][f / 2], where each block adds
// dot * (d * scale) with the block's whole integer dot product. A last odd
// row pairs with a row of zeros, so every row takes the same steps in its
// lane alone or in a batch.
template <int Rows, int Features>
struct TileSums<MatrixCodes, Rows, Features> {
  static_assert(Features % 2 == 0, "the outputs go in pairs");
  static constexpr int row_pairs = (Rows + 1) / 2, output_pairs = Features / 2;
  float32x4_t acc[row_pairs][output_pairs];
  TileSums() {
    for (int i = 0; i < row_pairs; ++i) {
      for (int p = 0; p < output_pairs; ++p) acc[i][p] = vdupq_n_f32(0.0f);
    }
  }
  template <int Bits>
  MLX_ATTN_STEP void add(const Int8MatvecCall& c, const uint8_t* const* w, int64_t b, int64_t lane_stride,
                         const float* scales, int scale_stride) {
    const int8_t* xq = static_cast<const int8_t*>(c.xq) + b * kInt8Block;
    MatrixCodes::Unpacked codes[output_pairs];
    float32x4_t scale[output_pairs];  // lanes: output 2p, 2p, 2p + 1, 2p + 1
    for (int p = 0; p < output_pairs; ++p) {
      codes[p] = MatrixCodes::unpack<Bits>(w[2 * p], w[2 * p + 1], b);
      scale[p] = vcombine_f32(vdup_n_f32(scales[2 * p * scale_stride]), vdup_n_f32(scales[(2 * p + 1) * scale_stride]));
    }
    for (int i = 0; i < row_pairs; ++i) {
      const int r = 2 * i;
      const bool paired = r + 1 < Rows;
      const MatrixCodes::RowPair x = MatrixCodes::rows(xq + r * c.k, paired ? xq + (r + 1) * c.k : nullptr);
      const float32x2_t d_pair = vset_lane_f32(paired ? c.xd[(r + 1) * lane_stride + b * 8] : 0.0f,
                                               vdup_n_f32(c.xd[r * lane_stride + b * 8]), 1);
      const float32x4_t d = vcombine_f32(d_pair, d_pair);  // lanes: rows r, r + 1, r, r + 1
      for (int p = 0; p < output_pairs; ++p) {
        acc[i][p] = vfmaq_f32(acc[i][p], vcvtq_f32_s32(MatrixCodes::dot(codes[p], x)), vmulq_f32(d, scale[p]));
      }
    }
  }
  float total(int r, int f) const {
    alignas(16) float lanes[4];
    vst1q_f32(lanes, acc[r / 2][f / 2]);
    return lanes[2 * (f % 2) + r % 2];
  }
};
#endif

#if defined(MLX_ATTN_INT8_I8MM)
using Int8Step = MatrixCodes;
#elif defined(MLX_ATTN_INT8_DOTPROD)
using Int8Step = DotCodes;
#else
using Int8Step = WideningCodes<int8_t>;
#endif

// Output features [begin, end) of Rows rows, Features at a time, as the AVX2
// copy's feature_tiles (the blocks' products in TileSums): the bias term, sum
// over groups of bias * (the row's group sum of x), is one vector FMA per
// feature and group for four rows (rows in the lanes).
template <typename Codes, int Bits, int Rows, int Features, int GroupShift>
void feature_tiles(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  static_assert(Rows <= 8, "the bias term holds the rows in 8 lanes");
  constexpr int row_quads = (Rows + 3) / 4;
  const Int8Layout layout(c, Bits);
  const int64_t groups = layout.groups, row_bytes = layout.row_bytes, lane_stride = layout.lane_stride;
  const bool one_chunk = groups <= kInt8ScaleChunk;
  float scales[Features * kInt8ScaleChunk], biases[Features * kInt8ScaleChunk];  // [feature][group - g0]
  alignas(16) float group_sums[kInt8ScaleChunk][8];
  if (one_chunk) row_group_sums<Rows>(c, layout, 0, int(groups), group_sums);
  for (int64_t n0 = begin; n0 < end; n0 += Features) {
    int64_t feature[Features];
    const uint8_t* w[Features];
    const int features = tile_outputs<Features>(c, n0, end, row_bytes, feature, w);
    TileSums<Codes, Rows, Features> sums;
    float32x4_t bias_terms[Features][row_quads];
    for (int f = 0; f < Features; ++f) {
      for (int q = 0; q < row_quads; ++q) bias_terms[f][q] = vdupq_n_f32(0.0f);
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kInt8ScaleChunk) {
      const int chunk = int(groups - g0 < kInt8ScaleChunk ? groups - g0 : kInt8ScaleChunk);
      const TileScales tile = tile_scale_chunk<Features>(c, groups, feature, features, g0, chunk, scales, biases);
      if (!one_chunk) row_group_sums<Rows>(c, layout, g0, chunk, group_sums);
      const int64_t first = g0 << GroupShift, last = (g0 + chunk) << GroupShift;
      for (int64_t b = first; b < last; ++b) {
        const int64_t g = (b - first) >> GroupShift;
        sums.template add<Bits>(c, w, b, lane_stride, tile.scales + g, chunk);
        if (GroupShift == 0 || ((b - first) & ((1 << GroupShift) - 1)) == 0) {  // the group's first block
          for (int f = 0; f < Features; ++f) {
            const float bias = tile.biases[f * chunk + g];
            for (int q = 0; q < row_quads; ++q) {
              bias_terms[f][q] = vfmaq_n_f32(bias_terms[f][q], vld1q_f32(group_sums[g] + 4 * q), bias);
            }
          }
        }
      }
    }
    for (int f = 0; f < features; ++f) {
      alignas(16) float bias_term[8];
      for (int q = 0; q < row_quads; ++q) vst1q_f32(bias_term + 4 * q, bias_terms[f][q]);
      for (int r = 0; r < Rows; ++r) c.out[r * c.n + n0 + f] = sums.total(r, f) + bias_term[r];
    }
  }
}

// Features a tile takes at Rows rows: 32 vector registers hold Rows x
// Features accumulators plus a feature's unpacked codes and a row's codes
// (reasoned, not measured: 4 at one or two rows, 2 up to 8 rows, 16
// accumulators; even, as MatrixCodes takes the outputs in pairs).
template <int Rows>
constexpr int kTileFeatures = Rows <= 2 ? 4 : 2;

template <int Bits, int Rows>
void int8_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  tiles_of_groups<Int8Step, Bits, Rows, kTileFeatures<Rows>>(c, begin, end);
}

template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  tiles_of_groups<WideningCodes<int16_t>, Bits, Rows, kTileFeatures<Rows>>(c, begin, end);
}

#else

// The plain C++ loop (Step: the block product, below): per output feature,
// per chunk of groups (their scales and biases converted to float32), per
// block of 32 columns the weight codes unpacked once (Step::codes) and added
// into each row's sums (Step::add: the block's integer dot product times
// d * scale, and the bias term); Step::total gives the output.
template <typename Step, int Bits, int Rows>
void block_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  using Code = typename Step::Code;
  const Code* xq = static_cast<const Code*>(c.xq);
  const Int8Layout layout(c, Bits);
  const int64_t groups = layout.groups, row_bytes = layout.row_bytes, lane_stride = layout.lane_stride;
  const int group_shift = layout.group_shift;
  float scales[kInt8ScaleChunk], biases[kInt8ScaleChunk];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(c.codes) + n * row_bytes;
    typename Step::Sums sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = Step::zero();
    for (int64_t g0 = 0; g0 < groups; g0 += kInt8ScaleChunk) {
      const int chunk = convert_chunk(c, groups, n, g0, scales, biases);
      const int64_t first = g0 << group_shift;
      for (int64_t b = first; b < ((g0 + chunk) << group_shift); ++b) {
        const int64_t g = (b - first) >> group_shift;
        const auto codes = Step::template codes<Bits>(w, b);
        for (int r = 0; r < Rows; ++r) {
          Step::template add<Bits>(sums[r], codes, b, xq + r * c.k + b * kInt8Block, c.xd + r * lane_stride + b * 8,
                                   c.xsum + r * lane_stride + b * 8, scales[g], biases[g]);
        }
      }
    }
    for (int r = 0; r < Rows; ++r) c.out[r * c.n + n] = Step::total(sums[r]);
  }
}

// Plain C++: the same sums, one block at a time (the reference the vector
// copies are tested against).
template <typename CodeType>
struct ScalarStep {
  using Code = CodeType;
  using Sums = float;
  struct Codes {
    uint8_t v[kInt8Block];
  };
  static Sums zero() { return 0.0f; }
  template <int Bits>
  static Codes codes(const uint8_t* w, int64_t b) {
    Codes codes;
    for (int i = 0; i < kInt8Block; ++i) {
      if constexpr (Bits == 8) {
        codes.v[i] = w[b * 32 + i];
      } else {
        const uint8_t byte = w[b * 16 + i % 16];
        codes.v[i] = i < 16 ? byte & 15 : byte >> 4;
      }
    }
    return codes;
  }
  template <int Bits>
  static void add(Sums& s, const Codes& codes, int64_t, const Code* x, const float* d, const float* sums, float scale,
                  float bias) {
    int32_t dot = 0;
    for (int i = 0; i < kInt8Block; ++i) dot += int32_t(codes.v[i]) * int32_t(x[i]);
    const float block_sum = sums[0] * 8.0f;
    s += float(dot) * (d[0] * scale) + block_sum * bias;
  }
  static float total(Sums s) { return s; }
};

template <int Bits, int Rows>
void int8_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  block_rows<ScalarStep<int8_t>, Bits, Rows>(c, begin, end);
}

template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  block_rows<ScalarStep<int16_t>, Bits, Rows>(c, begin, end);
}

#endif

template <int Bits, int Rows>
void rows_of(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  if (c.activation_bits == 16) {
    int16_rows<Bits, Rows>(c, begin, end);
  } else {
    int8_rows<Bits, Rows>(c, begin, end);
  }
}

// The AVX2, NEON, AVX512-VNNI int8 and plain C++ copies take up to this many rows a weight pass.
constexpr int kBlockRows = 8;

template <int Bits>
void block_passes(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  const int64_t lane_stride = c.k / kInt8Block * 8;
  const int64_t code_bytes = c.activation_bits / 8;
  for (int row = 0; row < c.rows; row += kBlockRows) {
    Int8MatvecCall part = c;
    part.rows = c.rows - row < kBlockRows ? c.rows - row : kBlockRows;
    part.xq = static_cast<const char*>(c.xq) + row * c.k * code_bytes;
    part.xd = c.xd + row * lane_stride;
    part.xsum = c.xsum + row * lane_stride;
    part.out = c.out + int64_t(row) * c.n;
    switch (part.rows) {
      case 1: rows_of<Bits, 1>(part, begin, end); break;
      case 2: rows_of<Bits, 2>(part, begin, end); break;
      case 3: rows_of<Bits, 3>(part, begin, end); break;
      case 4: rows_of<Bits, 4>(part, begin, end); break;
      case 5: rows_of<Bits, 5>(part, begin, end); break;
      case 6: rows_of<Bits, 6>(part, begin, end); break;
      case 7: rows_of<Bits, 7>(part, begin, end); break;
      default: rows_of<Bits, 8>(part, begin, end); break;
    }
  }
}

template <int Bits>
void int8_bits(const Int8MatvecCall& c, int64_t begin, int64_t end) {
#if defined(__AVX512VNNI__)
  if (c.activation_bits == 16) return int16_tiles<Bits>(c, begin, end);
#endif
  block_passes<Bits>(c, begin, end);
}

}  // namespace

void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end) {
  if (call.bits == 8) {
    int8_bits<8>(call, begin, end);
  } else {
    int8_bits<4>(call, begin, end);
  }
}

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
