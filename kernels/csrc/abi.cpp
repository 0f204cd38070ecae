// Library identity: the ABI version the Python side checks, and the CPU level that picks a build.
#include "common.h"

SPORE_EXPORT int32_t spore_abi_version() { return 2; }

// 4 when this CPU runs x86-64-v4 code (AVX-512), 3 for x86-64-v3 (AVX2, FMA, F16C), else 1.
SPORE_EXPORT int32_t spore_cpu_level() {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
#endif
    return 1;
}
