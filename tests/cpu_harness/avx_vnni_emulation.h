// AVX-VNNI's two integer dot instructions by exact AVX2 sequences, so the
// avxvnni copy of the integer-dot quantized matvec can be checked on CPUs
// without AVX-VNNI (tests/test_int8_matvec_arm64.py builds
// int8_matvec_avxvnni.cpp with -DMLX_ATTN_EMULATE_AVX_VNNI and without
// -mavxvnni; never in the extension). avx_vnni_emulation_check.cpp checks
// them against scalar arithmetic, and against the instructions where the CPU
// has them. Needs AVX2.
#pragma once

#include <immintrin.h>

namespace avx_vnni_emulation {

// vpdpbusd (VEX, 256-bit): each int32 lane of sum plus the four products of
// u's unsigned bytes and s's signed bytes in it, wrapping, never saturating.
// Not vpmaddubsw, whose pair sums saturate (255 * -128 * 2 < -32768): each
// byte is widened to a word first (even bytes: the words' low halves, odd:
// their high halves), so every product fits (|255 * -128| < 32768) and
// vpmaddwd sums two of them to int32 exactly.
static inline __m256i dpbusd(__m256i sum, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00ff));
  const __m256i u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
  const __m256i s_odd = _mm256_srai_epi16(s, 8);
  const __m256i even = _mm256_madd_epi16(u_even, s_even), odd = _mm256_madd_epi16(u_odd, s_odd);
  return _mm256_add_epi32(sum, _mm256_add_epi32(even, odd));
}

// vpdpwssd (VEX, 256-bit): each int32 lane of sum plus the two products of
// a's and b's int16 words in it, wrapping. vpmaddwd forms the same pair sum
// modulo 2^32 (its one overflow, -32768 * -32768 twice, wraps to 0x80000000
// as vpdpwssd's 32-bit sum does).
static inline __m256i dpwssd(__m256i sum, __m256i a, __m256i b) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
}

}  // namespace avx_vnni_emulation
