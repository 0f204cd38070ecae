// Branch-free fp32 math for the VM's op loops: written with selects instead of branches and
// without library calls so GCC vectorises every loop that uses them. Accuracy against the
// correctly rounded result (tests/test_vm.py checks these bounds over random fp32 bit
// patterns; the worst seen in brackets):
//   exp, log: <= 1 ulp (0.93, 0.75);  log1p: <= 2 ulp (1.44);  sigmoid, tanh: <= 3 ulp (2.58,
//   2.29);  pow: <= 1 ulp (double inside);  erf: <= 5e-7 absolute (1.1e-7);  sin, cos:
//   <= 1 ulp (0.51, double inside) for |x| <= 1e6; larger arguments are recomputed with the
//   C library by the caller (see SIN_COS_LIMIT). sqrt (the instruction) is correctly rounded.
// Subnormal inputs and results are handled (no flush to zero), NaN propagates, and the IEEE
// special cases (0, +-inf) follow C99 / torch.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
// GCC 12 warns of the AVX-512 header's own self-initialised _mm512_undefined_* values (GCC
// bug 105593); silenced for the header's lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// The functions the op loops call, forced inline: in a fused loop (a binary op, then one of
// these) GCC's inliner gave up on some, and a loop with a call in it stays scalar.
#define DVM_MATH inline __attribute__((always_inline))

