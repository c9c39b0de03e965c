// mlx_attn._ext.decode_attention: one decode step's attention block of a
// layer as one CPU primitive. It takes the step's projected query, key and
// value rows as the fused Q/K/V product returns them ([B, 1, heads * D]),
// rotates the query and key (RoPE, from the step's cos / sin), writes the key
// and value rows into the layer's preallocated cache buffers at the step's
// position, and attends the query over the filled slots only (GQA, an
// optional sliding window) through the fused CPU kernel; the output comes as
// [B, 1, Hq * Dv], the output projection's input. Per layer it stands for
// the reshapes and transposes, RoPE's elementwise ops, two slice updates,
// the visibility mask over the whole buffer and the attention call of the
// compiled decode step (mlx_attn/lm/compiled_decode.py). The GPU keeps that
// graph of MLX's kernels.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_attn {

namespace mx = mlx::core;

// q [B, 1, Hq * D], k [B, 1, Hkv * D], v [B, 1, Hkv * Dv] (float dtypes);
// key_cache [B, Hkv, S, D] and value_cache [B, Hkv, S, Dv] (one float
// dtype); position: an integer scalar (or [1]) array, the slot the step
// writes; cos, sin: float32 [R / 2], the rotation of the first R features
// (R even, R <= D; the rest pass through), pairs (2i, 2i + 1) when
// `traditional`, else (i, i + R / 2). Returns {out [B, 1, Hq * Dv], the key
// cache and the value cache with the step's rows written}, all in the
// caches' dtype. The queries see slots [0, position] (with window_size > 0
// the last window_size of them). A cache input no other array holds is
// updated in place (its buffer becomes the output's); otherwise the output is
// a copy. A position outside [0, S) at evaluation gives NaN outputs and the
// caches unchanged. Throws std::invalid_argument naming the argument. Three
// nodes: a DecodeCacheWrite per cache and the DecodeAttention reading them.
std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& key_cache, const mx::array& value_cache,
                                        const mx::array& position, const mx::array& cos, const mx::array& sin,
                                        float scale, int window_size = 0, bool traditional = false,
                                        mx::StreamOrDevice s = {});

// The cache buffer with the step's rows written at the position (rotated
// first when `rotate`: inputs cache, rows, position[, cos, sin]). The buffer
// is the output's when no other array holds it (donated), else copied.
mx::array decode_cache_write(const mx::array& cache, const mx::array& rows, const mx::array& position,
                             const std::optional<mx::array>& cos, const std::optional<mx::array>& sin,
                             bool traditional, mx::Stream stream);

// A CPU primitive writing a step's rows (rotated first when `rotate`) into
// the buffer of its first input, which it returns (DecodeCacheWrite,
// PagedRowsWrite). The GPU runs the step as MLX's own operations.
class RowsWrite : public mx::Primitive {
 public:
  RowsWrite(mx::Stream stream, bool rotate, bool traditional, const char* op)
      : mx::Primitive(stream), rotate_(rotate), traditional_(traditional), op_(op) {}

  // Throws: CPU only.
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // The same primitive class with the same flags.
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  bool rotate_;
  bool traditional_;

 private:
  const char* op_;  // the Python name in errors
};

class DecodeCacheWrite : public RowsWrite {
 public:
  DecodeCacheWrite(mx::Stream stream, bool rotate, bool traditional)
      : RowsWrite(stream, rotate, traditional, "mlx_attn.decode_attention") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "DecodeCacheWrite";
  }
};

// The attention of the rotated query rows over slots [0, position] of the
// written caches (inputs q, key_cache, value_cache, position, cos, sin).
class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream stream, float scale, int window_size, bool traditional)
      : mx::Primitive(stream), scale_(scale), window_size_(window_size), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  // Throws: the GPU runs the step as MLX's own operations.
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "DecodeAttention";
  }

 private:
  float scale_;
  int window_size_;
  bool traditional_;
};

// The serving engine's decode step over paged K/V (mlx_attn/serve/compiled_step.py):
// each row of a step is one token of its own sequence, at its own position.
//
// pages [num_pages, Hkv, page_size, D] (float) with rows [T, Hkv * D] or
// [1, T, Hkv * D] written at (write_pages[t], write_slots[t]) (int32 [T]);
// with cos / sin (float32 [T, R / 2]) each row rotated first by its own
// angles, as decode_attention rotates. A row whose page or slot lies outside
// the pool is not written. The pool nothing else holds is updated in place,
// otherwise copied. Throws std::invalid_argument naming the argument.
mx::array paged_rows_write(const mx::array& pages, const mx::array& rows, const mx::array& write_pages,
                           const mx::array& write_slots, const std::optional<mx::array>& cos,
                           const std::optional<mx::array>& sin, bool traditional = false,
                           mx::StreamOrDevice s = {});

// rows [T, heads * D] or [1, T, heads * D] as [T, heads, D] (rows' dtype), each
// token's first R features rotated by its cos / sin (float32 [T, R / 2]):
// the query rows paged attention reads.
mx::array rotated_rows(const mx::array& rows, const mx::array& cos, const mx::array& sin, int heads,
                       bool traditional = false, mx::StreamOrDevice s = {});

class PagedRowsWrite : public RowsWrite {
 public:
  PagedRowsWrite(mx::Stream stream, bool rotate, bool traditional)
      : RowsWrite(stream, rotate, traditional, "mlx_attn.paged_rows_write") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "PagedRowsWrite";
  }
};

class RotatedRows : public mx::Primitive {
 public:
  RotatedRows(mx::Stream stream, int heads, bool traditional)
      : mx::Primitive(stream), heads_(heads), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "RotatedRows";
  }

 private:
  int heads_;
  bool traditional_;
};

}  // namespace mlx_attn
