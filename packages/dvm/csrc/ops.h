// The VM's op loops: one pre-compiled loop per instruction over a run of n fp32 register
// elements (d may equal a source: every loop is elementwise). The dispatch in vm.cpp happens
// once per tile, so its cost is spread over up to TILE elements.
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.h"
#include "vm.h"
#include "vmath.h"

namespace dvm {

template <typename F>
inline void map1(float* d, const float* a, int64_t n, F f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = f(a[i]);
}

template <typename F>
inline void map2(float* d, const float* a, const float* b, int64_t n, F f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = f(a[i], b[i]);
}

inline void fill(float* d, float v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = v;
}

// sin/cos: the vector path is accurate to |x| <= SIN_COS_LIMIT; larger arguments (and inf)
// are recomputed with the C library, a rare scalar pass taken only when the run has one.
inline void sin_cos(float* d, const float* a, int64_t n, uint64_t quarter) {
    float big = 0.0f;
#pragma omp simd reduction(max : big)
    for (int64_t i = 0; i < n; ++i) {
        big = fabs_(a[i]) > big ? fabs_(a[i]) : big;
    }
    if (big > SIN_COS_LIMIT) {
        for (int64_t i = 0; i < n; ++i) {
            const float x = a[i];
            d[i] = fabs_(x) > SIN_COS_LIMIT ? (quarter ? std::cos(x) : std::sin(x))
                                            : sin_cos_f(x, quarter);
        }
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = sin_cos_f(a[i], quarter);
}

// dst <- op(a), a unary instruction. d and a may be the same buffer.
inline void unary(int32_t op, float* d, const float* a, int64_t n) {
    switch (op) {
        case NEG: return map1(d, a, n, [](float x) { return -x; });
        case ABS: return map1(d, a, n, [](float x) { return fabs_(x); });
        case EXP: return map1(d, a, n, exp_f);
        case LOG: return map1(d, a, n, log_f);
        case LOG1P: return map1(d, a, n, log1p_f);
        case SQRT: return map1(d, a, n, [](float x) { return std::sqrt(x); });
        case RSQRT: return map1(d, a, n, [](float x) { return 1.0f / std::sqrt(x); });
        case RECIPROCAL: return map1(d, a, n, [](float x) { return 1.0f / x; });
        case TANH: return map1(d, a, n, tanh_f);
        case SIGMOID: return map1(d, a, n, sigmoid_f);
        case ERF: return map1(d, a, n, erf_f);
        case SIN: return sin_cos(d, a, n, 0);
        case COS: return sin_cos(d, a, n, 1);
        case NOT: return map1(d, a, n, [](float x) { return x == 0.0f ? 1.0f : 0.0f; });
        case CAST_BF16: return round_bf16(a, d, n);
        case CAST_F16: return round_f16(a, d, n);
        default: return;
    }
}

inline float truth(bool v) { return v ? 1.0f : 0.0f; }

inline void binary(int32_t op, float* d, const float* a, const float* b, int64_t n) {
    switch (op) {
        case ADD: return map2(d, a, b, n, [](float x, float y) { return x + y; });
        case SUB: return map2(d, a, b, n, [](float x, float y) { return x - y; });
        case MUL: return map2(d, a, b, n, [](float x, float y) { return x * y; });
        case DIV: return map2(d, a, b, n, [](float x, float y) { return x / y; });
        case POW: return map2(d, a, b, n, pow_f);
        case MAX: return map2(d, a, b, n, max_f);
        case MIN: return map2(d, a, b, n, min_f);
        case EQ: return map2(d, a, b, n, [](float x, float y) { return truth(x == y); });
        case NE: return map2(d, a, b, n, [](float x, float y) { return truth(x != y); });
        case LT: return map2(d, a, b, n, [](float x, float y) { return truth(x < y); });
        case LE: return map2(d, a, b, n, [](float x, float y) { return truth(x <= y); });
        case GT: return map2(d, a, b, n, [](float x, float y) { return truth(x > y); });
        case GE: return map2(d, a, b, n, [](float x, float y) { return truth(x >= y); });
        case AND:
            return map2(d, a, b, n, [](float x, float y) { return truth(x != 0.0f && y != 0.0f); });
        case OR:
            return map2(d, a, b, n, [](float x, float y) { return truth(x != 0.0f || y != 0.0f); });
        default: return;
    }
}

// A bit select (no blend instruction needed, so SSE2 builds vectorise it too).
inline void where(float* d, const float* c, const float* a, const float* b, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t take_a = 0u - static_cast<uint32_t>(c[i] != 0.0f);
        d[i] = as_float((as_bits(a[i]) & take_a) | (as_bits(b[i]) & ~take_a));
    }
}

// A row's sum (LANES independent partial sums, folded pairwise: a fixed order, so results do
// not depend on threads) or maximum (NaN if any is NaN).
constexpr int64_t LANES = 32;

inline float row_sum(const float* a, int64_t n) {
    float acc[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) acc[l] += a[i + l];
    }
    for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l];
    for (int64_t w = LANES / 2; w > 0; w /= 2) {
#pragma omp simd
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
    }
    return acc[0];
}

inline float row_max(const float* a, int64_t n) {
    float acc[LANES];
    for (int64_t l = 0; l < LANES; ++l) acc[l] = -INF;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) acc[l] = max_f(a[i + l], acc[l]);
    }
    for (int64_t l = 0; i + l < n; ++l) acc[l] = max_f(a[i + l], acc[l]);
    float m = acc[0];
    for (int64_t l = 1; l < LANES; ++l) m = max_f(acc[l], m);
    return m;
}

// dst <- the reduction of each row of `row` elements, broadcast back along it.
inline void reduce(int32_t op, float* d, const float* a, int64_t n, int64_t row) {
    for (int64_t s = 0; s < n; s += row) {
        float v = op == REDUCE_MAX ? row_max(a + s, row) : row_sum(a + s, row);
        v = op == REDUCE_MEAN ? v / static_cast<float>(row) : v;
        fill(d + s, v, row);
    }
}

}  // namespace dvm
