// Fused attention for decoding (few queries, long key/value length): the
// kernel templates; metal/attention_decode.metal instantiates them for
// contiguous K/V, metal/attention_quantized.metal for quantized K/V.
//
// attention_decode_partial: the key/value length is split across
// threadgroups (grid.x = splits). A threadgroup serves up to R rows =
// (query head of the GQA group) x (query position) of one KV head, so K/V are
// read once for those rows (grid.y = KV heads x row chunks; one chunk
// unless rows > R). Its NSG simdgroups take the split's keys in turn (key j:
// simdgroup j % NSG); R and NSG are the threadgroup's shape (decode_split):
// the group shape (R rows of the register budget, 4 simdgroups) or the row
// shape (1 row, up to 32 simdgroups). They read each key straight from device memory into
// registers: lane l holds D/32 dims of the key, the value, every row's query
// and output, and a score is a simd_sum of lane partial dot products; no K/V
// staging. Register budget: R x D/32 floats of q and of the output per lane
// (MLX_ATTN_DECODE_ROW_FLOATS each).
//
// The K/V layout is an axis, not a kernel: a loader policy KV reads a key's
// and a value's lane slices (ContiguousKV here, QuantizedKV in
// metal/attention_quantized.h); everything else (rows, the logit step, the
// online softmax, the simdgroup combine, the partials) is decode_split,
// written once. A loader policy provides
//   SLICE, VEC             dims per lane (D / 32), dims per q load
//   dim(lane, e)           the head dim of element e of lane's slice (q, the
//                          partials and the merge use the same layout)
//   select_head(p, b, h)   the K/V head the threadgroup reads
//   load(key, lane, k, v)  this lane's slices of key `key` (uniform across
//                          the simdgroup: a policy may use simd functions)
//
// The simdgroups' online-softmax states are combined once into one partial
// (max, sum, output) per (row, split) (combine_simdgroup_states): simdgroups
// 1.. hand their live rows (not the register budget's unused ones) to
// simdgroup 0 through threadgroup memory, and simdgroup 0 adds them to its own
// registers (lane g reads the max and sum of simdgroup g + 1 once; the other
// lanes get its weight by shuffle). attention_decode_merge combines the
// splits, a threadgroup of MLX_ATTN_DECODE_MERGE_SIMDGROUPS simdgroups per row:
// each merges every NSG-th split, then the same combine adds the simdgroups'
// states, and sinks, normalize and the row log-sum-exp (decode_write_row). With one split the
// launch has no merge: the partial kernel ends with decode_write_row itself
// (DecodeOutputs). Each simdgroup loads its next key's K/V while the current
// key's math runs (DecodePrefetch, up to D = 256).
// Same step names and finite sentinels as metal/attention_prefill.h.
#pragma once

#include <metal_stdlib>

#include "metal/attention_steps.h"

using namespace metal;

// Dims per device load in decode: the largest of 4, 2, 1 that divides a lane's D/32.
template <int D>
struct DecodeLayout {
  static constexpr int SLICE = D / 32;
  static constexpr int VEC = SLICE % 4 == 0 ? 4 : (SLICE % 2 == 0 ? 2 : 1);
  // the head dim of element e of `lane`'s slice: chunk c of VEC consecutive
  // dims at c * 32 * VEC + lane * VEC, so consecutive lanes read consecutive
  // vectors of a row (coalesced)
  static inline int dim(uint lane, int e) { return e / VEC * 32 * VEC + int(lane) * VEC + e % VEC; }
};

// K/V rows of the input dtype read through their strides (VEC-wide loads when
// params.vector_loads).
template <typename T, int D>
struct ContiguousKV {
  static constexpr int SLICE = D / 32;
  static constexpr int VEC = DecodeLayout<D>::VEC;
  // per-thread registers a loader holds beyond the decode loop's own
  // (DecodePrefetch): none; its bases and strides are uniform across the
  // simdgroup (uniform registers)
  static constexpr int REGISTERS = 0;
  static inline int dim(uint lane, int e) { return DecodeLayout<D>::dim(lane, e); }

