// Activations, forward and backward: gelu (erf and tanh forms) and silu(a) * b (silu_mul, and
// swiglu, its two halves of one tensor). Elementwise, fp32 arithmetic, one rounding per output.
//
// The loops call no libm function so that they vectorise: exp is a range reduction
// (x = n ln2 + r) and a polynomial, and erfc comes from the scaled complementary error function
// erfcx(t) = exp(t^2) erfc(t), a polynomial in w = 1 / (t + 3) - 1/6. The polynomials were
// fitted for this file (minimax relative error, coefficients rounded to fp32 one at a time).
// The float32 exact gelu carries the rounding errors of x^2, t + 3 and 1 / (t + 3) (within 4 ulp
// of the true value); the backward takes shorter polynomials. 16-bit gelu forwards look their
// result up in a table of all 65536 inputs, built by the fp32 code.
#include <omp.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "common.h"

// The math below must inline into the loops for them to vectorise.
#define SPORE_MATH inline __attribute__((always_inline))

namespace spore {
namespace {

// a * b + c, fused (one rounding) where the build targets FMA hardware.
SPORE_MATH float fmadd(float a, float b, float c) {
#ifdef __FMA__
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

// Signed views of the bits (exponent arithmetic below is in int32).
SPORE_MATH float as_float(int32_t bits) { return bits_to_float(static_cast<uint32_t>(bits)); }

SPORE_MATH int32_t as_int(float v) { return static_cast<int32_t>(float_to_bits(v)); }

// 2^n for n in [-126, 127].
SPORE_MATH float pow2(int32_t n) { return as_float((n + 127) << 23); }

constexpr float kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo; nf * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer

// Writes a = n ln2 + r with n an integer and |r| <= ln2 / 2 (for |a| < 2^21).
SPORE_MATH void reduce(float a, float& r, int32_t& n) {
    const float shifted = fmadd(a, kLog2e, kRound);
    const float nf = shifted - kRound;
    n = as_int(shifted) - as_int(kRound);
    r = fmadd(nf, -kLn2Lo, fmadd(nf, -kLn2Hi, a));
}

// exp(r) - 1 for |r| <= ln2 / 2, within 4e-9 of exp(r).
SPORE_MATH float expm1_reduced(float r) {
    float p = 1.38204684e-3f;
    p = fmadd(p, r, 8.36925115e-3f);
    p = fmadd(p, r, 4.16682847e-2f);
    p = fmadd(p, r, 1.66665167e-1f);
    p = fmadd(p, r, 4.99999940e-1f);
    return fmadd(p, r * r, r);
}

// exp(r) - 1 for |r| <= ln2 / 2, within 1.2e-7 of exp(r).
SPORE_MATH float expm1_reduced_short(float r) {
    float p = 8.31202976e-3f;
    p = fmadd(p, r, 4.18945551e-2f);
    p = fmadd(p, r, 1.66671336e-1f);
    p = fmadd(p, r, 4.99992013e-1f);
    return fmadd(p, r * r, r);
}

// exp(a) for a <= 0, underflowing to 0 (a NaN gives a finite value: callers multiply by the
// input, which carries the NaN).
SPORE_MATH float exp_nonpositive(float a) {
    a = a > -104.0f ? a : -104.0f;
    float r;
    int32_t n;
    reduce(a, r, n);
    const int32_t half = n >> 1;  // two scalings keep each power of two normal
    const float scale = pow2(half);
    return fmadd(expm1_reduced(r), scale, scale) * pow2(n - half);
}

// 0.5 (t + 3) erfcx(t) as a polynomial in w = 1 / (t + 3) - 1/6 for t in [0, 16 / sqrt 2],
// within 1.7e-8 (w in fp32 is exact for t <= 9: then 1 / (t + 3) is within [1/12, 1/3]).
SPORE_MATH float erfcx_poly(float w) {
    float p = 1809.79297f;
    p = fmadd(p, w, -453.893921f);
    p = fmadd(p, w, -432.350403f);
    p = fmadd(p, w, -27.5066566f);
    p = fmadd(p, w, 104.334969f);
    p = fmadd(p, w, 77.4463882f);
    p = fmadd(p, w, 33.5304680f);
    p = fmadd(p, w, 10.6241322f);
    p = fmadd(p, w, 2.65018344f);
    return fmadd(p, w, 0.537003458f);
}

// As erfcx_poly, within 1.4e-7.
SPORE_MATH float erfcx_poly_short(float w) {
    float p = -411.097809f;
    p = fmadd(p, w, -37.8334732f);
    p = fmadd(p, w, 104.360306f);
    p = fmadd(p, w, 77.5228729f);
    p = fmadd(p, w, 33.5298882f);
    p = fmadd(p, w, 10.6239471f);
    p = fmadd(p, w, 2.65018392f);
    return fmadd(p, w, 0.537003517f);
}

// d log(inv erfcx_poly(inv - 1/6)) / d log(inv) at w = inv - 1/6, within 0.03: turns a relative
// error rho of inv = 1 / (t + 3) into the relative error of the erfc it gives.
SPORE_MATH float erfcx_rho_gain(float w) {
    return fmadd(fmadd(12.3936349f, w, 7.36107221f), w, 1.83942716f);
}

// xa * xa / 2 = hi + lo exactly.
SPORE_MATH void half_square(float xa, float& hi, float& lo) {
#ifdef __FMA__
    const float half = 0.5f * xa;
    hi = xa * half;
    lo = std::fma(xa, half, -hi);
#else
    const double sq = 0.5 * static_cast<double>(xa) * xa;
    hi = static_cast<float>(sq);
    lo = static_cast<float>(sq - hi);
#endif
}

constexpr float kGeluBound = 16.0f;  // beyond: gelu(x) = x (x > 0) or -0 (x < 0) in fp32
constexpr float kInvTwo64 = 5.42101086e-20f;  // 2^-64
constexpr float kRsqrt2Hi = 0.707106769f;  // 1 / sqrt 2 = hi + lo
constexpr float kRsqrt2Lo = 1.21016175e-8f;
constexpr float kInvSqrt2Pi = 0.398942292f;  // 1 / sqrt(2 pi)
constexpr float kSixth = 0.166666672f;

// min(|x|, 16), NaN giving 16: non-negative floats order like their bit patterns.
SPORE_MATH float gelu_abs_clamp(float x) {
    const int32_t bits = as_int(std::fabs(x));
    return as_float(bits < as_int(kGeluBound) ? bits : as_int(kGeluBound));
}

// The accurate erf form, for xa = min(|x|, 16) and t = xa / sqrt 2 (carried exactly enough):
// x^2 / 2 = s + s_lo exactly and exp(-x^2 / 2) = (1 + q) 2^n; inv = 1 / (t + 3) rounded,
// w = inv - 1/6 and 0.5 erfcx(t) = erfcx_poly(w) inv (1 + e), e correcting for the roundings
// of t + 3 and 1 / (t + 3). So 0.5 erfc(t) = poly inv (1 + q) (1 + e) 2^n. 2^n is carried as
// scale = 2^(n + 64), normal for every xa; the caller's final multiply by 2^-64 rounds once.
// Short (the backward's): shorter polynomials and e = 0.
struct GeluParts {
    float q, e, scale, inv, poly;
};

// Fills p (by reference: a returned struct stops GCC vectorising the caller's loop).
template <bool Short>
SPORE_MATH void gelu_parts(float xa, GeluParts& p) {
    float s, s_lo;
    half_square(xa, s, s_lo);
    // -s = nf ln2 + r: nf ln2_hi is exact and so is its subtraction; one rounding in r.
    const float shifted = fmadd(-s, kLog2e, kRound);
    const float nf = shifted - kRound;
    const int32_t n = as_int(shifted) - as_int(kRound);  // n >= -185
    const float r = fmadd(nf, -kLn2Hi, -s) + fmadd(nf, -kLn2Lo, -s_lo);
    p.q = Short ? expm1_reduced_short(r) : expm1_reduced(r);
    p.scale = pow2(n + 64);
    // d = t + 3 rounded; t + 3 = d + d_lo (with FMA: 3 - d is exact for d in [3, 16)).
#ifdef __FMA__
    const float d = std::fma(xa, kRsqrt2Hi, 3.0f);
#else
    const float t = xa * kRsqrt2Hi;
    const float d = t + 3.0f;
#endif
    p.inv = 1.0f / d;
    const float w = p.inv - kSixth;
    if constexpr (Short) {
        p.e = 0.0f;
        p.poly = erfcx_poly_short(w);
    } else {
#ifdef __FMA__
        const float d_lo = std::fma(xa, kRsqrt2Lo, std::fma(xa, kRsqrt2Hi, 3.0f - d));
#else
        const float d_lo = (t < 3.0f ? t : 3.0f) - (d - (t > 3.0f ? t : 3.0f));
#endif
        const float rho = fmadd(-p.inv, d_lo, fmadd(-p.inv, d, 1.0f));  // 1/(t+3) = inv (1+rho)
        p.e = rho * erfcx_rho_gain(w);
        p.poly = erfcx_poly(w);
    }
}

// gelu(x) = x Phi(x); with m = x 0.5 erfc(|x| / sqrt 2) (so m = x Phi(-|x|)): gelu = m for
// x <= 0 and x - m for x > 0. (1 + q) (1 + e) is taken as 1 + q + e: q e is below 2^-24.
SPORE_MATH float gelu_erf(float x) {
    const float xa = gelu_abs_clamp(x);
    const float xc = std::copysign(xa, x);
    GeluParts p;
    gelu_parts<false>(xa, p);
    const float m = xc * p.inv * p.poly;
    const float scaled = fmadd(m, p.q + p.e, m);
    const float xh = (scaled * p.scale) * kInvTwo64;
    return x <= 0.0f ? std::copysign(xh, x) : x - xh;
}

// gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi); with h = Phi(-|x|) and
// e = exp(-x^2 / 2), both times 2^64 / 2^n: Phi(x) = h (x <= 0) or 1 - h (x > 0). Short
// polynomials for every dtype: within 3e-7 of the true derivative (whose zero near x = -0.75
// bounds any relative accuracy anyway).
SPORE_MATH float gelu_erf_grad(float x) {
    const float xa = gelu_abs_clamp(x);
    GeluParts p;
    gelu_parts<true>(xa, p);
    const float a = p.poly * p.inv;
    const float h = fmadd(a, p.q, a) * p.scale;
    const float e = fmadd(p.q, p.scale, p.scale);
    const float xphi = std::copysign(xa, x) * kInvSqrt2Pi;
    const float neg = fmadd(xphi, e, h) * kInvTwo64;
    const float pos = fmadd(fmadd(xphi, e, -h), kInvTwo64, 1.0f);
    const float d = x <= 0.0f ? neg : pos;
    return x != x ? x : d;
}

constexpr float kTanhK0 = 0.797884561f;  // sqrt(2 / pi)
constexpr float kTanhK1 = 0.0356774081f;  // sqrt(2 / pi) * 0.044715

// sigmoid(v) = num / (1 + z) with z = exp(-|v|) in (0, 1] and num = 1 (v >= 0) or z (v < 0):
// no overflow and no cancellation for either sign; 1 - sigmoid(v) = (1 + z - num) / (1 + z).
SPORE_MATH void sigmoid_parts(float v, float& num, float& inv, float& z) {
    z = exp_nonpositive(-std::fabs(v));
    num = v >= 0.0f ? 1.0f : z;
    inv = 1.0f / (1.0f + z);
}

// 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3).
SPORE_MATH float gelu_tanh(float x) {
    float num, inv, z;
    sigmoid_parts(2.0f * x * fmadd(kTanhK1, x * x, kTanhK0), num, inv, z);
    const float out = x * num * inv;
    return x < -kGeluBound ? -0.0f : (x > kGeluBound ? x : out);
}

// With s = sigmoid(2y): d/dx = s + 2 x y' s (1 - s), y' = sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// and s (1 - s) = z / (1 + z)^2.
SPORE_MATH float gelu_tanh_grad(float x) {
    const float x2 = x * x;
    float num, inv, z;
    sigmoid_parts(2.0f * x * fmadd(kTanhK1, x2, kTanhK0), num, inv, z);
    const float slope = 2.0f * x * fmadd(3.0f * kTanhK1, x2, kTanhK0);
    const float d = fmadd(slope * z * inv, inv, num * inv);
    return x < -kGeluBound ? 0.0f : (x > kGeluBound ? 1.0f : d);
}

// Splits [0, n) into one contiguous range per thread (a multiple of 64 long) and runs
// body(begin, end) on each; small n runs on fewer threads.
template <typename Body>
void parallel_ranges(int64_t n, int32_t threads, Body&& body) {
    constexpr int64_t grain = 1 << 14;
    const int64_t useful = std::min<int64_t>(threads, (n + grain - 1) / grain);
    if (useful <= 1) {
        body(int64_t{0}, n);
        return;
    }
#pragma omp parallel num_threads(static_cast<int>(useful))
    {
        const int64_t nt = omp_get_num_threads();
        const int64_t chunk = ((n + nt - 1) / nt + 63) / 64 * 64;
        const int64_t begin = std::min(n, omp_get_thread_num() * chunk);
        const int64_t end = std::min(n, begin + chunk);
        if (begin < end) body(begin, end);
    }
}

// Runs body(row, c0, c1) over the [rows, cols] index space split evenly between threads.
template <typename Body>
void parallel_rows(int64_t rows, int64_t cols, int32_t threads, Body&& body) {
    parallel_ranges(rows * cols, threads, [&](int64_t begin, int64_t end) {
        int64_t row = begin / cols, col = begin % cols;
        while (begin < end) {
            const int64_t stop = std::min(cols, col + (end - begin));
            body(row, col, stop);
            begin += stop - col;
            ++row;
            col = 0;
        }
    });
}

// Runs body(in, out, m), a loop over fp32 arrays of m elements, on n elements of the NI input
// and NO output operands: float32 operands directly, others through fp32 blocks, so that the
// arithmetic loop vectorises on its own and the conversions are simple loops of their own.
template <typename T, size_t NI, size_t NO, typename Body>
void in_fp32(const std::array<const typename T::storage*, NI>& src,
             const std::array<typename T::storage*, NO>& dst, int64_t n, Body&& body) {
    if constexpr (std::is_same_v<T, F32>) {
        body(src.data(), dst.data(), n);
    } else {
        constexpr int64_t block = 256;
        alignas(64) float ib[NI][block];
        alignas(64) float ob[NO][block];
        std::array<const float*, NI> ip;
        std::array<float*, NO> op;
        for (size_t k = 0; k < NI; ++k) ip[k] = ib[k];
        for (size_t k = 0; k < NO; ++k) op[k] = ob[k];
        for (int64_t b = 0; b < n; b += block) {
            const int64_t m = std::min(block, n - b);
            for (size_t k = 0; k < NI; ++k) {
                const auto* s = src[k] + b;
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) ib[k][i] = T::load(s[i]);
            }
            body(ip.data(), op.data(), m);
            for (size_t k = 0; k < NO; ++k) {
                auto* d = dst[k] + b;
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) d[i] = T::store(ob[k][i]);
            }
        }
    }
}

// gelu of every 16-bit value, computed once by the float32 code and rounded: a lookup gives
// exactly what computing would (65536 entries per dtype and form, built on first use).
template <typename T, bool Tanh>
const uint16_t* gelu_table() {
    static const std::vector<uint16_t> table = [] {
        std::vector<uint16_t> t(1 << 16);
#pragma omp simd
        for (int32_t i = 0; i < (1 << 16); ++i) {
            const float v = T::load(static_cast<uint16_t>(i));
            t[i] = T::store(Tanh ? gelu_tanh(v) : gelu_erf(v));
        }
        return t;
    }();
    return table.data();
}

template <typename T, bool Tanh>
void gelu_fwd(const void* xp, void* yp, int64_t n, int32_t threads) {
    const auto* x = in<T>(xp);
    auto* y = out<T>(yp);
    if constexpr (std::is_same_v<T, F32>) {
        parallel_ranges(n, threads, [&](int64_t begin, int64_t end) {
#pragma omp simd
            for (int64_t i = begin; i < end; ++i) y[i] = Tanh ? gelu_tanh(x[i]) : gelu_erf(x[i]);
        });
    } else {
        const uint16_t* table = gelu_table<T, Tanh>();
        parallel_ranges(n, threads, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) y[i] = table[x[i]];
        });
    }
}

