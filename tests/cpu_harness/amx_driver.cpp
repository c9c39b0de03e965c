// Standalone check of the avx512amx kernel copy's tile products
// (csrc/cpu/amx_tiles.h through kernel_impl.h), for the mutation battery of
// tests/test_amx_cpu_mutations.py: the copy, linked alone (no MLX, no thread
// pool), runs dense bf16 problems item by item (whole and partial 16-key
// tiles, K in place and packed, 32 and 64 feature tiles, GQA) and is compared
// with a scalar double-precision attention written here. Exits 0 when every
// case matches, 1 otherwise, 2 when the CPU or Linux gives no AMX tiles.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MLX_ATTN_X86_KERNELS 1
#include "csrc/cpu/cpu_features.h"
#include "csrc/cpu/kernels.h"
#include "tests/cpu_harness/test_values.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

namespace {

uint32_t state = 12345;

struct Case {
  int q_heads, kv_heads, q_len, kv_len, dim, value_dim, causal;
};

bool run_case(const Case& c) {
  const int Hq = c.q_heads, Hkv = c.kv_heads, Tq = c.q_len, Tk = c.kv_len, D = c.dim, Dv = c.value_dim;
  uint16_t* q = (uint16_t*)malloc(sizeof(uint16_t) * Hq * Tq * D);
  uint16_t* k = (uint16_t*)malloc(sizeof(uint16_t) * Hkv * Tk * D);
  uint16_t* v = (uint16_t*)malloc(sizeof(uint16_t) * Hkv * Tk * Dv);
  uint16_t* out = (uint16_t*)malloc(sizeof(uint16_t) * Hq * Tq * Dv);
  for (int i = 0; i < Hq * Tq * D; ++i) q[i] = to_bfloat(next_value(state));
  for (int i = 0; i < Hkv * Tk * D; ++i) k[i] = to_bfloat(next_value(state));
  for (int i = 0; i < Hkv * Tk * Dv; ++i) v[i] = to_bfloat(next_value(state));

  KernelCall call{};
  AttentionProblem& p = call.problem;
  p.batch = 1;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.group = Hq / Hkv;
  p.q_len = Tq;
  p.kv_len = Tk;
  p.head_dim = D;
  p.value_dim = Dv;
  p.dtype = ElemType::bfloat16;
  const int64_t qs[4] = {int64_t(Hq) * Tq * D, int64_t(Tq) * D, D, 1};
  const int64_t ks[4] = {int64_t(Hkv) * Tk * D, int64_t(Tk) * D, D, 1};
  const int64_t vs[4] = {int64_t(Hkv) * Tk * Dv, int64_t(Tk) * Dv, Dv, 1};
  for (int i = 0; i < 4; ++i) p.q_strides[i] = qs[i], p.k_strides[i] = ks[i], p.v_strides[i] = vs[i];
  p.scale = 0.125f;
  p.causal = c.causal;
  p.mask_kind = MaskKind::none;
  call.q = q;
  call.k = k;
  call.v = v;
  call.out = out;
  call.query_block = 256 / p.group;  // the dense AMX plan (dispatch.cpp max_rows)
  float* scratch = (float*)malloc(sizeof(float) * (scratch_floats(call, avx512amx::vector_lanes()) + 64));
  for (int64_t i = 0; i < call.work_items(); ++i) avx512amx::process_work_item(call, i, scratch);

  // scalar double reference
  bool ok = true;
  double worst = 0;
  for (int h = 0; h < Hq; ++h) {
    const int kvh = h / p.group;
    for (int i = 0; i < Tq; ++i) {
      const int pos = Tk - Tq + i;
      double logits[512], m = -INFINITY;
      for (int j = 0; j < Tk; ++j) {
        double s = 0;
        for (int d = 0; d < D; ++d) {
          s += double(from_bfloat(q[(int64_t(h) * Tq + i) * D + d])) * from_bfloat(k[(int64_t(kvh) * Tk + j) * D + d]);
        }
        logits[j] = c.causal && j > pos ? -INFINITY : 0.125 * s;
        if (logits[j] > m) m = logits[j];
      }
      double total = 0, acc[256] = {};
      for (int j = 0; j < Tk; ++j) {
        if (logits[j] == -INFINITY) continue;
        const double w = exp(logits[j] - m);
        total += w;
        for (int e = 0; e < Dv; ++e) acc[e] += w * from_bfloat(v[(int64_t(kvh) * Tk + j) * Dv + e]);
      }
      for (int e = 0; e < Dv; ++e) {
        const double want = total > 0 ? acc[e] / total : 0;
        const double got = from_bfloat(out[(int64_t(h) * Tq + i) * Dv + e]);
        const double error = fabs(got - want);
        worst = error > worst ? error : worst;
        if (!(error <= 3e-2)) ok = false;  // the bf16 contract (tests/sdpa_cases.py TOLERANCE)
      }
    }
  }
  printf("Hq %d Hkv %d Tq %d Tk %d D %d Dv %d causal %d: worst %.3g %s\n", Hq, Hkv, Tq, Tk, D, Dv, c.causal, worst,
         ok ? "ok" : "FAIL");
  free(q), free(k), free(v), free(out), free(scratch);
  return ok;
}

}  // namespace

int main() {
  if (!features::amx_bf16()) {
    printf("no AMX-BF16 tiles on this CPU or not granted by the kernel\n");
    return 2;
  }
  const Case cases[] = {
      {2, 1, 70, 200, 64, 64, 1},    // blocks of 128 + 72 keys: the last packed, half a tile of zero keys
      {4, 2, 33, 130, 32, 48, 0},    // one 32-feature tile, Dv of 3 vector tiles, an odd key at the end
      {2, 2, 300, 300, 128, 128, 1}, // two query blocks of 256 rows, K read in place
  };
  bool ok = true;
  for (const Case& c : cases) ok = run_case(c) && ok;
  return ok ? 0 : 1;
}
