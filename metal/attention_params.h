// Parameters and constants of the fused attention, shared by the .metal
// sources, the C++ host and the CPU kernel (through csrc/core/attention_problem.h),
// so neither the layout nor a constant can drift.
// 64-bit members first: both sides then lay the struct out without padding.
#pragma once

#ifdef __METAL_VERSION__
typedef long attn_int64;
typedef int attn_int32;
#else
#include <stdint.h>
typedef int64_t attn_int64;
typedef int32_t attn_int32;
#endif

// Array mask kinds (AttentionParams::mask_kind).
#define MLX_ATTN_MASK_NONE 0
#define MLX_ATTN_MASK_BOOL 1
#define MLX_ATTN_MASK_ADDITIVE 2

// The mask kind field: a plain int for Metal, the typed enum for C++ (same
// 4-byte layout).
#ifdef __METAL_VERSION__
typedef int attn_mask_kind;
#else
namespace mlx_attn {
enum class MaskKind : int32_t {
  none = MLX_ATTN_MASK_NONE,
  boolean = MLX_ATTN_MASK_BOOL,   // false = masked
  additive = MLX_ATTN_MASK_ADDITIVE,
};
}  // namespace mlx_attn
typedef mlx_attn::MaskKind attn_mask_kind;
#endif

// log2(e): the kernels compute exp(x) as exp2(x * log2 e).
#define MLX_ATTN_LOG2E 1.4426950408889634f
// Every logit (scale * q.k, after adding an additive mask, and each sink)
// saturates to [-2^125, 2^125]. The difference of two logits, and of a logit
// and MLX_ATTN_MASKED_LOGIT, times log2 e then stays finite, so no exponent
// overflows for any finite float32 scale (docs/architecture.md, "Numbers").
#define MLX_ATTN_LOGIT_LIMIT 4.253529586511730793e37f
// -2^127: below every saturated logit; a finite stand-in for -inf where
// infinities are not reliable (Metal compiles with fast math). An additive
// mask value at or below it (-inf included) masks the key.
#define MLX_ATTN_MASKED_LOGIT (-1.701411834604692317e38f)

// Simdgroups per prefill threadgroup (BQ = 8 rows each); the launch plan's
// per-GPU-family table must agree (csrc/metal/launch_plan.cpp checks it).
#define MLX_ATTN_PREFILL_SIMDGROUPS 4
// Simdgroups per decode threadgroup; their states are combined into one
// partial per (row, split) before the merge.
#define MLX_ATTN_DECODE_SIMDGROUPS 4
// Simdgroups per decode merge threadgroup (one row): simdgroup g merges splits
// g, g + this, ... (a chain of splits / this dependent loads, not splits),
// then their states are combined as the partial kernel's simdgroups' are. The
// launch plans size the merge threadgroup from it.
#define MLX_ATTN_DECODE_MERGE_SIMDGROUPS 8
// Decode register budget: a lane holds rows x D/32 floats of q and as many of
// the output; the group shape's rows per threadgroup = this / (D / 32), at
// most MLX_ATTN_DECODE_GROUP_MAX_ROWS (8 at D = 64 to 128, 4 at 256, 2 at 512).
#define MLX_ATTN_DECODE_ROW_FLOATS 32
// The register figures the decode's prefetch rule (DecodePrefetch,
// metal/attention_decode.h) holds a threadgroup to, the cost model's
// (kernel_lab/metal_cost_model.py Gpu): 32-bit registers a thread holds
// before the compiler spills (assumed), and a core's register file (208 KB
// on Apple7/8, Turner's metal-benchmarks) in 32-bit registers.
#define MLX_ATTN_REGISTER_BUDGET 128
#define MLX_ATTN_CORE_REGISTERS 53248
// At most 8 rows: the GQA groups of the models in use are at most 8 (Llama 3
// and Mistral 4, Qwen 2.5 7), and registers for rows past a group hold
// nothing (D = 64 at 16 rows: 124 registers a lane, 3 threadgroups a core;
// at 8: 76, 5).
#define MLX_ATTN_DECODE_GROUP_MAX_ROWS 8
// D-split prefill register budget (metal/attention_prefill_split.h): a lane
// holds this / 4 floats of Q (one chunk of head dims at a time) and one pass's
// value chunk of O (value dims per pass), the kernel's per-lane floats.
#define MLX_ATTN_SPLIT_QUERY_CHUNK 64
#define MLX_ATTN_SPLIT_VALUE_CHUNK 128
// Elements per vector device load (half4 / bfloat4 / float4). The launch plan
// sets AttentionParams::vector_loads only when every q/k/v row, head and batch
// start is a multiple of it (strides and the buffer's element offset) and the
// last dim is contiguous; the kernels read element by element otherwise.
#define MLX_ATTN_VECTOR_WIDTH 4

// What the kernels read of a problem. The host's description
// (AttentionProblem, csrc/core/attention_problem.h) extends this struct, so the
// launch plan hands it to the GPU as is: no field-by-field copy.
struct AttentionParams {
  attn_int64 q_strides[4];     // in elements, [batch, head, position, dim]
  attn_int64 k_strides[4];
  attn_int64 v_strides[4];
  attn_int64 mask_strides[4];  // broadcast dims have stride 0
  attn_int64 sinks_stride;     // sinks[h * sinks_stride]; 0: one value for every head
  attn_int32 batch;
  attn_int32 q_heads;
  attn_int32 kv_heads;
  attn_int32 group;            // q_heads / kv_heads
  attn_int32 q_len;
  attn_int32 kv_len;
  attn_int32 causal;           // lower-right aligned
  attn_int32 window_size;      // > 0: sliding window (with causal)
  attn_mask_kind mask_kind;
  attn_int32 has_sinks;
  float scale;                 // multiplies q.k (natural-log units)
  attn_int32 output_lse;       // write the row log-sum-exp (float32 [B, Hq, Tq])
  attn_int32 vector_loads;     // q/k/v aligned to MLX_ATTN_VECTOR_WIDTH (prefill and decode read vectors)
  float softcap;               // > 0: each logit becomes softcap * tanh(logit / softcap); 0: none
};

#ifndef __METAL_VERSION__
// 14 four-byte members: no tail padding
static_assert(sizeof(AttentionParams) == 17 * 8 + 14 * 4, "AttentionParams layout");
#endif

#ifdef __METAL_VERSION__
// N consecutive elements of a row, from `at` on, as floats: one N-wide load
// when the plan found the inputs aligned (params.vector_loads), else N loads
// `stride` elements apart. N = 1 is always a scalar load.
template <typename T, int N>
struct RowLoad {
  static inline void read(const device T* base, long at, long stride, bool vector_load, thread float* out) {
    if (vector_load) {
      const metal::vec<T, N> x = *(const device metal::vec<T, N>*)(base + at);
      for (int i = 0; i < N; ++i) {
        out[i] = float(x[i]);
      }
    } else {
      for (int i = 0; i < N; ++i) {
        out[i] = float(base[at + i * stride]);
      }
    }
  }
};
template <typename T>
struct RowLoad<T, 1> {
  static inline void read(const device T* base, long at, long, bool, thread float* out) { out[0] = float(base[at]); }
};
#endif
