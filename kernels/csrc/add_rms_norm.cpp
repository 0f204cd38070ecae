// add_rms_norm forward and backward: the residual sum is rounded to the dtype first (it is an
// output), then normalised by rms_norm's own row routine (rms_norm.h), so y is bitwise
// rms_norm(s). The backward is rms_norm's at that sum, plus the gradient of the sum.
#include "common.h"
#include "rms_norm.h"

namespace spore {
namespace {

// Per row: s = round(x + r) is written, then normalised by rms_norm's row routine (the row of s
// is read back from cache).
template <typename T>
void add_rms_norm_fwd(const void* xp, const void* rp, const void* wp, void* yp, void* sp,
                      int64_t rows, int64_t cols, float eps, int32_t threads) {
    const auto* x = in<T>(xp);
    const auto* res = in<T>(rp);
    std::vector<float> wbuf;
    const float* w = as_f32<T>(wp, cols, wbuf);
    auto* y = out<T>(yp);
    auto* s = out<T>(sp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const auto* xr = x + r * cols;
        const auto* rr = res + r * cols;
        auto* sr = s + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) sr[c] = T::store(T::load(xr[c]) + T::load(rr[c]));
        rms_norm_row<T>(sr, w, y + r * cols, cols, eps);
    }
}

}  // namespace
}  // namespace spore

// s = x + r rounded to the dtype; y = s / sqrt(mean(s^2) + eps) * w in fp32, rounded once.
// x, r, y, s: contiguous [rows, cols]; w: contiguous [cols]; all of `dtype`.
SPORE_EXPORT int32_t spore_add_rms_norm(const void* x, const void* r, const void* w, void* y,
                                        void* s, int64_t rows, int64_t cols, float eps,
                                        int32_t dtype, int32_t threads) {
    if (!x || !r || !w || !y || !s || rows < 0 || cols <= 0 || threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        spore::add_rms_norm_fwd<decltype(t)>(x, r, w, y, s, rows, cols, eps, threads);
    });
}

// Gradients of spore_add_rms_norm for upstream g (of y) and gs (of s; null means zero): ds, the
// gradient of both x and r, [rows, cols], and dw [cols]; all of `dtype`.
SPORE_EXPORT int32_t spore_add_rms_norm_backward(const void* g, const void* gs, const void* s,
                                                 const void* w, void* ds, void* dw, int64_t rows,
                                                 int64_t cols, float eps, int32_t dtype,
                                                 int32_t threads) {
    if (!g || !s || !w || !ds || !dw || rows < 0 || cols <= 0 || threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::rms_norm_backward(g, gs, s, w, ds, dw, rows, cols, eps, dtype, threads);
}
