// Standalone check of the integer-dot quantized matrix-vector product's
// copies (csrc/cpu/int8_matvec_impl.h), without MLX or Python, so the arm64
// copies can run under qemu-aarch64: each copy against a double-precision
// oracle of the codes this file unpacks itself from MLX's packed words,
// within the error bound int8_matvec_kernels.h states, and each row alone
// against the same row in a batch, bit for bit. No STL (a cross build needs
// only a C library).
//
// Build with -DHARNESS_ARM64 (copies neoni8mm, neondot, neon, generic) or -DHARNESS_X86
// (avx512vnni, avxvnni, avx2, generic) plus the matching int8_matvec_<copy>.cpp
// units, and for HARNESS_X86 also int8_matvec_avxvnni.cpp built with
// -DMLX_ATTN_EMULATE_AVX_VNNI and AVX2 flags only: copy avxvnni_emulated, the
// avxvnni copy with its two VNNI instructions done by exact AVX2 sequences
// (avx_vnni_emulation.h), which runs on any AVX2 CPU.
//
// Usage: int8_matvec_driver [--full] copy ...   each copy over the grid
//        int8_matvec_driver --rule ISA          the copy the dispatch rule
//                                               (int8_matvec_copies.h) picks
//                                               for CPU kernel ISA ISA here
// Prints one line per copy; exits 1 on any mismatch, 2 on bad usage.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(HARNESS_X86)
#define MLX_ATTN_X86_KERNELS 1
#elif defined(HARNESS_ARM64)
#define MLX_ATTN_ARM64_KERNELS 1
#else
#error "define HARNESS_X86 or HARNESS_ARM64"
#endif
#include "csrc/cpu/int8_matvec_copies.h"
#include "tests/cpu_harness/test_values.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

#if defined(HARNESS_X86)
namespace mlx_attn::cpu::avxvnni_emulated {
void int8_matvec(const Int8MatvecCall& call, int64_t begin, int64_t end);
}
#endif