  const device T* k;
  const device T* v;
  attn_int64 k_at;  // the selected head's first element
  attn_int64 v_at;
  attn_int64 k_key_stride;
  attn_int64 v_key_stride;
  attn_int64 k_dim_stride;
  attn_int64 v_dim_stride;
  bool vector_loads;

  inline void select_head(constant AttentionParams& p, int b, int kv_head) {
    k_at = b * p.k_strides[0] + kv_head * p.k_strides[1];
    v_at = b * p.v_strides[0] + kv_head * p.v_strides[1];
    k_key_stride = p.k_strides[2];
    v_key_stride = p.v_strides[2];
    k_dim_stride = p.k_strides[3];
    v_dim_stride = p.v_strides[3];
    vector_loads = p.vector_loads != 0;
  }
  inline void load(int key, uint lane, thread float* k_slice, thread float* v_slice) const {
    const attn_int64 k_row = k_at + key * k_key_stride;
    const attn_int64 v_row = v_at + key * v_key_stride;
    for (int e = 0; e < SLICE; e += VEC) {
      const int d = dim(lane, e);
      RowLoad<T, VEC>::read(k, k_row + d * k_dim_stride, k_dim_stride, vector_loads, &k_slice[e]);
      RowLoad<T, VEC>::read(v, v_row + d * v_dim_stride, v_dim_stride, vector_loads, &v_slice[e]);
    }
  }
};

// The group shape's rows at head dim D (metal/attention_params.h): the
// register budget's, at most MLX_ATTN_DECODE_GROUP_MAX_ROWS.
template <int D>
struct DecodeGroupRows {
  static constexpr int BUDGET = MLX_ATTN_DECODE_ROW_FLOATS / (D / 32);
  static constexpr int value = BUDGET < MLX_ATTN_DECODE_GROUP_MAX_ROWS ? BUDGET : MLX_ATTN_DECODE_GROUP_MAX_ROWS;
};

// R rows' online-softmax states, in registers: each row's output slice,
// running max and sum (what combine_simdgroup_states combines).
template <int R, int SLICE>
struct RowStates {
  float o[R][SLICE];
  float m[R];
  float l[R];
};

// The rows of one decode threadgroup, in registers: each row's state and
// query slice.
template <int R, int SLICE>
struct DecodeRows : RowStates<R, SLICE> {
  float q[R][SLICE];
};

// One key of the split for every row: score, scale, softcap (SOFTCAP), mask,
// online max / rescale, accumulate. EDGE: the causal / window rule may hide the key from
// some row (attention_rules.h block_on_edge); interior keys skip the test.
template <typename T, int R, int SLICE, int MASK, bool EDGE, bool SOFTCAP>
inline void decode_key(
    constant AttentionParams& p, const device uchar* mask, thread DecodeRows<R, SLICE>& rows, int key,
    thread const float* k_slice, thread const float* v_slice, int b, int kv_head, int r0, int row_count) {
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    if (r >= row_count) {
      break;  // uniform across the simdgroup
    }
    const int h = kv_head * p.group + r / p.q_len;
    const int qi = r % p.q_len;
    // score
    float dot = 0.0f;
    for (int e = 0; e < SLICE; ++e) {
      dot += rows.q[i][e] * k_slice[e];
    }
    // scale, softcap, mask
    const float s = masked_logit<T, MASK, EDGE, SOFTCAP>(p, mask, simd_sum(dot) * p.scale, b, h, qi, key,
                                                         query_position(p, qi)).value;
    if (logit_masked(s)) {
      continue;  // same decision on every lane
    }
    // online max / rescale, accumulate
    const float m_new = max(rows.m[i], s);
    const float alpha = fast::exp2((rows.m[i] - m_new) * MLX_ATTN_LOG2E);
    const float prob = fast::exp2((s - m_new) * MLX_ATTN_LOG2E);
    rows.l[i] = rows.l[i] * alpha + prob;
    rows.m[i] = m_new;
    for (int e = 0; e < SLICE; ++e) {
      rows.o[i][e] = rows.o[i][e] * alpha + prob * v_slice[e];
    }
  }
}

