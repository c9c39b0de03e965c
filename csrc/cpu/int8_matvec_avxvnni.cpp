// The integer-dot quantized matrix-vector product compiled for AVX-VNNI (VEX
// vpdpbusd / vpdpwssd, 256-bit: Intel Alder Lake and later, Sierra Forest,
// AMD Zen 5): the avx2 copy with its block dot step by those instructions;
// see int8_matvec_impl.h. The test driver also builds it with
// MLX_ATTN_EMULATE_AVX_VNNI (namespace avxvnni_emulated, the two
// instructions by exact AVX2 sequences) to check it on CPUs without them.
#if defined(MLX_ATTN_EMULATE_AVX_VNNI)
#define MLX_ATTN_ISA avxvnni_emulated
#else
#define MLX_ATTN_ISA avxvnni
#endif
#define MLX_ATTN_INT8_AVX_VNNI 1
#include "csrc/cpu/isa_avx2.h"
#include "csrc/cpu/int8_matvec_impl.h"
