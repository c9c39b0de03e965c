// Standalone check of the fused CPU kernel copies, forward and backward,
// against a scalar double-precision reference, without MLX or Python: the
// per-ISA units have no MLX dependency, so this file plus the
// kernel_<isa>.cpp / backward_<isa>.cpp units build for any target (arm64
// under qemu-aarch64 included). No STL, so a cross build needs only a C
// library.
//
// Build with -DHARNESS_ARM64 (forward neonbf16, neonfhm, neon, generic;
// backward neon_backward, generic_backward) or -DHARNESS_X86 (forward
// avx512amx, avx512bf16, avx512, avx2, generic; backward avx512amx_backward,
// avx512_backward, avx2_backward, generic_backward) plus the matching units.
//
// Usage: harness [--sample] [copy ...]   (default: every copy built in that
// the CPU runs; --sample: every third forward case only)
//        harness --cpu                   the copies this CPU supports, by the
//                                        dispatcher's rule, widest first
// Prints one line per copy and exits 1 on any mismatch, 2 on bad usage.
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
#include "csrc/cpu/copies.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

namespace {

// The dispatchers' own table (csrc/cpu/copies.h): every forward copy and
// every backward copy built for this architecture, with its availability rule.
#if !defined(HARNESS_X86) && !defined(HARNESS_ARM64)
#error "define HARNESS_X86 or HARNESS_ARM64"
#endif

// ------------------------------------------------------------ element codes
// Inputs are multiples of 1/64 in [-2, 2] (and mask values multiples of 1/8),
// exact in float16 and bfloat16, so the encoders below need no rounding. The
// backward's forward output O is not: it is truncated (and flushed to zero
// below 2^-14 in float16), and the reference reads back the stored values.
uint32_t bits_of(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

uint16_t encode_half(float f) {
  uint32_t x = bits_of(f);
  uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return uint16_t(sign);
  if ((x & 0x7fffffff) == 0x7f800000) return uint16_t(sign | 0x7c00);  // -inf mask values
  if ((x & 0x7fffffff) < 0x38800000) return uint16_t(sign);  // below 2^-14: flushed
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
    else if (dtype == ElemType::float16) static_cast<uint16_t*>(data)[i] = encode_half(x);
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
  // q and k inputs times this power of two, and the scale (0: 1/sqrt(D)):
  // tiny q.k with a huge scale make logits of order one from products below
  // float32's normal range.
  float input_magnitude = 1.0f;
  float scale = 0.0f;
};

double saturate(double x) {
  return x < -kLogitLimit ? -kLogitLimit : (x > kLogitLimit ? kLogitLimit : x);
}

// Float32 agreement is limited by float32 sums; reduced types by rounding the
// output once (half: 2^-11, bfloat: 2^-8 relative), values here are <= 2.
double tolerance(ElemType t) {
  return t == ElemType::float32 ? 2e-5 : (t == ElemType::float16 ? 4e-3 : 3e-2);
}

// A case's random inputs, its problem description and their decoded values.
struct Inputs {
  Buffer q, k, v;
  Buffer additive, sinks;  // masks: [Tq, Tkv] broadcast over batch and heads; sinks one per head
  bool* keep;
  AttentionProblem p{};
  double *qd, *kd, *vd;

  explicit Inputs(const Case& c)
      : q(c.dtype, int64_t(c.batch) * c.q_heads * c.q_len * c.head_dim),
        k(c.dtype, int64_t(c.batch) * c.kv_heads * c.kv_len * c.head_dim),
        v(c.dtype, int64_t(c.batch) * c.kv_heads * c.kv_len * c.value_dim),
        additive(c.dtype, int64_t(c.q_len) * c.kv_len),
        sinks(c.dtype, c.q_heads) {
    const int Hq = c.q_heads, Hkv = c.kv_heads, Tq = c.q_len, Tk = c.kv_len, D = c.head_dim,
              Dv = c.value_dim;
    keep = static_cast<bool*>(calloc(size_t(Tq) * Tk + 1, 1));
    for (int64_t i = 0; i < q.count; ++i) q.set(i, random_input() * c.input_magnitude);
    for (int64_t i = 0; i < k.count; ++i) k.set(i, random_input() * c.input_magnitude);
    for (int64_t i = 0; i < v.count; ++i) v.set(i, random_input());
    for (int64_t i = 0; i < additive.count; ++i) {
      // Some keys fully masked (-inf); the rest shifted by multiples of 1/8.
      additive.set(i, next_int(5) == 0 ? -INFINITY : float(next_int(33) - 16) / 8.0f);
      keep[i] = next_int(5) != 0;
    }
    for (int h = 0; h < Hq; ++h) sinks.set(h, float(next_int(33) - 16) / 8.0f);
    p.batch = c.batch, p.q_heads = Hq, p.kv_heads = Hkv, p.group = Hq / Hkv, p.q_len = Tq, p.kv_len = Tk;
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
    p.scale = c.scale != 0.0f ? c.scale : 1.0f / sqrtf(float(D));
    qd = decoded(q);
    kd = decoded(k);
    vd = decoded(v);
  }
  ~Inputs() {
    free(keep);
    free(qd);
    free(kd);
    free(vd);
  }
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;

  const void* mask() const {
    return p.mask_kind == MaskKind::boolean ? static_cast<const void*>(keep)
        : p.mask_kind == MaskKind::additive ? additive.data
                                            : nullptr;
  }
  const double* query(int b, int h, int i) const {
    return qd + ((int64_t(b) * p.q_heads + h) * p.q_len + i) * p.head_dim;
  }
  const double* keys(int b, int h) const {  // of query head h
    return kd + (int64_t(b) * p.kv_heads + h / p.group_size()) * p.kv_len * p.head_dim;
  }
  const double* values(int b, int h) const {
    return vd + (int64_t(b) * p.kv_heads + h / p.group_size()) * p.kv_len * p.value_dim;
  }
  double sink(int h) const { return p.has_sinks ? saturate(sinks.get(h)) : -INFINITY; }

  // Logits of query row (b, h, i) against every key (-inf where masked) into
  // s[Tkv]; returns their max.
  double logits(int b, int h, int i, double* s) const {
    const double* qi = query(b, h, i);
    const double* kh = keys(b, h);
    const int Tk = p.kv_len, D = p.head_dim, pos = i + Tk - p.q_len;
    double m = -INFINITY;
    for (int j = 0; j < Tk; ++j) {
      double dot = 0.0;
      for (int d = 0; d < D; ++d) dot += qi[d] * kh[int64_t(j) * D + d];
      double x = saturate(double(p.scale) * dot);
      const int64_t mi = int64_t(i) * Tk + j;
      if (p.mask_kind == MaskKind::additive) {
        const double a = additive.get(mi);
        x = a <= kMaskedLogit ? -INFINITY : saturate(x + a);
      }
      if (p.mask_kind == MaskKind::boolean && !keep[mi]) x = -INFINITY;
      if (p.causal && (j > pos || (p.window_size > 0 && j <= pos - p.window_size))) x = -INFINITY;
      s[j] = x;
      m = x > m ? x : m;
    }
    return m;
  }
};

// Keeps the largest error divided by its tolerance (NaN counts as failure).
void note_error(double& worst, double err) {
  worst = err > worst || err != err ? err : worst;
}

// Runs one case through `copy` with query blocks of `query_block` positions;
// returns the largest error divided by the tolerance (> 1: failure).
double run_case(const ForwardCopy& copy, const Case& c, int query_block) {
  Inputs in(c);
  const AttentionProblem& p = in.p;
  const int B = c.batch, Hq = c.q_heads, Tq = c.q_len, Tk = c.kv_len, Dv = c.value_dim;
  Buffer out(c.dtype, int64_t(B) * Hq * Tq * Dv);
  float* lse = static_cast<float*>(calloc(size_t(B) * Hq * Tq + 1, 4));

  KernelCall call{};
  call.problem = p;
  call.problem.output_lse = true;
  call.q = in.q.data, call.k = in.k.data, call.v = in.v.data, call.out = out.data, call.lse = lse;
  call.mask = in.mask();
  call.sinks = c.sinks ? in.sinks.data : nullptr;
  call.query_block = query_block;

  float* scratch = static_cast<float*>(
      aligned_alloc(64, size_t(round_up(scratch_floats(call, copy.lanes()) * 4, 64))));
  for (int64_t item = 0; item < call.work_items(); ++item) copy.process(call, item, scratch);
  free(scratch);

  // Scalar reference in double, from the inputs as the kernel sees them.
  double worst = 0.0;
  double* weights = static_cast<double*>(malloc(sizeof(double) * (Tk + 1)));
  double* row_out = static_cast<double*>(malloc(sizeof(double) * Dv));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const double* vh = in.values(b, h);
      for (int i = 0; i < Tq; ++i) {
        double m = in.logits(b, h, i, weights);
        const double sink = in.sink(h);
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
          note_error(worst, fabs(double(out.get(row * Dv + e)) - expected) /
                                (tolerance(c.dtype) * (1.0 + fabs(expected))));
        }
        const double expected_lse = l == 0.0 ? -INFINITY : m + log(l);
        if (expected_lse == -INFINITY) {
          if (lse[row] != -INFINITY) worst = INFINITY;
        } else {
          note_error(worst, fabs(lse[row] - expected_lse) / (2e-5 * (1.0 + fabs(expected_lse))));
        }
      }
    }
  }
  free(row_out);
  free(weights);
  free(lse);
  return worst;
}