// The decode loop's registers per lane, the cost model's estimate
// (kernel_lab/metal_cost_model.py decode_loop_registers): q and o of R rows
// (2 x R x SLICE), their max and sum (2 R), the key's K and V slices
// (2 x SLICE, twice when the next key's are loaded ahead), ~20 of addresses
// and loop state, and the loader's own (KV::REGISTERS).
constexpr int decode_loop_registers(int rows, int slice, bool prefetch, int loader) {
  return 2 * rows * slice + 2 * rows + 2 * slice * (prefetch ? 2 : 1) + 20 + loader;
}

// Whether decode_keys holds the next key's K/V slices while it computes the
// current key's (loads one key ahead): where the loop's registers with them
// stay within the per-thread budget and a core's register file holds the
// threadgroup's 32 x NSG threads. The group shape: up to D = 256 (D = 64:
// 76, 96: 96, 128: 116, 256: 124; the quantized loader 3 more); at D = 512
// they would take 152, so it loads the key it computes (120). The row shape
// at 32 simdgroups (52 a lane): D = 128 takes 46, the paged quantized loader
// 53, which loads the key it computes.
template <int R, int NSG, typename KV>
struct DecodePrefetch {
  static constexpr int LIMIT = MLX_ATTN_CORE_REGISTERS / (32 * NSG) < MLX_ATTN_REGISTER_BUDGET
      ? MLX_ATTN_CORE_REGISTERS / (32 * NSG)
      : MLX_ATTN_REGISTER_BUDGET;
  static constexpr bool ENABLED = decode_loop_registers(R, KV::SLICE, true, KV::REGISTERS) <= LIMIT;
};

// The split's keys [kv_begin, kv_end), key j on simdgroup j % NSG; per key
// the variant of decode_key (edge or interior, with or without the softcap).
// With DecodePrefetch, key j + NSG's loads are issued before key j's math, so
// they are in flight while it runs (the loop bound is uniform across the
// simdgroup: a loader may use simd functions).
template <typename T, int R, int NSG, typename KV, int MASK>
inline void decode_keys(
    constant AttentionParams& p, const device uchar* mask, const thread KV& kv, thread DecodeRows<R, KV::SLICE>& rows,
    int kv_begin, int kv_end, int first_pos, int last_pos, int b, int kv_head, int r0, int row_count, uint sg,
    uint lane) {
  constexpr int SLICE = KV::SLICE;
  constexpr bool PREFETCH = DecodePrefetch<R, NSG, KV>::ENABLED;
  float k_next[SLICE];
  float v_next[SLICE];
  int key = kv_begin + int(sg);
  if (PREFETCH && key < kv_end) {
    kv.load(key, lane, k_next, v_next);
  }
  for (; key < kv_end; key += NSG) {
    float k_slice[SLICE];
    float v_slice[SLICE];
    if (PREFETCH) {
      for (int e = 0; e < SLICE; ++e) {
        k_slice[e] = k_next[e];
        v_slice[e] = v_next[e];
      }
      const int next = key + NSG;
      if (next < kv_end) {
        kv.load(next, lane, k_next, v_next);  // in flight during this key's math
      }
    } else {
      kv.load(key, lane, k_slice, v_slice);
    }
    const bool edge = block_on_edge(p, key, 1, first_pos, last_pos);
    if (p.softcap > 0.0f) {
      if (edge) {
        decode_key<T, R, SLICE, MASK, true, true>(p, mask, rows, key, k_slice, v_slice, b, kv_head, r0, row_count);
      } else {
        decode_key<T, R, SLICE, MASK, false, true>(p, mask, rows, key, k_slice, v_slice, b, kv_head, r0, row_count);
      }
    } else if (edge) {
      decode_key<T, R, SLICE, MASK, true, false>(p, mask, rows, key, k_slice, v_slice, b, kv_head, r0, row_count);
    } else {
      decode_key<T, R, SLICE, MASK, false, false>(p, mask, rows, key, k_slice, v_slice, b, kv_head, r0, row_count);
    }
  }
}

