// Fused attention backward (FlashAttention-2 style): the kernel templates;
// metal/attention_backward.metal instantiates them. Launched through
// csrc/metal/backward_launch_plan.cpp. The forward's row log-sum-exp lets every
// tile recompute P = exp(S - lse) directly; with delta = rowsum(dO * O) -
// dlse the softmax derivative is dS = P * (dP - delta), dP = dO . V^T.
// Four dispatches, each writing disjoint memory (no atomics):
//   delta   one simdgroup per query row: delta[row] (a float32 scratch)
//   dkdv    one threadgroup per (32 keys, kv head, batch): dK, dV of its keys,
//           summed in registers over every query head of the GQA group and
//           every query block that can see them
//   dq      one threadgroup per (32 query rows, query head, batch), as the
//           forward prefill kernel: dQ of its rows
//   sinks   (with sinks) one simdgroup per query head:
//           d_sink = -sum over rows of exp(sink - lse) * delta
// Logits are built exactly as the forward's (scale, saturate, softcap, mask):
// a logit that saturated has no gradient, like the CPU backward (csrc/cpu/).
// Every 8x8 tile is a simdgroup matrix; a lane owns row
// r = (lane / 16) * 4 + (lane / 2) % 4, columns c, c + 1 with
// c = ((lane / 8) % 2) * 4 + (lane % 2) * 2 (see attention_prefill.metal).
// No Tq x Tkv buffer exists: the largest tile is 8 x 32 per simdgroup.
#pragma once

#include <metal_stdlib>

#include "metal/attention_steps.h"

using namespace metal;

// P and dS = P * (dP - delta) of one (query qi of head h, key) pair from its
// raw score q.k and dP, rebuilding the forward's logit (scale, saturate,
// softcap, mask: masked_logit, metal/attention_steps.h). dS is 0 where a logit
// saturated (the clamp has no gradient) and carries the softcap's slope
// 1 - tanh^2 (masked_logit's slope); the caller multiplies dQ and dK by
// the scale once. A row that saw nothing (lse -inf, the forward's) has every
// key masked, so its lse is never used. EDGE: the tile may hold a pair the
// causal / window rule or the bounds hide (per-element tests).
template <typename T, int MASK, bool EDGE, bool SOFTCAP>
inline float2 probability_and_gradient(
    constant AttentionParams& p, const device uchar* mask, float score, float d_prob,
    float lse, float delta, int b, int h, int qi, int key) {
  const MaskedLogit logit =
      masked_logit<T, MASK, EDGE, SOFTCAP>(p, mask, score * p.scale, b, h, qi, key, query_position(p, qi));
  const float prob = logit_masked(logit.value) ? 0.0f : fast::exp2((logit.value - lse) * MLX_ATTN_LOG2E);
  return float2(prob, logit.exact ? prob * (d_prob - delta) * logit.slope : 0.0f);
}

// P and dS of the two pairs this lane owns in an 8x8 tile, in place: `s`
// (the raw scores) becomes P, `dp` becomes dS. Pair t is (query qi[t], key
// key[t]) with that query's lse and delta.
template <typename T, int MASK, bool EDGE, bool SOFTCAP>
inline void pair_gradients(
    constant AttentionParams& p, const device uchar* mask, thread simdgroup_float8x8& s,
    thread simdgroup_float8x8& dp, float2 lse, float2 delta, int b, int h, int2 qi, int2 key) {
  for (int t = 0; t < 2; ++t) {
    const float2 grad = probability_and_gradient<T, MASK, EDGE, SOFTCAP>(
        p, mask, s.thread_elements()[t], dp.thread_elements()[t], lse[t], delta[t], b, h, qi[t], key[t]);
    s.thread_elements()[t] = grad.x;
    dp.thread_elements()[t] = grad.y;
  }
}
// The variant for this tile: edge (per-element tests) or interior, with or
// without the softcap.
template <typename T, int MASK>
inline void tile_gradients(
    constant AttentionParams& p, const device uchar* mask, thread simdgroup_float8x8& s,
    thread simdgroup_float8x8& dp, float2 lse, float2 delta, int b, int h, int2 qi, int2 key, bool edge) {
  if (p.softcap > 0.0f) {
    if (edge) {
      pair_gradients<T, MASK, true, true>(p, mask, s, dp, lse, delta, b, h, qi, key);
    } else {
      pair_gradients<T, MASK, false, true>(p, mask, s, dp, lse, delta, b, h, qi, key);
    }
  } else if (edge) {
    pair_gradients<T, MASK, true, false>(p, mask, s, dp, lse, delta, b, h, qi, key);
  } else {
    pair_gradients<T, MASK, false, false>(p, mask, s, dp, lse, delta, b, h, qi, key);
  }
}

