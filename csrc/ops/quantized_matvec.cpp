#include "csrc/ops/quantized_matvec.h"
#include "csrc/core/argument_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <optional>
#include <string>
#include <vector>

#include "csrc/cpu/cpu_features.h"
#include "csrc/cpu/host.h"
#include "csrc/cpu/int8_matvec_copies.h"
#include "csrc/cpu/int8_matvec_kernels.h"
#include "csrc/cpu/matvec_kernels.h"
#include "csrc/cpu/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"

namespace mlx_attn {
namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw_invalid("mlx_attn.quantized_matvec", message);
}

ElemType scale_type(mx::Dtype t) {
  const std::optional<ElemType> type = float_elem_type(t);
  if (!type) invalid("scales must be float32, float16 or bfloat16, got " + dtype_string(t));
  return *type;
}

// Output features per thread-pool task: small enough to balance two to
// sixteen threads over a 576-wide projection, large enough to amortize.
constexpr int64_t kOutputsPerTask = 32;

#ifdef MLX_ATTN_X86_KERNELS
// Whether the float copies (matvec_kernels.h) run their AVX2 copy: the CPU has it and the ISA chosen is not generic.
bool wide_float_copy() { return cpu::features::avx2() && std::string(cpu::current_isa()) != "generic"; }
#endif

void run(const cpu::MatvecCall& call) {
#ifdef MLX_ATTN_X86_KERNELS
  const bool wide = wide_float_copy();
#endif
  const int64_t tasks = (call.n + kOutputsPerTask - 1) / kOutputsPerTask;
  cpu::thread_pool().parallel_for(tasks, [&](int64_t task, int) {
    const int64_t begin = task * kOutputsPerTask;
    const int64_t end = std::min(call.n, begin + kOutputsPerTask);
    for (int r = 0; r < call.rows; r += cpu::kMatvecMaxRows) {
      cpu::MatvecCall part = call;
      part.rows = std::min(cpu::kMatvecMaxRows, call.rows - r);
      part.x = call.x + r * call.k;
      part.out = call.out + r * call.n;
#ifdef MLX_ATTN_X86_KERNELS
      if (wide) {
        cpu::avx2::quantized_matvec(part, begin, end);
        continue;
      }
#endif
      cpu::generic::quantized_matvec(part, begin, end);
    }
  }, /*contiguous=*/true);
}

// The int8 copy for the active CPU kernel ISA (csrc/cpu/int8_matvec_copies.h).
using cpu::Int8Matvec;
using cpu::NamedInt8Matvec;
NamedInt8Matvec named_int8_copy() { return cpu::int8_matvec_copy(cpu::current_isa()); }
Int8Matvec int8_copy() { return named_int8_copy().kernel; }

// x's rows times rsqrt(mean(x^2) + eps) times the norm's weight, as MLX's RMSNorm computes it in float32.
std::vector<float> rms_normalized(const float* x, int rows, int64_t k, const float* weight, float eps) {
  std::vector<float> out(size_t(rows) * k);
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    float squares = 0.0f;
    for (int64_t i = 0; i < k; ++i) squares += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(squares / float(k) + eps);
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = (row[i] * inverse) * weight[i];
  }
  return out;
}

// The SwiGLU activations silu(gate) * up of `count` elements (matvec_kernels.h), by the CPU's float copy.
void swiglu(const float* gate, const float* up, int64_t count, float* out) {
#ifdef MLX_ATTN_X86_KERNELS
  if (wide_float_copy()) return cpu::avx2::swiglu(gate, up, count, out);
#endif
  cpu::generic::swiglu(gate, up, count, out);
}

// What an integer product does around the product itself (quantized_matvec_int8_many).
struct Int8Extras {
  const float* norm_weight = nullptr;  // RMSNorm x first
  float norm_eps = 0.0f;
  const float* gate = nullptr;         // x is a SwiGLU's up: the product takes silu(gate) * x
  const float* residual = nullptr;     // [rows, n] added to the (one) product's output
};

