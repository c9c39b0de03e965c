// The host side of the fused CPU kernel over paged K/V: the work split over
// (sequence, kv head, query block), planned when the call runs (the lengths
// and the block table are read from the evaluated inputs), heaviest items
// first, handed out by the thread pool's atomic counter (dynamic scheduling
// for ragged work). The tile loop is the dense kernel's, with PagedLayout
// (csrc/cpu/kernel_impl.h).
#include "csrc/cpu/paged_host.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "csrc/cpu/host.h"

namespace mlx_attn::cpu {
namespace {

// Whether sequence b's lengths and every block-table entry it reads are
// within the buffers (Python checks the same and raises; this guards direct
// callers of _ext, so the kernel never reads outside its buffers).
bool sequence_readable(const PagedKV& pg, int b, int q_len, int kv_len, int64_t q_begin) {
  if (q_len < 0 || kv_len < q_len || q_begin + q_len > pg.total_q) return false;
  const int64_t pages = (int64_t(kv_len) + pg.page_size - 1) / pg.page_size;
  if (pages > pg.max_pages) return false;
  for (int64_t j = 0; j < pages; ++j) {
    const int32_t page = pg.block_table[b * pg.table_strides[0] + j * pg.table_strides[1]];
    if (page < 0 || page >= pg.num_pages) return false;
  }
  return true;
}

// NaN in rows [begin, end) of out (and lse): rows no readable sequence owns.
void poison_rows(const KernelCall& call, int64_t begin, int64_t end) {
  const AttentionProblem& p = call.problem;
  const int64_t per_row = int64_t(p.q_heads) * p.value_dim;
  for (int64_t i = begin * per_row; i < end * per_row; ++i) {
    switch (p.dtype) {
      case ElemType::float32: static_cast<uint32_t*>(call.out)[i] = 0x7fc00000u; break;
      case ElemType::float16: static_cast<uint16_t*>(call.out)[i] = 0x7e00; break;
      case ElemType::bfloat16: static_cast<uint16_t*>(call.out)[i] = 0x7fc0; break;
    }
  }
  if (call.lse) {
    for (int64_t i = begin * p.q_heads; i < end * p.q_heads; ++i) call.lse[i] = __builtin_nanf("");
  }
}

// Score-product work of one item (rows x keys it may see), for ordering.
int64_t item_cost(const AttentionProblem& p, const PagedItem& it, int rows) {
  int64_t keys = it.kv_len;
  if (p.causal) {
    keys = int64_t(it.kv_len) - it.q_len + it.q_start + rows;
    if (p.window_size > 0 && keys > int64_t(p.window_size) + rows) keys = int64_t(p.window_size) + rows;
  }
  return int64_t(rows) * (keys + kKeyBlock);  // + a block: every item has fixed costs
}

}  // namespace

void plan_paged_work(KernelCall& call) {
  const int group = call.problem.group_size();
  int qb = kMaxRows / group;
  const int total_q = call.paged.total_q;
  call.query_block = qb < 1 ? 1 : (qb < total_q ? qb : (total_q > 0 ? total_q : 1));
}

std::vector<PagedItem> plan_paged_items(KernelCall& call) {
  PagedKV& pg = call.paged;
  const AttentionProblem& p = call.problem;
  std::vector<PagedItem> items;
  std::vector<int64_t> costs;
  int64_t q_begin = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int q_len = pg.q_lens[b * pg.q_len_stride];
    const int kv_len = pg.kv_lens[b * pg.kv_len_stride];
    if (!sequence_readable(pg, b, q_len, kv_len, q_begin)) {
      const int64_t end = q_len > 0 ? std::min<int64_t>(q_begin + q_len, pg.total_q) : q_begin;
      poison_rows(call, q_begin, end);
      q_begin = end;
      continue;
    }
    for (int start = 0; start < q_len; start += call.query_block) {
      items.push_back({b, int32_t(q_begin), start, q_len, kv_len});
    }
    q_begin += q_len;
  }
  poison_rows(call, q_begin, pg.total_q);  // rows past every sequence's

  // Heaviest first: the atomic counter then hands the long sequences out
  // early and the short ones fill in (longest-processing-time order).
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    order[i] = int32_t(i);
    const int rows = std::min(call.query_block, items[i].q_len - items[i].q_start);
    costs.push_back(item_cost(p, items[i], rows));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
  std::vector<PagedItem> planned(items.size());
  for (size_t i = 0; i < items.size(); ++i) planned[i] = items[order[i]];

  pg.items = planned.data();
  pg.item_count = int64_t(planned.size());
  return planned;
}

void run_paged_attention(KernelCall call, float* scratch) {
  const std::vector<PagedItem> items = plan_paged_items(call);
  run_attention(call, scratch);
}

}  // namespace mlx_attn::cpu