// The threadgroup memory of combine_simdgroup_states for NSG simdgroups of
// ROWS rows each (decode_split's defaults; the merge: its simdgroups, one
// row): simdgroups 1..'s output, max and sum per row (element e of a lane's
// slice at e * 32 + lane, so that the 32 lanes hit 32 different banks). Each
// kernel declares one (Metal declares threadgroup variables in kernel scope).
template <int D, int NSG = MLX_ATTN_DECODE_SIMDGROUPS, int ROWS = DecodeGroupRows<D>::value>
struct DecodeStates {
  float out[(NSG - 1) * ROWS * D];
  float row_max[(NSG - 1) * ROWS];
  float row_sum[(NSG - 1) * ROWS];
};

// The NSG simdgroups' online-softmax states of rows [0, live_rows) combined
// into simdgroup 0's `rows`: simdgroups 1.. hand their live rows to
// simdgroup 0 through `states`, and simdgroup 0 rescales its own and theirs
// to the common max and adds them (lane g reads the max and sum of
// simdgroup g + 1 once; the other lanes get its weight by shuffle). True on
// simdgroup 0, which then holds the combined states; the others return false
// after the barrier and must reach no other. Shared by decode_split (its
// simdgroups' keys) and merge_splits (its simdgroups' splits).
template <int NSG, int R, int SLICE>
inline bool combine_simdgroup_states(
    threadgroup DecodeStates<SLICE * 32, NSG, R>& states, thread RowStates<R, SLICE>& rows, int live_rows, uint sg,
    uint lane) {
  static_assert(NSG - 1 <= 32, "lane g reads simdgroup g + 1's max and sum");
  constexpr int D = SLICE * 32;
  if (sg != 0) {
    const int at = (int(sg) - 1) * R;
    for (int i = 0; i < live_rows; ++i) {
      for (int e = 0; e < SLICE; ++e) {
        states.out[(at + i) * D + e * 32 + int(lane)] = rows.o[i][e];
      }
      if (lane == 0) {
        states.row_max[at + i] = rows.m[i];
        states.row_sum[at + i] = rows.l[i];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg != 0) {
    return false;  // after the last barrier
  }
  const bool reads_stats = lane < uint(NSG - 1);  // lane g: simdgroup g + 1's max and sum
  for (int i = 0; i < live_rows; ++i) {
    const float their_max = reads_stats ? states.row_max[int(lane) * R + i] : MLX_ATTN_MASKED_LOGIT;
    const float their_sum = reads_stats ? states.row_sum[int(lane) * R + i] : 0.0f;
    const float m = max(rows.m[i], simd_max(their_max));
    // rescale to the common max: lane g's weight is simdgroup g + 1's
    const float own = fast::exp2((rows.m[i] - m) * MLX_ATTN_LOG2E);
    const float their_weight = fast::exp2((their_max - m) * MLX_ATTN_LOG2E);
    rows.l[i] = rows.l[i] * own + simd_sum(their_sum * their_weight);
    rows.m[i] = m;
    for (int e = 0; e < SLICE; ++e) {
      rows.o[i][e] = rows.o[i][e] * own;
    }
    for (int g = 0; g < NSG - 1; ++g) {
      const float weight = simd_shuffle(their_weight, ushort(g));
      for (int e = 0; e < SLICE; ++e) {
        rows.o[i][e] += states.out[(g * R + i) * D + e * 32 + int(lane)] * weight;
      }
    }
  }
  return true;
}

// A row's final step, once its splits are combined (running max m, sum l and
// this lane's output slice o, element e at head dim Layout::dim(lane, e)):
// sinks join the sum, normalize (row_normalizer, the prefill kernels' step:
// rows that saw nothing give zeros), write the output row and, when lse_row
// is not null, the row log-sum-exp. Query head h. Shared by the merge and
// the one-split partial.
template <typename T, int SLICE, typename Layout>
inline void decode_write_row(
    float m, float l, thread const float* o, const device T* sinks, constant AttentionParams& p, int h,
    device T* out_row, device float* lse_row, uint lane) {
  const float factor = row_normalizer(p, sinks, h, m, l);
  for (int e = 0; e < SLICE; ++e) {
    out_row[Layout::dim(lane, e)] = T(o[e] * factor);
  }
  if (lse_row != nullptr && lane == 0) {
    *lse_row = row_log_sum_exp(m, l);
  }
}

// Where decode_split puts each row's combined state: the split's partial
// (partial_out / partial_stats, merged by a second dispatch), or, when the
// launch has one split (`direct`), the normalized output row itself
// (decode_write_row: sinks, out, lse), with no merge dispatch. Output row of
// (batch b, query head h, position qi): b * Hq * Tq + h * head_rows +
// qi * position_rows.
template <typename T>
struct DecodeOutputs {
  device float* partial_out;
  device float* partial_stats;
  bool direct;
  const device T* sinks;
  device T* out;    // rows of D
  device float* lse;  // one per row, when p.output_lse
  int head_rows;
  int position_rows;
  int partial_splits;  // partials per row in partial_out: the launch's splits (cascade: plus its prefix splits)
};

// The outputs of a launch of `groups` partial threadgroups: direct when the
// launch has one split (its plan then dispatches no merge); out [B, Hq, Tq,
// D], lse [B, Hq, Tq]. The float, quantized and paged decode kernels take
// their outputs from here.
template <typename T>
inline DecodeOutputs<T> decode_launch_outputs(
    device float* partial_out, device float* partial_stats, const device T* sinks, device T* out, device float* lse,
    constant AttentionParams& p, uint3 groups) {
  return {partial_out, partial_stats, groups.x == 1, sinks, out, lse, p.q_len, 1, int(groups.x)};
}

// The partial kernel's body for any K/V loader; `states`: the kernel's
// threadgroup memory, whose type is the threadgroup's shape: R rows (query
// heads x positions of one KV head) served together, their keys dealt out
// to NSG simdgroups. The group shape (DecodeStates<D>'s defaults: the
// register budget's rows, MLX_ATTN_DECODE_SIMDGROUPS simdgroups) reads each
// key once for all R rows; the row shape (one row, up to 32 simdgroups, as
// MLX's sdpa_vector) gives each simdgroup fewer keys, for contexts too short
// to keep many split threadgroups busy. The launch plan picks the shape
// (csrc/metal/launch_plan.cpp decode_shape).
template <typename T, int D, int MASK, typename KV, int NSG, int R>
inline void decode_split(
    thread KV& kv, const device T* q, constant AttentionParams& p, const device uchar* mask,
    thread const DecodeOutputs<T>& outputs, threadgroup DecodeStates<D, NSG, R>& states, uint3 group_id,
    uint3 groups, uint sg, uint lane) {
  constexpr int SLICE = KV::SLICE;  // head-dim elements per lane
  constexpr int VEC = KV::VEC;
  static_assert(R >= 1 && R * SLICE <= MLX_ATTN_DECODE_ROW_FLOATS, "R rows of q and o within the register budget");

  const int split = int(group_id.x);
  const int splits = int(groups.x);
  const int row_count = p.group * p.q_len;
  const int row_chunks = (row_count + R - 1) / R;
  const int kv_head = int(group_id.y) / row_chunks;
  const int r0 = (int(group_id.y) % row_chunks) * R;
  const int b = int(group_id.z);

  const bool vector_loads = p.vector_loads != 0;
  DecodeRows<R, SLICE> rows;
  int first_pos = p.kv_len;  // the chunk's query positions (every chunk has a row)
  int last_pos = -p.q_len;
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    const bool real = r < row_count;
    const int h = kv_head * p.group + (real ? r / p.q_len : 0);
    const int qi = real ? r % p.q_len : 0;
    if (real) {
      first_pos = min(first_pos, query_position(p, qi));
      last_pos = max(last_pos, query_position(p, qi));
    }
    const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
    for (int e = 0; e < SLICE; e += VEC) {
      if (real) {
        const long at = q_row + KV::dim(lane, e) * p.q_strides[3];
        RowLoad<T, VEC>::read(q, at, p.q_strides[3], vector_loads, &rows.q[i][e]);
      }
    }
    for (int e = 0; e < SLICE; ++e) {
      rows.q[i][e] = real ? rows.q[i][e] : 0.0f;  // rows past the group: not read above
      rows.o[i][e] = 0.0f;
    }
    rows.m[i] = MLX_ATTN_MASKED_LOGIT;
    rows.l[i] = 0.0f;
  }

  // the split's keys, narrowed to those some row of the chunk can see
  const int chunk = (p.kv_len + splits - 1) / splits;
  const KeyRange visible = block_key_range(p, first_pos, last_pos);
  const int kv_begin = max(split * chunk, visible.begin);
  const int kv_end = min(min(p.kv_len, split * chunk + chunk), visible.end);

  kv.select_head(p, b, kv_head);
  decode_keys<T, R, NSG, KV, MASK>(p, mask, kv, rows, kv_begin, kv_end, first_pos, last_pos, b, kv_head, r0,
                                   row_count, sg, lane);

  // combine the simdgroups' states into this split's partial, live rows only
  const int live_rows = min(R, row_count - r0);
  if (!combine_simdgroup_states<NSG>(states, rows, live_rows, sg, lane)) {
    return;
  }
  for (int i = 0; i < live_rows; ++i) {
    if (outputs.direct) {  // one split: this is the row's whole state
      const int h = kv_head * p.group + (r0 + i) / p.q_len;
      const long row =
          long(b) * p.q_heads * p.q_len + h * outputs.head_rows + (r0 + i) % p.q_len * outputs.position_rows;
      decode_write_row<T, SLICE, KV>(rows.m[i], rows.l[i], rows.o[i], outputs.sinks, p, h, outputs.out + row * D,
                                     p.output_lse != 0 ? outputs.lse + row : nullptr, lane);
      continue;
    }
    const long base = ((long(b) * p.kv_heads + kv_head) * outputs.partial_splits + split) * row_count + r0 + i;
    for (int e = 0; e < SLICE; ++e) {
      outputs.partial_out[base * D + KV::dim(lane, e)] = rows.o[i][e];
    }
    if (lane == 0) {
      outputs.partial_stats[base * 2] = rows.m[i];
      outputs.partial_stats[base * 2 + 1] = rows.l[i];
    }
  }
}

// R rows and NSG simdgroups per threadgroup (decode_split); the attribute
// makes the compiler fit 32 x NSG threads in a core's registers.
template <typename T, int D, int MASK, int R, int NSG>
[[kernel, max_total_threads_per_threadgroup(32 * NSG)]] void attention_decode_partial(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    constant AttentionParams& p [[buffer(3)]],
    const device uchar* mask [[buffer(4)]],
    device float* partial_out [[buffer(5)]],    // [B, Hkv, splits, rows, D]
    device float* partial_stats [[buffer(6)]],  // [B, Hkv, splits, rows, 2]: max, sum
    const device T* sinks [[buffer(7)]],
    device T* out [[buffer(8)]],                // one split: written here, no merge
    device float* lse [[buffer(9)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup DecodeStates<D, NSG, R> states;
  ContiguousKV<T, D> kv;
  kv.k = k;
  kv.v = v;
  const DecodeOutputs<T> outputs = decode_launch_outputs(partial_out, partial_stats, sinks, out, lse, p, groups);
  decode_split<T, D, MASK>(kv, q, p, mask, outputs, states, group_id, groups, sg, lane);
}

// Split s's weight at the common max m: its partial rescaled (base: its
// partial row).
inline float split_weight(const device float* partial_stats, long base, float m) {
  return fast::exp2((partial_stats[base * 2] - m) * MLX_ATTN_LOG2E);
}

// The threadgroup memory of a merge threadgroup (one row):
// combine_simdgroup_states' for MLX_ATTN_DECODE_MERGE_SIMDGROUPS simdgroups.
template <int D>
using MergeStates = DecodeStates<D, MLX_ATTN_DECODE_MERGE_SIMDGROUPS, 1>;

// Merges one row's split partials (split s at partial row first + s * stride)
// into its output row `out_row` and, when lse_row is not null, its row
// log-sum-exp. Query head h. A threadgroup of NSG =
// MLX_ATTN_DECODE_MERGE_SIMDGROUPS simdgroups per row: simdgroup g takes
// splits g, g + NSG, ... (the chain of dependent loads is splits / NSG
// long, not splits): the max and sum of its splits across its lanes (lane
// j: its splits j, j + 32, ...; one load round for up to 32) reduced with
// simd_max / simd_sum, then its output slices split by split, rescaled to
// its max, the next one loaded ahead (its first before the max and sum).
// combine_simdgroup_states then adds the simdgroups' states as the partial
// kernel adds its simdgroups', and decode_write_row writes the row (sinks,
// normalize, lse).
template <typename T, int D>
inline void merge_splits(
    const device float* partial_out, const device float* partial_stats, long first, long stride, int splits,
    const device T* sinks, constant AttentionParams& p, int h, device T* out_row, device float* lse_row,
    threadgroup MergeStates<D>& states, uint sg, uint lane) {
  constexpr int NSG = MLX_ATTN_DECODE_MERGE_SIMDGROUPS;
  constexpr int SLICE = D / 32;
  const int own = int(sg);  // this simdgroup's first split
  float next[SLICE];
  for (int e = 0; e < SLICE; ++e) {
    next[e] = own < splits ? partial_out[(first + own * stride) * D + DecodeLayout<D>::dim(lane, e)] : 0.0f;
  }
  float lane_max = MLX_ATTN_MASKED_LOGIT;
  for (int s = own + int(lane) * NSG; s < splits; s += 32 * NSG) {
    lane_max = max(lane_max, partial_stats[(first + s * stride) * 2]);
  }
  const float m = simd_max(lane_max);
  float lane_sum = 0.0f;
  for (int s = own + int(lane) * NSG; s < splits; s += 32 * NSG) {
    const long base = first + s * stride;
    lane_sum += partial_stats[base * 2 + 1] * split_weight(partial_stats, base, m);  // rescale to the common max
  }
  RowStates<1, SLICE> row;
  row.m[0] = m;
  row.l[0] = simd_sum(lane_sum);
  for (int e = 0; e < SLICE; ++e) {
    row.o[0][e] = 0.0f;
  }
  for (int s = own; s < splits; s += NSG) {
    const long base = first + s * stride;
    float slice[SLICE];
    for (int e = 0; e < SLICE; ++e) {
      slice[e] = next[e];
    }
    if (s + NSG < splits) {
      for (int e = 0; e < SLICE; ++e) {
        next[e] = partial_out[(base + NSG * stride) * D + DecodeLayout<D>::dim(lane, e)];
      }
    }
    const float weight = split_weight(partial_stats, base, m);
    for (int e = 0; e < SLICE; ++e) {
      row.o[0][e] += slice[e] * weight;
    }
  }
  if (!combine_simdgroup_states<NSG>(states, row, 1, sg, lane)) {
    return;
  }
  decode_write_row<T, SLICE, DecodeLayout<D>>(row.m[0], row.l[0], row.o[0], sinks, p, h, out_row, lse_row, lane);
}

// One threadgroup of MLX_ATTN_DECODE_MERGE_SIMDGROUPS simdgroups per (row, KV
// head, batch): merge the splits' partials.
template <typename T, int D>
[[kernel]] void attention_decode_merge(
    const device float* partial_out [[buffer(0)]],
    const device float* partial_stats [[buffer(1)]],
    const device T* sinks [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    constant int& splits [[buffer(5)]],
    device float* lse [[buffer(6)]],  // [B, Hq, Tq] when p.output_lse
    MLX_ATTN_THREAD_POSITION) {
  threadgroup MergeStates<D> states;
  const int r = int(group_id.x);
  const int kv_head = int(group_id.y);
  const int b = int(group_id.z);
  const int rows = p.group * p.q_len;
  const int h = kv_head * p.group + r / p.q_len;
  const int qi = r % p.q_len;
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
  merge_splits<T, D>(partial_out, partial_stats, (long(b) * p.kv_heads + kv_head) * splits * rows + r, rows, splits,
                     sinks, p, h, out + row * D, p.output_lse != 0 ? lse + row : nullptr, states, sg, lane);
}
