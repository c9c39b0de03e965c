// Standalone check of the avx512amx backward copy's tile products
// (csrc/cpu/amx_tiles.h through backward_impl.h), for the mutation battery of
// tests/test_amx_backward_mutations.py: the copy, linked alone (no MLX, no
// thread pool), runs dense bf16 backward problems item by item through both
// schemes (partial key blocks, padded query tiles, 32 and 64 feature tiles,
// D != Dv, GQA, causal) and its dQ, dK, dV are compared with a scalar
// double-precision backward written here (the forward's O and lse from a
// double forward). Exits 0 when every case matches, 1 otherwise, 2 when the
// CPU or Linux gives no AMX tiles.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MLX_ATTN_X86_KERNELS 1
#include "csrc/cpu/backward_kernels.h"
#include "csrc/cpu/cpu_features.h"
#include "tests/cpu_harness/test_values.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

namespace {

uint32_t state = 777;

uint16_t* random_bf16(int64_t count) {
  uint16_t* x = (uint16_t*)malloc(sizeof(uint16_t) * count);
  for (int64_t i = 0; i < count; ++i) x[i] = to_bfloat(next_value(state));
  return x;
}

struct Case {
  int q_heads, kv_heads, q_len, kv_len, dim, value_dim, causal, window;  // window > 0: causal with a window
  // q and k times these powers of two, and the scale (0: 1/sqrt(D)): tiny
  // q.k with a huge scale make logits of order one (the exactness guard's
  // cases: its power of two moved into Q, or products below float32's normal
  // range, which the tiles flush, scored in float32).
  float q_magnitude = 1.0f, k_magnitude = 1.0f;
  double scale = 0.0;
};

// The largest error of got against want, relative to want's largest element.
double relative_error(const uint16_t* got, const double* want, int64_t count) {
  double largest = 0, worst = 0;
  for (int64_t i = 0; i < count; ++i) largest = fabs(want[i]) > largest ? fabs(want[i]) : largest;
  for (int64_t i = 0; i < count; ++i) {
    const double e = fabs(from_bfloat(got[i]) - want[i]);
    worst = e > worst || e != e ? e : worst;
  }
  return worst / (1.0 + largest);
}

bool run_case(const Case& c, bool single_pass) {
  const int Hq = c.q_heads, Hkv = c.kv_heads, Tq = c.q_len, Tk = c.kv_len, D = c.dim, Dv = c.value_dim;
  const int group = Hq / Hkv;
  const int64_t rows = int64_t(Hq) * Tq;
  uint16_t *q = random_bf16(rows * D), *k = random_bf16(int64_t(Hkv) * Tk * D), *v = random_bf16(int64_t(Hkv) * Tk * Dv);
  for (int64_t i = 0; i < rows * D; ++i) q[i] = to_bfloat(float(from_bfloat(q[i])) * c.q_magnitude);
  for (int64_t i = 0; i < int64_t(Hkv) * Tk * D; ++i) k[i] = to_bfloat(float(from_bfloat(k[i])) * c.k_magnitude);
  uint16_t* d_out = random_bf16(rows * Dv);
  uint16_t* out = (uint16_t*)malloc(sizeof(uint16_t) * rows * Dv);
  float* lse = (float*)malloc(sizeof(float) * rows);
  double* probs = (double*)malloc(sizeof(double) * rows * Tk);
  const double scale = float(c.scale > 0 ? c.scale : 1.0 / sqrt(double(D)));

  // double forward: P, O (rounded to bf16), lse
  for (int h = 0; h < Hq; ++h) {
    const int kvh = h / group;
    for (int i = 0; i < Tq; ++i) {
      const int64_t row = int64_t(h) * Tq + i;
      double* pr = probs + row * Tk;
      double m = -INFINITY;
      for (int j = 0; j < Tk; ++j) {
        double s = 0;
        for (int d = 0; d < D; ++d) s += from_bfloat(q[row * D + d]) * from_bfloat(k[(int64_t(kvh) * Tk + j) * D + d]);
        const int pos = Tk - Tq + i;
        const bool hidden = c.causal && (j > pos || (c.window > 0 && j <= pos - c.window));
        pr[j] = hidden ? -INFINITY : float(scale) * s;
        m = pr[j] > m ? pr[j] : m;
      }
      double l = 0;
      for (int j = 0; j < Tk; ++j) l += pr[j] == -INFINITY ? 0.0 : exp(pr[j] - m);
      for (int j = 0; j < Tk; ++j) pr[j] = pr[j] == -INFINITY ? 0.0 : exp(pr[j] - m) / l;
      lse[row] = float(m + log(l));
      for (int e = 0; e < Dv; ++e) {
        double o = 0;
        for (int j = 0; j < Tk; ++j) o += pr[j] * from_bfloat(v[(int64_t(kvh) * Tk + j) * Dv + e]);
        out[row * Dv + e] = to_bfloat(float(o));
      }
    }
  }

  BackwardCall call{};
  AttentionProblem& p = call.problem;
  p.batch = 1;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.group = group;
  p.q_len = Tq;
  p.kv_len = Tk;
  p.head_dim = D;
  p.value_dim = Dv;
  p.dtype = ElemType::bfloat16;
  const int64_t qs[4] = {rows * D, int64_t(Tq) * D, D, 1};
  const int64_t ks[4] = {int64_t(Hkv) * Tk * D, int64_t(Tk) * D, D, 1};
  const int64_t vs[4] = {int64_t(Hkv) * Tk * Dv, int64_t(Tk) * Dv, Dv, 1};
  const int64_t os[4] = {rows * Dv, int64_t(Tq) * Dv, Dv, 1};
  for (int i = 0; i < 4; ++i) {
    p.q_strides[i] = qs[i], p.k_strides[i] = ks[i], p.v_strides[i] = vs[i];
    call.out_strides[i] = os[i], call.d_out_strides[i] = os[i];
  }
  p.scale = float(scale);
  p.causal = c.causal;
  p.window_size = c.window;
  p.mask_kind = MaskKind::none;
  uint16_t* dq = (uint16_t*)malloc(sizeof(uint16_t) * rows * D);
  uint16_t* dk = (uint16_t*)malloc(sizeof(uint16_t) * Hkv * Tk * D);
  uint16_t* dv = (uint16_t*)malloc(sizeof(uint16_t) * Hkv * Tk * Dv);
  call.q = q, call.k = k, call.v = v, call.out = out, call.lse = lse, call.d_out = d_out;
  call.dq = dq, call.dk = dk, call.dv = dv;
  call.delta = (float*)malloc(sizeof(float) * rows);
  int qb = kMaxRows / group;  // as plan_backward
  call.query_block = qb < Tq ? qb : Tq;
  call.single_pass = single_pass;
  const int64_t floats = backward_scratch(call, avx512amx_backward::backward_vector_lanes()).total +
      avx512amx_backward::backward_panel_floats(call);
  float* scratch = (float*)aligned_alloc(64, size_t(round_up(floats * 4, 64)));
  for (int h = 0; h < Hq; ++h) avx512amx_backward::backward_rows(call, h);
  if (single_pass) {
    for (int64_t item = 0; item < Hkv; ++item) avx512amx_backward::backward_group(call, item, scratch);
  } else {
    for (int64_t item = 0; item < int64_t(Hkv) * call.key_blocks(); ++item) {
      avx512amx_backward::backward_key_block(call, item, scratch);
    }
    for (int64_t item = 0; item < int64_t(Hkv) * call.query_blocks(); ++item) {
      avx512amx_backward::backward_query_block(call, item, scratch);
    }
  }

  // double backward: dS = scale P (dO . V^T - delta), delta = rowsum(dO * O)
  double* dq_ref = (double*)calloc(rows * D, sizeof(double));
  double* dk_ref = (double*)calloc(int64_t(Hkv) * Tk * D, sizeof(double));
  double* dv_ref = (double*)calloc(int64_t(Hkv) * Tk * Dv, sizeof(double));
  for (int h = 0; h < Hq; ++h) {
    const int64_t kvh = h / group;
    for (int i = 0; i < Tq; ++i) {
      const int64_t row = int64_t(h) * Tq + i;
      double delta = 0;
      for (int e = 0; e < Dv; ++e) delta += from_bfloat(out[row * Dv + e]) * from_bfloat(d_out[row * Dv + e]);
      for (int j = 0; j < Tk; ++j) {
        const double pj = probs[row * Tk + j];
        const int64_t key = kvh * Tk + j;
        double dp = 0;
        for (int e = 0; e < Dv; ++e) {
          dp += from_bfloat(d_out[row * Dv + e]) * from_bfloat(v[key * Dv + e]);
          dv_ref[key * Dv + e] += pj * from_bfloat(d_out[row * Dv + e]);
        }
        const double ds = scale * pj * (dp - delta);
        for (int d = 0; d < D; ++d) {
          dq_ref[row * D + d] += ds * from_bfloat(k[key * D + d]);
          dk_ref[key * D + d] += ds * from_bfloat(q[row * D + d]);
        }
      }
    }
  }
  const double errors[3] = {relative_error(dq, dq_ref, rows * D), relative_error(dk, dk_ref, int64_t(Hkv) * Tk * D),
                            relative_error(dv, dv_ref, int64_t(Hkv) * Tk * Dv)};
  // the harness's bf16 tolerance (tests/cpu_harness/harness.cpp tolerance)
  const bool ok = errors[0] <= 3e-2 && errors[1] <= 3e-2 && errors[2] <= 3e-2;
  printf("Hq %d Hkv %d Tq %d Tk %d D %d Dv %d causal %d window %d scale %g %s: dq %.3g dk %.3g dv %.3g %s\n", Hq, Hkv, Tq, Tk, D, Dv,
         c.causal, c.window, scale, single_pass ? "single" : "two", errors[0], errors[1], errors[2], ok ? "ok" : "FAIL");
  free(q), free(k), free(v), free(d_out), free(out), free(lse), free(probs), free(dq), free(dk), free(dv);
  free(call.delta), free(scratch), free(dq_ref), free(dk_ref), free(dv_ref);
  return ok;
}

}  // namespace

int main() {
  if (!features::amx_bf16()) {
    printf("no AMX-BF16 tiles on this CPU or not granted by the kernel\n");
    return 2;
  }
  const Case cases[] = {
      {2, 1, 70, 100, 64, 64, 1, 0},    // query tiles of 140 rows (padded to 160), key blocks of 64 + 36
      {4, 2, 33, 130, 32, 96, 0, 0},    // one 32-feature tile, D != Dv, an odd last key
      {1, 1, 150, 150, 128, 128, 1, 0}, // two query blocks (128 + 22 rows), causal edges
      {1, 1, 300, 300, 64, 64, 1, 90},  // a window: key blocks seen by some query tiles only
      {2, 1, 20, 40, 64, 32, 0, 0, 0x1p-65f, 0x1p-65f, 0x1.8p127},  // every q.k product below 2^-126
      {2, 1, 20, 40, 64, 32, 1, 0, 0x1p-65f, 1.0f, 0x1p61},          // 2^56 of the scale moved into Q
  };
  bool ok = true;
  for (const Case& c : cases) {
    for (int single = 0; single < 2; ++single) ok = run_case(c, single == 1) && ok;
  }
  return ok ? 0 : 1;
}