// Quantizes x's rows (one pass, on the calling thread; RMSNorm or SwiGLU
// first where asked), then splits the output features over the pool;
// each task runs every row chunk over its features while their weights are
// in cache, then adds the residual to its outputs.
void run_int8(const float* x, const std::vector<cpu::Int8MatvecCall>& calls, int rows, const Int8Extras& extras) {
  // every call shares x's quantization: the same k and bits (checked on construction)
  const cpu::Int8MatvecCall& first = calls.front();
  std::vector<float> activations;
  if (extras.norm_weight != nullptr) {
    activations = rms_normalized(x, rows, first.k, extras.norm_weight, extras.norm_eps);
    x = activations.data();
  } else if (extras.gate != nullptr) {
    activations.resize(size_t(rows) * first.k);
    swiglu(extras.gate, x, int64_t(rows) * first.k, activations.data());
    x = activations.data();
  }
  const int64_t lanes = first.k / cpu::kInt8Block * 8;
  const size_t code_bytes = first.activation_bits / 8;
  std::vector<int16_t> codes(size_t(rows) * first.k * code_bytes / 2 + 1);
  std::vector<float> xd(size_t(rows) * lanes), xsum(size_t(rows) * lanes);
  for (int r = 0; r < rows; ++r) {
    if (first.activation_bits == 16) {
      cpu::quantize_activations(x + r * first.k, first.k, first.bits, codes.data() + r * first.k,
                                xd.data() + r * lanes, xsum.data() + r * lanes);
    } else {
      cpu::quantize_activations(x + r * first.k, first.k, first.bits,
                                reinterpret_cast<int8_t*>(codes.data()) + r * first.k, xd.data() + r * lanes,
                                xsum.data() + r * lanes);
    }
  }
  const char* xq = reinterpret_cast<const char*>(codes.data());
  const Int8Matvec kernel = int8_copy();
  // the tasks of all weights in one pool call: one wake-up per step, not per weight
  std::vector<int64_t> first_task(calls.size() + 1, 0);
  for (size_t w = 0; w < calls.size(); ++w) {
    first_task[w + 1] = first_task[w] + (calls[w].n + kOutputsPerTask - 1) / kOutputsPerTask;
  }
  // contiguous: each thread streams its own stretch of the weights (see thread_pool.h)
  cpu::thread_pool().parallel_for(first_task.back(), [&](int64_t task, int) {
    const size_t w = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const cpu::Int8MatvecCall& call = calls[w];
    const int64_t begin = (task - first_task[w]) * kOutputsPerTask;
    const int64_t end = std::min(call.n, begin + kOutputsPerTask);
    for (int r = 0; r < rows; r += cpu::kInt8MatvecMaxRows) {
      cpu::Int8MatvecCall part = call;
      part.rows = std::min(cpu::kInt8MatvecMaxRows, rows - r);
      part.xq = xq + r * call.k * code_bytes;
      part.xd = xd.data() + r * lanes;
      part.xsum = xsum.data() + r * lanes;
      part.out = call.out + r * call.n;
      kernel(part, begin, end);
    }
    // the residual stream's add, while the outputs are in cache (one weight: checked on construction)
    for (int r = 0; extras.residual != nullptr && r < rows; ++r) {
      float* out = call.out + r * call.n;
      const float* residual = extras.residual + r * call.n;
      for (int64_t j = begin; j < end; ++j) out[j] = residual[j] + out[j];
    }
  }, /*contiguous=*/true);
}

// Rows of a weight per thread-pool task when dequantizing.
constexpr int64_t kRowsPerTask = 16;

struct DequantizeCall {
  const uint8_t* codes;
  const void* scales;
  const void* biases;
  float* out;
  int64_t n, k, row_bytes;
  int group_size, bits;
};

