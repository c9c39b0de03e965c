// Fused attention backward at large head dims, or key head dim D != value
// head dim DV (192/128, 256, 512, 576/512), and the D = 128 dK/dV pass: the
// D-split variant of metal/attention_backward.h (same dispatches, same
// steps: tile_gradients, block_query_range, block_needs_tests, query_rows);
// metal/attention_backward_split.metal instantiates it.
//
// Register budget. The register-resident dK/dV kernel holds K, V, dK and dV
// rows as D/4 floats each per lane (128 at D = 128, 256 at D = 256); its dQ
// kernel holds Q, dO and dQ (3 * D/4: 192 at D = 256). Here every threadgroup
// owns one chunk of C = 64 output columns (a grid dimension over the chunks):
//   dkdv  chunk g of dK (D / C chunks) and of dV (DV / C chunks) of its 32
//         keys: accumulators 2 * C/4 = 32 floats per lane; the scores
//         S^T = K . Q^T and dP^T = V . dO^T of a query block (BQ = 32
//         columns: 2 * BQ/4 = 16 floats) are summed over every chunk of D
//         and DV, each chunk's 8x8 K and V fragments read from device memory
//         (the threadgroup's own rows: cached) into 2 + 2 floats and dropped.
//   dq    chunk g of dQ of its 32 rows: 16 floats of accumulators; S = Q . K^T
//         and dP = dO . V^T of a key block (BK = 32: 16 floats) summed the
//         same way over Q and dO fragments (2 floats).
// So 52 (dkdv) and 34 (dq) floats of tiles per lane at every head dim (the
// emulator's per-thread arrays: 208 and 136 bytes), against 128 / 96
// (D = 128) and 256 / 192 (D = 256) register-resident. The
// price: each of the max(D, DV) / C threadgroups of a block recomputes S and
// dP over the whole head dims (dkdv at D = 128: 6 tile products per 8 x 8
// output column instead of 4).
//
// The streamed side (Q and dO for dkdv, K and V for dq) is staged one chunk
// of C columns at a time as float32 (two BQ x (C + 4) tiles, 17 KB). The
// threadgroup's own chunk is staged last, so after the loop the tiles still
// hold the columns its gradient products need: no second copy.
#pragma once

#include <metal_stdlib>

#include "metal/attention_backward.h"

using namespace metal;

// Stages columns [d0, d0 + C) of rows [first, first + N) of a row-major
// operand (row i at src[base + i * row_stride + col * col_stride]) into
// `tile` as float (LD floats a row); rows at or past `end` are zeros, not read.
template <typename T, int C, int N, int LD, int THREADS>
inline void stage_column_chunk(
    const device T* src, attn_int64 base, attn_int64 row_stride, attn_int64 col_stride, int first, int end, int d0,
    uint tid, threadgroup float* tile) {
  for (int e = int(tid); e < N * C; e += THREADS) {
    const int i = e / C;
    const int col = e % C;
    const int row = first + i;
    tile[i * LD + col] = row < end ? float(src[base + row * row_stride + (d0 + col) * col_stride]) : 0.0f;
  }
}

// acc[j] += A[:, d0 .. d0 + C) . tile[j*8 .. j*8 + 8, 0 .. C)^T for j < N / 8:
// the partial scores of one chunk. A's 8 rows are this simdgroup's own (this
// lane's row at src[row_at + col * col_stride], zeros when !inside), read
// one 8x8 fragment at a time; the tile holds the streamed rows' chunk.
template <typename T, int C, int N, int LD>
inline void accumulate_chunk_scores(
    thread simdgroup_float8x8* acc, const device T* src, attn_int64 row_at, attn_int64 col_stride, bool inside,
    bool vector_loads, int d0, threadgroup const float* tile, int r, int c) {
  for (int d = 0; d < C / 8; ++d) {
    float pair[2] = {0.0f, 0.0f};
    if (inside) {
      RowLoad<T, 2>::read(src, row_at + (d0 + d * 8 + c) * col_stride, col_stride, vector_loads, pair);
    }
    simdgroup_float8x8 a;  // row = own row r, column = dim d0 + d*8 + c
    for (int t = 0; t < 2; ++t) {
      a.thread_elements()[t] = pair[t];
    }
    for (int j = 0; j < N / 8; ++j) {
      simdgroup_float8x8 b;  // row = dim d*8 + r, column = streamed row j*8 + c
      for (int t = 0; t < 2; ++t) {
        b.thread_elements()[t] = tile[(j * 8 + c + t) * LD + d * 8 + r];
      }
      simdgroup_multiply_accumulate(acc[j], a, b, acc[j]);
    }
  }
}

