// What this CPU can run, read from CPUID at run time (the build's -march=native flags say what the compiler may
// emit everywhere; the AVX512_BF16 and AMX kernels are compiled with target attributes and chosen here instead, so
// one build serves a CPU whether or not it has them).
#pragma once

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define KVFLOW_X86_TARGETS 1  // the compiler knows the avx512bf16 and amx-* targets
#include <cpuid.h>
#include <immintrin.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace kvflow {

// CPUID leaf 7, sub-leaf `sub`: {eax, ebx, ecx, edx}, zeros where the leaf does not exist.
struct CpuidLeaf7 {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  explicit CpuidLeaf7(unsigned sub) {
#ifdef KVFLOW_X86_TARGETS
    if (!__get_cpuid_count(7, sub, &eax, &ebx, &ecx, &edx)) eax = ebx = ecx = edx = 0;
#else
    (void)sub;
#endif
  }
};

// CPUID leaf 0's vendor string is "AuthenticAMD".
inline bool cpu_is_amd() {
  static const bool amd = [] {
#ifdef KVFLOW_X86_TARGETS
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    return ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "Auth" "enti" "cAMD"
#else
    return false;
#endif
  }();
  return amd;
}

// vdpbf16ps (AVX512_BF16: CPUID.(7, 1):EAX bit 5), with the AVX-512 the kernels around it need.
inline bool cpu_has_avx512_bf16() {
  static const bool present = (CpuidLeaf7(1).eax >> 5 & 1) && (CpuidLeaf7(0).ebx >> 16 & 1);
  return present;
}

// AMX_BF16, AMX_TILE and AMX_INT8 (CPUID.(7, 0):EDX bits 22, 24, 25) and the kernel's permission for this
// process to use the tile data state (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), asked
// once; without it the first tile instruction would fault.
inline bool amx_usable() {
  static const bool usable = [] {
#if defined(KVFLOW_X86_TARGETS) && defined(__linux__)
    const unsigned edx = CpuidLeaf7(0).edx;
    if (!((edx >> 22 & 1) && (edx >> 24 & 1) && (edx >> 25 & 1))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

}  // namespace kvflow