// One row: code i is the `bits` bits at bit i * bits of the row's bytes,
// least significant first (a 16-bit window from the code's first byte holds
// it: bits <= 8, offset within the byte < 8).
template <ElemType S>
float scale_at(const void* p, int64_t i) {
  if constexpr (S == ElemType::float32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (S == ElemType::float16) {
    return float(static_cast<const mx::float16_t*>(p)[i]);
  } else {
    return float(static_cast<const mx::bfloat16_t*>(p)[i]);
  }
}

template <ElemType S>
void dequantize_rows(const DequantizeCall& c, int64_t begin, int64_t end) {
  const uint32_t mask = (1u << c.bits) - 1u;
  const int64_t groups = c.k / c.group_size;
  for (int64_t row = begin; row < end; ++row) {
    const uint8_t* bytes = c.codes + row * c.row_bytes;
    float* out = c.out + row * c.k;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = scale_at<S>(c.scales, row * groups + g);
      const float bias = scale_at<S>(c.biases, row * groups + g);
      for (int64_t i = g * c.group_size; i < (g + 1) * c.group_size; ++i) {
        const int64_t bit = i * c.bits;
        const int64_t at = bit >> 3;
        const uint32_t window = bytes[at] | (at + 1 < c.row_bytes ? uint32_t(bytes[at + 1]) << 8 : 0u);
        out[i] = std::fma(scale, float((window >> (bit & 7)) & mask), bias);
      }
    }
  }
}

void run_dequantize(const DequantizeCall& c, ElemType scale_type) {
  const int64_t tasks = (c.n + kRowsPerTask - 1) / kRowsPerTask;
  cpu::thread_pool().parallel_for(tasks, [&](int64_t task, int) {
    const int64_t begin = task * kRowsPerTask;
    const int64_t end = std::min(c.n, begin + kRowsPerTask);
    switch (scale_type) {
      case ElemType::float32: dequantize_rows<ElemType::float32>(c, begin, end); break;
      case ElemType::float16: dequantize_rows<ElemType::float16>(c, begin, end); break;
      case ElemType::bfloat16: dequantize_rows<ElemType::bfloat16>(c, begin, end); break;
    }
  });
}

void check_scales(const char* op, const mx::array& scales, const mx::array& biases, int64_t n, int64_t groups) {
  for (const auto& [name, a] : {std::pair<const char*, const mx::array&>{"scales", scales}, {"biases", biases}}) {
    if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != groups) {
      throw_invalid(op, std::string(name) + " must be [" + std::to_string(n) + ", " + std::to_string(groups) +
                            "], got " + shape_string(a));
    }
  }
  if (biases.dtype() != scales.dtype()) throw_invalid(op, "biases must have the scales' dtype");
  if (!float_elem_type(scales.dtype())) {
    throw_invalid(op, "scales must be float32, float16 or bfloat16, got " + dtype_string(scales.dtype()));
  }
}

}  // namespace

std::string int8_matvec_copy_name() { return named_int8_copy().name; }

mx::array dequantize_affine(const mx::array& codes, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::StreamOrDevice s) {
  constexpr const char* op = "mlx_attn.dequantize_affine";
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw_invalid(op, "bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw_invalid(op, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (codes.ndim() != 2 || codes.dtype() != mx::uint32) {
    throw_invalid(op, "codes must be uint32 [n, k * bits / 32], got " + shape_string(codes) + " " +
                          dtype_string(codes.dtype()));
  }
  const int64_t n = codes.shape(0);
  const int64_t packed_bits = int64_t(codes.shape(1)) * 32;
  if (packed_bits % bits != 0 || (packed_bits / bits) % group_size != 0) {
    throw_invalid(op, "codes " + shape_string(codes) + " do not hold whole groups of " + std::to_string(group_size) +
                          " " + std::to_string(bits) + "-bit columns");
  }
  const int64_t k = packed_bits / bits;
  check_scales(op, scales, biases, n, k / group_size);
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) throw_invalid(op, "runs on the CPU only (the GPU has mx.dequantize)");
  std::vector<mx::array> inputs = {mx::contiguous(codes, false, stream), mx::contiguous(scales, false, stream),
                                   mx::contiguous(biases, false, stream)};
  return mx::array(mx::Shape{int(n), int(k)}, mx::float32, std::make_shared<DequantizeAffine>(stream, group_size, bits),
                   std::move(inputs));
}

std::vector<mx::Shape> DequantizeAffine::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), int(int64_t(inputs[0].shape(1)) * 32 / bits_)}};
}

