// rms_norm forward and backward: fp32 accumulation, one rounding per output.
#include <omp.h>

#include "common.h"

namespace spore {
namespace {

template <typename T>
void rms_norm_fwd(const void* xp, const void* wp, void* yp, int64_t rows, int64_t cols, float eps,
                  int32_t threads) {
    const auto* x = in<T>(xp);
    const auto* w = in<T>(wp);
    auto* y = out<T>(yp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const auto* xr = x + r * cols;
        auto* yr = y + r * cols;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; ++c) {
            const float v = T::load(xr[c]);
            sum += v * v;
        }
        const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) yr[c] = T::store(T::load(xr[c]) * rstd * T::load(w[c]));
    }
}

// dx = rstd * (g*w - xhat * mean(g*w*xhat)),  dw = sum over rows of g * xhat,  xhat = x * rstd.
// rstd is recomputed from x in the same pass as the dot product (nothing saved by forward).
template <typename T>
void rms_norm_bwd(const void* gp, const void* xp, const void* wp, void* dxp, void* dwp,
                  int64_t rows, int64_t cols, float eps, int32_t threads) {
    const auto* g = in<T>(gp);
    const auto* x = in<T>(xp);
    const auto* w = in<T>(wp);
    auto* dx = out<T>(dxp);
    std::vector<float> partial(static_cast<size_t>(threads) * cols, 0.0f);
#pragma omp parallel num_threads(threads)
    {
        float* acc = partial.data() + static_cast<int64_t>(omp_get_thread_num()) * cols;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const auto* gr = g + r * cols;
            const auto* xr = x + r * cols;
            auto* dxr = dx + r * cols;
            float sum = 0.0f, dot = 0.0f;
#pragma omp simd reduction(+ : sum, dot)
            for (int64_t c = 0; c < cols; ++c) {
                const float xv = T::load(xr[c]);
                sum += xv * xv;
                dot += T::load(gr[c]) * T::load(w[c]) * xv;
            }
            const float n = static_cast<float>(cols);
            const float rstd = 1.0f / std::sqrt(sum / n + eps);
            const float k = rstd * rstd * rstd * dot / n;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) {
                const float xv = T::load(xr[c]);
                const float gv = T::load(gr[c]);
                dxr[c] = T::store(rstd * gv * T::load(w[c]) - k * xv);
                acc[c] += gv * xv * rstd;
            }
        }
    }
    auto* dw = out<T>(dwp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < cols; ++c) {
        float total = 0.0f;
        for (int32_t t = 0; t < threads; ++t) total += partial[static_cast<int64_t>(t) * cols + c];
        dw[c] = T::store(total);
    }
}

}  // namespace
}  // namespace spore

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, in fp32, rounded once to the dtype.
// x, y: contiguous [rows, cols]; w: contiguous [cols]; all of `dtype`.
SPORE_EXPORT int32_t spore_rms_norm(const void* x, const void* w, void* y, int64_t rows,
                                    int64_t cols, float eps, int32_t dtype, int32_t threads) {
    if (!x || !w || !y || rows < 0 || cols <= 0 || threads < 1) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        spore::rms_norm_fwd<decltype(t)>(x, w, y, rows, cols, eps, threads);
    });
}

// Gradients of spore_rms_norm for upstream g: dx [rows, cols] and dw [cols], all of `dtype`.
SPORE_EXPORT int32_t spore_rms_norm_backward(const void* g, const void* x, const void* w, void* dx,
                                             void* dw, int64_t rows, int64_t cols, float eps,
                                             int32_t dtype, int32_t threads) {
    if (!g || !x || !w || !dx || !dw || rows < 0 || cols <= 0 || threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        spore::rms_norm_bwd<decltype(t)>(g, x, w, dx, dw, rows, cols, eps, threads);
    });
}
