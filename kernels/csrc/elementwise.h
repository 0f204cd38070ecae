// What the elementwise activations (gelu.cpp, glu.cpp) share: exp and sigmoid without libm, so
// that loops calling them vectorise (exp is a range reduction x = n ln2 + r and a polynomial,
// fitted for these files: minimax relative error, coefficients rounded to fp32 one at a time),
// and the loops that split elementwise work between threads and through fp32 blocks.
#pragma once

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

// sigmoid(v) = num / (1 + z) with z = exp(-|v|) in (0, 1] and num = 1 (v >= 0) or z (v < 0):
// no overflow and no cancellation for either sign; 1 - sigmoid(v) = (1 + z - num) / (1 + z).
SPORE_MATH void sigmoid_parts(float v, float& num, float& inv, float& z) {
    z = exp_nonpositive(-std::fabs(v));
    num = v >= 0.0f ? 1.0f : z;
    inv = 1.0f / (1.0f + z);
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

inline bool valid(int64_t n, int32_t threads) { return n >= 0 && threads >= 1; }

}  // namespace
}  // namespace spore
