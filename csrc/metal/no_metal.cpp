// A build whose MLX has no Metal (Linux, or a Mac build without it): the
// launch plans still compile (tests read them), the GPU evaluation refuses.
#include <stdexcept>

#include "csrc/metal/backend.h"
#include "csrc/ops/attention.h"
#include "csrc/ops/metal_paged_attention.h"

namespace mlx_attn {

namespace {

[[noreturn]] void no_gpu_kernels() {
  throw std::runtime_error("[mlx_attn] this build of mlx_attn has no GPU kernels (MLX without Metal)");
}

}  // namespace

bool metal::available() {
  return false;
}

void AttentionPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels();
}

void FusedAttentionBackward::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels();
}

void MetalPagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels();
}

void MetalCascadePagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels();
}

}  // namespace mlx_attn
