// gelu, forward and backward, erf and tanh forms. Elementwise, fp32 arithmetic, one rounding
// per output.
//
// erfc comes from the scaled complementary error function erfcx(t) = exp(t^2) erfc(t), a
// polynomial in w = 1 / (t + 3) - 1/6 (fitted as elementwise.h's). The float32 exact gelu
// carries the rounding errors of x^2, t + 3 and 1 / (t + 3) (within 4 ulp of the true value);
// the backward takes shorter polynomials. 16-bit gelu forwards look their result up in a table
// of all 65536 inputs, built by the fp32 code.
#include "elementwise.h"

namespace spore {
namespace {

// exp(r) - 1 for |r| <= ln2 / 2, within 1.2e-7 of exp(r).
SPORE_MATH float expm1_reduced_short(float r) {
    float p = 8.31202976e-3f;
    p = fmadd(p, r, 4.18945551e-2f);
    p = fmadd(p, r, 1.66671336e-1f);
    p = fmadd(p, r, 4.99992013e-1f);
    return fmadd(p, r * r, r);
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

}  // namespace
}  // namespace spore

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
