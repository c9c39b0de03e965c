// Standalone check of the quantized matrix-vector product's generic copy
// (csrc/cpu/matvec_impl.h, possibly mutated by tests/test_matvec_mutations.py)
// against a double-precision product of codes unpacked here from the words.
// Exit status 0 when every case matches.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "csrc/cpu/matvec_kernels.h"

namespace mv = mlx_attn::cpu;
using mlx_attn::ElemType;

namespace {

uint16_t to_half(float f) {  // round to nearest (finite, normal inputs only)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exponent = int((b >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = b & 0x7fffffu;
  uint32_t h = sign | (uint32_t(exponent) << 10) | (mantissa >> 13);
  if ((mantissa & 0x1fffu) > 0x1000u || ((mantissa & 0x1fffu) == 0x1000u && (h & 1u))) ++h;
  return uint16_t(h);
}

double from_half(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const double mantissa = 1.0 + (h & 0x3ff) / 1024.0;
  return ((h & 0x8000) ? -1.0 : 1.0) * std::ldexp(mantissa, exponent - 15);
}

uint16_t to_bfloat(float f) {  // truncate: any bfloat16 value is a valid scale
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return uint16_t(b >> 16);
}

double from_bfloat(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool run_case(int bits, int group_size, ElemType type, int rows, int64_t n, int64_t k, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> word(0, 0xffffffffu);
  const int64_t groups = k / group_size;
  std::vector<uint32_t> codes(n * k * bits / 32);
  for (auto& w : codes) w = word(rng);
  std::vector<float> scales32(n * groups), biases32(n * groups);
  std::vector<uint16_t> scales16(n * groups), biases16(n * groups);
  std::vector<double> scale(n * groups), bias(n * groups);
  for (int64_t i = 0; i < n * groups; ++i) {
    const float s = 0.01f + 0.1f * std::fabs(uniform(rng)), b = uniform(rng);
    scales32[i] = s, biases32[i] = b;
    if (type == ElemType::float16) {
      scales16[i] = to_half(s), biases16[i] = to_half(b);
      scale[i] = from_half(scales16[i]), bias[i] = from_half(biases16[i]);
    } else if (type == ElemType::bfloat16) {
      scales16[i] = to_bfloat(s), biases16[i] = to_bfloat(b);
      scale[i] = from_bfloat(scales16[i]), bias[i] = from_bfloat(biases16[i]);
    } else {
      scale[i] = s, bias[i] = b;
    }
  }
  std::vector<float> x(rows * k), handed(rows * k);
  for (auto& v : x) v = uniform(rng);
  for (int r = 0; r < rows; ++r) {  // 4 bits: even columns first, then odd ones
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = bits == 4 ? (j % 2) * (k / 2) + j / 2 : j;
      handed[r * k + at] = x[r * k + j];
    }
  }
  std::vector<float> out(rows * n, NAN);
  mv::MatvecCall call{};
  call.x = handed.data();
  call.rows = rows;
  call.k = k;
  call.n = n;
  call.codes = codes.data();
  const bool wide = type == ElemType::float32;
  call.scales = wide ? static_cast<const void*>(scales32.data()) : scales16.data();
  call.biases = wide ? static_cast<const void*>(biases32.data()) : biases16.data();
  call.scale_type = type;
  call.group_size = group_size;
  call.bits = bits;
  call.out = out.data();
  mv::generic::quantized_matvec(call, 0, n);
  const int per_word = 32 / bits;
  for (int r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < n; ++o) {
      double want = 0.0, magnitude = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const uint32_t w = codes[(o * k + j) / per_word];
        const double code = double((w >> (bits * (j % per_word))) & ((1u << bits) - 1));
        const double weight = code * scale[o * groups + j / group_size] + bias[o * groups + j / group_size];
        want += weight * x[r * k + j];
        magnitude += std::fabs(weight * x[r * k + j]);
      }
      const double got = out[r * n + o];
      if (!(std::fabs(got - want) <= 1e-5 * magnitude + 1e-6)) {
        std::printf("bits %d group %d type %d rows %d: out[%d, %lld] = %.8g, want %.8g\n", bits, group_size,
                    int(type), rows, r, (long long)o, got, want);
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  bool ok = true;
  for (int bits : {4, 8}) {
    for (int group_size : {32, 64, 128}) {
      for (ElemType type : {ElemType::float32, ElemType::float16, ElemType::bfloat16}) {
        for (int rows : {1, 3, 8}) ok &= run_case(bits, group_size, type, rows, 37, 256, rng);
      }
    }
  }
  // more groups per output row than one scale chunk converts at once
  ok &= run_case(4, 32, ElemType::float16, 2, 5, 32 * 300, rng);
  ok &= run_case(8, 32, ElemType::bfloat16, 1, 5, 32 * 300, rng);
  std::printf(ok ? "matvec driver: every case matches\n" : "matvec driver: FAILED\n");
  return ok ? 0 : 1;
}
