// Standalone check of the fused CPU kernel copies against a scalar
// double-precision reference, without MLX or Python: the per-ISA units have
// no MLX dependency, so this file plus one or more kernel_<isa>.cpp units
// build for any target (arm64 under qemu-aarch64 included). No STL, so a
// cross build needs only a C library.
//
// Build with -DHARNESS_ARM64 (neon, generic) or -DHARNESS_X86 (avx512bf16, avx512, avx2,
// generic) plus the matching units. Usage: harness [isa ...] (default: every
// copy built in that the CPU runs). Prints one line per copy and exits 1 on
// any mismatch, 2 on bad usage.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Declare the copies of the chosen architecture (as CMakeLists.txt does).
#if defined(HARNESS_X86)
#define MLX_ATTN_X86_KERNELS 1
#elif defined(HARNESS_ARM64)
#define MLX_ATTN_ARM64_KERNELS 1
#endif
#include "csrc/cpu/kernels.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

namespace {

struct Copy {
  const char* name;
  int (*lanes)();
  void (*process)(const KernelCall&, int64_t, float*);
  bool (*available)();
};

bool always() { return true; }

#if defined(HARNESS_X86)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl");
}
bool has_avx512bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}
const Copy kCopies[] = {
    {"avx512bf16", avx512bf16::vector_lanes, avx512bf16::process_work_item, has_avx512bf16},
    {"avx512", avx512::vector_lanes, avx512::process_work_item, has_avx512},
    {"avx2", avx2::vector_lanes, avx2::process_work_item, has_avx2},
    {"generic", generic::vector_lanes, generic::process_work_item, always},
};
#elif defined(HARNESS_ARM64)
const Copy kCopies[] = {
    {"neon", neon::vector_lanes, neon::process_work_item, always},
    {"generic", generic::vector_lanes, generic::process_work_item, always},
};
#else
#error "define HARNESS_X86 or HARNESS_ARM64"
#endif

