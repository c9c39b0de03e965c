// Standalone check of the CPU kernel's paged K/V layout (PagedLayout in
// csrc/cpu/kernel_impl.h), for the mutation battery of
// tests/test_paged_cpu_mutations.py: the generic kernel copy, linked alone
// (no MLX, no thread pool), runs ragged batches over scattered, shared pages
// item by item and is compared with a scalar double-precision paged attention
// written here. Exits 0 when every case matches, 1 otherwise.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "csrc/cpu/kernels.h"
#include "tests/cpu_harness/test_values.h"

using namespace mlx_attn;
using namespace mlx_attn::cpu;

namespace {

uint32_t state = 12345;

struct Case {
  int batch, heads, kv_heads, dim, page_size;
  int q_lens[4], kv_lens[4];
  int causal, window;
  bool sinks;
};

bool run_case(const Case& c) {
  const int max_pages = 12, num_pages = 4 * max_pages;
  const int D = c.dim, Hq = c.heads, Hkv = c.kv_heads, P = c.page_size;
  int total_q = 0;
  for (int b = 0; b < c.batch; ++b) total_q += c.q_lens[b];
  float* q = (float*)malloc(sizeof(float) * total_q * Hq * D);
  float* k = (float*)malloc(sizeof(float) * num_pages * Hkv * P * D);
  float* v = (float*)malloc(sizeof(float) * num_pages * Hkv * P * D);
  float* sinks = (float*)malloc(sizeof(float) * Hq);
  float* out = (float*)malloc(sizeof(float) * total_q * Hq * D);
  float* lse = (float*)malloc(sizeof(float) * total_q * Hq);
  int32_t table[4 * max_pages];
  for (int i = 0; i < total_q * Hq * D; ++i) q[i] = next_value(state);
  for (int i = 0; i < num_pages * Hkv * P * D; ++i) k[i] = next_value(state), v[i] = next_value(state) ;
  for (int h = 0; h < Hq; ++h) sinks[h] = next_value(state);
  for (int i = 0; i < 4 * max_pages; ++i) table[i] = int32_t((i * 29 + 7) % num_pages);  // scattered
  for (int b = 1; b < c.batch; ++b) table[b * max_pages] = table[0];                     // a shared page

  KernelCall call{};
  AttentionProblem& p = call.problem;
  p.batch = c.batch;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.group = Hq / Hkv;
  p.q_len = total_q;
  p.kv_len = max_pages * P;
  p.head_dim = p.value_dim = D;
  p.dtype = ElemType::float32;
  const int64_t qs[4] = {0, D, int64_t(Hq) * D, 1};
  const int64_t ks[4] = {int64_t(Hkv) * P * D, int64_t(P) * D, D, 1};
  for (int i = 0; i < 4; ++i) p.q_strides[i] = qs[i], p.k_strides[i] = p.v_strides[i] = ks[i];
  p.scale = 0.3f;
  p.causal = c.causal;
  p.window_size = c.window;
  p.has_sinks = c.sinks;
  p.sinks_stride = 1;
  p.mask_kind = MaskKind::none;
  call.q = q;
  call.k = k;
  call.v = v;
  call.sinks = sinks;
  call.out = out;
  call.lse = lse;
  int32_t kv_lens[4], q_lens[4];
  for (int b = 0; b < c.batch; ++b) kv_lens[b] = c.kv_lens[b], q_lens[b] = c.q_lens[b];
  call.paged.block_table = table;
  call.paged.table_strides[0] = max_pages;
  call.paged.table_strides[1] = 1;
  call.paged.max_pages = max_pages;
  call.paged.page_size = P;
  call.paged.num_pages = num_pages;
  call.paged.kv_lens = kv_lens;
  call.paged.q_lens = q_lens;
  call.paged.kv_len_stride = call.paged.q_len_stride = 1;
  call.paged.total_q = total_q;
  call.query_block = 3;  // several query blocks per chunked-prefill sequence
  PagedItem items[64];
  int count = 0, begin = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int s = 0; s < c.q_lens[b]; s += call.query_block) items[count++] = {b, begin, s, c.q_lens[b], c.kv_lens[b]};
    begin += c.q_lens[b];
  }
  call.paged.items = items;
  call.paged.item_count = count;
  float* scratch = (float*)malloc(sizeof(float) * (scratch_floats(call, generic::vector_lanes()) + 64));
  for (int64_t i = 0; i < call.work_items(); ++i) generic::process_work_item(call, i, scratch);

  // scalar double reference
  bool ok = true;
  int row = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int i = 0; i < c.q_lens[b]; ++i, ++row) {
      const int pos = c.kv_lens[b] - c.q_lens[b] + i;
      for (int h = 0; h < Hq; ++h) {
        const int kvh = h / (Hq / Hkv);
        double m = c.sinks ? sinks[h] : -INFINITY;
        double logits[max_pages * 128];
        for (int j = 0; j < c.kv_lens[b]; ++j) {
          const bool seen = !c.causal || (j <= pos && (c.window <= 0 || j > pos - c.window));
          const int64_t at = (int64_t(table[b * max_pages + j / P]) * Hkv + kvh) * P * D + int64_t(j % P) * D;
          double s = 0;
          for (int d = 0; d < D; ++d) s += double(q[(int64_t(row) * Hq + h) * D + d]) * k[at + d];
          logits[j] = seen ? 0.3 * s : -INFINITY;
          if (logits[j] > m) m = logits[j];
        }
        double total = c.sinks ? exp(sinks[h] - m) : 0;
        double acc[256] = {};
        for (int j = 0; j < c.kv_lens[b]; ++j) {
          if (logits[j] == -INFINITY) continue;
          const double w = exp(logits[j] - m);
          total += w;
          const int64_t at = (int64_t(table[b * max_pages + j / P]) * Hkv + kvh) * P * D + int64_t(j % P) * D;
          for (int d = 0; d < D; ++d) acc[d] += w * v[at + d];
        }
        for (int d = 0; d < D; ++d) {
          const double want = total > 0 ? acc[d] / total : 0;
          const double got = out[(int64_t(row) * Hq + h) * D + d];
          if (!(fabs(got - want) <= 1e-4 + 1e-4 * fabs(want))) ok = false;
        }
        const double want_lse = total > 0 ? m + log(total) : -INFINITY;
        const double got_lse = lse[int64_t(row) * Hq + h];
        if (!(got_lse == want_lse || fabs(got_lse - want_lse) <= 1e-4 + 1e-4 * fabs(want_lse))) ok = false;
      }
    }
  }
  free(q), free(k), free(v), free(sinks), free(out), free(lse), free(scratch);
  return ok;
}

}  // namespace

int main() {
  // decode rows, chunked-prefill rows, an empty sequence; pages of 16 (read
  // in place, four segments per key block), 5 (packed) and 100 (uneven);
  // GQA, window and sinks
  const Case cases[] = {
      {4, 4, 2, 16, 16, {1, 7, 0, 1}, {130, 70, 9, 1}, 1, 0, false},
      {4, 4, 2, 16, 5, {1, 7, 0, 1}, {53, 20, 9, 2}, 1, 0, true},
      {3, 6, 2, 8, 100, {4, 1, 1, 0}, {150, 101, 1, 0}, 1, 40, true},
      {3, 2, 1, 8, 16, {2, 1, 1, 0}, {70, 33, 3, 0}, 0, 0, false},
  };
  int failures = 0;
  for (const Case& c : cases) failures += run_case(c) ? 0 : 1;
  printf("paged driver: %d cases, %d failures\n", int(sizeof(cases) / sizeof(cases[0])), failures);
  return failures ? 1 : 0;
}
