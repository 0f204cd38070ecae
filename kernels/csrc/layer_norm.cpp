// layer_norm over the last dimension, forward and backward. Statistics are fp32 and two-pass
// per row (a first mean, then the deviations from it and their squares; the row is in cache for
// the second pass), the mean kept as that first mean plus the mean deviation from it (see
// Centre); one rounding per output; long sums spill from fp32 into fp64 (common.h: Lanes,
// spill_columns). weight and bias are optional (null: 1 and 0).
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "common.h"

namespace spore {
namespace {

// A row's mean as shift + offset: shift is a first fp32 mean of the row, offset the mean of
// x - shift. Whatever the values, x - shift is then of the size of the spread, so neither the
// second pass's sums nor x - mean (whose fp32 mean would be off by up to half an ulp of its
// magnitude) loses accuracy to the mean's magnitude or to one large value: x is centred as
// (x - shift) - offset.
struct Centre {
    float shift, offset;
    float of(float v) const { return (v - shift) - offset; }
};

// The first mean: the sum of x / cols (each term scaled, so that the sum cannot overflow).
template <typename T>
inline float row_shift(const typename T::storage* xr, int64_t cols) {
    const float scale = 1.0f / static_cast<float>(cols);
    float acc[LANES] = {};
    int64_t c0 = 0;
    for (; c0 + LANES <= cols; c0 += LANES) {
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) acc[l] += T::load(xr[c0 + l]) * scale;
    }
    for (int64_t c = c0; c < cols; ++c) acc[c - c0] += T::load(xr[c]) * scale;
    return fold(acc);
}

struct RowStats {
    Centre centre;
    float rstd;
};

// The variance is the mean square of x - shift less the square of offset, their mean: offset
// is small against the spread (shift is already a mean), so the difference loses nothing.
template <typename T>
inline RowStats row_stats(const typename T::storage* xr, int64_t cols, float eps) {
    const float shift = row_shift<T>(xr, cols);
    Lanes sum, sq;
    const int64_t full = cols - cols % LANES;
    for (int64_t b0 = 0; b0 < full; b0 += SPILL) {
        const int64_t b1 = std::min(b0 + SPILL, full);
        for (int64_t c0 = b0; c0 < b1; c0 += LANES) {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) {
                const float d = T::load(xr[c0 + l]) - shift;
                sum.part[l] += d;
                sq.part[l] += d * d;
            }
        }
        if (b1 < full) {
            sum.spill();
            sq.spill();
        }
    }
    for (int64_t c = full; c < cols; ++c) {
        const float d = T::load(xr[c]) - shift;
        sum.part[c - full] += d;
        sq.part[c - full] += d * d;
    }
    const float n = static_cast<float>(cols);
    const float offset = sum.sum() / n;
    const float var = std::max(sq.sum() / n - offset * offset, 0.0f);
    return {{shift, offset}, 1.0f / std::sqrt(var + eps)};
}

template <typename T, bool HasW, bool HasB>
void layer_norm_fwd(const void* xp, const void* wp, const void* bp, void* yp, int64_t rows,
                    int64_t cols, float eps, int32_t threads) {
    const auto* x = in<T>(xp);
    std::vector<float> wbuf, bbuf;
    const float* w = HasW ? as_f32<T>(wp, cols, wbuf) : nullptr;
    const float* b = HasB ? as_f32<T>(bp, cols, bbuf) : nullptr;
    auto* y = out<T>(yp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const auto* xr = x + r * cols;
        auto* yr = y + r * cols;
        const RowStats st = row_stats<T>(xr, cols, eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
            float v = st.centre.of(T::load(xr[c])) * st.rstd;
            if constexpr (HasW) v *= w[c];
            if constexpr (HasB) v += b[c];
            yr[c] = T::store(v);
        }
    }
}

// Per-row quantities of the backward: xhat = (x - mean) * rstd, gw = g * w,
// dx = rstd * (gw - mean_gw - xhat * k) with k = mean(gw * xhat).
struct RowGrad {
    Centre centre;
    float rstd, mean_gw, k;
};

