// What the attention kernels (triangle_attention.cpp, block_sparse_attention.cpp) share: fp32
// vectors of the build's widest kind, the register tile's shape, and the base-2 softmax's
// exponent with the rule for NaN and infinite scores.
#pragma once

#include <cstdint>
#include <limits>

#include "elementwise.h"

namespace spore {
namespace {

// A vector of W fp32 lanes (GCC vector extensions: one register of the build's widest kind;
// a * b + c becomes an FMA where the build targets FMA hardware), read and written unaligned.
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#elif defined(__AVX__)
constexpr int64_t W = 8;
#else
constexpr int64_t W = 4;
#endif
using vec = float __attribute__((vector_size(W * 4)));
using vec_u = float __attribute__((vector_size(W * 4), aligned(4), may_alias));
using ivec = int32_t __attribute__((vector_size(W * 4)));

inline vec splat(float x) { return vec{} + x; }
inline vec vload(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void vstore(float* p, vec x) { *reinterpret_cast<vec_u*>(p) = x; }

// Register tiles of RT query rows by VT (two vectors) key or value columns: 12 accumulators,
// two column vectors and a broadcast row value fit the 16 vector registers of SSE2 and AVX2.
constexpr int64_t RT = 6;
constexpr int64_t VT = 2 * W;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147182f;

// 2^a lane by lane for a <= 0 (the scores are in base 2: q was scaled by log2 e), 0 below
// -126 and for a NaN lane: a = n + r with n an integer and |r| <= 1/2, and 2^r = exp(r ln 2)
// by elementwise.h's polynomial.
inline vec exp2_nonpositive(vec a) {
    const vec clamped = a > -126.0f ? a : splat(-126.0f);
    const vec shifted = clamped + kRound;
    const vec x = (clamped - (shifted - kRound)) * kLn2;
    vec p = splat(1.38204684e-3f);
    p = p * x + 8.36925115e-3f;
    p = p * x + 4.16682847e-2f;
    p = p * x + 1.66665167e-1f;
    p = p * x + 4.99999940e-1f;
    const vec em1 = p * (x * x) + x;
    const ivec n = reinterpret_cast<ivec>(shifted) - as_int(kRound);
    const vec scale = reinterpret_cast<vec>((n + 127) << 23);
    const vec e = em1 * scale + scale;
    return a >= -126.0f ? e : vec{};
}

// One lane's 2^a, as exp2_nonpositive.
inline float exp2_nonpositive(float a) { return exp2_nonpositive(splat(a))[0]; }

// A softmax numerator, 2^(x - top), for scores x at or below their row's max `top`. Where
// x - top is NaN (a NaN score, or a +inf score at a +inf max: an inf in an input, or q.k past
// float32) it stays NaN and reaches the row's output, as in torch's softmax; a -inf score (a
// masked key) gives 0, also at a -inf max, so a row with every key masked gives zeros.
inline vec shifted_exp2(vec x, float top) {
    const vec d = x - top;
    return (d == d) | (x == splat(-kInf)) ? exp2_nonpositive(d) : d;
}
inline float shifted_exp2(float x, float top) {
    const float d = x - top;
    return d == d || x == -kInf ? exp2_nonpositive(d) : d;
}

// x[c] = shifted_exp2(x[c], top) for n values, whole vectors first, then lane by lane; returns
// their sum (the vectors' lanes summed in order, then the rest).
inline float shifted_exp2_sum(float* x, int64_t n, float top) {
    vec acc = {};
    int64_t c = 0;
    for (; c + W <= n; c += W) {
        const vec e = shifted_exp2(vload(x + c), top);
        vstore(x + c, e);
        acc += e;
    }
    float total = 0.0f;
    for (int64_t l = 0; l < W; ++l) total += acc[l];
    for (; c < n; ++c) {
        x[c] = shifted_exp2(x[c], top);
        total += x[c];
    }
    return total;
}

}  // namespace
}  // namespace spore
