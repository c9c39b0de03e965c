// Fused attention forward for prefill (FlashAttention-2 style).
//
// One threadgroup of 4 simdgroups (128 threads) owns BQ = 32 query rows of one
// (batch, query head); each simdgroup owns 8 rows. Key/value blocks of BK keys
// are staged in threadgroup memory (as float) and consumed with 8x8
// simdgroup_matrix multiply-accumulates:
//   score      S = Q . K^T
//   scale      S = saturate(scale * S)                 (natural-log units)
//   mask       additive (saturated; -inf masks), causal / window / bool -> kMasked
//   online max / rescale   m_new = max(m, rowmax S); O = diag(exp(m - m_new)) O
//   accumulate P = exp(S - m_new); l = l * alpha + rowsum P; O += P . V
//   normalize  sinks join l; O = diag(1 / l) O (rows that saw nothing: 0)
// exp(x) = exp2(x * log2 e) of differences of saturated logits, which stay
// finite (metal/attention_params.h). Finite sentinels instead of infinities:
// Metal compiles with fast math.
// K/V head = query head / group: keys and values are never repeated.
// Threadgroup memory: 2 * BK * D * 4 (K, V) + BQ * BK * 4 (S) + 4 * 64 * 4
// (staging) + BQ * 4 bytes; BK is chosen so this stays below 32 KB (see
// csrc/launch_plan.cpp and docs/metal_kernels.md).
#include <metal_stdlib>

#include "metal/attention_params.h"

using namespace metal;

constant float kMasked = MLX_ATTN_MASKED_LOGIT;

// Clamps a logit to [-MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT].
inline float saturate_logit(float x) {
  return clamp(x, -MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT);
}