// Runs one case's backward through `copy` (the single-pass or the two-pass
// scheme, as csrc/cpu/backward_dispatch.cpp runs them) and compares dQ, dK,
// dV and the sinks' gradient with the double reference of the same formulas:
// P = exp(S - lse), delta = rowsum(dO * O), dS = scale P (dO V^T - delta).
// The forward's O (rounded to the dtype) and lse come from the reference;
// errors are relative to each gradient's largest element. Returns the
// largest error divided by the tolerance.
double run_backward_case(const BackwardCopy& copy, const Case& c, bool single_pass) {
  Inputs in(c);
  const AttentionProblem& p = in.p;
  const int B = c.batch, Hq = c.q_heads, Hkv = c.kv_heads, Tq = c.q_len, Tk = c.kv_len,
            D = c.head_dim, Dv = c.value_dim;
  const int64_t rows = int64_t(B) * Hq * Tq;
  Buffer out(c.dtype, rows * Dv), d_out(c.dtype, rows * Dv);
  Buffer dq(c.dtype, rows * D), dk(c.dtype, int64_t(B) * Hkv * Tk * D),
      dv(c.dtype, int64_t(B) * Hkv * Tk * Dv), d_sinks(c.dtype, Hq);
  float* lse = static_cast<float*>(calloc(size_t(rows) + 1, 4));
  for (int64_t i = 0; i < d_out.count; ++i) d_out.set(i, random_input());

  // Reference forward: probabilities P[row][j] (double), O in the dtype, lse.
  double* probs = static_cast<double*>(calloc(size_t(rows) * Tk + 1, sizeof(double)));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const double* vh = in.values(b, h);
      for (int i = 0; i < Tq; ++i) {
        const int64_t row = (int64_t(b) * Hq + h) * Tq + i;
        double* pr = probs + row * Tk;
        double m = in.logits(b, h, i, pr);
        const double sink = in.sink(h);
        m = sink > m ? sink : m;
        double l = c.sinks ? exp(sink - m) : 0.0;
        for (int j = 0; j < Tk; ++j) l += pr[j] == -INFINITY ? 0.0 : exp(pr[j] - m);
        for (int j = 0; j < Tk; ++j) pr[j] = l == 0.0 || pr[j] == -INFINITY ? 0.0 : exp(pr[j] - m) / l;
        lse[row] = l == 0.0 ? -INFINITY : float(m + log(l));
        for (int e = 0; e < Dv; ++e) {
          double o = 0.0;
          for (int j = 0; j < Tk; ++j) o += pr[j] * vh[int64_t(j) * Dv + e];
          out.set(row * Dv + e, float(o));
        }
      }
    }
  }

  BackwardCall call{};
  call.problem = p;
  call.q = in.q.data, call.k = in.k.data, call.v = in.v.data;
  call.mask = in.mask();
  call.sinks = c.sinks ? in.sinks.data : nullptr;
  call.out = out.data;
  const int64_t row_strides[4] = {int64_t(Hq) * Tq * Dv, int64_t(Tq) * Dv, Dv, 1};
  memcpy(call.out_strides, row_strides, sizeof row_strides);
  memcpy(call.d_out_strides, row_strides, sizeof row_strides);
  call.lse = lse;
  call.d_out = d_out.data;
  call.dq = dq.data, call.dk = dk.data, call.dv = dv.data;
  call.d_sinks = c.sinks ? d_sinks.data : nullptr;
  call.delta = static_cast<float*>(calloc(size_t(rows) + 1, 4));
  int qb = kMaxRows / p.group_size();
  qb = qb < 1 ? 1 : qb;
  call.query_block = qb < Tq ? qb : Tq;
  call.single_pass = single_pass;
  const int64_t floats = backward_scratch(call, copy.lanes()).total + copy.panel_floats(call);
  float* scratch = static_cast<float*>(aligned_alloc(64, size_t(round_up(floats * 4, 64))));
  for (int h = 0; h < Hq; ++h) copy.rows(call, h);
  const int64_t per_block = int64_t(B) * Hkv;
  if (single_pass) {
    for (int64_t item = 0; item < per_block; ++item) copy.group(call, item, scratch);
  } else {
    for (int64_t item = 0; item < per_block * call.key_blocks(); ++item) copy.key_block(call, item, scratch);
    for (int64_t item = 0; item < per_block * call.query_blocks(); ++item) copy.query_block(call, item, scratch);
  }
  free(scratch);
  free(call.delta);

  // Reference gradients in double.
  double* dq_ref = static_cast<double*>(calloc(size_t(dq.count) + 1, sizeof(double)));
  double* dk_ref = static_cast<double*>(calloc(size_t(dk.count) + 1, sizeof(double)));
  double* dv_ref = static_cast<double*>(calloc(size_t(dv.count) + 1, sizeof(double)));
  double* ds_ref = static_cast<double*>(calloc(size_t(Hq) + 1, sizeof(double)));
  double* dp = static_cast<double*>(malloc(sizeof(double) * (Tk + 1)));
  const double scale = p.scale;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int64_t kv = int64_t(b) * Hkv + h / p.group_size();
      const double* kh = in.keys(b, h);
      const double* vh = in.values(b, h);
      for (int i = 0; i < Tq; ++i) {
        const int64_t row = (int64_t(b) * Hq + h) * Tq + i;
        const double* pr = probs + row * Tk;
        const double* qi = in.query(b, h, i);
        double delta = 0.0;
        for (int e = 0; e < Dv; ++e) delta += double(out.get(row * Dv + e)) * d_out.get(row * Dv + e);
        if (c.sinks && lse[row] != -INFINITY) ds_ref[h] -= exp(in.sink(h) - double(lse[row])) * delta;
        for (int j = 0; j < Tk; ++j) {
          double dpj = 0.0;
          for (int e = 0; e < Dv; ++e) dpj += d_out.get(row * Dv + e) * vh[int64_t(j) * Dv + e];
          dp[j] = scale * pr[j] * (dpj - delta);  // dS
          for (int e = 0; e < Dv; ++e) dv_ref[(kv * Tk + j) * Dv + e] += pr[j] * d_out.get(row * Dv + e);
          for (int d = 0; d < D; ++d) {
            dq_ref[row * D + d] += dp[j] * kh[int64_t(j) * D + d];
            dk_ref[(kv * Tk + j) * D + d] += dp[j] * qi[d];
          }
        }
      }
    }
  }
  double worst = 0.0;
  const Buffer* got[4] = {&dq, &dk, &dv, &d_sinks};
  const double* want[4] = {dq_ref, dk_ref, dv_ref, ds_ref};
  for (int g = 0; g < (c.sinks ? 4 : 3); ++g) {
    double largest = 0.0;
    for (int64_t i = 0; i < got[g]->count; ++i) largest = fabs(want[g][i]) > largest ? fabs(want[g][i]) : largest;
    for (int64_t i = 0; i < got[g]->count; ++i) {
      note_error(worst, fabs(double(got[g]->get(i)) - want[g][i]) / (tolerance(c.dtype) * (1.0 + largest)));
    }
  }
  free(dq_ref);
  free(dk_ref);
  free(dv_ref);
  free(ds_ref);
  free(dp);
  free(probs);
  free(lse);
  return worst;
}

