// mlx_attn._ext.quantized_matvec: x @ dequantize(W).T for a few rows of
// float32 activations and an MLX affine-quantized weight (4 or 8 bits), on
// the CPU, reading the packed codes once for all rows (csrc/cpu/matvec_impl.h).
// MLX's CPU quantized matmul costs several times the weight's bytes; this
// is what a decode step's matmuls are bound by. Python routes rows here
// (mlx_attn/lm/quantized_matmul.py); the GPU keeps MLX's kernels.
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_attn {

namespace mx = mlx::core;

// x [rows, k] float32; codes uint32 [n, k * bits / 32]; scales, biases
// [n, k / group_size] in one float dtype. Returns float32 [rows, n].
// Throws std::invalid_argument naming the argument.
mx::array quantized_matvec(const mx::array& x, const mx::array& codes, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

// As quantized_matvec, through integer dot products: each row of x is
// quantized to int8 or int16 (activation_bits) per block of 32 columns
// (csrc/cpu/int8_matvec_kernels.h states the error bound against the float
// product), any number of rows.
mx::array quantized_matvec_int8(const mx::array& x, const mx::array& codes, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, int activation_bits = 8,
                                mx::StreamOrDevice s = {});

// quantized_matvec_int8 of one x against several weights of one bit width
// and group size (a layer's Q/K/V or gate/up projections): x quantized once
// and every weight's outputs in one thread-pool call. Returns one float32
// [rows, n_i] per weight. With norm_weight (float32 [k]) the products take
// RMSNorm(x) = x / sqrt(mean(x^2) + norm_eps) * norm_weight instead of x,
// normalized in the same pass that quantizes it (no graph nodes for the
// norm in a decode step). With gate (float32, x's shape) they take a SwiGLU's
// activations silu(gate) * x instead (a down projection; not with a norm),
// and residual (float32 [..., rows, n], one weight only) is added to the
// output: a layer's `h + down(silu(g) * u)` or `h + o_proj(a)` as one node.
std::vector<mx::array> quantized_matvec_int8_many(const mx::array& x, const std::vector<mx::array>& codes,
                                                  const std::vector<mx::array>& scales,
                                                  const std::vector<mx::array>& biases, int group_size, int bits,
                                                  int activation_bits = 8,
                                                  const std::optional<mx::array>& norm_weight = std::nullopt,
                                                  float norm_eps = 1e-5f,
                                                  const std::optional<mx::array>& gate = std::nullopt,
                                                  const std::optional<mx::array>& residual = std::nullopt,
                                                  mx::StreamOrDevice s = {});

// The integer product's copy for the active CPU kernel ISA: "avx512vnni",
// "avxvnni", "avx2", "neoni8mm", "neondot", "neon" or "generic" (the policy in
// lm/quantized_matmul.py reads it: only the AVX512-VNNI int16 copy reads a
// weight block once for 128 rows).
std::string int8_matvec_copy_name();

// codes uint32 [n, k * bits / 32] (bits 2, 3, 4, 5, 6 or 8: code i of a row
// at bit i * bits of its little-endian bit stream, MLX's affine packing);
// scales, biases [n, k / group_size] in one float dtype. Returns the float32
// weight [n, k], fma(scale, code, bias) each, on the CPU: one pass that
// writes only the output (MLX's CPU dequantize of 3, 5 and 6 bits builds
// intermediates several times the weight's float32 size).
mx::array dequantize_affine(const mx::array& codes, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::StreamOrDevice s = {});

// What the CPU ops over an affine-quantized weight share: the packing's
// group size and bit width, equivalence by op and both, and no GPU
// evaluation (the GPU keeps MLX's quantized kernels).
class QuantizedWeightPrimitive : public mx::Primitive {
 public:
  QuantizedWeightPrimitive(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  // Throws: "[mlx_attn.<op_name()>] runs on the CPU only".
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  // The op's name in mlx_attn._ext, for errors.
  virtual const char* op_name() const = 0;

 protected:
  int group_size_;
  int bits_;
};

class DequantizeAffine : public QuantizedWeightPrimitive {
 public:
  using QuantizedWeightPrimitive::QuantizedWeightPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // To the scales (the codes summed per group) and the biases (the
  // cotangent summed per group); the integer codes get zeros.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "DequantizeAffine";
  }
  const char* op_name() const override {
    return "dequantize_affine";
  }
};

class QuantizedMatvec : public QuantizedWeightPrimitive {
 public:
  using QuantizedWeightPrimitive::QuantizedWeightPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // Gradients flow to x only (the weight is not trained through this op).
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "QuantizedMatvec";
  }
  const char* op_name() const override {
    return "quantized_matvec";
  }
};

class QuantizedMatvecInt8 : public QuantizedWeightPrimitive {
 public:
  // After the weights' (codes, scales, biases), in this order: with normalized an RMSNorm weight applied to
  // x first, with gated a SwiGLU gate, with with_residual a residual added to the output
  // (quantized_matvec_int8_many).
  QuantizedMatvecInt8(mx::Stream stream, int group_size, int bits, int activation_bits, bool normalized = false,
                      float norm_eps = 0.0f, bool gated = false, bool with_residual = false)
      : QuantizedWeightPrimitive(stream, group_size, bits), activation_bits_(activation_bits),
        normalized_(normalized), norm_eps_(norm_eps), gated_(gated), with_residual_(with_residual) {}
  bool is_equivalent(const mx::Primitive& other) const override;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // The float product's gradient, to x (through the norm or the SwiGLU), the norm's weight, the gate and the
  // residual.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "QuantizedMatvecInt8";
  }
  const char* op_name() const override {
    return "quantized_matvec_int8";
  }

 private:
  // The weights among `inputs` inputs: x, three per weight, then the extras.
  size_t weights(size_t inputs) const {
    return (inputs - 1 - size_t(normalized_) - size_t(gated_) - size_t(with_residual_)) / 3;
  }
  int activation_bits_;
  bool normalized_;
  float norm_eps_;
  bool gated_;
  bool with_residual_;
};

}  // namespace mlx_attn
