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
// lane by lane; the lanes are summed once per output. One loop (block_rows)
// serves every block-at-a-time copy (AVX512-VNNI int16, AVX2 int8 and int16,
// plain C++), each ISA giving only its block step; AVX512-VNNI's int8 copy
// takes two blocks a step and has its own loop.
#pragma once

#include "csrc/cpu/elements.h"
#include "csrc/cpu/int8_matvec_kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
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

// The loop every block-at-a-time copy shares (Step: one instruction set's
// block product, below): per output feature, per chunk of groups (their
// scales and biases converted to float32), per block of 32 columns the
// weight codes unpacked once (Step::codes) and added into each row's sums
// (Step::add: the block's integer dot product times d * scale, and the bias
// term); Step::total gives the output.
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


// int16 activations: a block's 32 codes widen to 32 words, one vpdpwssd per
// row gives the block's 16 int32 lanes, scaled by one broadcast d * scale.
template <int Bits>
inline __m512i block_words(const uint8_t* w, int64_t block) {
  return _mm512_cvtepu8_epi16(one_block<Bits>(w, block));
}

struct Int16Step {
  struct Sums {
    __m512 acc;
    float bias;
  };
  using Code = int16_t;
  using Codes = __m512i;
  static Sums zero() { return {_mm512_setzero_ps(), 0.0f}; }
  template <int Bits>
  static Codes codes(const uint8_t* w, int64_t block) {
    return block_words<Bits>(w, block);
  }
  template <int Bits>
  static void add(Sums& s, const Codes& codes, int64_t, const Code* xq, const float* d, const float* sums, float scale,
                  float bias) {
    const __m512i x = _mm512_loadu_si512(xq);
    const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), codes, x);
    s.acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[0] * scale), s.acc);
    s.bias += sums[0] * 8.0f * bias;
  }
  static float total(const Sums& s) { return _mm512_reduce_add_ps(s.acc) + s.bias; }
};

template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  block_rows<Int16Step, Bits, Rows>(c, begin, end);
}

#elif defined(__AVX2__)

// A block's int32 dot products (8 lanes of 4 columns) of unsigned weight
// codes with signed activation codes. vpmaddubsw saturates pairs at int16:
// 4-bit codes (15 * 127 * 2) fit, 8-bit codes are split into nibbles.
template <int Bits>
inline __m256i block_dot(const uint8_t* w, int64_t block, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 8) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + block * 32));
    const __m256i low = _mm256_and_si256(raw, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(high, x), _mm256_set1_epi16(16)));
  } else {
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + block * 16));
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), _mm_and_si128(raw, nibble));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
  }
}

// int8 activations: each block's dot products in 8 lanes, scaled lane by lane.
struct Int8Step {
  struct Sums {
    __m256 acc, bias;
  };
  using Code = int8_t;
  using Codes = const uint8_t*;  // the weight row; block_dot unpacks it with the activations
  static Sums zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  template <int Bits>
  static Codes codes(const uint8_t* w, int64_t) {
    return w;
  }
  template <int Bits>
  static void add(Sums& s, Codes w, int64_t block, const Code* xq, const float* d, const float* sums, float scale,
                  float bias) {
    const __m256i dot = block_dot<Bits>(w, block, xq);
    s.acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_set1_ps(scale)), s.acc);
    s.bias = _mm256_fmadd_ps(_mm256_loadu_ps(sums), _mm256_set1_ps(bias), s.bias);
  }
  static float total(const Sums& s) { return lanes_sum(_mm256_add_ps(s.acc, s.bias)); }
};

// int16 activations: a block's 32 codes widen to two vectors of 16 words,
// vpmaddwd with the row's words gives 8 int32 lanes of 4 columns each.
struct Int16Step {
  struct Sums {
    __m256 acc;
    float bias;
  };
  using Code = int16_t;
  struct Codes {
    __m256i first_words, last_words;  // the block's first and last 16 codes, in the activations' order
  };
  static Sums zero() { return {_mm256_setzero_ps(), 0.0f}; }
  template <int Bits>
  static Codes codes(const uint8_t* w, int64_t b) {
    __m128i low, high;
    if constexpr (Bits == 8) {
      low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 32));
      high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 32 + 16));
    } else {
      const __m128i nibble = _mm_set1_epi8(15);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      low = _mm_and_si128(raw, nibble);
      high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    }
    return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)};
  }
  template <int Bits>
  static void add(Sums& s, const Codes& codes, int64_t, const Code* x, const float* d, const float* sums, float scale,
                  float bias) {
    const __m256i dot = _mm256_add_epi32(
        _mm256_madd_epi16(codes.first_words, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
        _mm256_madd_epi16(codes.last_words, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
    s.acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[0] * scale), s.acc);
    s.bias += sums[0] * 8.0f * bias;
  }
  static float total(const Sums& s) { return lanes_sum(s.acc) + s.bias; }
};

template <int Bits, int Rows>
void int8_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  block_rows<Int8Step, Bits, Rows>(c, begin, end);
}

template <int Bits, int Rows>
void int16_rows(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  block_rows<Int16Step, Bits, Rows>(c, begin, end);
}

#else

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

template <int Bits>
void int8_bits(const Int8MatvecCall& c, int64_t begin, int64_t end) {
  switch (c.rows) {
    case 1: return rows_of<Bits, 1>(c, begin, end);
    case 2: return rows_of<Bits, 2>(c, begin, end);
    case 3: return rows_of<Bits, 3>(c, begin, end);
    case 4: return rows_of<Bits, 4>(c, begin, end);
    case 5: return rows_of<Bits, 5>(c, begin, end);
    case 6: return rows_of<Bits, 6>(c, begin, end);
    case 7: return rows_of<Bits, 7>(c, begin, end);
    default: return rows_of<Bits, 8>(c, begin, end);
  }
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