const char* dtype_name(ElemType t) { return elem_type_name(t); }

void print_failure(const char* copy, const Case& c, const char* how, double worst) {
  printf("FAIL %s %s B=%d Hq=%d Hkv=%d Tq=%d Tkv=%d D=%d Dv=%d causal=%d window=%d "
         "mask=%d sinks=%d %s: error %.3g x tolerance\n",
         copy, dtype_name(c.dtype), c.batch, c.q_heads, c.kv_heads, c.q_len, c.kv_len,
         c.head_dim, c.value_dim, int(c.causal), c.window, int(c.mask), int(c.sinks), how, worst);
}

// The grid of tests/test_fused_cpu.py (head dims, lengths, dtypes, causal,
// GQA/MQA, masks, windows, sinks), for one copy; `sample`: every third case.
// Returns failures.
int check_copy(const ForwardCopy& copy, bool sample) {
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
  // Every product q_d k_d below 2^-126 (subnormal in float32; bf16 dot
  // products flush them), scale 1.5 * 2^127: logits of order one.
  static const ElemType kTinyDtypes[] = {ElemType::float32, ElemType::bfloat16};
  for (ElemType t : kTinyDtypes) {
    for (int i = 0; i < 3; ++i) {  // one of the three runs under --sample
      cases[n++] = {t, 1, 2, 2, 7, 70, 64, 64, false, 0, MaskKind::none, false, 0x1p-65f, 0x1.8p127f};
    }
  }
  int failures = 0, ran = 0;
  double worst_seen = 0.0;
  for (int i = 0; i < n; ++i) {
    if (sample && i % 3 != 0) continue;
    const Case& c = cases[i];
    const int group = c.q_heads / c.kv_heads;
    int block = kMaxRows / group;
    block = block < 1 ? 1 : (block < c.q_len ? block : c.q_len);
    // The planned block and a small one (many items, partial last block).
    const int blocks[2] = {block, block > 5 ? 5 : block};
    for (int qb : blocks) {
      const double worst = run_case(copy, c, qb);
      ++ran;
      worst_seen = worst > worst_seen ? worst : worst_seen;
      if (!(worst <= 1.0)) {
        ++failures;
        char how[32];
        snprintf(how, sizeof how, "qb=%d", qb);
        print_failure(copy.name, c, how, worst);
      }
    }
  }
  printf("%s: %d cases, %d failures, worst error %.3g x tolerance\n", copy.name, ran, failures,
         worst_seen);
  return failures;
}