std::vector<mx::array> DequantizeAffine::vjp(const std::vector<mx::array>& primals,
                                              const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                              const std::vector<mx::array>&) {
  const mx::array& scales = primals[1];
  const int n = scales.shape(0);
  const int groups = scales.shape(1);
  auto per_group = [&](const mx::array& a) {
    return mx::sum(mx::reshape(a, {n, groups, group_size_}, stream()), -1, false, stream());
  };
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      grads.push_back(mx::zeros_like(primals[0], stream()));
    } else if (arg == 1) {  // d w / d scale = code
      mx::array codes = dequantize_affine(primals[0], mx::ones_like(scales, stream()), mx::zeros_like(scales, stream()),
                                          group_size_, bits_, stream());
      grads.push_back(mx::astype(per_group(mx::multiply(cotangents[0], codes, stream())), scales.dtype(), stream()));
    } else {  // d w / d bias = 1
      grads.push_back(mx::astype(per_group(cotangents[0]), primals[2].dtype(), stream()));
    }
  }
  return grads;
}

void DequantizeAffine::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  DequantizeCall call{};
  call.n = out.shape(0);
  call.k = out.shape(1);
  call.row_bytes = int64_t(inputs[0].shape(1)) * 4;
  call.group_size = group_size_;
  call.bits = bits_;
  const ElemType scale_type = *float_elem_type(inputs[1].dtype());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  call.codes = inputs[0].data<uint8_t>();
  call.scales = inputs[1].data<void>();
  call.biases = inputs[2].data<void>();
  call.out = out.data<float>();
  encoder.dispatch([call, scale_type]() { run_dequantize(call, scale_type); });
}

mx::array quantized_matvec(const mx::array& x, const mx::array& codes, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) invalid("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    invalid("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (x.ndim() != 2) invalid("x must be [rows, k], got " + shape_string(x));
  if (x.dtype() != mx::float32) invalid("x must be float32");
  if (codes.ndim() != 2 || codes.dtype() != mx::uint32) invalid("codes must be uint32 [n, k * bits / 32]");
  const int64_t k = x.shape(1);
  const int64_t n = codes.shape(0);
  if (k % group_size != 0 || int64_t(codes.shape(1)) * 32 != k * bits) {
    invalid("codes " + shape_string(codes) + " do not hold " + std::to_string(k) + " columns of " +
            std::to_string(bits) + " bits in groups of " + std::to_string(group_size));
  }
  check_scales("mlx_attn.quantized_matvec", scales, biases, n, k / group_size);
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) invalid("runs on the CPU only (the GPU has MLX's quantized kernels)");
  // 4 bits: a byte holds an even and an odd column, so x goes even columns first
  mx::array rows = bits == 4 ? mx::reshape(mx::swapaxes(mx::reshape(x, {x.shape(0), int(k / 2), 2}, stream), 1, 2, stream),
                                           {x.shape(0), int(k)}, stream)
                             : x;
  std::vector<mx::array> inputs = {mx::contiguous(rows, false, stream), mx::contiguous(codes, false, stream),
                                   mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)};
  auto primitive = std::make_shared<QuantizedMatvec>(stream, group_size, bits);
  auto shape = primitive->output_shapes(inputs)[0];
  return mx::array(std::move(shape), mx::float32, primitive, std::move(inputs));
}

std::vector<mx::Shape> QuantizedMatvec::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[1].shape(0)}};
}

std::vector<mx::array> QuantizedMatvec::vjp(const std::vector<mx::array>& primals,
                                            const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                            const std::vector<mx::array>&) {
  for (int arg : argnums) {
    if (arg != 0) invalid("gradients flow to x only, not to the quantized weight");
  }
  const mx::array& x = primals[0];
  mx::array dx = mx::astype(mx::quantized_matmul(cotangents[0], primals[1], primals[2], primals[3], false, group_size_,
                                                 bits_, "affine", stream()),
                            mx::float32, stream());
  if (bits_ == 4) {  // into the op's input layout: even columns, then odd ones
    dx = mx::reshape(mx::swapaxes(mx::reshape(dx, {x.shape(0), x.shape(1) / 2, 2}, stream()), 1, 2, stream()),
                     x.shape(), stream());
  }
  return {dx};
}

