// Which copy of the integer-dot quantized matrix-vector product
// (int8_matvec_kernels.h) runs, the one rule: the widest the CPU supports
// within the CPU kernel ISA chosen (MLX_ATTN_CPU_ISA / set_cpu_isa), so
// "generic" stays plain C++. x86-64: an AVX-512 choice takes the 512-bit
// vpdpbusd copy where the CPU has AVX512-VNNI; otherwise (any choice but
// generic) the 256-bit AVX-VNNI copy where the CPU has AVX-VNNI, else AVX2;
// arm64: USMMLA where the CPU reports FEAT_I8MM and FEAT_DotProd (hwcaps on
// Linux, sysctl on macOS), else SDOT where it reports FEAT_DotProd, else
// baseline NEON. Shared
// by the op (csrc/ops/quantized_matvec.cpp) and the standalone driver
// (tests/cpu_harness/int8_matvec_driver.cpp). No STL.
#pragma once

#include <string.h>

#include "csrc/cpu/cpu_features.h"
#include "csrc/cpu/int8_matvec_kernels.h"

namespace mlx_attn::cpu {

using Int8Matvec = void (*)(const Int8MatvecCall&, int64_t, int64_t);
struct NamedInt8Matvec {
  Int8Matvec kernel;
  const char* name;
};

// The copy for the CPU kernel ISA named `isa` (e.g. current_isa()).
inline NamedInt8Matvec int8_matvec_copy(const char* isa) {
  const bool generic_only = strcmp(isa, "generic") == 0;
#ifdef MLX_ATTN_X86_KERNELS
  if (strncmp(isa, "avx512", 6) == 0 && features::avx512vnni()) return {avx512vnni::int8_matvec, "avx512vnni"};
  if (!generic_only && features::avx_vnni()) return {avxvnni::int8_matvec, "avxvnni"};
  if (!generic_only && features::avx2()) return {avx2::int8_matvec, "avx2"};
#elif defined(MLX_ATTN_ARM64_KERNELS)
  if (!generic_only && features::neon_i8mm_and_dotprod()) return {neoni8mm::int8_matvec, "neoni8mm"};
  if (!generic_only && features::neon_dotprod()) return {neondot::int8_matvec, "neondot"};
  if (!generic_only) return {neon::int8_matvec, "neon"};
#endif
  (void)generic_only;
  return {generic::int8_matvec, "generic"};
}

}  // namespace mlx_attn::cpu