// The backward grid: every dtype over head dims (odd, unpadded, wide),
// GQA/MQA, causal, sliding window, both mask kinds and sinks, each through
// both schemes. Returns failures.
int check_backward_copy(const BackwardCopy& copy) {
  static const ElemType kDtypes[] = {ElemType::float32, ElemType::float16, ElemType::bfloat16};
  Case cases[64];
  int n = 0;
  for (ElemType t : kDtypes) {
    cases[n++] = {t, 1, 2, 2, 13, 130, 64, 64, true, 0, MaskKind::none, false};
    cases[n++] = {t, 2, 4, 2, 70, 70, 16, 16, false, 0, MaskKind::none, false};
    cases[n++] = {t, 1, 6, 2, 65, 65, 80, 80, true, 0, MaskKind::none, true};
    cases[n++] = {t, 1, 3, 1, 9, 70, 3, 100, false, 0, MaskKind::additive, false};
    cases[n++] = {t, 2, 4, 2, 9, 70, 16, 16, false, 0, MaskKind::boolean, false};
    cases[n++] = {t, 1, 4, 2, 100, 100, 32, 32, true, 17, MaskKind::none, true};
  }
  int failures = 0, ran = 0;
  double worst_seen = 0.0;
  for (int i = 0; i < n; ++i) {
    for (int single = 0; single < 2; ++single) {
      const double worst = run_backward_case(copy, cases[i], single == 1);
      ++ran;
      worst_seen = worst > worst_seen ? worst : worst_seen;
      if (!(worst <= 1.0)) {
        ++failures;
        print_failure(copy.name, cases[i], single ? "single pass" : "two passes", worst);
      }
    }
  }
  printf("%s: %d cases, %d failures, worst error %.3g x tolerance\n", copy.name, ran, failures,
         worst_seen);
  return failures;
}