namespace dvm {

inline float as_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint32_t as_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline double as_double(uint64_t u) {
    double d;
    std::memcpy(&d, &u, 8);
    return d;
}
inline uint64_t as_bits64(double d) {
    uint64_t u;
    std::memcpy(&u, &d, 8);
    return u;
}

constexpr float INF = __builtin_inff();
constexpr float QNAN = __builtin_nanf("");
constexpr float LN2_HI = 0.693145751953125f;  // 16 significant bits: n * LN2_HI is exact
constexpr float LN2_LO = 1.42860682030941723212e-6f;
constexpr float LOG2E = 1.44269504088896341f;

inline float fabs_(float x) { return as_float(as_bits(x) & 0x7fffffffu); }
inline float with_sign_of(float magnitude, float sign) {
    return as_float(as_bits(magnitude) | (as_bits(sign) & 0x80000000u));
}
// NaN-preserving clamps: a comparison with NaN is false, so NaN passes through.
inline float at_least(float x, float lo) { return x < lo ? lo : x; }
inline float at_most(float x, float hi) { return x > hi ? hi : x; }

// x rounded to the nearest integer, ties to even (the FPU rounds x + 2^23); |x| >= 2^23
// (already integral), inf and NaN are returned as they are.
inline float round_even(float x) {
    const float shift = with_sign_of(8388608.0f, x);
    const float r = (x + shift) - shift;
    return fabs_(x) < 8388608.0f ? r : x;
}

// c0 + x (c1 + x (c2 + ...)): Horner's scheme, coefficients from the constant term up.
template <typename T, typename... Cs>
inline T poly(T x, T c0, Cs... cs) {
    if constexpr (sizeof...(cs) == 0) {
        return c0;
    } else {
        return c0 + x * poly(x, static_cast<T>(cs)...);
    }
}

// 2^n for integer n in [-126, 127] as a float built from its exponent bits.
inline float pow2i(int32_t n) { return as_float(static_cast<uint32_t>(n + 127) << 23); }

// exp_f's argument floor (e^-104 is below the smallest subnormal), its rounding shifter and
// its q(r), constant term first; sigmoid16 uses the same.
constexpr float EXP_LOW = -104.0f;
constexpr float SHIFTER = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float EXP_Q[] = {1.0f,          0.49999994f,    0.166664317f,
                           0.0416680016f, 0.00837415643f, 0.00138436502f};

// e^x: x = n ln2 + r, |r| <= ln2/2 (Cody-Waite), e^r = 1 + r q(r) with q of degree 5 (our own
// near-minimax fit of (e^r - 1) / r, relative error 2e-9), scaled by 2^n in two halves so
// subnormal results round once.
DVM_MATH float exp_f(float x) {
    x = at_most(at_least(x, EXP_LOW), 89.0f);
    const float shifter = SHIFTER;
    const float t = x * LOG2E + shifter;
    const float n = t - shifter;
    const int32_t k = static_cast<int32_t>(as_bits(t) - as_bits(shifter));
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    const float p =
        1.0f + r * poly(r, EXP_Q[0], EXP_Q[1], EXP_Q[2], EXP_Q[3], EXP_Q[4], EXP_Q[5]);
    const int32_t half = k >> 1;
    return p * pow2i(half) * pow2i(k - half);
}

// log(x) = e ln2 + log1p(f), with 1 + f in [sqrt(1/2), sqrt(2)) and
// log1p(f) = f - f^2/2 + s (f^2/2 + R(s^2)), s = f / (2 + f), R the atanh series' tail.
inline float log_core(float x, float& f_out) {
    const bool tiny = x < 1.17549435e-38f;  // subnormal: scale into the normal range first
    const float xs = tiny ? x * 8388608.0f : x;
    const uint32_t u = as_bits(xs) + (0x3f800000u - 0x3f3504f3u);
    const int32_t e = static_cast<int32_t>(u >> 23) - 127 - (tiny ? 23 : 0);
    const float f = as_float((u & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
    const float s = f / (2.0f + f);
    const float z = s * s;
    const float R = z * poly(z, 2.0f / 3, 2.0f / 5, 2.0f / 7, 2.0f / 9, 2.0f / 11, 2.0f / 13);
    const float hfsq = 0.5f * f * f;
    const float ef = static_cast<float>(e);
    f_out = f;
    return ef * LN2_HI + (f - (hfsq - (s * (hfsq + R) + ef * LN2_LO)));
}

inline float log_special(float x, float r) {
    r = x == INF ? INF : r;
    r = x == 0.0f ? -INF : r;
    return (x < 0.0f || x != x) ? QNAN : r;
}

inline float log_f(float x) {
    float f;
    return log_special(x, log_core(x, f));
}

// log(1 + x): log(u) for u = 1 + x, corrected by the rounding of u: (x - (u - 1)) / u.
inline float log1p_f(float x) {
    const float u = 1.0f + x;
    float f;
    const float l = log_special(u, log_core(u, f));
    const float c = (x - (u - 1.0f)) / u;
    const float r = l + (fabs_(c) < INF ? c : 0.0f);  // u = 0 or inf: no correction
    return x == 0.0f ? x : r;                          // log1p(-0) = -0
}

// e^x - 1 for x in [0, 20]: 2^n (e^r - 1) + (2^n - 1), e^r - 1 by Taylor to r^8.
DVM_MATH float expm1_pos(float x) {
    const float shifter = SHIFTER;
    const float t = x * LOG2E + shifter;
    const float n = t - shifter;
    const int32_t k = static_cast<int32_t>(as_bits(t) - as_bits(shifter));
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    const float p = poly(r, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040,
                         1.0f / 40320);
    const float em1 = r + r * r * p;
    const float two_k = pow2i(k);
    return two_k * em1 + (two_k - 1.0f);
}

// tanh |x| = t / (t + 2), t = e^{2|x|} - 1; |x| >= 9.5 rounds to 1.
DVM_MATH float tanh_f(float x) {
    const float t = expm1_pos(2.0f * at_most(fabs_(x), 9.5f));
    return with_sign_of(t / (t + 2.0f), x);
}

// 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below (no overflow, subnormal tails kept).
inline float sigmoid_f(float x) {
    const float e = exp_f(-fabs_(x));
    const float s = 1.0f / (1.0f + e);
    return x >= 0.0f ? s : e * s;
}

// x * sigmoid(x): the fused SiLU passes' one formula (the same arithmetic as the two ops).
inline float silu_f(float x) { return x * sigmoid_f(x); }

#if defined(__AVX512F__)
// sigmoid_f on 16 lanes, written with intrinsics: GCC's vectorisation of sigmoid_f spends a
// third more instructions (blends for the selects, exp_f's two-step 2^n). The same operations
// in the same order, with vscalefps for p * 2^n (one rounding, as exp_f's two halves), so the
// same bits as sigmoid_f for every input (checked over all 2^32 fp32 patterns; a NaN gives a
// NaN, its sign aside).
DVM_MATH __m512 sigmoid16(__m512 x) {
    const __m512 shifter = _mm512_set1_ps(SHIFTER);
    const __m512 minus_abs = _mm512_or_ps(x, _mm512_set1_ps(-0.0f));
    const __m512 z = _mm512_max_ps(_mm512_set1_ps(EXP_LOW), minus_abs);  // NaN stays NaN
    const __m512 t = _mm512_fmadd_ps(z, _mm512_set1_ps(LOG2E), shifter);
    const __m512 n = _mm512_sub_ps(t, shifter);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), z);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 q = _mm512_set1_ps(EXP_Q[5]);  // exp_f's polynomial, Horner from the top
    for (int32_t i = 4; i >= 0; --i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(EXP_Q[i]));
    const __m512 e = _mm512_scalef_ps(_mm512_fmadd_ps(r, q, _mm512_set1_ps(1.0f)), n);
    const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NGE_UQ);
    return _mm512_mask_mul_ps(s, below, e, s);
}

