// Checks avx_vnni_emulation.h, the exact AVX2 stand-ins for vpdpbusd and
// vpdpwssd the test driver's avxvnni_emulated copy uses: each int32 lane
// against the sums formed here in 64-bit integers, reduced modulo 2^32, on
// seeded random inputs and on the extremes (every code 0 to 255 times -128
// to 127, every word -32768 or 32767, sums at INT32_MAX / INT32_MIN so the
// additions wrap); where the CPU has AVX-VNNI, against the instructions themselves too.
// Build with AVX2 (-mavx2); no STL. Prints one line; exits 1 on any mismatch.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "csrc/cpu/cpu_features.h"
#include "tests/cpu_harness/avx_vnni_emulation.h"

namespace {

struct Lanes {
  int32_t sum[8];
  uint8_t u[32];  // also a's words for vpdpwssd, as bytes
  int8_t s[32];   // also b's words
};

__m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

int32_t wrapped(int64_t v) { return int32_t(uint32_t(uint64_t(v))); }

int32_t scalar_dpbusd(const Lanes& l, int lane) {
  int64_t total = l.sum[lane];
  for (int i = 0; i < 4; ++i) total += int64_t(l.u[4 * lane + i]) * int64_t(l.s[4 * lane + i]);
  return wrapped(total);
}

int32_t scalar_dpwssd(const Lanes& l, int lane) {
  int16_t a[16], b[16];
  memcpy(a, l.u, 32);
  memcpy(b, l.s, 32);
  return wrapped(int64_t(l.sum[lane]) + int64_t(a[2 * lane]) * b[2 * lane] + int64_t(a[2 * lane + 1]) * b[2 * lane + 1]);
}

#if defined(__clang__) || defined(__GNUC__)
__attribute__((target("avx2,avxvnni"))) void hardware(const Lanes& l, int32_t* busd, int32_t* wssd) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(busd), _mm256_dpbusd_avx_epi32(load(l.sum), load(l.u), load(l.s)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(wssd), _mm256_dpwssd_avx_epi32(load(l.sum), load(l.u), load(l.s)));
}
#endif

// Returns the mismatching lanes (printing the first few).
int check(const Lanes& l, bool with_hardware, int& reported) {
  using namespace avx_vnni_emulation;
  int32_t busd[8], wssd[8], hw_busd[8], hw_wssd[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(busd), dpbusd(load(l.sum), load(l.u), load(l.s)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(wssd), dpwssd(load(l.sum), load(l.u), load(l.s)));
  if (with_hardware) hardware(l, hw_busd, hw_wssd);
  int misses = 0;
  for (int lane = 0; lane < 8; ++lane) {
    const int32_t want_busd = scalar_dpbusd(l, lane), want_wssd = scalar_dpwssd(l, lane);
    bool ok = busd[lane] == want_busd && wssd[lane] == want_wssd;
    if (with_hardware) ok = ok && hw_busd[lane] == want_busd && hw_wssd[lane] == want_wssd;
    if (!ok) {
      ++misses;
      if (reported++ < 4) {
        printf("  lane %d: dpbusd %d (want %d), dpwssd %d (want %d)\n", lane, busd[lane], want_busd, wssd[lane],
               want_wssd);
      }
    }
  }
  return misses;
}

}  // namespace

int main() {
  const bool with_hardware = mlx_attn::cpu::features::avx_vnni();
  int cases = 0, misses = 0, reported = 0;
  // the extremes: every byte pattern of u and s from the corner values, with
  // sums that make the final additions wrap both ways
  const uint8_t codes[] = {0, 1, 15, 127, 128, 255};
  const int8_t activations[] = {-128, -127, -1, 0, 1, 127};
  const int32_t sums[] = {0, 2147483647, -2147483647 - 1, 65280, -65536};
  for (uint8_t u : codes) {
    for (int8_t s : activations) {
      for (int32_t sum : sums) {
        Lanes l;
        memset(l.u, u, 32);
        memset(l.s, s, 32);
        for (int i = 0; i < 8; ++i) l.sum[i] = sum;
        misses += check(l, with_hardware, reported);
        ++cases;
      }
    }
  }
  // the word extremes: every word of a and of b -32768, -1 or 32767
  const int16_t words[] = {-32768, -1, 32767};
  for (int16_t a : words) {
    for (int16_t b : words) {
      for (int32_t sum : sums) {
        Lanes l;
        for (int i = 0; i < 16; ++i) memcpy(l.u + 2 * i, &a, 2), memcpy(l.s + 2 * i, &b, 2);
        for (int i = 0; i < 8; ++i) l.sum[i] = sum;
        misses += check(l, with_hardware, reported);
        ++cases;
      }
    }
  }
  // seeded random bytes and sums
  uint32_t state = 2463534242u;
  auto next = [&state] {
    state ^= state << 13, state ^= state >> 17, state ^= state << 5;
    return state;
  };
  for (int c = 0; c < 100000; ++c) {
    Lanes l;
    for (int i = 0; i < 8; ++i) l.sum[i] = int32_t(next());
    for (int i = 0; i < 32; ++i) l.u[i] = uint8_t(next()), l.s[i] = int8_t(next());
    misses += check(l, with_hardware, reported);
    ++cases;
  }
  printf("avx_vnni_emulation: %d cases, %d mismatching lanes (%s)\n", cases, misses,
         with_hardware ? "also against the AVX-VNNI instructions" : "this CPU lacks AVX-VNNI: against scalar only");
  return misses ? 1 : 0;
}