// acc[d] += g . tile[j*8 .. j*8 + 8, 0 .. C) for d < C / 8: the gradient
// product of one 8x8 tile g (rows own, columns streamed rows j*8 ..) with
// the own chunk's columns of the streamed rows.
template <int C, int LD>
inline void accumulate_chunk_gradient(
    thread simdgroup_float8x8* acc, thread const simdgroup_float8x8& g, threadgroup const float* tile, int j, int r,
    int c) {
  for (int d = 0; d < C / 8; ++d) {
    simdgroup_float8x8 part;  // row = streamed row j*8 + r, column = dim d*8 + c
    for (int t = 0; t < 2; ++t) {
      part.thread_elements()[t] = tile[(j * 8 + r) * LD + d * 8 + c + t];
    }
    simdgroup_multiply_accumulate(acc[d], g, part, acc[d]);
  }
}

// The columns of chunk `i` of the streamed loop for a threadgroup owning
// chunk `own` of `chunks`: every chunk once, its own one last.
inline int streamed_chunk(int own, int i, int chunks) {
  return (own + 1 + i) % chunks;
}

// dK[:, g*C ..), dV[:, g*C ..) of 32 keys (8 per simdgroup) of one (batch,
// kv head); grid ((ceil(Tkv / 32) * max(D, DV) / C, Hkv, B): x = key block
// * chunks + g. Query blocks of BQ rows of every query head of the group, as
// the register-resident kernel's.
template <typename T, int D, int DV, int C, int BQ, int MASK>
[[kernel]] void attention_backward_split_dkdv(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    const device T* q [[buffer(2)]],
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
  constexpr int KC = D / C;  // chunks of dK
  constexpr int VC = DV / C;  // chunks of dV
  constexpr int CHUNKS = KC > VC ? KC : VC;
  constexpr int LD = C + 4;  // padded float row
  static_assert(D % C == 0 && DV % C == 0 && C % 8 == 0 && BQ % 8 == 0, "head dims: whole chunks");
  threadgroup float q_tile[BQ * LD];
  threadgroup float d_out_tile[BQ * LD];
  threadgroup float lse_tile[BQ];
  threadgroup float delta_tile[BQ];

  const int own = int(group_id.x) % CHUNKS;
  const KeyRows keys = key_rows<BK>(p, uint3(group_id.x / CHUNKS, group_id.y, group_id.z), sg, lane);
  const int r = keys.r, c = keys.c;
  const bool key_inside = keys.key < p.kv_len;
  const bool vector_loads = p.vector_loads != 0;

  simdgroup_float8x8 dk_acc[C / 8];
  simdgroup_float8x8 dv_acc[C / 8];
  for (int d = 0; d < C / 8; ++d) {
    dk_acc[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    dv_acc[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  const int q_end = keys.queries.end;
  // one unit: the chunk loop leaves the own chunk staged for the gradient products after it
  for (int g = 0; g < p.group; ++g) {
    const GroupQueryHead head = group_query_head(p, keys, g);
    for (int qs = keys.queries.begin; qs < q_end; qs += BQ) {
      // S^T = K . Q^T and dP^T = V . dO^T (rows keys, columns queries qs ..),
      // summed over the chunks; rows past q_end see none of this block's
      // keys (causal / window): zeros
      simdgroup_float8x8 s_t[BQ / 8];
      simdgroup_float8x8 dp_t[BQ / 8];
      for (int j = 0; j < BQ / 8; ++j) {
        s_t[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        dp_t[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      for (int i = 0; i < CHUNKS; ++i) {
        const int q0 = streamed_chunk(own, i, KC) * C;
        const int o0 = streamed_chunk(own, i, VC) * C;
        if (i < KC) {
          stage_column_chunk<T, C, BQ, LD, THREADS>(q, head.q_head, p.q_strides[2], p.q_strides[3], qs, q_end, q0,
                                                    tid, q_tile);
        }
        if (i < VC) {
          stage_column_chunk<T, C, BQ, LD, THREADS>(d_out, head.rows * DV, DV, 1, qs, q_end, o0, tid, d_out_tile);
        }
        if (i == CHUNKS - 1) {
          stage_row_statistics<BQ, THREADS>(lse, delta, head.rows, qs, q_end, tid, lse_tile, delta_tile);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (i < KC) {
          accumulate_chunk_scores<T, C, BQ, LD>(s_t, k, keys.k_row, p.k_strides[3], key_inside, vector_loads, q0,
                                                q_tile, r, c);
        }
        if (i < VC) {
          accumulate_chunk_scores<T, C, BQ, LD>(dp_t, v, keys.v_row, p.v_strides[3], key_inside, vector_loads, o0,
                                                d_out_tile, r, c);
        }
        if (i < CHUNKS - 1) {
          threadgroup_barrier(mem_flags::mem_threadgroup);  // the next chunk overwrites the tiles
        }
      }
      // the tiles now hold the own chunk: P, dS per 8 queries, then
      // dV += P^T . dO[:, own], dK += dS^T . Q[:, own]
      for (int j = 0; j < BQ / 8; ++j) {
        key_tile_gradients<T, MASK>(p, mask, keys, head.h, qs, j, sg, lse_tile, delta_tile, s_t[j], dp_t[j]);
        if (own < VC) accumulate_chunk_gradient<C, LD>(dv_acc, s_t[j], d_out_tile, j, r, c);
        if (own < KC) accumulate_chunk_gradient<C, LD>(dk_acc, dp_t[j], q_tile, j, r, c);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
    }
  }

  if (key_inside) {
    const long row = (long(keys.b) * p.kv_heads + keys.kv_head) * p.kv_len + keys.key;
    for (int d = 0; d < C / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        const int col = own * C + d * 8 + c + t;
        if (own < KC) dk[row * D + col] = T(dk_acc[d].thread_elements()[t] * p.scale);
        if (own < VC) dv[row * DV + col] = T(dv_acc[d].thread_elements()[t]);
      }
    }
  }
}

// dQ[:, g*C ..) of 32 query rows (8 per simdgroup) of one (batch, query
// head), over the key blocks its rows can see; grid (ceil(Tq / 32) * D / C,
// Hq, B): x = row block * chunks + g.
template <typename T, int D, int DV, int C, int BK, int MASK>
[[kernel]] void attention_backward_split_dq(
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
  constexpr int BQ = BackwardGroup::ROWS;
  constexpr int THREADS = BackwardGroup::THREADS;
  constexpr int KC = D / C;  // chunks of dQ
  constexpr int VC = DV / C;
  constexpr int CHUNKS = KC > VC ? KC : VC;
  constexpr int LD = C + 4;
  static_assert(D % C == 0 && DV % C == 0 && C % 8 == 0 && BK % 8 == 0, "head dims: whole chunks");
  threadgroup float k_tile[BK * LD];
  threadgroup float v_tile[BK * LD];

  const int own = int(group_id.x) % KC;
  const QueryRows rows = query_rows<BQ>(p, uint3(group_id.x / KC, group_id.y, group_id.z), sg, lane);
  const int b = rows.b, h = rows.h, r = rows.r, c = rows.c, qi = rows.qi;
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
  const bool inside = qi < p.q_len;
  const bool vector_loads = p.vector_loads != 0;
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  const float lse_row = inside ? lse[row] : 0.0f;
  const float delta_row = inside ? delta[row] : 0.0f;

  simdgroup_float8x8 dq_acc[C / 8];
  for (int d = 0; d < C / 8; ++d) {
    dq_acc[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // the keys its rows can see (as the forward's)
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;
  const long k_head = b * p.k_strides[0] + rows.kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + rows.kv_head * p.v_strides[1];
  // one unit: the chunk loop leaves the own K chunk staged for dQ += dS . K after it
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    // S = Q . K^T and dP = dO . V^T (rows queries, columns keys kb ..),
    // summed over the chunks
    simdgroup_float8x8 s[BK / 8];
    simdgroup_float8x8 dp[BK / 8];
    for (int j = 0; j < BK / 8; ++j) {
      s[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      dp[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (int i = 0; i < CHUNKS; ++i) {
      const int k0 = streamed_chunk(own, i, KC) * C;
      const int v0 = streamed_chunk(own, i, VC) * C;
      if (i < KC) {
        stage_column_chunk<T, C, BK, LD, THREADS>(k, k_head, p.k_strides[2], p.k_strides[3], kb, kv_end, k0, tid,
                                                  k_tile);
      }
      if (i < VC) {
        stage_column_chunk<T, C, BK, LD, THREADS>(v, v_head, p.v_strides[2], p.v_strides[3], kb, kv_end, v0, tid,
                                                  v_tile);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (i < KC) {
        accumulate_chunk_scores<T, C, BK, LD>(s, q, q_row, p.q_strides[3], inside, vector_loads, k0, k_tile, r, c);
      }
      if (i < VC) {  // dO is row-contiguous: element loads (no alignment promise)
        accumulate_chunk_scores<T, C, BK, LD>(dp, d_out, row * DV, 1, inside, false, v0, v_tile, r, c);
      }
      if (i < CHUNKS - 1) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the next chunk overwrites the tiles
      }
    }
    // the K tile now holds the own chunk: dS, then dQ += dS . K[:, own]
    const bool edge = key_block_on_edge(p, rows, kb, BK);
    for (int j = 0; j < BK / 8; ++j) {
      const int key = kb + j * 8 + c;
      tile_gradients<T, MASK>(p, mask, s[j], dp[j], float2(lse_row), float2(delta_row), b, h, int2(qi),
                              int2(key, key + 1), edge);  // dp: dS
      accumulate_chunk_gradient<C, LD>(dq_acc, dp[j], k_tile, j, r, c);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  if (inside) {
    for (int d = 0; d < C / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        dq[row * D + own * C + d * 8 + c + t] = T(dq_acc[d].thread_elements()[t] * p.scale);
      }
    }
  }
}