DVM_MATH __m512 silu16(__m512 x) { return _mm512_mul_ps(x, sigmoid16(x)); }
#endif

// erf from two polynomials of our own fit (near-minimax: Chebyshev least squares reweighted
// toward equal ripple, in float64, coefficients rounded to float), no exp and no division:
// |x| < 1: x S(x^2), S of degree 5 (fit error 4e-8 relative, so tiny x keep full precision);
// 1 <= |x| < 3.9: a degree-12 polynomial in t = (2|x| - 4.9) / 2.9 in [-1, 1] (fit error 3e-8
// absolute); |x| >= 3.9: +-1 (1 - erf(3.9) < 3.5e-8). NaN falls through to the second piece;
// inf and huge |x| make t overflow there, and the select drops that value.
constexpr float ERF_ONE_AT = 3.9f;

DVM_MATH float erf_f(float x) {
    const float a = fabs_(x);
    // |x| S(x^2) given x's sign: the bits of x S(x^2), and as a bit operation it cannot be
    // fused into a caller's next addition (GELU's erf + 1), which GCC did only where it
    // branches instead of selecting, i.e. in a loop's scalar tail but not its vector body
    const float small = with_sign_of(
        a * poly(x * x, 1.12837911f, -0.37612325f, 0.112801798f, -0.0267113093f, 0.0049175485f,
                 -0.000563140959f),
        x);
    const float t = a * 0.689655172f - 1.68965517f;
    const float p = poly(t, 0.999469459f, 0.00404535327f, -0.0143742971f, 0.0312058609f,
                         -0.0453065336f, 0.0447169766f, -0.0278334152f, 0.00579192163f,
                         0.00817796681f, -0.00869008061f, 0.00200543855f, 0.00157958327f,
                         -0.000788228645f);
    const float large = with_sign_of(a >= ERF_ONE_AT ? 1.0f : at_most(p, 1.0f), x);
    return a < 1.0f ? small : large;
}

// GELU, erf form: (x / 2) (1 + erf(x / sqrt 2)), the operations of its decomposition in its
// order. Absolute error <= |x| / 2 times erf's (where x / sqrt 2 <= -3.9 the result is -0, as
// erf rounds to -1 there: the true value is under 1e-7 in magnitude).
DVM_MATH float gelu_f(float x) {
    return (x * 0.5f) * (erf_f(x * 0.70710678118654752f) + 1.0f);
}