template <typename T, bool Tanh>
void gelu_bwd(const void* gp, const void* xp, void* dxp, int64_t n, int32_t threads) {
    const auto* g = in<T>(gp);
    const auto* x = in<T>(xp);
    auto* dx = out<T>(dxp);
    parallel_ranges(n, threads, [&](int64_t begin, int64_t end) {
        in_fp32<T, 2, 1>({g + begin, x + begin}, {dx + begin}, end - begin,
                         [](const float* const* in, float* const* out, int64_t m) {
                             const float* gv = in[0];
                             const float* xv = in[1];
                             float* dv = out[0];
#pragma omp simd
                             for (int64_t i = 0; i < m; ++i) {
                                 const float v = xv[i];
                                 dv[i] = gv[i] * (Tanh ? gelu_tanh_grad(v) : gelu_erf_grad(v));
                             }
                         });
    });
}

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

bool valid(int64_t n, int32_t threads) { return n >= 0 && threads >= 1; }

}  // namespace
}  // namespace spore

using spore::Rows;

// y = gelu(x) over n contiguous elements; approximate 0: exact (erf), 1: tanh form.
SPORE_EXPORT int32_t spore_gelu(const void* x, void* y, int64_t n, int32_t approximate,
                                int32_t dtype, int32_t threads) {
    if (!x || !y || !spore::valid(n, threads) || approximate < 0 || approximate > 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        if (approximate) {
            spore::gelu_fwd<T, true>(x, y, n, threads);
        } else {
            spore::gelu_fwd<T, false>(x, y, n, threads);
        }
    });
}

// dx = g * gelu'(x) over n contiguous elements.
SPORE_EXPORT int32_t spore_gelu_backward(const void* g, const void* x, void* dx, int64_t n,
                                         int32_t approximate, int32_t dtype, int32_t threads) {
    if (!g || !x || !dx || !spore::valid(n, threads) || approximate < 0 || approximate > 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        if (approximate) {
            spore::gelu_bwd<T, true>(g, x, dx, n, threads);
        } else {
            spore::gelu_bwd<T, false>(g, x, dx, n, threads);
        }
    });
}

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