// Whether the dK/dV tile of the 8 keys from first_key against the 8 queries
// from first_query needs the per-element visibility tests (queries at or
// past q_end are outside the keys' query range).
inline bool key_tile_needs_tests(constant AttentionParams& p, int first_key, int first_query, int q_end) {
  return block_needs_tests(p, first_key, 8, p.kv_len, query_position(p, first_query),
                           query_position(p, first_query + 7), first_query + 8 > q_end);
}

// Stages lse and delta of the query rows qs .. qs + BQ of one head (rows
// head_rows ..) for the dK/dV kernels; rows at or past q_end are zeros.
template <int BQ, int THREADS>
inline void stage_row_statistics(
    const device float* lse, const device float* delta, long head_rows, int qs, int q_end, uint tid,
    threadgroup float* lse_tile, threadgroup float* delta_tile) {
  for (int i = int(tid); i < BQ; i += THREADS) {
    const bool inside = qs + i < q_end;
    lse_tile[i] = inside ? lse[head_rows + qs + i] : 0.0f;
    delta_tile[i] = inside ? delta[head_rows + qs + i] : 0.0f;
  }
}

// The keys of a dK/dV threadgroup, BK = 8 x simdgroups keys from k0 of one
// (batch, KV head) (grid (key blocks, Hkv, B)): this lane's row and first
// column in every 8x8 tile, its key (its row of K, V, dK, dV) and that
// key's K and V rows, and the query rows that may see a key of the block
// (as the CPU backward's). The dK/dV kernels' prologue.
struct KeyRows {
  int b, kv_head, k0;
  int r, c;
  int key;
  attn_int64 k_row, v_row;
  QueryRange queries;
};
template <int BK>
inline KeyRows key_rows(constant AttentionParams& p, uint3 group_id, uint sg, uint lane) {
  KeyRows keys;
  keys.b = int(group_id.z);
  keys.kv_head = int(group_id.y);
  keys.k0 = int(group_id.x) * BK;
  const TileLane at = tile_lane(lane);
  keys.r = at.row;
  keys.c = at.col;
  keys.key = keys.k0 + int(sg) * 8 + keys.r;
  keys.k_row = keys.b * p.k_strides[0] + keys.kv_head * p.k_strides[1] + keys.key * p.k_strides[2];
  keys.v_row = keys.b * p.v_strides[0] + keys.kv_head * p.v_strides[1] + keys.key * p.v_strides[2];
  keys.queries = block_query_range(p, keys.k0, min(keys.k0 + BK, p.kv_len) - 1);
  return keys;
}

// Query head g of the keys' GQA group (the dK/dV kernels sum over the
// group): its index, q's offset of the head and the first of its rows in
// [B, Hq, Tq] order (lse, delta, dO).
struct GroupQueryHead {
  int h;
  attn_int64 q_head;
  attn_int64 rows;
};
inline GroupQueryHead group_query_head(constant AttentionParams& p, thread const KeyRows& keys, int g) {
  GroupQueryHead head;
  head.h = keys.kv_head * p.group + g;
  head.q_head = keys.b * p.q_strides[0] + head.h * p.q_strides[1];
  head.rows = (long(keys.b) * p.q_heads + head.h) * p.q_len;
  return head;
}

// This lane's row of K and V (its key's; zeros past kv_len) into the
// A-operand tiles of the register-resident dK/dV kernel, its dK and dV
// accumulators zeroed.
template <typename T, int D>
inline void load_key_rows(constant AttentionParams& p, const device T* k, const device T* v,
                          thread const KeyRows& keys, thread simdgroup_float8x8* k_rows,
                          thread simdgroup_float8x8* v_rows, thread simdgroup_float8x8* dk_acc,
                          thread simdgroup_float8x8* dv_acc) {
  const bool inside = keys.key < p.kv_len;
  for (int d = 0; d < D / 8; ++d) {
    for (int t = 0; t < 2; ++t) {
      const int col = d * 8 + keys.c + t;
      k_rows[d].thread_elements()[t] = inside ? float(k[keys.k_row + col * p.k_strides[3]]) : 0.0f;
      v_rows[d].thread_elements()[t] = inside ? float(v[keys.v_row + col * p.v_strides[3]]) : 0.0f;
      dk_acc[d].thread_elements()[t] = 0.0f;
      dv_acc[d].thread_elements()[t] = 0.0f;
    }
  }
}

