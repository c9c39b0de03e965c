#include "csrc/quantized_matvec.h"
#include "csrc/argument_checks.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "csrc/cpu/cpu_features.h"
#include "csrc/cpu/host.h"
#include "csrc/cpu/matvec_kernels.h"
#include "csrc/cpu/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"

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

void run(const cpu::MatvecCall& call) {
#ifdef MLX_ATTN_X86_KERNELS
  const bool wide = cpu::features::avx2() && std::string(cpu::current_isa()) != "generic";
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
  });
}

}  // namespace

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
  for (const auto& [name, a] : {std::pair<const char*, const mx::array&>{"scales", scales}, {"biases", biases}}) {
    if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != k / group_size) {
      invalid(std::string(name) + " must be [" + std::to_string(n) + ", " + std::to_string(k / group_size) +
              "], got " + shape_string(a));
    }
  }
  if (biases.dtype() != scales.dtype()) invalid("biases must have the scales' dtype");
  scale_type(scales.dtype());
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

bool QuantizedMatvec::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatvec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
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

void QuantizedMatvec::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.quantized_matvec] runs on the CPU only");
}

}  // namespace mlx_attn
