// Rotary position embedding, forward and backward: fp32 arithmetic, one rounding per output.
//
// x is contiguous [rows, dim]; row r uses row t(r) of the cos and sin tables, where r is read as
// (outer, middle, inner) indices and t(r) = outer * t_outer + middle * t_middle + inner * t_inner
// (a stride of 0 broadcasts the table over that index). Pairs are (k, k + dim/2) in "half" mode
// and (2k, 2k + 1) in "interleaved" mode; a table row has dim entries (one per element) or
// dim/2 (one per pair). For pair (i, j): y_i = x_i c_i - x_j s_i, y_j = x_j c_j + x_i s_j.
// The backward is the transpose: dx_i = g_i c_i + g_j s_j, dx_j = g_j c_j - g_i s_i.
#include <omp.h>

#include <algorithm>

#include "common.h"

namespace spore {
namespace {

inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

struct TableLayout {
    int64_t outer, middle, inner;        // rows = outer * middle * inner
    int64_t t_outer, t_middle, t_inner;  // table rows per step of each index
};

template <typename T, typename TT, bool Interleaved, bool HalfTable, bool Transpose>
void rope_rows(const void* xp, const void* cp, const void* sp, void* yp, int64_t rows,
               int64_t dim, TableLayout lay, int32_t threads) {
    const auto* x = in<T>(xp);
    const auto* cos = in<TT>(cp);
    const auto* sin = in<TT>(sp);
    auto* y = out<T>(yp);
    if (rows == 0) return;
    const int64_t half = dim / 2;
    const int64_t tcols = HalfTable ? half : dim;
    constexpr int64_t grain = 1 << 14;  // elements per thread worth a fork
    const int64_t useful =
        std::max<int64_t>(1, std::min<int64_t>(threads, std::min(rows, rows * dim / grain)));
#pragma omp parallel num_threads(static_cast<int>(useful))
    {
        const int64_t nt = omp_get_num_threads();
        const int64_t chunk = (rows + nt - 1) / nt;
        const int64_t begin = std::min(rows, omp_get_thread_num() * chunk);
        const int64_t end = std::min(rows, begin + chunk);
        int64_t i = begin % lay.inner;
        int64_t m = (begin / lay.inner) % lay.middle;
        int64_t o = begin / (lay.inner * lay.middle);
        for (int64_t r = begin; r < end; ++r) {
            const int64_t t = o * lay.t_outer + m * lay.t_middle + i * lay.t_inner;
            const auto* c = cos + t * tcols;
            const auto* s = sin + t * tcols;
            const auto* xr = x + r * dim;
            auto* yr = y + r * dim;
#pragma omp simd
            for (int64_t k = 0; k < half; ++k) {
                const int64_t k1 = Interleaved ? 2 * k : k;
                const int64_t k2 = Interleaved ? 2 * k + 1 : k + half;
                const int64_t t1 = HalfTable ? k : k1;
                const int64_t t2 = HalfTable ? k : k2;
                const float x1 = T::load(xr[k1]);
                const float x2 = T::load(xr[k2]);
                const float s1 = Transpose ? -TT::load(s[t2]) : TT::load(s[t1]);
                const float s2 = Transpose ? -TT::load(s[t1]) : TT::load(s[t2]);
                yr[k1] = T::store(mul_add(x1, TT::load(c[t1]), -x2 * s1));
                yr[k2] = T::store(mul_add(x2, TT::load(c[t2]), x1 * s2));
            }
            if (++i == lay.inner) {
                i = 0;
                if (++m == lay.middle) {
                    m = 0;
                    ++o;
                }
            }
        }
    }
}

template <typename T, typename TT>
void rope_dispatch(const void* x, const void* c, const void* s, void* y, int64_t rows,
                   int64_t dim, TableLayout lay, bool interleaved, bool half_table,
                   bool transpose, int32_t threads) {
    const int variant = (interleaved ? 4 : 0) | (half_table ? 2 : 0) | (transpose ? 1 : 0);
    switch (variant) {
        case 0:
            return rope_rows<T, TT, false, false, false>(x, c, s, y, rows, dim, lay, threads);
        case 1:
            return rope_rows<T, TT, false, false, true>(x, c, s, y, rows, dim, lay, threads);
        case 2:
            return rope_rows<T, TT, false, true, false>(x, c, s, y, rows, dim, lay, threads);
        case 3:
            return rope_rows<T, TT, false, true, true>(x, c, s, y, rows, dim, lay, threads);
        case 4:
            return rope_rows<T, TT, true, false, false>(x, c, s, y, rows, dim, lay, threads);
        case 5:
            return rope_rows<T, TT, true, false, true>(x, c, s, y, rows, dim, lay, threads);
        case 6:
            return rope_rows<T, TT, true, true, false>(x, c, s, y, rows, dim, lay, threads);
        default:
            return rope_rows<T, TT, true, true, true>(x, c, s, y, rows, dim, lay, threads);
    }
}

}  // namespace
}  // namespace spore

// y = rope(x) (transpose 0) or its transpose applied to x (transpose 1: the backward, x = grad).
// x, y: contiguous [rows, dim] of `dtype`; cos, sin: contiguous tables of `table_dtype` (x's
// dtype or float32) with dim / 2 (half_table 1) or dim columns, indexed as described above.
SPORE_EXPORT int32_t spore_rope(const void* x, const void* cos, const void* sin, void* y,
                                int64_t rows, int64_t dim, int64_t outer, int64_t middle,
                                int64_t inner, int64_t t_outer, int64_t t_middle, int64_t t_inner,
                                int32_t interleaved, int32_t half_table, int32_t transpose,
                                int32_t dtype, int32_t table_dtype, int32_t threads) {
    const auto is_flag = [](int32_t v) { return v == 0 || v == 1; };
    if (!x || !cos || !sin || !y || rows < 0 || dim <= 0 || dim % 2 != 0 || outer < 0 ||
        middle < 0 || inner < 0 || outer * middle * inner != rows || t_outer < 0 ||
        t_middle < 0 || t_inner < 0 || threads < 1 || !is_flag(interleaved) ||
        !is_flag(half_table) || !is_flag(transpose)) {
        return spore::BAD_ARGUMENT;
    }
    if (table_dtype != dtype && table_dtype != spore::DT_F32) return spore::BAD_DTYPE;
    const spore::TableLayout lay{outer, middle, inner, t_outer, t_middle, t_inner};
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        if (table_dtype == spore::DT_F32) {
            spore::rope_dispatch<T, spore::F32>(x, cos, sin, y, rows, dim, lay, interleaved,
                                                half_table, transpose, threads);
        } else {
            spore::rope_dispatch<T, T>(x, cos, sin, y, rows, dim, lay, interleaved, half_table,
                                       transpose, threads);
        }
    });
}