namespace {

bool always() { return true; }

struct Copy {
  const char* name;
  Int8Matvec kernel;
  bool (*available)();
};
const Copy kCopies[] = {
#if defined(HARNESS_ARM64)
    {"neoni8mm", neoni8mm::int8_matvec, features::neon_i8mm_and_dotprod},
    {"neondot", neondot::int8_matvec, features::neon_dotprod},
    {"neon", neon::int8_matvec, always},
#else
    {"avx512vnni", avx512vnni::int8_matvec, features::avx512vnni},
    {"avxvnni", avxvnni::int8_matvec, features::avx_vnni},
    {"avxvnni_emulated", avxvnni_emulated::int8_matvec, features::avx2},
    {"avx2", avx2::int8_matvec, features::avx2},
#endif
    {"generic", generic::int8_matvec, always},
};

// float16 by the compiler's own conversion (round to nearest), not the
// kernels' (elements.h).
uint16_t to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  memcpy(&bits, &h, 2);
  return bits;
}
float from_half(uint16_t bits) {
  _Float16 h;
  memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// Weight code of output o, column i, from MLX's little-endian packing:
// `bits`-wide fields from the low end of each 32-bit word.
int code_at(const uint32_t* codes, int64_t k, int bits, int64_t o, int64_t i) {
  const int64_t per_word = 32 / bits;
  const uint32_t word = codes[o * (k / per_word) + i / per_word];
  return int((word >> (bits * (i % per_word))) & ((1u << bits) - 1));
}

struct Case {
  int bits, group_size, activation_bits, rows;
  ElemType type;
  int64_t n, k;
};

// A case's weights, activations and their quantization.
struct Data {
  uint32_t* codes;
  void* scales;
  void* biases;
  double* scale;  // the stored scales and biases as values
  double* bias;
  float* x;
  void* xq;
  float* xd;
  float* xsum;
};

Data make_data(const Case& c, uint32_t& state) {
  const int64_t groups = c.k / c.group_size, lanes = c.k / kInt8Block * 8;
  const int scale_bytes = c.type == ElemType::float32 ? 4 : 2;
  Data d;
  d.codes = static_cast<uint32_t*>(malloc(sizeof(uint32_t) * c.n * c.k * c.bits / 32));
  d.scales = malloc(size_t(scale_bytes) * c.n * groups);
  d.biases = malloc(size_t(scale_bytes) * c.n * groups);
  d.scale = static_cast<double*>(malloc(sizeof(double) * c.n * groups));
  d.bias = static_cast<double*>(malloc(sizeof(double) * c.n * groups));
  d.x = static_cast<float*>(malloc(sizeof(float) * c.rows * c.k));
  d.xq = malloc(size_t(c.activation_bits / 8) * c.rows * c.k);
  d.xd = static_cast<float*>(malloc(sizeof(float) * c.rows * lanes));
  d.xsum = static_cast<float*>(malloc(sizeof(float) * c.rows * lanes));
  for (int64_t i = 0; i < c.n * c.k * c.bits / 32; ++i) {
    state = state * 1664525u + 1013904223u;
    d.codes[i] = state ^ (state >> 13) * 2654435761u;
  }
  for (int64_t i = 0; i < c.n * groups; ++i) {
    const float s = 0.01f + 0.05f * fabsf(next_value(state)), b = next_value(state) * 0.25f;
    if (c.type == ElemType::float32) {
      static_cast<float*>(d.scales)[i] = s, static_cast<float*>(d.biases)[i] = b;
      d.scale[i] = s, d.bias[i] = b;
    } else if (c.type == ElemType::float16) {
      static_cast<uint16_t*>(d.scales)[i] = to_half(s), static_cast<uint16_t*>(d.biases)[i] = to_half(b);
      d.scale[i] = from_half(to_half(s)), d.bias[i] = from_half(to_half(b));
    } else {
      static_cast<uint16_t*>(d.scales)[i] = to_bfloat(s), static_cast<uint16_t*>(d.biases)[i] = to_bfloat(b);
      d.scale[i] = from_bfloat(to_bfloat(s)), d.bias[i] = from_bfloat(to_bfloat(b));
    }
  }
  for (int r = 0; r < c.rows; ++r) {
    const float row_scale = 0.25f * float(1 + r % 5);  // rows of different magnitudes
    for (int64_t i = 0; i < c.k; ++i) d.x[r * c.k + i] = next_value(state) * row_scale + 0.01f * float(i % 7);
    if (c.activation_bits == 16) {
      quantize_activations(d.x + r * c.k, c.k, c.bits, static_cast<int16_t*>(d.xq) + r * c.k, d.xd + r * lanes,
                           d.xsum + r * lanes);
    } else {
      quantize_activations(d.x + r * c.k, c.k, c.bits, static_cast<int8_t*>(d.xq) + r * c.k, d.xd + r * lanes,
                           d.xsum + r * lanes);
    }
  }
  return d;
}

void free_data(Data& d) {
  void* all[] = {d.codes, d.scales, d.biases, d.scale, d.bias, d.x, d.xq, d.xd, d.xsum};
  for (void* p : all) free(p);
}

Int8MatvecCall call_of(const Case& c, const Data& d, int row, int rows, float* out) {
  const int64_t lanes = c.k / kInt8Block * 8;
  Int8MatvecCall call;
  call.activation_bits = c.activation_bits;
  call.xq = static_cast<const char*>(d.xq) + int64_t(row) * c.k * (c.activation_bits / 8);
  call.xd = d.xd + row * lanes;
  call.xsum = d.xsum + row * lanes;
  call.rows = rows;
  call.k = c.k;
  call.n = c.n;
  call.codes = d.codes;
  call.scales = d.scales;
  call.biases = d.biases;
  call.scale_type = c.type;
  call.group_size = c.group_size;
  call.bits = c.bits;
  call.out = out;
  return call;
}

// Row r's activation code of column i (4-bit weights: a block's even
// columns first, then its odd ones).
int64_t activation_code(const Case& c, const Data& d, int r, int64_t i) {
  const int64_t block = i / kInt8Block, at = i % kInt8Block;
  const int64_t slot = block * kInt8Block + (c.bits == 4 ? (at % 2) * 16 + at / 2 : at);
  return c.activation_bits == 16 ? static_cast<const int16_t*>(d.xq)[r * c.k + slot]
                                 : static_cast<const int8_t*>(d.xq)[r * c.k + slot];
}

// Checks output (r, o) against the oracles; prints the first few misses.
bool check_output(const Case& c, const Data& d, const char* copy, int r, int64_t o, float y, int& reported) {
  const int64_t groups = c.k / c.group_size, lanes = c.k / kInt8Block * 8, blocks = c.k / kInt8Block;
  double exact = 0, bound = 0;    // the float product sum_k x * w and the header's bound on |y - exact|
  double quantized = 0, size = 0;  // the same sums as the copies form them, and their magnitude
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b * kInt8Block / c.group_size;
    const double scale = d.scale[o * groups + g], bias = d.bias[o * groups + g];
    const double step = d.xd[r * lanes + b * 8];
    int64_t dot = 0;
    for (int64_t i = b * kInt8Block; i < (b + 1) * kInt8Block; ++i) {
      const int code = code_at(d.codes, c.k, c.bits, o, i);
      exact += double(d.x[r * c.k + i]) * (scale * code + bias);
      bound += fabs(scale * code) * step / 2;
      dot += int64_t(code) * activation_code(c, d, r, i);
    }
    const double block_sum = double(d.xsum[r * lanes + b * 8]) * 8.0;
    quantized += double(dot) * step * scale + block_sum * bias;
    size += fabs(double(dot) * step * scale) + fabs(block_sum * bias);
  }
  // float32 rounding: a few ulps of the terms' magnitude per block summed
  const double rounding = size * (double(blocks) + 8.0) * 0x1p-22;
  const bool ok = fabs(double(y) - quantized) <= rounding && fabs(double(y) - exact) <= bound + 2 * rounding;
  if (!ok && reported++ < 4) {
    printf("  %s: bits %d group %d activations int%d rows %d n %lld k %lld scales %d: out[%d, %lld] = %.9g, "
           "quantized oracle %.9g (+- %.3g), float oracle %.9g (+- %.3g)\n",
           copy, c.bits, c.group_size, c.activation_bits, c.rows, (long long)c.n, (long long)c.k, int(c.type), r,
           (long long)o, double(y), quantized, rounding, exact, bound + 2 * rounding);
  }
  return ok;
}