template <typename T, bool HasW>
inline RowGrad row_grad(const typename T::storage* gr, const typename T::storage* xr,
                        const float* w, int64_t cols, float eps) {
    const float n = static_cast<float>(cols);
    const float shift = row_shift<T>(xr, cols);
    Lanes sum, sq, sum_gw, dot;
    const int64_t full = cols - cols % LANES;
    for (int64_t b0 = 0; b0 < full; b0 += SPILL) {
        const int64_t b1 = std::min(b0 + SPILL, full);
        for (int64_t c0 = b0; c0 < b1; c0 += LANES) {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) {
                const float d = T::load(xr[c0 + l]) - shift;
                float gw = T::load(gr[c0 + l]);
                if constexpr (HasW) gw *= w[c0 + l];
                sum.part[l] += d;
                sq.part[l] += d * d;
                sum_gw.part[l] += gw;
                dot.part[l] += gw * d;
            }
        }
        if (b1 < full) {
            sum.spill();
            sq.spill();
            sum_gw.spill();
            dot.spill();
        }
    }
    for (int64_t c = full; c < cols; ++c) {
        const float d = T::load(xr[c]) - shift;
        float gw = T::load(gr[c]);
        if constexpr (HasW) gw *= w[c];
        sum.part[c - full] += d;
        sq.part[c - full] += d * d;
        sum_gw.part[c - full] += gw;
        dot.part[c - full] += gw * d;
    }
    const float offset = sum.sum() / n;
    const float var = std::max(sq.sum() / n - offset * offset, 0.0f);
    const float rstd = 1.0f / std::sqrt(var + eps);
    const float total_gw = sum_gw.sum();
    // sum of gw * (d - offset) = sum of gw * d - offset * sum of gw
    const float k = (dot.sum() - offset * total_gw) * rstd / n;
    return {{shift, offset}, rstd, total_gw / n, k};
}

// dx for N consecutive rows (their statistics in st) in one pass over the columns, with their
// dw and db contributions summed before they are added to the accumulators (fewer loads and
// stores of acc_w and acc_b per row).
template <typename T, bool HasW, bool NeedDw, bool NeedDb, int N>
inline void grad_rows(const typename T::storage* g, const typename T::storage* x,
                      typename T::storage* dx, const float* w, const RowGrad* st, float* acc_w,
                      float* acc_b, int64_t cols) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
        float sum_w = 0.0f, sum_b = 0.0f;
        for (int i = 0; i < N; ++i) {
            const float gv = T::load(g[i * cols + c]);
            const float xhat = st[i].centre.of(T::load(x[i * cols + c])) * st[i].rstd;
            float gw = gv;
            if constexpr (HasW) gw *= w[c];
            dx[i * cols + c] = T::store(st[i].rstd * (gw - st[i].mean_gw - xhat * st[i].k));
            sum_w += gv * xhat;
            sum_b += gv;
        }
        if constexpr (NeedDw) acc_w[c] += sum_w;
        if constexpr (NeedDb) acc_b[c] += sum_b;
    }
}

constexpr int64_t GROUP = 4;  // rows per fused gradient pass (their rows stay in L2)