// Stages Q and dO (as float, LD floats a row) of the query rows qs .. qs + BQ
// of one head for the register-resident dK/dV kernel; rows at or past q_end
// see none of the block's keys (causal / window): zeros, not read.
template <typename T, int D, int BQ, int LD, int THREADS>
inline void stage_query_block(constant AttentionParams& p, const device T* q, const device T* d_out,
                              thread const GroupQueryHead& head, int qs, int q_end, uint tid,
                              threadgroup float* q_tile, threadgroup float* d_out_tile) {
  for (int e = int(tid); e < BQ * D; e += THREADS) {
    const int i = e / D;
    const int col = e % D;
    const int qi = qs + i;
    const bool inside = qi < q_end;
    q_tile[i * LD + col] = inside ? float(q[head.q_head + qi * p.q_strides[2] + col * p.q_strides[3]]) : 0.0f;
    d_out_tile[i * LD + col] = inside ? float(d_out[(head.rows + qi) * D + col]) : 0.0f;
  }
}

// P^T and dS^T, in place, of this simdgroup's 8 keys against the staged
// query rows j*8 .. (the block from qs; lse and delta staged with them):
// the tile gradients, interior tiles without the per-element tests.
template <typename T, int MASK>
inline void key_tile_gradients(
    constant AttentionParams& p, const device uchar* mask, thread const KeyRows& keys, int h, int qs, int j, uint sg,
    threadgroup const float* lse_tile, threadgroup const float* delta_tile, thread simdgroup_float8x8& s_t,
    thread simdgroup_float8x8& dp_t) {
  const int first_query = qs + j * 8;
  const bool edge = key_tile_needs_tests(p, keys.k0 + int(sg) * 8, first_query, keys.queries.end);
  const int i = j * 8 + keys.c;
  tile_gradients<T, MASK>(p, mask, s_t, dp_t, float2(lse_tile[i], lse_tile[i + 1]),
                          float2(delta_tile[i], delta_tile[i + 1]), keys.b, h, int2(qs + i, qs + i + 1),
                          int2(keys.key, keys.key), edge);
}