// One case through one copy: the batch against the oracles, then each row
// alone against its row of the batch (bit for bit). Returns the failures.
int run_case(const Copy& copy, const Case& c, uint32_t& state, int& reported) {
  Data d = make_data(c, state);
  float* batch = static_cast<float*>(malloc(sizeof(float) * c.rows * c.n));
  float* alone = static_cast<float*>(malloc(sizeof(float) * c.n));
  int failures = 0;
  // two calls over a split of the outputs, as the op's tasks split them
  const int64_t split = c.n / 2;
  copy.kernel(call_of(c, d, 0, c.rows, batch), 0, split);
  copy.kernel(call_of(c, d, 0, c.rows, batch), split, c.n);
  for (int r = 0; r < c.rows; ++r) {
    for (int64_t o = 0; o < c.n; ++o) failures += !check_output(c, d, copy.name, r, o, batch[r * c.n + o], reported);
    copy.kernel(call_of(c, d, r, 1, alone), 0, c.n);
    if (memcmp(alone, batch + r * c.n, sizeof(float) * c.n) != 0) {
      ++failures;
      if (reported++ < 4) {
        printf("  %s: bits %d group %d activations int%d: row %d alone differs from row %d of %d rows\n", copy.name,
               c.bits, c.group_size, c.activation_bits, r, r, c.rows);
      }
    }
  }
  free(batch);
  free(alone);
  free_data(d);
  return failures;
}

// The grid: 4 and 8 bits, groups of 32/64/128, float32/float16/bfloat16
// scales, int8 and int16 activations, 1 to 9 and 17 rows (one pass of 8, a
// pass and a single row, two passes and one), n = 13 (not a multiple of a
// tile's features), 3 groups a row (odd block counts at group 32); plus rows
// longer than one scale chunk (256 groups, kInt8ScaleChunk). --full: n also
// 1, 4 and 37, and 7 and 12 groups a row.
int run_copy(const Copy& copy, bool full) {
  const int rows_list[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17};
  const int64_t n_list[] = {13, 1, 4, 37};
  const int64_t k_groups[] = {3, 7, 12};
  const ElemType types[] = {ElemType::float32, ElemType::float16, ElemType::bfloat16};
  const int bit_widths[] = {4, 8}, group_sizes[] = {32, 64, 128}, activation_widths[] = {8, 16}, long_rows[] = {1, 3};
  uint32_t state = 12345u;
  int cases = 0, failures = 0, reported = 0;
  for (int bits : bit_widths) {
    for (int group_size : group_sizes) {
      for (ElemType type : types) {
        for (int activation_bits : activation_widths) {
          for (int rows : rows_list) {
            for (int ni = 0; ni < (full ? 4 : 1); ++ni) {
              for (int ki = 0; ki < (full ? 3 : 1); ++ki) {
                const int64_t k = int64_t(group_size) * k_groups[ki];
                failures += run_case(copy, {bits, group_size, activation_bits, rows, type, n_list[ni], k}, state,
                                     reported) != 0;
                ++cases;
              }
            }
          }
        }
      }
    }
  }
  // more groups than one scale chunk: the chunked scale and group-sum paths
  for (int bits : bit_widths) {
    for (int activation_bits : activation_widths) {
      for (int rows : long_rows) {
        const int64_t k = int64_t(kInt8Block) * (256 + 9);  // kInt8ScaleChunk (int8_matvec_impl.h): 256
        failures += run_case(copy, {bits, 32, activation_bits, rows, ElemType::float16, 5, k}, state, reported) != 0;
        ++cases;
      }
    }
  }
  printf("%s: %d cases, %d failures\n", copy.name, cases, failures);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "--rule") == 0) {
    printf("picked: %s\n", int8_matvec_copy(argv[2]).name);
    return 0;
  }
  int first = 1;
  const bool full = argc > 1 && strcmp(argv[1], "--full") == 0;
  first += full;
  if (first >= argc) {
    fprintf(stderr, "usage: int8_matvec_driver [--full] copy ... | --rule ISA\n");
    return 2;
  }
  int failures = 0;
  for (int a = first; a < argc; ++a) {
    const Copy* copy = nullptr;
    for (const Copy& candidate : kCopies) {
      if (strcmp(candidate.name, argv[a]) == 0) copy = &candidate;
    }
    if (!copy) {
      fprintf(stderr, "unknown copy %s\n", argv[a]);
      return 2;
    }
    if (!copy->available()) {
      printf("%s: not supported by this CPU\n", copy->name);
      continue;
    }
    failures += run_copy(*copy, full);
  }
  return failures ? 1 : 0;
}