// dw = sum of g * xhat, db = sum of g; per-thread column partials, summed at the end.
template <typename T, bool HasW, bool NeedDw, bool NeedDb>
void layer_norm_bwd(const void* gp, const void* xp, const void* wp, void* dxp, void* dwp,
                    void* dbp, int64_t rows, int64_t cols, float eps, int32_t threads) {
    const auto* g = in<T>(gp);
    const auto* x = in<T>(xp);
    std::vector<float> wbuf;
    const float* w = HasW ? as_f32<T>(wp, cols, wbuf) : nullptr;
    auto* dx = out<T>(dxp);
    const int64_t slots = (NeedDw ? cols : 0) + (NeedDb ? cols : 0);
    std::vector<float> partial(static_cast<size_t>(threads) * slots, 0.0f);
    std::vector<double> wide(static_cast<size_t>(threads) * slots, 0.0);
    const int64_t groups = (rows + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(threads)
    {
        const int64_t at_thread = static_cast<int64_t>(omp_get_thread_num()) * slots;
        float* acc_w = partial.data() + at_thread;
        float* acc_b = acc_w + (NeedDw ? cols : 0);
        int64_t since = 0;  // groups added into the accumulators since their last spill
#pragma omp for schedule(static)
        for (int64_t group = 0; group < groups; ++group) {
            if (++since * GROUP > SPILL_ROWS) {
                spill_columns(acc_w, wide.data() + at_thread, slots);
                since = 1;
            }
            const int64_t r0 = group * GROUP, count = std::min(GROUP, rows - r0);
            RowGrad st[GROUP];
            for (int64_t i = 0; i < count; ++i) {
                const int64_t at = (r0 + i) * cols;
                st[i] = row_grad<T, HasW>(g + at, x + at, w, cols, eps);
            }
            const int64_t at = r0 * cols;
            if (count == GROUP) {
                grad_rows<T, HasW, NeedDw, NeedDb, GROUP>(g + at, x + at, dx + at, w, st, acc_w,
                                                          acc_b, cols);
            } else {
                for (int64_t i = 0; i < count; ++i) {
                    const int64_t ai = at + i * cols;
                    grad_rows<T, HasW, NeedDw, NeedDb, 1>(g + ai, x + ai, dx + ai, w, st + i,
                                                          acc_w, acc_b, cols);
                }
            }
        }
        spill_columns(acc_w, wide.data() + at_thread, slots);
    }
    if (slots == 0) return;
    auto* dw = out<T>(dwp);
    auto* db = out<T>(dbp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < cols; ++c) {
        double total_w = 0.0, total_b = 0.0;
        for (int32_t t = 0; t < threads; ++t) {
            const double* acc = wide.data() + static_cast<int64_t>(t) * slots;
            if constexpr (NeedDw) total_w += acc[c];
            if constexpr (NeedDb) total_b += acc[(NeedDw ? cols : 0) + c];
        }
        if constexpr (NeedDw) dw[c] = T::store(static_cast<float>(total_w));
        if constexpr (NeedDb) db[c] = T::store(static_cast<float>(total_b));
    }
}

// Calls fn(std::bool_constant<a>{}, std::bool_constant<b>{}) for runtime flags a and b.
template <typename Fn>
void with_flags(bool a, bool b, Fn&& fn) {
    if (a && b) {
        fn(std::true_type{}, std::true_type{});
    } else if (a) {
        fn(std::true_type{}, std::false_type{});
    } else if (b) {
        fn(std::false_type{}, std::true_type{});
    } else {
        fn(std::false_type{}, std::false_type{});
    }
}

}  // namespace
}  // namespace spore

// y[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b (biased variance), fp32, rounded once.
// x, y: contiguous [rows, cols]; w, b: contiguous [cols] or null (no weight / no bias); all of
// `dtype`.
SPORE_EXPORT int32_t spore_layer_norm(const void* x, const void* w, const void* b, void* y,
                                      int64_t rows, int64_t cols, float eps, int32_t dtype,
                                      int32_t threads) {
    if (!x || !y || rows < 0 || cols <= 0 || threads < 1) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        spore::with_flags(w != nullptr, b != nullptr, [&](auto has_w, auto has_b) {
            spore::layer_norm_fwd<decltype(t), has_w(), has_b()>(x, w, b, y, rows, cols, eps,
                                                                 threads);
        });
    });
}

// Gradients of spore_layer_norm for upstream g: dx [rows, cols]; dw [cols] when dw is not null
// (needs w); db [cols] when db is not null. w null means no weight (1). All of `dtype`.
SPORE_EXPORT int32_t spore_layer_norm_backward(const void* g, const void* x, const void* w,
                                               void* dx, void* dw, void* db, int64_t rows,
                                               int64_t cols, float eps, int32_t dtype,
                                               int32_t threads) {
    if (!g || !x || !dx || (dw && !w) || rows < 0 || cols <= 0 || threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        spore::with_flags(dw != nullptr, db != nullptr, [&](auto need_dw, auto need_db) {
            if (w) {
                spore::layer_norm_bwd<T, true, need_dw(), need_db()>(g, x, w, dx, dw, db, rows,
                                                                     cols, eps, threads);
            } else {
                spore::layer_norm_bwd<T, false, false, need_db()>(g, x, w, dx, dw, db, rows,
                                                                  cols, eps, threads);
            }
        });
    });
}