bool wanted(const char* name, int argc, char** argv, int first) {
  bool any = false;
  for (int a = first; a < argc; ++a) {
    if (strcmp(argv[a], name) == 0) return true;
    any = true;
  }
  return !any;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "--cpu") == 0) {
    printf("supported:");
    for (const ForwardCopy& copy : kForwardCopies) {
      if (copy.available()) printf(" %s", copy.name);
    }
    printf("\n");
    return 0;
  }
  const bool sample = argc > 1 && strcmp(argv[1], "--sample") == 0;
  const int first = sample ? 2 : 1;
  int failures = 0, checked = 0;
  for (const ForwardCopy& copy : kForwardCopies) {
    if (!wanted(copy.name, argc, argv, first)) continue;
    ++checked;
    if (!copy.available()) {
      printf("%s: not supported by this CPU\n", copy.name);
      continue;
    }
    failures += check_copy(copy, sample);
  }
  for (const BackwardCopy* backward : kBackwardCopies) {
    const BackwardCopy& copy = *backward;
    if (!wanted(copy.name, argc, argv, first)) continue;
    ++checked;
    if (!copy.available()) {
      printf("%s: not supported by this CPU\n", copy.name);
      continue;
    }
    failures += check_backward_copy(copy);
  }
  if (checked == 0) {
    fprintf(stderr, "harness: no kernel copy matched the arguments\n");
    return 2;
  }
  return failures == 0 ? 0 : 1;
}