void QuantizedMatvec::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  cpu::MatvecCall call{};
  call.rows = inputs[0].shape(0);
  call.k = inputs[0].shape(1);
  call.n = inputs[1].shape(0);
  call.scale_type = scale_type(inputs[2].dtype());
  call.group_size = group_size_;
  call.bits = bits_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  call.x = inputs[0].data<float>();
  call.codes = inputs[1].data<uint32_t>();
  call.scales = inputs[2].data<void>();
  call.biases = inputs[3].data<void>();
  call.out = out.data<float>();
  encoder.dispatch([call]() { run(call); });
}

namespace {

// x's elements in row-major order: its own memory when row-contiguous, else
// gathered into `gathered` by its strides (a view: a slice, a transpose).
const float* rows_of(const mx::array& x, std::vector<float>& gathered) {
  if (x.flags().row_contiguous) return x.data<float>();
  gathered.resize(x.size());
  const float* base = x.data<float>();
  std::vector<int> index(x.ndim(), 0);
  for (size_t i = 0; i < x.size(); ++i) {
    int64_t offset = 0;
    for (int d = 0; d < x.ndim(); ++d) offset += int64_t(index[d]) * x.strides()[d];
    gathered[i] = base[offset];
    for (int d = x.ndim() - 1; d >= 0 && ++index[d] == x.shape(d); --d) index[d] = 0;
  }
  return gathered.data();
}

// An input the CPU op reads as row-contiguous memory: an evaluated
// row-contiguous array as it is (a weight: no Contiguous node per call in
// every step's graph), anything else through mx::contiguous.
mx::array row_contiguous(const mx::array& a, const mx::Stream& stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
}

}  // namespace

