// silu(a) * b, forward and backward: silu_mul, and swiglu (its two halves of one tensor).
// Elementwise, fp32 arithmetic (elementwise.h's sigmoid), one rounding per output.
#include "elementwise.h"

namespace spore {
namespace {

// A [rows, cols] operand: element (r, c) at data[r * stride + c].
template <typename S>
struct Rows {
    S* data;
    int64_t stride;
    S* row(int64_t r) const { return data + r * stride; }
};

// out = silu(a) * b = a sigmoid(a) b.
template <typename T>
void silu_mul_fwd(Rows<const typename T::storage> a, Rows<const typename T::storage> b,
                  Rows<typename T::storage> y, int64_t rows, int64_t cols, int32_t threads) {
    parallel_rows(rows, cols, threads, [&](int64_t r, int64_t c0, int64_t c1) {
        in_fp32<T, 2, 1>({a.row(r) + c0, b.row(r) + c0}, {y.row(r) + c0}, c1 - c0,
                         [](const float* const* in, float* const* out, int64_t m) {
                             const float* av = in[0];
                             const float* bv = in[1];
                             float* yv = out[0];
#pragma omp simd
                             for (int64_t i = 0; i < m; ++i) {
                                 float num, inv, z;
                                 sigmoid_parts(av[i], num, inv, z);
                                 yv[i] = av[i] * num * inv * bv[i];
                             }
                         });
    });
}

// da = g b (s + a s (1 - s)), db = g a s, with s = sigmoid(a).
template <typename T>
void silu_mul_bwd(Rows<const typename T::storage> g, Rows<const typename T::storage> a,
                  Rows<const typename T::storage> b, Rows<typename T::storage> da,
                  Rows<typename T::storage> db, int64_t rows, int64_t cols, int32_t threads) {
    parallel_rows(rows, cols, threads, [&](int64_t r, int64_t c0, int64_t c1) {
        in_fp32<T, 3, 2>({g.row(r) + c0, a.row(r) + c0, b.row(r) + c0},
                         {da.row(r) + c0, db.row(r) + c0}, c1 - c0,
                         [](const float* const* in, float* const* out, int64_t m) {
                             const float* gv = in[0];
                             const float* av = in[1];
                             const float* bv = in[2];
                             float* dav = out[0];
                             float* dbv = out[1];
#pragma omp simd
                             for (int64_t i = 0; i < m; ++i) {
                                 float num, inv, z;
                                 sigmoid_parts(av[i], num, inv, z);
                                 const float s = num * inv;
                                 dav[i] = gv[i] * bv[i] * fmadd(av[i] * z * inv, inv, s);
                                 dbv[i] = gv[i] * av[i] * s;
                             }
                         });
    });
}

}  // namespace
}  // namespace spore

using spore::Rows;

// y = silu(a) * b over n contiguous elements (a, b, y of one shape).
SPORE_EXPORT int32_t spore_silu_mul(const void* a, const void* b, void* y, int64_t n,
                                    int32_t dtype, int32_t threads) {
    if (!a || !b || !y || !spore::valid(n, threads)) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        using S = typename T::storage;
        spore::silu_mul_fwd<T>(Rows<const S>{spore::in<T>(a), n}, Rows<const S>{spore::in<T>(b), n},
                               Rows<S>{spore::out<T>(y), n}, 1, n, threads);
    });
}

// da, db of silu(a) * b for upstream g, all n contiguous elements.
SPORE_EXPORT int32_t spore_silu_mul_backward(const void* g, const void* a, const void* b,
                                             void* da, void* db, int64_t n, int32_t dtype,
                                             int32_t threads) {
    if (!g || !a || !b || !da || !db || !spore::valid(n, threads)) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        using S = typename T::storage;
        spore::silu_mul_bwd<T>(Rows<const S>{spore::in<T>(g), n}, Rows<const S>{spore::in<T>(a), n},
                               Rows<const S>{spore::in<T>(b), n}, Rows<S>{spore::out<T>(da), n},
                               Rows<S>{spore::out<T>(db), n}, 1, n, threads);
    });
}

// x: contiguous [rows, 2 * half]; y: contiguous [rows, half] = silu(x[:, :half]) * x[:, half:].
SPORE_EXPORT int32_t spore_swiglu(const void* x, void* y, int64_t rows, int64_t half,
                                  int32_t dtype, int32_t threads) {
    if (!x || !y || rows < 0 || half <= 0 || threads < 1) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        using S = typename T::storage;
        const S* xs = spore::in<T>(x);
        spore::silu_mul_fwd<T>(Rows<const S>{xs, 2 * half}, Rows<const S>{xs + half, 2 * half},
                               Rows<S>{spore::out<T>(y), half}, rows, half, threads);
    });
}

// dx [rows, 2 * half] of spore_swiglu for upstream g [rows, half]; all contiguous.
SPORE_EXPORT int32_t spore_swiglu_backward(const void* g, const void* x, void* dx, int64_t rows,
                                           int64_t half, int32_t dtype, int32_t threads) {
    if (!g || !x || !dx || rows < 0 || half <= 0 || threads < 1) return spore::BAD_ARGUMENT;
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        using S = typename T::storage;
        const S* xs = spore::in<T>(x);
        S* dxs = spore::out<T>(dx);
        const int64_t w = 2 * half;
        spore::silu_mul_bwd<T>(Rows<const S>{spore::in<T>(g), half}, Rows<const S>{xs, w},
                               Rows<const S>{xs + half, w}, Rows<S>{dxs, w},
                               Rows<S>{dxs + half, w}, rows, half, threads);
    });
}
