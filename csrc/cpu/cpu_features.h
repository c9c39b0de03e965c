// What the running CPU supports, for choosing a kernel copy: CPUID on x86-64
// (__builtin_cpu_supports), hwcaps on Linux arm64 (getauxval), sysctl on
// macOS arm64. Shared by the dispatchers (dispatch.cpp) and the standalone
// harness (tests/cpu_harness), so both apply one rule. No STL.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace mlx_attn::cpu::features {

#if defined(__x86_64__) || defined(_M_X64)
inline bool avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}
inline bool avx512() {
  return avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
inline bool avx512bf16() {
  return avx512() && __builtin_cpu_supports("avx512bf16");
}
// AMX bf16 tiles (TDPBF16PS). Linux hands out the tile state only to a
// process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once
// here; a refusal leaves the copy unavailable, so dispatch falls back).
inline bool amx_bf16() {
#if defined(__linux__)
  // -1: not asked yet. Racing first callers each ask; the answer is the same.
  // (No function-local static with an initializer: the harness links no C++ runtime.)
  static int granted = -1;
  int state = __atomic_load_n(&granted, __ATOMIC_ACQUIRE);
  if (state < 0) {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, fpu/xstate.h
    state = avx512bf16() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
        syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    __atomic_store_n(&granted, state, __ATOMIC_RELEASE);
  }
  return state == 1;
#else
  return false;
#endif
}
// Integer dot products of unsigned with signed bytes (vpdpbusd).
inline bool avx512vnni() {
  return avx512() && __builtin_cpu_supports("avx512vnni");
}
// The same dot products VEX-encoded on ymm (AVX-VNNI): CPUID.(EAX=7,
// ECX=1):EAX bit 4, read directly (older compilers' __builtin_cpu_supports
// lack the name); avx2() has checked that the OS saves the YMM state.
inline bool avx_vnni() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return avx2() && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1u) != 0;
}
#endif

#if defined(__aarch64__)
#if defined(__linux__)
// Bits of the kernel's AT_HWCAP / AT_HWCAP2 (asm/hwcap.h), spelled out for
// older C libraries whose headers lack them.
inline constexpr unsigned long kHwcapAsimdDp = 1ul << 20;   // HWCAP_ASIMDDP
inline constexpr unsigned long kHwcapAsimdFhm = 1ul << 23;  // HWCAP_ASIMDFHM
inline constexpr unsigned long kHwcap2I8mm = 1ul << 13;     // HWCAP2_I8MM
inline constexpr unsigned long kHwcap2Bf16 = 1ul << 14;     // HWCAP2_BF16
// FEAT_DotProd: SDOT / UDOT.
inline bool neon_dotprod() {
  return (getauxval(AT_HWCAP) & kHwcapAsimdDp) != 0;
}
inline bool neon_fhm() {
  return (getauxval(AT_HWCAP) & kHwcapAsimdFhm) != 0;
}
inline bool neon_bf16() {
  return (getauxval(AT_HWCAP2) & kHwcap2Bf16) != 0;
}
// FEAT_I8MM: SMMLA / UMMLA / USMMLA, USDOT.
inline bool neon_i8mm() {
  return (getauxval(AT_HWCAP2) & kHwcap2I8mm) != 0;
}
#elif defined(__APPLE__)
// Apple's "Determining instruction set characteristics" names; a name the
// kernel does not know reads as absent.
inline bool sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof value;
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
inline bool neon_dotprod() {
  return sysctl_flag("hw.optional.arm.FEAT_DotProd");
}
inline bool neon_fhm() {
  return sysctl_flag("hw.optional.arm.FEAT_FHM");
}
inline bool neon_bf16() {
  return sysctl_flag("hw.optional.arm.FEAT_BF16");
}
inline bool neon_i8mm() {
  return sysctl_flag("hw.optional.arm.FEAT_I8MM");
}
#else
inline bool neon_dotprod() {
  return false;
}
inline bool neon_fhm() {
  return false;
}
inline bool neon_bf16() {
  return false;
}
inline bool neon_i8mm() {
  return false;
}
#endif
// The neonbf16 copy multiplies float16 natively too (FMLAL), so it needs both.
inline bool neon_bf16_and_fhm() {
  return neon_bf16() && neon_fhm();
}
// The neoni8mm copy is compiled for FEAT_DotProd too (every I8MM core has it).
inline bool neon_i8mm_and_dotprod() {
  return neon_i8mm() && neon_dotprod();
}
#endif

}  // namespace mlx_attn::cpu::features