std::vector<mx::array> quantized_matvec_int8_many(const mx::array& x, const std::vector<mx::array>& codes,
                                                  const std::vector<mx::array>& scales,
                                                  const std::vector<mx::array>& biases, int group_size, int bits,
                                                  int activation_bits, const std::optional<mx::array>& norm_weight,
                                                  float norm_eps, const std::optional<mx::array>& gate,
                                                  const std::optional<mx::array>& residual, mx::StreamOrDevice s) {
  constexpr const char* op = "mlx_attn.quantized_matvec_int8";
  if (bits != 4 && bits != 8) throw_invalid(op, "bits must be 4 or 8, got " + std::to_string(bits));
  if (activation_bits != 8 && activation_bits != 16) {
    throw_invalid(op, "activation_bits must be 8 or 16, got " + std::to_string(activation_bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw_invalid(op, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (codes.empty() || scales.size() != codes.size() || biases.size() != codes.size()) {
    throw_invalid(op, "codes, scales and biases must be lists of one length (one entry per weight), got " +
                          std::to_string(codes.size()) + ", " + std::to_string(scales.size()) + " and " +
                          std::to_string(biases.size()));
  }
  if (x.ndim() < 2) throw_invalid(op, "x must be [rows, k] (or [..., rows, k]), got " + shape_string(x));
  if (x.dtype() != mx::float32) throw_invalid(op, "x must be float32, got " + dtype_string(x.dtype()));
  const int64_t k = x.shape(-1);
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) throw_invalid(op, "runs on the CPU only (the GPU has MLX's quantized kernels)");
  // x as it comes: a strided x is gathered at evaluation (rows_of), so a
  // decode step's trace holds no Contiguous node before each product
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  for (size_t w = 0; w < codes.size(); ++w) {
    if (codes[w].ndim() != 2 || codes[w].dtype() != mx::uint32) {
      throw_invalid(op, "codes must be uint32 [n, k * bits / 32]");
    }
    const int64_t n = codes[w].shape(0);
    if (k % group_size != 0 || int64_t(codes[w].shape(1)) * 32 != k * bits) {
      throw_invalid(op, "codes " + shape_string(codes[w]) + " do not hold " + std::to_string(k) + " columns of " +
                            std::to_string(bits) + " bits in groups of " + std::to_string(group_size));
    }
    check_scales(op, scales[w], biases[w], n, k / group_size);
    for (const mx::array* a : {&codes[w], &scales[w], &biases[w]}) inputs.push_back(row_contiguous(*a, stream));
    mx::Shape shape = x.shape();  // [..., rows, n]: no reshape around the call
    shape.back() = int(n);
    shapes.push_back(std::move(shape));
  }
  if (norm_weight) {
    if (norm_weight->dtype() != mx::float32 || norm_weight->ndim() != 1 || norm_weight->shape(0) != k) {
      throw_invalid(op, "norm_weight must be float32 [" + std::to_string(k) + "] (x's last axis), got " +
                            dtype_string(norm_weight->dtype()) + " " + shape_string(*norm_weight));
    }
    if (!(norm_eps >= 0.0f) || !std::isfinite(norm_eps)) {
      throw_invalid(op, "norm_eps must be finite and >= 0, got " + std::to_string(norm_eps));
    }
    inputs.push_back(row_contiguous(*norm_weight, stream));
  }
  // gate and residual as they come, like x (gathered at evaluation when strided)
  if (gate) {
    if (norm_weight) throw_invalid(op, "gate and norm_weight cannot be combined (a SwiGLU's down projection has no norm)");
    if (gate->dtype() != mx::float32 || gate->shape() != x.shape()) {
      throw_invalid(op, "gate must be float32 of x's shape " + shape_string(x) + ", got " + dtype_string(gate->dtype()) +
                            " " + shape_string(*gate));
    }
    inputs.push_back(*gate);
  }
  if (residual) {
    if (codes.size() != 1) {
      throw_invalid(op, "residual needs exactly one weight, got " + std::to_string(codes.size()));
    }
    if (residual->dtype() != mx::float32 || residual->shape() != shapes[0]) {
      throw_invalid(op, "residual must be float32 of the output's shape " + shape_string(shapes[0]) +
                            ", got " + dtype_string(residual->dtype()) + " " + shape_string(*residual));
    }
    inputs.push_back(*residual);
  }
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<QuantizedMatvecInt8>(stream, group_size, bits, activation_bits, norm_weight.has_value(),
                                            norm_eps, gate.has_value(), residual.has_value()),
      std::move(inputs));
}

mx::array quantized_matvec_int8(const mx::array& x, const mx::array& codes, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, int activation_bits,
                                mx::StreamOrDevice s) {
  return quantized_matvec_int8_many(x, {codes}, {scales}, {biases}, group_size, bits, activation_bits, std::nullopt,
                                    1e-5f, std::nullopt, std::nullopt, s)[0];
}

std::vector<mx::Shape> QuantizedMatvecInt8::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t w = 1; w < 1 + 3 * weights(inputs.size()); w += 3) {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[w].shape(0);
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

std::vector<mx::array> QuantizedMatvecInt8::vjp(const std::vector<mx::array>& primals,
                                                const std::vector<mx::array>& cotangents,
                                                const std::vector<int>& argnums, const std::vector<mx::array>&) {
  // the extra inputs follow the weights in this order
  int next = 1 + 3 * int(weights(primals.size()));
  const int norm_arg = normalized_ ? next++ : -1;
  const int gate_arg = gated_ ? next++ : -1;
  const int residual_arg = with_residual_ ? next++ : -1;
  for (int arg : argnums) {
    if (arg != 0 && arg != norm_arg && arg != gate_arg && arg != residual_arg) {
      throw_invalid("mlx_attn.quantized_matvec_int8",
                    "gradients flow to x, the norm's weight, the gate and the residual, not to the weight");
    }
  }
  // the float product's gradient (the activations' rounding passes straight through), summed over the weights
  std::optional<mx::array> dx;
  for (size_t w = 0; w < cotangents.size(); ++w) {
    mx::array part = mx::quantized_matmul(cotangents[w], primals[1 + 3 * w], primals[2 + 3 * w], primals[3 + 3 * w],
                                          false, group_size_, bits_, "affine", stream());
    dx = dx ? mx::add(*dx, part, stream()) : part;
  }
  const mx::array d_activations = mx::astype(*dx, mx::float32, stream());
  const mx::Stream on = stream();
  // back through what made the activations from x: nothing, RMSNorm or SwiGLU (each by MLX's own vjp)
  std::vector<mx::array> grads = {d_activations};  // to x, then to the norm's weight or the gate
  if (normalized_) {
    const float eps = norm_eps_;
    auto norm = [eps, on](const std::vector<mx::array>& in) -> std::vector<mx::array> {
      return {mx::fast::rms_norm(in[0], in[1], eps, on)};
    };
    grads = mx::vjp(norm, {primals[0], primals[norm_arg]}, {d_activations}).second;
  } else if (gated_) {
    auto swiglu = [on](const std::vector<mx::array>& in) -> std::vector<mx::array> {
      const mx::array& gate = in[1];
      return {mx::multiply(mx::multiply(gate, mx::sigmoid(gate, on), on), in[0], on)};
    };
    grads = mx::vjp(swiglu, {primals[0], primals[gate_arg]}, {d_activations}).second;
  }
  std::vector<mx::array> out;
  for (int arg : argnums) {
    out.push_back(arg == 0 ? grads[0] : arg == residual_arg ? cotangents[0] : grads[1]);
  }
  return out;
}

void QuantizedMatvecInt8::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  std::vector<cpu::Int8MatvecCall> calls;
  const int64_t k = inputs[0].shape(-1);
  int64_t leading = 1;  // the rows of x [..., rows, k]
  for (int d = 0; d + 1 < inputs[0].ndim(); ++d) leading *= inputs[0].shape(d);
  const int rows = int(leading);
  size_t next = 1 + 3 * outputs.size();  // the extra inputs, in order
  const float* norm_weight = normalized_ ? inputs[next++].data<float>() : nullptr;
  const std::optional<mx::array> gate = gated_ ? std::optional<mx::array>(inputs[next++]) : std::nullopt;
  const std::optional<mx::array> residual = with_residual_ ? std::optional<mx::array>(inputs[next++]) : std::nullopt;
  for (size_t w = 0; w < outputs.size(); ++w) {
    mx::array& out = outputs[w];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    if (out.size() == 0) continue;
    cpu::Int8MatvecCall call{};
    call.k = k;
    call.n = inputs[1 + 3 * w].shape(0);
    call.scale_type = *float_elem_type(inputs[2 + 3 * w].dtype());
    call.group_size = group_size_;
    call.bits = bits_;
    call.activation_bits = activation_bits_;
    call.codes = inputs[1 + 3 * w].data<uint32_t>();
    call.scales = inputs[2 + 3 * w].data<void>();
    call.biases = inputs[3 + 3 * w].data<void>();
    call.out = out.data<float>();
    calls.push_back(call);
  }
  if (calls.empty()) return;
  const mx::array x = inputs[0];
  encoder.dispatch([x, calls = std::move(calls), rows, norm_weight, eps = norm_eps_, gate, residual]() {
    std::vector<float> gathered_x, gathered_gate, gathered_residual;
    Int8Extras extras;
    extras.norm_weight = norm_weight;
    extras.norm_eps = eps;
    extras.gate = gate ? rows_of(*gate, gathered_gate) : nullptr;
    extras.residual = residual ? rows_of(*residual, gathered_residual) : nullptr;
    run_int8(rows_of(x, gathered_x), calls, rows, extras);
  });
}

bool QuantizedMatvecInt8::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const QuantizedMatvecInt8*>(&other);
  return QuantizedWeightPrimitive::is_equivalent(other) && o != nullptr && o->activation_bits_ == activation_bits_ &&
         o->normalized_ == normalized_ && o->norm_eps_ == norm_eps_ && o->gated_ == gated_ &&
         o->with_residual_ == with_residual_;
}

void QuantizedWeightPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string("[mlx_attn.") + op_name() + "] runs on the CPU only");
}

bool QuantizedWeightPrimitive::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const QuantizedWeightPrimitive*>(&other);
  return o != nullptr && std::strcmp(name(), o->name()) == 0 && group_size_ == o->group_size_ && bits_ == o->bits_;
}

}  // namespace mlx_attn
