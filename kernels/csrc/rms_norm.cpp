// rms_norm forward and backward: fp32 accumulation, one rounding per output. The forward's row
// routine (rms_norm_row) and the backward (rms_norm_backward), declared in rms_norm.h, also
// serve add_rms_norm. Long sums spill from fp32 into fp64 (common.h: Lanes, spill_columns).
#include <omp.h>

#include <algorithm>

#include "common.h"
#include "rms_norm.h"

namespace spore {

// Not inlined: both exports run this one compiled routine, whatever their surrounding loops.
template <typename T>
__attribute__((noinline)) void rms_norm_row(const typename T::storage* x, const float* w,
                                            typename T::storage* y, int64_t cols, float eps) {
    Lanes sq;
    const int64_t full = cols - cols % LANES;
    for (int64_t b0 = 0; b0 < full; b0 += SPILL) {
        const int64_t b1 = std::min(b0 + SPILL, full);
        for (int64_t c0 = b0; c0 < b1; c0 += LANES) {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) {
                const float v = T::load(x[c0 + l]);
                sq.part[l] += v * v;
            }
        }
        if (b1 < full) sq.spill();
    }
    for (int64_t c = full; c < cols; ++c) {
        const float v = T::load(x[c]);
        sq.part[c - full] += v * v;
    }
    const float rstd = 1.0f / std::sqrt(sq.sum() / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) y[c] = T::store(T::load(x[c]) * rstd * w[c]);
}

template void rms_norm_row<F32>(const float*, const float*, float*, int64_t, float);
template void rms_norm_row<BF16>(const uint16_t*, const float*, uint16_t*, int64_t, float);
template void rms_norm_row<F16>(const uint16_t*, const float*, uint16_t*, int64_t, float);

namespace {

template <typename T>
void rms_norm_fwd(const void* xp, const void* wp, void* yp, int64_t rows, int64_t cols, float eps,
                  int32_t threads) {
    const auto* x = in<T>(xp);
    std::vector<float> wbuf;
    const float* w = as_f32<T>(wp, cols, wbuf);
    auto* y = out<T>(yp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row<T>(x + r * cols, w, y + r * cols, cols, eps);
}

constexpr int64_t GROUP = 4;  // rows per fused gradient pass (their rows stay in L2)

// rstd and k = rstd * mean(g*w*shat) = rstd^2 * mean(g*w*s) of one row (shat = s * rstd).
struct RowGrad {
    float rstd, k;
};

template <typename T>
inline RowGrad row_grad(const typename T::storage* gr, const typename T::storage* sr,
                        const float* w, int64_t cols, float eps) {
    Lanes sq, dot;
    const int64_t full = cols - cols % LANES;
    for (int64_t b0 = 0; b0 < full; b0 += SPILL) {
        const int64_t b1 = std::min(b0 + SPILL, full);
        for (int64_t c0 = b0; c0 < b1; c0 += LANES) {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) {
                const float sv = T::load(sr[c0 + l]);
                sq.part[l] += sv * sv;
                dot.part[l] += T::load(gr[c0 + l]) * w[c0 + l] * sv;
            }
        }
        if (b1 < full) {
            sq.spill();
            dot.spill();
        }
    }
    for (int64_t c = full; c < cols; ++c) {
        const float sv = T::load(sr[c]);
        sq.part[c - full] += sv * sv;
        dot.part[c - full] += T::load(gr[c]) * w[c] * sv;
    }
    const float n = static_cast<float>(cols);
    const float rstd = 1.0f / std::sqrt(sq.sum() / n + eps);
    // ds = rstd * (g*w - s*k): k times s, never rstd^3 or rstd^2 times s, which overflow for
    // tiny rows (rstd ~ 1e20) where ds is finite
    return {rstd, rstd * (rstd * (dot.sum() / n))};
}

// ds for N consecutive rows in one pass over the columns; their dw contributions are summed
// before they are added to the accumulator. The row loop is unrolled on request (4 = GROUP):
// GCC's own limit left it rolled for fp16 with gs (the conversions make the body long), and a
// rolled inner loop kept the column loop scalar (15x slower than bf16).
template <typename T, bool HasGs, int N>
inline void grad_rows(const typename T::storage* g, const typename T::storage* gs,
                      const typename T::storage* s, typename T::storage* ds, const float* w,
                      const RowGrad* st, float* acc, int64_t cols) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
        float sum_w = 0.0f;
#pragma GCC unroll 4
        for (int i = 0; i < N; ++i) {
            const float sv = T::load(s[i * cols + c]);
            const float gv = T::load(g[i * cols + c]);
            float d = st[i].rstd * (gv * w[c] - sv * st[i].k);
            if constexpr (HasGs) d += T::load(gs[i * cols + c]);
            ds[i * cols + c] = T::store(d);
            sum_w += gv * sv * st[i].rstd;
        }
        acc[c] += sum_w;
    }
}