#if defined(__AVX512F__)
// GELU on 16 lanes (the AVX-512 build's GELU, its only one): x (1/2 + sign(x) H(|x|)),
// H(a) = erf(a / sqrt 2) / 2 from a table instead of gelu_f's two erf polynomials (1.7x
// fewer cycles). With u = |x| K clamped to GELU_U_MAX (beyond, H rounds to 1/2), H is a
// degree-4 polynomial in t = u - round(u), one per interval round(u) = 0..31, its five
// coefficients picked by two-table permutes. Our own fit (tools/fit_gelu.py prints the table
// and its error): |H error| <= 3.6e-8 for every x, so GELU's absolute error is at most
// |x| (3.6e-8 + an ulp of 1/2): the same bound as gelu_f's, other bits. 0 -> 0 with x's sign,
// -inf and NaN -> NaN, inf -> inf, as gelu_f.
constexpr float GELU_K = 16.0f / 3.0f;
constexpr float GELU_U_MAX = 31.49f;
constexpr float GELU_TABLE[5][32] = {
    {0.0f, 0.07436568f, 0.14616977f, 0.2131123f, 0.27337265f, 0.32574928f, 0.36970547f,
     0.40532425f, 0.4331928f, 0.45424637f, 0.46960363f, 0.4804199f, 0.48777553f, 0.4926054f,
     0.49566755f, 0.4975421f, 0.4986501f, 0.49928245f, 0.49963093f, 0.49981633f, 0.49991158f,
     0.49995884f, 0.49998146f, 0.49999192f, 0.4999966f, 0.49999863f, 0.49999946f, 0.4999998f,
     0.4999999f, 0.49999997f, 0.5f, 0.5f},
    {0.07480166f, 0.07349825f, 0.0697228f, 0.06385641f, 0.056463268f, 0.04820137f, 0.039726894f,
     0.03161125f, 0.024284577f, 0.018011553f, 0.012897443f, 0.008916363f, 0.0059511876f,
     0.0038348748f, 0.00238578f, 0.0014329837f, 0.00083096675f, 0.00046521917f, 0.0002514566f,
     0.00013121997f, 6.6110166e-05f, 3.2156437e-05f, 1.5100762e-05f, 6.8463805e-06f,
     2.9967769e-06f, 1.2664233e-06f, 5.166952e-07f, 2.035265e-07f, 7.739954e-08f,
     2.8417553e-08f, 1.0073159e-08f, 3.447271e-09f},
    {2.2099165e-07f, -0.0012919598f, -0.002451189f, -0.0033674235f, -0.0039700684f,
     -0.0042364434f, -0.004189941f, -0.0038896615f, -0.0034150158f, -0.0028494825f,
     -0.0022671279f, -0.0017240628f, -0.0012553296f, -0.0008763302f, -0.00058712706f,
     -0.0003778389f, -0.00023371063f, -0.00013902155f, -7.956317e-05f, -4.3825934e-05f,
     -2.3242197e-05f, -1.1870462e-05f, -5.839877e-06f, -2.7680442e-06f, -1.2643055e-06f,
     -5.565547e-07f, -2.3615634e-07f, -9.6600594e-08f, -3.8097383e-08f, -1.44872985e-08f,
     -5.312441e-09f, -1.8786648e-09f},
    {-0.0004395518f, -0.00041485447f, -0.00035059446f, -0.00025552567f, -0.00014475269f,
     -3.44329e-05f, 6.144873e-05f, 0.00013340787f, 0.00017744068f, 0.00019464851f,
     0.00018986991f, 0.00016987075f, 0.00014162666f, 0.00011106584f, 8.241626e-05f,
     5.8103986e-05f, 3.903198e-05f, 2.50376e-05f, 1.5361651e-05f, 9.0264475e-06f, 5.084848e-06f,
     2.748439e-06f, 1.4264037e-06f, 7.1121184e-07f, 3.4085411e-07f, 1.5708443e-07f,
     6.9638496e-08f, 2.9706626e-08f, 1.2197304e-08f, 4.821536e-09f, 1.8353146e-09f,
     6.7285577e-10f},
    {2.8899972e-06f, 1.119773e-05f, 2.0490917e-05f, 2.6423337e-05f, 2.8301254e-05f,
     2.6287822e-05f, 2.126856e-05f, 1.4552235e-05f, 7.514383e-06f, 1.2914397e-06f,
     -3.402033e-06f, -6.3124826e-06f, -7.5691437e-06f, -7.541394e-06f, -6.687389e-06f,
     -5.4345423e-06f, -4.109995e-06f, -2.9192342e-06f, -1.958978e-06f, -1.2471204e-06f,
     -7.554367e-07f, -4.3638428e-07f, -2.4080845e-07f, -1.2711588e-07f, -6.4258856e-08f,
     -3.113616e-08f, -1.4471847e-08f, -6.456335e-09f, -2.766226e-09f, -1.1387568e-09f,
     -4.506042e-10f, -1.7144396e-10f},
};

DVM_MATH __m512 gelu16(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 u = _mm512_min_ps(_mm512_mul_ps(_mm512_andnot_ps(sign, x),
                                                 _mm512_set1_ps(GELU_K)),
                                   _mm512_set1_ps(GELU_U_MAX));  // NaN -> GELU_U_MAX
    const __m512 v = _mm512_add_ps(u, _mm512_set1_ps(SHIFTER));  // round(u) in the low bits
    const __m512 t = _mm512_sub_ps(u, _mm512_sub_ps(v, _mm512_set1_ps(SHIFTER)));
    const __m512i at = _mm512_castps_si512(v);  // the permutes read its low 5 bits
    const auto c = [&](int32_t p) {
        return _mm512_permutex2var_ps(_mm512_loadu_ps(GELU_TABLE[p]), at,
                                      _mm512_loadu_ps(GELU_TABLE[p] + 16));
    };
    __m512 h = c(4);
    for (int32_t p = 3; p >= 0; --p) h = _mm512_fmadd_ps(h, t, c(p));
    const __m512 signed_h = _mm512_or_ps(h, _mm512_and_ps(x, sign));  // h >= 0
    return _mm512_mul_ps(x, _mm512_add_ps(_mm512_set1_ps(0.5f), signed_h));
}
#endif

