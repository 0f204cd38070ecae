// Library identity: the ABI version the Python side checks, and the ISA this copy was built for.
#include "common.h"

#ifndef SPORE_ISA
#define SPORE_ISA "base"
#endif

SPORE_EXPORT int32_t spore_abi_version() { return 2; }

SPORE_EXPORT const char* spore_isa() { return SPORE_ISA; }

// 4 when this CPU runs x86-64-v4 code (AVX-512), 3 for x86-64-v3 (AVX2, FMA, F16C), else 1.
SPORE_EXPORT int32_t spore_cpu_level() {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
#endif
    return 1;
}