// The one RMS backward (rms_norm's, and add_rms_norm's at its sum s with gs):
// ds = rstd * (g*w - shat * mean(g*w*shat)) + gs,  dw = sum over rows of g * shat,
// shat = s * rstd, rstd recomputed from s; gs (the gradient flowing into add_rms_norm's sum
// output) may be absent (zero). Per-thread dw partials, summed at the end.
template <typename T, bool HasGs>
void rms_norm_bwd(const void* gp, const void* gsp, const void* sp, const void* wp, void* dsp,
                      void* dwp, int64_t rows, int64_t cols, float eps, int32_t threads) {
    const auto* g = in<T>(gp);
    const auto* gs = in<T>(gsp);
    const auto* s = in<T>(sp);
    std::vector<float> wbuf;
    const float* w = as_f32<T>(wp, cols, wbuf);
    auto* ds = out<T>(dsp);
    std::vector<float> partial(static_cast<size_t>(threads) * cols, 0.0f);
    std::vector<double> wide(static_cast<size_t>(threads) * cols, 0.0);
    const int64_t groups = (rows + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(threads)
    {
        const int64_t at_thread = static_cast<int64_t>(omp_get_thread_num()) * cols;
        float* acc = partial.data() + at_thread;
        int64_t since = 0;  // groups added into acc since its last spill
#pragma omp for schedule(static)
        for (int64_t group = 0; group < groups; ++group) {
            if (++since * GROUP > SPILL_ROWS) {
                spill_columns(acc, wide.data() + at_thread, cols);
                since = 1;
            }
            const int64_t r0 = group * GROUP, count = std::min(GROUP, rows - r0);
            RowGrad st[GROUP];
            for (int64_t i = 0; i < count; ++i) {
                const int64_t at = (r0 + i) * cols;
                st[i] = row_grad<T>(g + at, s + at, w, cols, eps);
            }
            const int64_t at = r0 * cols;
            const auto* gs_at = HasGs ? gs + at : nullptr;
            if (count == GROUP) {
                grad_rows<T, HasGs, GROUP>(g + at, gs_at, s + at, ds + at, w, st, acc, cols);
            } else {
                for (int64_t i = 0; i < count; ++i) {
                    const int64_t ai = at + i * cols;
                    const auto* gs_ai = HasGs ? gs + ai : nullptr;
                    grad_rows<T, HasGs, 1>(g + ai, gs_ai, s + ai, ds + ai, w, st + i, acc, cols);
                }
            }
        }
        spill_columns(acc, wide.data() + at_thread, cols);
    }
    auto* dw = out<T>(dwp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < cols; ++c) {
        double total = 0.0;
        for (int32_t t = 0; t < threads; ++t) total += wide[static_cast<int64_t>(t) * cols + c];
        dw[c] = T::store(static_cast<float>(total));
    }
}

}  // namespace

int32_t rms_norm_backward(const void* g, const void* gs, const void* s, const void* w, void* ds,
                          void* dw, int64_t rows, int64_t cols, float eps, int32_t dtype,
                          int32_t threads) {
    return with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        if (gs) {
            rms_norm_bwd<T, true>(g, gs, s, w, ds, dw, rows, cols, eps, threads);
        } else {
            rms_norm_bwd<T, false>(g, gs, s, w, ds, dw, rows, cols, eps, threads);
        }
    });
}

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
    return spore::rms_norm_backward(g, nullptr, x, w, dx, dw, rows, cols, eps, dtype, threads);
}
