// dtype conversion through the library's own load/store: the one place their rounding is
// exposed directly, so tests can check it exhaustively against torch's conversions.
#include "common.h"

namespace spore {
namespace {

template <typename From, typename To>
void convert(const void* src, void* dst, int64_t n, int32_t threads) {
    const auto* s = in<From>(src);
    auto* d = out<To>(dst);
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = To::store(From::load(s[i]));
}

}  // namespace
}  // namespace spore

// dst[i] = src[i] converted from src_dtype to dst_dtype (via fp32; rounding to nearest even).
SPORE_EXPORT int32_t spore_convert(const void* src, int32_t src_dtype, void* dst,
                                   int32_t dst_dtype, int64_t n, int32_t threads) {
    if (!src || !dst || n < 0 || threads < 1) return spore::BAD_ARGUMENT;
    int32_t inner = spore::OK;
    const int32_t outer = spore::with_dtype(src_dtype, [&](auto from) {
        inner = spore::with_dtype(dst_dtype, [&](auto to) {
            spore::convert<decltype(from), decltype(to)>(src, dst, n, threads);
        });
    });
    return outer != spore::OK ? outer : inner;
}