// sin and cos: x = k pi/2 + r in double (pi/2 in two parts, the first with 33 bits so k * it
// is exact for |k| < 2^20), |r| <= pi/4, Taylor polynomials in double, quadrant by selects.
constexpr float SIN_COS_LIMIT = 1.0e6f;

inline double sin_poly(double r) {
    const double z = r * r;
    // r (1 + ...), not r + r (...): sin(-0) = -0; the double's rounding is far below a float's
    return r * (1.0 + z * poly(z, -1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880, -1.0 / 39916800));
}

inline double cos_poly(double r) {
    const double z = r * r;
    return 1.0 + z * poly(z, -0.5, 1.0 / 24, -1.0 / 720, 1.0 / 40320, -1.0 / 3628800,
                          1.0 / 479001600);
}

// sin(x) (quarter = 0) or cos(x) (quarter = 1, since cos x = sin(x + pi/2)).
inline float sin_cos_f(float x, uint64_t quarter) {
    const double xd = x;
    const double shifter = 6755399441055744.0;  // 1.5 * 2^52
    const double t = xd * 0.63661977236758134308 + shifter;
    const double k = t - shifter;
    const double r = (xd - k * 1.57079632673412561417e+00) - k * 6.07710050650619224932e-11;
    const uint64_t q = as_bits64(t) + quarter;
    const double v = (q & 1u) ? cos_poly(r) : sin_poly(r);
    return static_cast<float>((q & 2u) ? -v : v);
}

// log(x) in double for x >= 0 (pow's inner step): the float's exponent, then the atanh
// series of the mantissa to s^17 (relative error ~1e-15).
inline double log_d(float x) {
    const bool tiny = x < 1.17549435e-38f;
    const float xs = tiny ? x * 8388608.0f : x;
    const uint32_t u = as_bits(xs) + (0x3f800000u - 0x3f3504f3u);
    const int32_t e = static_cast<int32_t>(u >> 23) - 127 - (tiny ? 23 : 0);
    const double f = static_cast<double>(as_float((u & 0x007fffffu) + 0x3f3504f3u)) - 1.0;
    const double s = f / (2.0 + f);
    const double z = s * s;
    const double R = z * poly(z, 2.0 / 3, 2.0 / 5, 2.0 / 7, 2.0 / 9, 2.0 / 11, 2.0 / 13, 2.0 / 15,
                              2.0 / 17);
    const double hfsq = 0.5 * f * f;
    const double ln2 = 0.69314718055994530942;
    const double l = static_cast<double>(e) * ln2 + (f - (hfsq - s * (hfsq + R)));
    const double special = x == 0.0f ? -static_cast<double>(INF) : static_cast<double>(x);
    return (x == 0.0f || x == INF || x != x) ? special : l;
}

// e^z rounded to float, z in double: Taylor to r^11 on |r| <= ln2/2, 2^n from its bits.
inline float exp_d(double z) {
    z = z < -110.0 ? -110.0 : z;
    z = z > 90.0 ? 90.0 : z;
    const double shifter = 6755399441055744.0;
    const double t = z * 1.44269504088896340736 + shifter;
    const double n = t - shifter;
    const double r = (z - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    const double p = poly(r, 1.0, 1.0, 0.5, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                          1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800);
    const uint64_t k = as_bits64(t) - as_bits64(shifter);
    return static_cast<float>(p * as_double((k + 1023u) << 52));
}

// a^b as C99 pow: e^{b log|a|} in double, then the sign and special cases.
inline float pow_f(float a, float b) {
    float r = exp_d(static_cast<double>(b) * log_d(fabs_(a)));
    const bool b_int = b == round_even(b);  // +-inf counts as an (even) integer
    const float half = 0.5f * b;
    const bool b_odd = b_int && fabs_(b) < 16777216.0f && half != round_even(half);
    r = (as_bits(a) >> 31) && b_odd ? -r : r;
    r = a < 0.0f && a != -INF && !b_int ? QNAN : r;
    r = (a == -1.0f && fabs_(b) == INF) ? 1.0f : r;
    return (a == 1.0f || b == 0.0f) ? 1.0f : r;
}

// torch.maximum / torch.minimum: NaN when either is NaN.
inline float max_f(float a, float b) { return (a > b || a != a) ? a : b; }
inline float min_f(float a, float b) { return (a < b || a != a) ? a : b; }

}  // namespace dvm
