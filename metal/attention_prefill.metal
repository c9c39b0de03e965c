// Fused attention forward for prefill (FlashAttention-2 style, in registers).
//
// One threadgroup of NSG = 4 simdgroups (128 threads) owns BQ = 32 query rows of one
// (batch, query head); each simdgroup owns 8 rows, held as D/8 8x8 float
// simdgroup matrices of Q and of the output accumulator O. Key/value blocks
// of BK keys are staged in threadgroup memory in the input dtype (rows padded
// by 16 bytes against bank conflicts) and read into float fragments:
//   score      S = Q . K^T                              (8x8 MMAs)
//   scale      S = saturate(scale * S)                 (natural-log units)
//   mask       additive (saturated; -inf masks), causal / window / bool -> kMasked
//   online max / rescale   m_new = max(m, rowmax S); O *= exp(m - m_new)
//   accumulate P = exp(S - m_new); l = l * alpha + rowsum P; O += P . V
//   normalize  sinks join l; O *= 1 / l (rows that saw nothing: 0)
// S, P, the row max / sum and the rescale never leave registers: each lane
// works on the two elements per 8x8 tile it owns (thread_elements(): row
// (lane / 16) * 4 + (lane / 2) % 4, columns c, c + 1 with
// c = ((lane / 8) % 2) * 4 + (lane % 2) * 2), and the 4 lanes sharing a row
// combine with simd_shuffle_xor 1 and 8.
// exp(x) = exp2(x * log2 e) of differences of saturated logits, which stay
// finite (metal/attention_params.h). Finite sentinels instead of infinities:
// Metal compiles with fast math.
// K/V head = query head / group: keys and values are never repeated.
// Device loads: W = 4-element vectors (Q: pairs) when params.vector_loads
// says every row start is aligned (csrc/launch_plan.cpp), else per element.
// Threadgroup memory: 2 * BK * (D + 16 / sizeof(T)) * sizeof(T) bytes
// (csrc/launch_plan.cpp, docs/metal_kernels.md).
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
    device float* lse [[buffer(7)]],  // [B, Hq, Tq] when p.output_lse
    uint3 group_id [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = MLX_ATTN_PREFILL_SIMDGROUPS;
  constexpr int BQ = 8 * NSG;
  constexpr int THREADS = 32 * NSG;
  constexpr int LD = D + 16 / int(sizeof(T));  // padded tile row
  threadgroup T k_tile[BK * LD];
  threadgroup T v_tile[BK * LD];

  const int b = int(group_id.z);
  const int h = int(group_id.y);
  const int q0 = int(group_id.x) * BQ;
  const int kv_head = h / p.group;
  const int offset = p.kv_len - p.q_len;

  // The two elements this lane owns in every 8x8 tile: row r, columns c, c + 1.
  const int r = int(lane) / 16 * 4 + int(lane) / 2 % 4;
  const int c = int(lane) / 8 % 2 * 4 + int(lane) % 2 * 2;
  const int qi = q0 + int(sg) * 8 + r;
  const int pos = qi + offset;

  simdgroup_float8x8 q_tiles[D / 8];
  simdgroup_float8x8 o_tiles[D / 8];
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  const bool vector_loads = p.vector_loads != 0;
  for (int d = 0; d < D / 8; ++d) {
    float pair[2] = {0.0f, 0.0f};
    if (qi < p.q_len) {
      RowLoad<T, 2>::read(q, q_row + (d * 8 + c) * p.q_strides[3], p.q_strides[3], vector_loads, pair);
    }
    for (int t = 0; t < 2; ++t) {
      q_tiles[d].thread_elements()[t] = pair[t];
      o_tiles[d].thread_elements()[t] = 0.0f;
    }
  }
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

  const long k_head = b * p.k_strides[0] + kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + kv_head * p.v_strides[1];
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    // stage K/V in the input dtype: consecutive threads take consecutive
    // elements (aligned inputs: consecutive W-element vectors) of a key row,
    // coalesced device reads; keys past the range are zeros
    if (vector_loads) {
      constexpr int W = MLX_ATTN_VECTOR_WIDTH;
      for (int e = int(tid) * W; e < BK * D; e += THREADS * W) {
        const int j = e / D;
        const int col = e % D;
        const int key = kb + j;
        const bool inside = key < kv_end;
        vec<T, W> k_part = vec<T, W>(T(0));
        vec<T, W> v_part = vec<T, W>(T(0));
        if (inside) {
          k_part = *(const device vec<T, W>*)(k + k_head + key * p.k_strides[2] + col);
          v_part = *(const device vec<T, W>*)(v + v_head + key * p.v_strides[2] + col);
        }
        for (int i = 0; i < W; ++i) {
          k_tile[j * LD + col + i] = k_part[i];
          v_tile[j * LD + col + i] = v_part[i];
        }
      }
    } else {
      for (int e = int(tid); e < BK * D; e += THREADS) {
        const int j = e / D;
        const int col = e % D;
        const int key = kb + j;
        const bool inside = key < kv_end;
        k_tile[j * LD + col] = inside ? k[k_head + key * p.k_strides[2] + col * p.k_strides[3]] : T(0);
        v_tile[j * LD + col] = inside ? v[v_head + key * p.v_strides[2] + col * p.v_strides[3]] : T(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // score: S[8 x BK] = Q . K^T, tile j holds keys kb + 8j ..
    simdgroup_float8x8 s_tiles[BK / 8];
    for (int j = 0; j < BK / 8; ++j) {
      s_tiles[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_t;  // K^T block: row = dim d*8 + r, column = key j*8 + c
        for (int t = 0; t < 2; ++t) {
          k_t.thread_elements()[t] = float(k_tile[(j * 8 + c + t) * LD + d * 8 + r]);
        }
        simdgroup_multiply_accumulate(s_tiles[j], q_tiles[d], k_t, s_tiles[j]);
      }
    }

    // scale, mask, then online max / rescale
    float block_max = kMasked;
    for (int j = 0; j < BK / 8; ++j) {
      for (int t = 0; t < 2; ++t) {
        const int key = kb + j * 8 + c + t;
        bool visible = key < kv_end && qi < p.q_len;
        if (p.causal != 0) {
          visible = visible && key <= pos && (p.window_size <= 0 || key > pos - p.window_size);
        }
        float s = saturate_logit(s_tiles[j].thread_elements()[t] * p.scale);
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
        s = visible ? s : kMasked;
        s_tiles[j].thread_elements()[t] = s;
        block_max = max(block_max, s);
      }
    }
    // the 4 lanes of a row differ in lane bits 0 and 3
    block_max = max(block_max, simd_shuffle_xor(block_max, 1));
    block_max = max(block_max, simd_shuffle_xor(block_max, 8));
    const float m_new = max(m_row, block_max);
    const float alpha = exp2((m_row - m_new) * MLX_ATTN_LOG2E);

    // accumulate: P = exp2(S - m_new), l = l * alpha + rowsum P
    float p_sum = 0.0f;
    for (int j = 0; j < BK / 8; ++j) {
      for (int t = 0; t < 2; ++t) {
        const float s = s_tiles[j].thread_elements()[t];
        const float prob = s > 0.5f * kMasked ? exp2((s - m_new) * MLX_ATTN_LOG2E) : 0.0f;
        s_tiles[j].thread_elements()[t] = prob;
        p_sum += prob;
      }
    }
    p_sum += simd_shuffle_xor(p_sum, 1);
    p_sum += simd_shuffle_xor(p_sum, 8);
    l_row = l_row * alpha + p_sum;
    m_row = m_new;

    // rescale O by alpha (its row's), then O += P . V
    for (int d = 0; d < D / 8; ++d) {
      o_tiles[d].thread_elements() *= alpha;
      for (int j = 0; j < BK / 8; ++j) {
        simdgroup_float8x8 v_part;  // row = key j*8 + r, column = dim d*8 + c
        for (int t = 0; t < 2; ++t) {
          v_part.thread_elements()[t] = float(v_tile[(j * 8 + r) * LD + d * 8 + c + t]);
        }
        simdgroup_multiply_accumulate(o_tiles[d], s_tiles[j], v_part, o_tiles[d]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  // normalize: sinks join the sum; rows that saw nothing give zeros
  float correction = 1.0f;
  float l_final = l_row;
  float m_final = m_row;
  if (p.has_sinks != 0) {
    const float sink = saturate_logit(float(sinks[h * p.sinks_stride]));
    m_final = max(m_row, sink);
    correction = exp2((m_row - m_final) * MLX_ATTN_LOG2E);
    l_final = l_row * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);
  }
  const float factor = l_final > 0.0f ? correction / l_final : 0.0f;
  if (qi < p.q_len) {
    const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
    for (int d = 0; d < D / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        out[row * D + d * 8 + c + t] = T(o_tiles[d].thread_elements()[t] * factor);
      }
    }
    if (p.output_lse != 0 && c == 0) {
      // a row that saw nothing: -inf, written as bits (fast math has no infinities)
      lse[row] = l_final > 0.0f ? m_final + log(l_final) : as_type<float>(0xff800000u);
    }
  }
}

#define MLX_ATTN_PREFILL(tname, type, d, bk)                                                   \
  template [[host_name("attention_prefill_" #tname "_d" #d "_bk" #bk)]] [[kernel]] decltype( \
      attention_prefill<type, d, bk>) attention_prefill<type, d, bk>;

// BK: keys per block, chosen per GPU family, head dim and element size by
// the launch plan's table (csrc/launch_plan.cpp, docs/metal_kernels.md).
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk) MLX_ATTN_PREFILL(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk)
#endif
#define MLX_ATTN_PREFILL_2BYTE_TYPES(d, bk) \
  MLX_ATTN_PREFILL(float16, half, d, bk)    \
  MLX_ATTN_PREFILL_BFLOAT16(d, bk)
#define MLX_ATTN_PREFILL_TYPES(d, bk)        \
  MLX_ATTN_PREFILL(float32, float, d, bk)    \
  MLX_ATTN_PREFILL_2BYTE_TYPES(d, bk)

// every family, every dtype (MLX steel_attention's BK)
MLX_ATTN_PREFILL_TYPES(64, 32)
MLX_ATTN_PREFILL_TYPES(80, 16)
MLX_ATTN_PREFILL_TYPES(96, 16)
MLX_ATTN_PREFILL_TYPES(128, 16)
MLX_ATTN_PREFILL_TYPES(256, 8)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_PREFILL_2BYTE_TYPES(80, 32)
MLX_ATTN_PREFILL_2BYTE_TYPES(96, 32)
MLX_ATTN_PREFILL_2BYTE_TYPES(128, 32)
MLX_ATTN_PREFILL_2BYTE_TYPES(256, 16)