template <typename T, int D, int BK>
[[kernel]] void attention_prefill(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    const device uchar* mask [[buffer(5)]],
    const device T* sinks [[buffer(6)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = 4;
  constexpr int BQ = 8 * NSG;
  constexpr int THREADS = 32 * NSG;
  threadgroup float k_tile[BK * D];
  threadgroup float v_tile[BK * D];
  threadgroup float s_tile[BQ * BK];
  threadgroup float staging[NSG * 64];
  threadgroup float row_factor[BQ];

  const int b = int(group_id.z);
  const int h = int(group_id.y);
  const int q0 = int(group_id.x) * BQ;
  const int kv_head = h / p.group;
  const int offset = p.kv_len - p.q_len;
  threadgroup float* stage = staging + sg * 64;

  // This simdgroup's 8 query rows as D/8 tiles.
  simdgroup_float8x8 q_tiles[D / 8];
  for (int d = 0; d < D / 8; ++d) {
    for (int e = int(lane); e < 64; e += 32) {
      const int row = q0 + int(sg) * 8 + e / 8;
      const int col = d * 8 + e % 8;
      stage[e] = row < p.q_len
          ? float(q[b * p.q_strides[0] + h * p.q_strides[1] + row * p.q_strides[2] + col * p.q_strides[3]])
          : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // stage written -> read by all lanes
    simdgroup_load(q_tiles[d], stage, 8);  // collective: every lane has read stage after it
  }
  simdgroup_float8x8 o_tiles[D / 8];
  for (int d = 0; d < D / 8; ++d) {
    o_tiles[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // Each lane owns a quarter of one row's columns: row r = lane / 4.
  const int r = int(lane) / 4;
  const int quarter = int(lane) % 4;
  const int qi = q0 + int(sg) * 8 + r;
  const int pos = qi + offset;
  float m_row = kMasked;
  float l_row = 0.0f;

  // Key range any row of this block can see: skip fully masked blocks.
  const int first_pos = q0 + offset;
  const int last_pos = min(q0 + BQ, p.q_len) - 1 + offset;
  int kv_begin = 0;
  int kv_end = p.kv_len;
  if (p.causal != 0) {
    kv_end = min(kv_end, last_pos + 1);
    if (p.window_size > 0) {
      kv_begin = max(0, first_pos - p.window_size + 1);
    }
  }

  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    for (int e = int(tid); e < BK * D; e += THREADS) {
      const int key = kb + e / D;
      const int col = e % D;
      const bool inside = key < kv_end;
      k_tile[e] = inside
          ? float(k[b * p.k_strides[0] + kv_head * p.k_strides[1] + key * p.k_strides[2] + col * p.k_strides[3]])
          : 0.0f;
      v_tile[e] = inside
          ? float(v[b * p.v_strides[0] + kv_head * p.v_strides[1] + key * p.v_strides[2] + col * p.v_strides[3]])
          : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // score: S[8 x BK] = Q . K^T
    threadgroup float* s_rows = s_tile + int(sg) * 8 * BK;
    for (int j = 0; j < BK / 8; ++j) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_t;
        // K^T block: the pointer selects keys j*8.. and dims d*8.., transpose flips it
        simdgroup_load(k_t, k_tile + j * 8 * D + d * 8, D, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, q_tiles[d], k_t, acc);
      }
      simdgroup_store(acc, s_rows, BK, ulong2(j * 8, 0));
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // scale, mask, then online max / rescale
    threadgroup float* s_row = s_rows + r * BK;
    float block_max = kMasked;
    for (int c = quarter; c < BK; c += 4) {
      const int key = kb + c;
      bool visible = key < kv_end && qi < p.q_len;
      if (p.causal != 0) {
        visible = visible && key <= pos && (p.window_size <= 0 || key > pos - p.window_size);
      }
      float s = saturate_logit(s_row[c] * p.scale);
      if (visible && p.mask_kind != MLX_ATTN_MASK_NONE) {
        const long at = b * p.mask_strides[0] + h * p.mask_strides[1] + qi * p.mask_strides[2] +
            key * p.mask_strides[3];
        if (p.mask_kind == MLX_ATTN_MASK_BOOL) {
          visible = mask[at] != 0;
        } else {
          // values at or below the sentinel (-inf included) mask the key;
          // max() turns -inf into a finite value before any arithmetic
          const float added = max(float(((const device T*)mask)[at]), kMasked);
          visible = added > kMasked;
          s = saturate_logit(s + added);
        }
      }
      s_row[c] = visible ? s : kMasked;
      block_max = max(block_max, visible ? s : kMasked);
    }
    block_max = max(block_max, simd_shuffle_xor(block_max, 1));
    block_max = max(block_max, simd_shuffle_xor(block_max, 2));
    const float m_new = max(m_row, block_max);
    const float alpha = exp2((m_row - m_new) * MLX_ATTN_LOG2E);

    // accumulate: P = exp2(S - m_new), l = l * alpha + rowsum P
    float p_sum = 0.0f;
    for (int c = quarter; c < BK; c += 4) {
      const float s = s_row[c];
      const float prob = s > 0.5f * kMasked ? exp2((s - m_new) * MLX_ATTN_LOG2E) : 0.0f;
      s_row[c] = prob;
      p_sum += prob;
    }
    p_sum += simd_shuffle_xor(p_sum, 1);
    p_sum += simd_shuffle_xor(p_sum, 2);
    l_row = l_row * alpha + p_sum;
    m_row = m_new;
    if (quarter == 0) {
      row_factor[int(sg) * 8 + r] = alpha;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // rescale O by diag(alpha), then O += P . V
    for (int e = int(lane); e < 64; e += 32) {
      stage[e] = (e / 8 == e % 8) ? row_factor[int(sg) * 8 + e / 8] : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 rescale;
    simdgroup_load(rescale, stage, 8);
    for (int d = 0; d < D / 8; ++d) {
      simdgroup_multiply(o_tiles[d], rescale, o_tiles[d]);
      for (int c = 0; c < BK / 8; ++c) {
        simdgroup_float8x8 p_tile;
        simdgroup_float8x8 v_part;
        simdgroup_load(p_tile, s_rows, BK, ulong2(c * 8, 0));
        simdgroup_load(v_part, v_tile, D, ulong2(d * 8, c * 8));
        simdgroup_multiply_accumulate(o_tiles[d], p_tile, v_part, o_tiles[d]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  // normalize: sinks join the sum; rows that saw nothing give zeros
  float correction = 1.0f;
  float l_final = l_row;
  if (p.has_sinks != 0) {
    const float sink = saturate_logit(float(sinks[h * p.sinks_stride]));
    const float m_final = max(m_row, sink);
    correction = exp2((m_row - m_final) * MLX_ATTN_LOG2E);
    l_final = l_row * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);
  }
  if (quarter == 0) {
    row_factor[int(sg) * 8 + r] = l_final > 0.0f ? correction / l_final : 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(lane); e < 64; e += 32) {
    stage[e] = (e / 8 == e % 8) ? row_factor[int(sg) * 8 + e / 8] : 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 normalize;
  simdgroup_load(normalize, stage, 8);
  for (int d = 0; d < D / 8; ++d) {
    simdgroup_multiply(o_tiles[d], normalize, o_tiles[d]);
    simdgroup_store(o_tiles[d], stage, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(lane); e < 64; e += 32) {
      const int row = q0 + int(sg) * 8 + e / 8;
      if (row < p.q_len) {
        out[((long(b) * p.q_heads + h) * p.q_len + row) * D + d * 8 + e % 8] = T(stage[e]);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}

#define MLX_ATTN_PREFILL(tname, type, d, bk)                                          \
  template [[host_name("attention_prefill_" #tname "_d" #d)]] [[kernel]] decltype( \
      attention_prefill<type, d, bk>) attention_prefill<type, d, bk>;

// BK: keys per block, so that 2 * BK * D * 4 bytes of K/V tiles stay <= 16 KB.
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk) MLX_ATTN_PREFILL(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk)
#endif
#define MLX_ATTN_PREFILL_TYPES(d, bk)        \
  MLX_ATTN_PREFILL(float32, float, d, bk)    \
  MLX_ATTN_PREFILL(float16, half, d, bk)     \
  MLX_ATTN_PREFILL_BFLOAT16(d, bk)

MLX_ATTN_PREFILL_TYPES(64, 32)
MLX_ATTN_PREFILL_TYPES(80, 16)
MLX_ATTN_PREFILL_TYPES(96, 16)
MLX_ATTN_PREFILL_TYPES(128, 16)
MLX_ATTN_PREFILL_TYPES(256, 8)