// ------------------------------------------------------------ element codes
// Inputs are multiples of 1/64 in [-2, 2] (and mask values multiples of 1/8),
// exact in float16 and bfloat16, so the encoders below need no rounding.
uint32_t bits_of(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

uint16_t encode_half_exact(float f) {
  uint32_t x = bits_of(f);
  uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return uint16_t(sign);
  if ((x & 0x7fffffff) == 0x7f800000) return uint16_t(sign | 0x7c00);  // -inf mask values
  int exponent = int((x >> 23) & 0xff) - 127 + 15;  // normal halves only here
  return uint16_t(sign | (uint32_t(exponent) << 10) | ((x >> 13) & 0x3ff));
}

float decode_half(uint16_t h) {
  int exponent = (h >> 10) & 0x1f;
  int mantissa = h & 0x3ff;
  float magnitude = exponent == 0 ? ldexpf(float(mantissa), -24)
      : exponent == 31           ? (mantissa ? NAN : INFINITY)
                                 : ldexpf(float(mantissa | 0x400), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

float decode_bfloat(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

struct Buffer {
  ElemType dtype;
  int64_t count;
  void* data;
  Buffer(ElemType t, int64_t n) : dtype(t), count(n) {
    data = calloc(size_t(n > 0 ? n : 1), t == ElemType::float32 ? 4 : 2);
  }
  ~Buffer() { free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void set(int64_t i, float x) {
    if (dtype == ElemType::float32) static_cast<float*>(data)[i] = x;
    else if (dtype == ElemType::float16) static_cast<uint16_t*>(data)[i] = encode_half_exact(x);
    else static_cast<uint16_t*>(data)[i] = uint16_t(bits_of(x) >> 16);
  }
  float get(int64_t i) const {
    if (dtype == ElemType::float32) return static_cast<const float*>(data)[i];
    uint16_t h = static_cast<const uint16_t*>(data)[i];
    return dtype == ElemType::float16 ? decode_half(h) : decode_bfloat(h);
  }
};

double* decoded(const Buffer& b) {
  double* d = static_cast<double*>(malloc(sizeof(double) * size_t(b.count > 0 ? b.count : 1)));
  for (int64_t i = 0; i < b.count; ++i) d[i] = b.get(i);
  return d;
}

uint64_t rng_state = 0x9e3779b97f4a7c15ull;
int next_int(int modulus) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return int((rng_state >> 33) % uint64_t(modulus));
}
float random_input() { return float(next_int(257) - 128) / 64.0f; }

// ------------------------------------------------------------ one case
struct Case {
  ElemType dtype;
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  bool causal;
  int window;
  MaskKind mask;
  bool sinks;
};

double saturate(double x) {
  return x < -kLogitLimit ? -kLogitLimit : (x > kLogitLimit ? kLogitLimit : x);
}

// Float32 agreement is limited by float32 sums; reduced types by rounding the
// output once (half: 2^-11, bfloat: 2^-8 relative), values here are <= 2.
double tolerance(ElemType t) {
  return t == ElemType::float32 ? 2e-5 : (t == ElemType::float16 ? 4e-3 : 3e-2);
}

// Runs one case through `copy` with query blocks of `query_block` positions;
// returns the largest error divided by the tolerance (> 1: failure).
double run_case(const Copy& copy, const Case& c, int query_block) {
  const int B = c.batch, Hq = c.q_heads, Hkv = c.kv_heads, Tq = c.q_len,
            Tk = c.kv_len, D = c.head_dim, Dv = c.value_dim;
  Buffer q(c.dtype, int64_t(B) * Hq * Tq * D), k(c.dtype, int64_t(B) * Hkv * Tk * D),
      v(c.dtype, int64_t(B) * Hkv * Tk * Dv), out(c.dtype, int64_t(B) * Hq * Tq * Dv);
  // Masks: [Tq, Tkv] broadcast over batch and heads; sinks one per head.
  Buffer additive(c.dtype, int64_t(Tq) * Tk), sinks(c.dtype, Hq);
  bool* keep = static_cast<bool*>(calloc(size_t(Tq) * Tk + 1, 1));
  float* lse = static_cast<float*>(calloc(size_t(B) * Hq * Tq + 1, 4));
  for (int64_t i = 0; i < q.count; ++i) q.set(i, random_input());
  for (int64_t i = 0; i < k.count; ++i) k.set(i, random_input());
  for (int64_t i = 0; i < v.count; ++i) v.set(i, random_input());
  for (int64_t i = 0; i < additive.count; ++i) {
    // Some keys fully masked (-inf); the rest shifted by multiples of 1/8.
    additive.set(i, next_int(5) == 0 ? -INFINITY : float(next_int(33) - 16) / 8.0f);
    keep[i] = next_int(5) != 0;
  }
  for (int h = 0; h < Hq; ++h) sinks.set(h, float(next_int(33) - 16) / 8.0f);

  KernelCall call{};
  AttentionProblem& p = call.problem;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Tq, p.kv_len = Tk;
  p.head_dim = D, p.value_dim = Dv, p.dtype = c.dtype;
  const int64_t qs[4] = {int64_t(Hq) * Tq * D, int64_t(Tq) * D, D, 1};
  const int64_t ks[4] = {int64_t(Hkv) * Tk * D, int64_t(Tk) * D, D, 1};
  const int64_t vs[4] = {int64_t(Hkv) * Tk * Dv, int64_t(Tk) * Dv, Dv, 1};
  const int64_t ms[4] = {0, 0, Tk, 1};
  memcpy(p.q_strides, qs, sizeof qs);
  memcpy(p.k_strides, ks, sizeof ks);
  memcpy(p.v_strides, vs, sizeof vs);
  memcpy(p.mask_strides, ms, sizeof ms);
  p.mask_kind = c.mask;
  p.causal = c.causal || c.window > 0;
  p.window_size = c.window;
  p.has_sinks = c.sinks;
  p.sinks_stride = 1;
  p.scale = 1.0f / sqrtf(float(D));
  p.output_lse = true;
  call.q = q.data, call.k = k.data, call.v = v.data, call.out = out.data, call.lse = lse;
  call.mask = c.mask == MaskKind::boolean ? static_cast<const void*>(keep)
      : c.mask == MaskKind::additive       ? additive.data
                                           : nullptr;
  call.sinks = c.sinks ? sinks.data : nullptr;
  call.query_block = query_block;

  float* scratch = static_cast<float*>(
      aligned_alloc(64, size_t(round_up(scratch_floats(call, copy.lanes()) * 4, 64))));
  for (int64_t item = 0; item < call.work_items(); ++item) copy.process(call, item, scratch);
  free(scratch);

  // Scalar reference in double, from the inputs as the kernel sees them.
  double worst = 0.0;
  double* qd = decoded(q);
  double* kd = decoded(k);
  double* vd = decoded(v);
  double* weights = static_cast<double*>(malloc(sizeof(double) * (Tk + 1)));
  double* row_out = static_cast<double*>(malloc(sizeof(double) * Dv));
  const int group = Hq / Hkv, offset = Tk - Tq;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / group;
      const double* kh = kd + (int64_t(b) * Hkv + hk) * Tk * D;
      const double* vh = vd + (int64_t(b) * Hkv + hk) * Tk * Dv;
      for (int i = 0; i < Tq; ++i) {
        const double* qi = qd + ((int64_t(b) * Hq + h) * Tq + i) * D;
        double m = -INFINITY;
        for (int j = 0; j < Tk; ++j) {
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += qi[d] * kh[int64_t(j) * D + d];
          double s = saturate(double(p.scale) * dot);
          const int64_t mi = int64_t(i) * Tk + j;
          if (c.mask == MaskKind::additive) {
            const double a = additive.get(mi);
            s = a <= kMaskedLogit ? -INFINITY : saturate(s + a);
          }
          if (c.mask == MaskKind::boolean && !keep[mi]) s = -INFINITY;
          const int pos = i + offset;
          if (p.causal && (j > pos || (c.window > 0 && j <= pos - c.window))) s = -INFINITY;
          weights[j] = s;
          m = s > m ? s : m;
        }
        const double sink = c.sinks ? saturate(sinks.get(h)) : -INFINITY;
        m = sink > m ? sink : m;
        double l = c.sinks ? exp(sink - m) : 0.0;
        for (int e = 0; e < Dv; ++e) row_out[e] = 0.0;
        for (int j = 0; j < Tk; ++j) {
          if (weights[j] == -INFINITY) continue;
          const double w = exp(weights[j] - m);
          l += w;
          for (int e = 0; e < Dv; ++e) row_out[e] += w * vh[int64_t(j) * Dv + e];
        }
        const int64_t row = (int64_t(b) * Hq + h) * Tq + i;
        for (int e = 0; e < Dv; ++e) {
          const double expected = l == 0.0 ? 0.0 : row_out[e] / l;
          const double err = fabs(double(out.get(row * Dv + e)) - expected) /
              (tolerance(c.dtype) * (1.0 + fabs(expected)));
          worst = err > worst || err != err ? err : worst;  // NaN counts as failure
        }
        const double expected_lse = l == 0.0 ? -INFINITY : m + log(l);
        if (expected_lse == -INFINITY) {
          if (lse[row] != -INFINITY) worst = INFINITY;
        } else {
          const double err = fabs(lse[row] - expected_lse) / (2e-5 * (1.0 + fabs(expected_lse)));
          worst = err > worst || err != err ? err : worst;
        }
      }
    }
  }
  free(qd);
  free(kd);
  free(vd);
  free(row_out);
  free(weights);
  free(keep);
  free(lse);
  return worst;
}

const char* dtype_name(ElemType t) { return elem_type_name(t); }

// The grid of tests/test_fused_cpu.py (head dims, lengths, dtypes, causal,
// GQA/MQA, masks, windows, sinks), for one copy. Returns failures.
int check_copy(const Copy& copy) {
  static const ElemType kDtypes[] = {ElemType::float32, ElemType::float16, ElemType::bfloat16};
  static const int kHeadDims[] = {1, 3, 16, 64, 80, 96, 128, 256};
  static const int kLengths[][2] = {{1, 1}, {1, 77}, {7, 7}, {13, 130}, {65, 65}, {130, 61}};
  static const int kHeads[][2] = {{2, 2}, {4, 2}, {6, 2}, {8, 1}, {5, 1}};
  static const int kValueDims[][2] = {{64, 32}, {16, 100}, {3, 256}, {256, 8}};
  Case cases[512];
  int n = 0;
  for (ElemType t : kDtypes) {
    for (int d : kHeadDims) {
      for (auto& len : kLengths) {
        for (int causal = 0; causal < 2; ++causal) {
          cases[n++] = {t, 1, 2, 2, len[0], len[1], d, d, causal == 1, 0, MaskKind::none, false};
        }
      }
    }
    for (auto& heads : kHeads) {
      cases[n++] = {t, 2, heads[0], heads[1], 70, 140, 32, 32, true, 0, MaskKind::none, false};
      cases[n++] = {t, 2, heads[0], heads[1], 1, 100, 32, 32, false, 0, MaskKind::none, false};
    }
    cases[n++] = {t, 2, 4, 2, 9, 70, 16, 16, false, 0, MaskKind::boolean, false};
    cases[n++] = {t, 2, 4, 2, 9, 70, 16, 16, true, 0, MaskKind::additive, false};
    cases[n++] = {t, 1, 4, 2, 100, 100, 64, 64, true, 17, MaskKind::none, true};
    cases[n++] = {t, 1, 2, 1, 70, 200, 64, 64, false, 0, MaskKind::additive, true};
  }
  for (auto& dims : kValueDims) {
    cases[n++] = {ElemType::float32, 2, 4, 2, 9, 70, dims[0], dims[1], true, 0, MaskKind::none, false};
  }
  int failures = 0;
  double worst_seen = 0.0;
  for (int i = 0; i < n; ++i) {
    const Case& c = cases[i];
    const int group = c.q_heads / c.kv_heads;
    int block = kMaxRows / group;
    block = block < 1 ? 1 : (block < c.q_len ? block : c.q_len);
    // The planned block and a small one (many items, partial last block).
    const int blocks[2] = {block, block > 5 ? 5 : block};
    for (int qb : blocks) {
      const double worst = run_case(copy, c, qb);
      worst_seen = worst > worst_seen ? worst : worst_seen;
      if (!(worst <= 1.0)) {
        ++failures;
        printf("FAIL %s %s B=%d Hq=%d Hkv=%d Tq=%d Tkv=%d D=%d Dv=%d causal=%d window=%d "
               "mask=%d sinks=%d qb=%d: error %.3g x tolerance\n",
               copy.name, dtype_name(c.dtype), c.batch, c.q_heads, c.kv_heads, c.q_len,
               c.kv_len, c.head_dim, c.value_dim, int(c.causal), c.window, int(c.mask),
               int(c.sinks), qb, worst);
      }
    }
  }
  printf("%s: %d cases, %d failures, worst error %.3g x tolerance\n", copy.name, 2 * n,
         failures, worst_seen);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  int failures = 0, checked = 0;
  for (const Copy& copy : kCopies) {
    bool wanted = argc == 1;
    for (int a = 1; a < argc; ++a) wanted = wanted || strcmp(argv[a], copy.name) == 0;
    if (!wanted) continue;
    if (!copy.available()) {
      printf("%s: not supported by this CPU\n", copy.name);
      continue;
    }
    failures += check_copy(copy);
    ++checked;
  }
  if (checked == 0) {
    fprintf(stderr, "harness: no kernel copy matched the arguments\n");
    return 2;
  }
  return failures == 0 ? 0 : 1;
}