// delta[row] = rowsum(dO * O) - dlse[row]; out, d_out, d_lse row-contiguous
// (the host makes them so). One simdgroup per row.
template <typename T, int D>
[[kernel]] void attention_backward_delta(
    const device T* out [[buffer(0)]],
    const device T* d_out [[buffer(1)]],
    const device float* d_lse [[buffer(2)]],
    device float* delta [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    MLX_ATTN_THREAD_POSITION) {
  const long rows = long(p.batch) * p.q_heads * p.q_len;
  const long row = long(group_id.x) * 4 + sg;
  if (row >= rows) return;  // the whole simdgroup: no collective is split
  float dot = 0.0f;
  for (int e = int(lane); e < D; e += 32) {
    dot += float(out[row * D + e]) * float(d_out[row * D + e]);
  }
  dot = simd_sum(dot);
  if (lane == 0) delta[row] = dot - d_lse[row];
}

// dK, dV of 32 keys (8 per simdgroup, held as A-operand tiles in registers
// with their accumulators) of one (batch, kv head). Query blocks of BQ rows
// (Q, dO as float, lse and delta) are staged in threadgroup memory; the
// loop runs over every query head of the group, so dK/dV sum over it.
template <typename T, int D, int BQ, int MASK>
[[kernel]] void attention_backward_dkdv(
    const device T* k [[buffer(0)]],  // the keys and values it owns first,
    const device T* v [[buffer(1)]],
    const device T* q [[buffer(2)]],  // then the query rows it streams
    const device T* d_out [[buffer(3)]],
    const device float* lse [[buffer(4)]],
    const device float* delta [[buffer(5)]],
    device T* dk [[buffer(6)]],
    device T* dv [[buffer(7)]],
    constant AttentionParams& p [[buffer(8)]],
    const device uchar* mask [[buffer(9)]],
    MLX_ATTN_THREAD_POSITION) {
  constexpr int BK = BackwardGroup::ROWS;
  constexpr int THREADS = BackwardGroup::THREADS;
  constexpr int LD = D + 4;  // padded float row
  threadgroup float q_tile[BQ * LD];
  threadgroup float d_out_tile[BQ * LD];
  threadgroup float lse_tile[BQ];
  threadgroup float delta_tile[BQ];

  const KeyRows keys = key_rows<BK>(p, group_id, sg, lane);
  const int r = keys.r, c = keys.c, key = keys.key;

  simdgroup_float8x8 k_rows[D / 8];
  simdgroup_float8x8 v_rows[D / 8];
  simdgroup_float8x8 dk_acc[D / 8];
  simdgroup_float8x8 dv_acc[D / 8];
  load_key_rows<T, D>(p, k, v, keys, k_rows, v_rows, dk_acc, dv_acc);

  const int q_end = keys.queries.end;
  for (int g = 0; g < p.group; ++g) {
    const GroupQueryHead head = group_query_head(p, keys, g);
    for (int qs = keys.queries.begin; qs < q_end; qs += BQ) {
      stage_query_block<T, D, BQ, LD, THREADS>(p, q, d_out, head, qs, q_end, tid, q_tile, d_out_tile);
      stage_row_statistics<BQ, THREADS>(lse, delta, head.rows, qs, q_end, tid, lse_tile, delta_tile);
      threadgroup_barrier(mem_flags::mem_threadgroup);

      for (int j = 0; j < BQ / 8; ++j) {
        // S^T = K . Q^T and dP^T = V . dO^T: rows keys, columns queries j*8 ..
        simdgroup_float8x8 s_t = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        simdgroup_float8x8 dp_t = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int d = 0; d < D / 8; ++d) {
          simdgroup_float8x8 q_t;  // row = dim d*8 + r, column = query j*8 + c
          simdgroup_float8x8 d_out_t;
          for (int t = 0; t < 2; ++t) {
            q_t.thread_elements()[t] = q_tile[(j * 8 + c + t) * LD + d * 8 + r];
            d_out_t.thread_elements()[t] = d_out_tile[(j * 8 + c + t) * LD + d * 8 + r];
          }
          simdgroup_multiply_accumulate(s_t, k_rows[d], q_t, s_t);
          simdgroup_multiply_accumulate(dp_t, v_rows[d], d_out_t, dp_t);
        }
        key_tile_gradients<T, MASK>(p, mask, keys, head.h, qs, j, sg, lse_tile, delta_tile, s_t, dp_t);
        // s_t: P^T, dp_t: dS^T; dV += P^T . dO, dK += dS^T . Q (rows queries j*8 .., columns dims)
        for (int d = 0; d < D / 8; ++d) {
          simdgroup_float8x8 q_part;
          simdgroup_float8x8 d_out_part;
          for (int t = 0; t < 2; ++t) {
            q_part.thread_elements()[t] = q_tile[(j * 8 + r) * LD + d * 8 + c + t];
            d_out_part.thread_elements()[t] = d_out_tile[(j * 8 + r) * LD + d * 8 + c + t];
          }
          simdgroup_multiply_accumulate(dv_acc[d], s_t, d_out_part, dv_acc[d]);
          simdgroup_multiply_accumulate(dk_acc[d], dp_t, q_part, dk_acc[d]);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
    }
  }

  if (key < p.kv_len) {
    const long row = (long(keys.b) * p.kv_heads + keys.kv_head) * p.kv_len + key;
    for (int d = 0; d < D / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        dk[row * D + d * 8 + c + t] = T(dk_acc[d].thread_elements()[t] * p.scale);
        dv[row * D + d * 8 + c + t] = T(dv_acc[d].thread_elements()[t]);
      }
    }
  }
}

// dQ of 32 query rows (8 per simdgroup) of one (batch, query head), over the
// key blocks its rows can see; K/V blocks of BK keys staged in threadgroup
// memory in the input dtype, as the forward prefill kernel does.
template <typename T, int D, int BK, int MASK>
[[kernel]] void attention_backward_dq(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device T* d_out [[buffer(3)]],
    const device float* lse [[buffer(4)]],
    const device float* delta [[buffer(5)]],
    device T* dq [[buffer(6)]],
    constant AttentionParams& p [[buffer(7)]],
    const device uchar* mask [[buffer(8)]],
    MLX_ATTN_THREAD_POSITION) {
  constexpr int THREADS = BackwardGroup::THREADS;
  using Tiles = KeyValueTiles<T, D, BK>;
  constexpr int LD = Tiles::LD;
  threadgroup Tiles tiles;

  const QueryRows rows = query_rows<BackwardGroup::ROWS>(p, group_id, sg, lane);
  const int b = rows.b, h = rows.h, r = rows.r, c = rows.c, qi = rows.qi;
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;

  simdgroup_float8x8 q_rows[D / 8];
  simdgroup_float8x8 d_out_rows[D / 8];
  simdgroup_float8x8 dq_acc[D / 8];
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  for (int d = 0; d < D / 8; ++d) {
    for (int t = 0; t < 2; ++t) {
      const int col = d * 8 + c + t;
      q_rows[d].thread_elements()[t] = qi < p.q_len ? float(q[q_row + col * p.q_strides[3]]) : 0.0f;
      d_out_rows[d].thread_elements()[t] = qi < p.q_len ? float(d_out[row * D + col]) : 0.0f;
      dq_acc[d].thread_elements()[t] = 0.0f;
    }
  }
  const float lse_row = qi < p.q_len ? lse[row] : 0.0f;
  const float delta_row = qi < p.q_len ? delta[row] : 0.0f;

  // the keys its rows can see (as the forward's)
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;

  const long k_head = b * p.k_strides[0] + rows.kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + rows.kv_head * p.v_strides[1];
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    stage_key_block<T, D, BK, THREADS>(p, k, v, k_head, v_head, kb, kv_end, false, tid, tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // interior blocks skip the per-element visibility tests
    const bool edge = key_block_on_edge(p, rows, kb, BK);

    for (int j = 0; j < BK / 8; ++j) {
      // S = Q . K^T and dP = dO . V^T: rows queries, columns keys kb + j*8 ..
      simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      simdgroup_float8x8 dp = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_t;  // row = dim d*8 + r, column = key j*8 + c
        simdgroup_float8x8 v_t;
        for (int t = 0; t < 2; ++t) {
          k_t.thread_elements()[t] = float(tiles.k[(j * 8 + c + t) * LD + d * 8 + r]);
          v_t.thread_elements()[t] = float(tiles.v[(j * 8 + c + t) * LD + d * 8 + r]);
        }
        simdgroup_multiply_accumulate(s, q_rows[d], k_t, s);
        simdgroup_multiply_accumulate(dp, d_out_rows[d], v_t, dp);
      }
      const int key = kb + j * 8 + c;
      tile_gradients<T, MASK>(p, mask, s, dp, float2(lse_row), float2(delta_row), b, h, int2(qi), int2(key, key + 1),
                              edge);  // dp: dS
      // dQ += dS . K (rows keys j*8 .., columns dims)
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_part;
        for (int t = 0; t < 2; ++t) {
          k_part.thread_elements()[t] = float(tiles.k[(j * 8 + r) * LD + d * 8 + c + t]);
        }
        simdgroup_multiply_accumulate(dq_acc[d], dp, k_part, dq_acc[d]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  if (qi < p.q_len) {
    for (int d = 0; d < D / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        dq[row * D + d * 8 + c + t] = T(dq_acc[d].thread_elements()[t] * p.scale);
      }
    }
  }
}

// d_sinks[h] = -sum over (batch, row) of exp(sink - lse) * delta: the sink's
// probability, whose dP is 0. A sink that saturated gets no gradient. With a
// sink every row's sum is positive: its lse is finite.
template <typename T>
[[kernel]] void attention_backward_sinks(
    const device T* sinks [[buffer(0)]],
    const device float* lse [[buffer(1)]],
    const device float* delta [[buffer(2)]],
    device T* d_sinks [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    MLX_ATTN_THREAD_POSITION) {
  const int h = int(group_id.x);
  const float raw = float(sinks[h * p.sinks_stride]);
  const float sink = saturate_logit(raw);
  float sum = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    const long head_rows = (long(b) * p.q_heads + h) * p.q_len;
    for (int qi = int(lane); qi < p.q_len; qi += 32) {
      sum -= fast::exp2((sink - lse[head_rows + qi]) * MLX_ATTN_LOG2E) * delta[head_rows + qi];
    }
  }
  sum = simd_sum(sum);
  if (lane == 0) d_sinks[h] = T(sink == raw ? sum : 0.0f);
}
