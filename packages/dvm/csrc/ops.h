// The VM's op loops: one pre-compiled loop per instruction over a run of fp32 register
// elements (d may equal a source: every loop is elementwise). The dispatch in vm.cpp happens
// once per tile, so its cost is spread over up to TILE elements.
//
// A binary or ternary op's operand is a register's values (Vec) or a broadcast one (Row: one
// value per row of the run, or with step 0 one value for the whole run): a row-scalar or
// scalar register is read where it lies, never filled out to the run's length.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "convert.h"
#include "vm.h"
#include "vmath.h"

namespace dvm {

struct Vec {
    const float* p;
    int64_t pitch;  // elements from one row to the next
    const float* row(int64_t k) const { return p + k * pitch; }
};

struct Row {
    const float* p;
    int64_t step;  // 1: one value per row; 0: one value for all
    float row(int64_t k) const { return p[k * step]; }
};

// A bf16 input's values read in place (widened as they are used).
struct Vec16 {
    const uint16_t* p;
    int64_t pitch;
    const uint16_t* row(int64_t k) const { return p + k * pitch; }
};

inline float at(const float* p, int64_t i) { return p[i]; }
inline float at(float v, int64_t) { return v; }
inline float at(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// An operand as vm.cpp hands it over: its values (full) or a broadcast value per row / run.
struct Arg {
    const float* p;
    int64_t step;
    bool full;
};

// Whether the operand reads the same way however the rows are cut: values, or one value.
inline bool flat(Arg x) { return x.full || x.step == 0; }

// fn(Vec or Row), the operand's access for rows of `len` elements.
template <typename Fn>
inline void access(Arg x, int64_t len, Fn&& fn) {
    if (x.full) return fn(Vec{x.p, len});
    fn(Row{x.p, x.step});
}

template <typename F>
inline void map1(float* d, const float* a, int64_t n, F f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = f(a[i]);
}

// d[k * len + i] <- f(a, b) over `rows` rows of `len` elements, f giving the element type T.
template <typename T, typename A, typename B, typename F>
inline void map2(T* d, A a, B b, int64_t rows, int64_t len, F f) {
    for (int64_t k = 0; k < rows; ++k) {
        const auto x = a.row(k);
        const auto y = b.row(k);
        T* dk = d + k * len;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) dk[i] = f(at(x, i), at(y, i));
    }
}

// Asks for the cache lines of p[TILE, TILE + n): what a loop streaming an input from memory
// reads a tile later, asked for a little at a time as it goes (a tile's worth asked for at once
// stalls the loop until the lines come). GCC's vectoriser drops __builtin_prefetch from loops
// it vectorises: the empty asm statement keeps this loop scalar and its prefetches in place.
template <typename T>
inline void prefetch_ahead(const T* p, int64_t n) {
    const char* at = reinterpret_cast<const char*>(p + TILE);
    for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(at + b, 0, 3);
        asm volatile("");
    }
}

#if defined(__AVX512F__)
// d[i] = f(a[i]) with f on 16 lanes (the AVX-512 build's sigmoid16, gelu16).
template <typename F>
inline void map16(float* d, const float* a, int64_t n, F f) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(i, n);
        store16(d + i, m, f(load16(a + i, m)));
    }
}

// store16, but a whole vector into 64-byte aligned fp32 storage with a non-temporal store when
// `stream` (see STREAM_BYTES in vm.cpp).
inline void put16(float* p, __mmask16 m, __m512 v, bool stream) {
    if (stream && m == 0xffff && !(reinterpret_cast<uintptr_t>(p) & 63u)) _mm512_stream_ps(p, v);
    else store16(p, m, v);
}
inline void put16(uint16_t* p, __mmask16 m, __m512 v, bool) { store16(p, m, v); }
#endif

// silu_into's y when there is no product.
struct NoFactor {};
constexpr const NoFactor* NO_FACTOR = nullptr;

// d[i] = silu(x[i]), times y[i] unless y is NoFactor; x and y fp32 or bf16 read in place, d
// fp32 or bf16 (rounded; fp32 with non-temporal stores when `stream`, on AVX-512 builds). One
// loop, the same bits as the SIGMOID and MUL instructions apart.
template <typename O, typename X, typename Y>
void silu_into(O* d, const X* x, const Y* y, int64_t n, [[maybe_unused]] bool stream) {
    constexpr bool times = !std::is_same_v<Y, NoFactor>;
#if defined(__AVX512F__)
    constexpr int64_t step = 16;  // a vector
#else
    constexpr int64_t step = 64;  // chunks for GCC's vector loop: at 16 the v3 bf16 SiLU ran
                                  // at 26.5 ms (8192x4096), at 64 at 23.4
#endif
    for (int64_t c = 0; c < n; c += step) {
        prefetch_ahead(x + c, step);
        if constexpr (times) prefetch_ahead(y + c, step);
#if defined(__AVX512F__)
        const __mmask16 m = lanes(c, n);
        __m512 v = silu16(load16(x + c, m));
        if constexpr (times) v = _mm512_mul_ps(v, load16(y + c, m));
        put16(d + c, m, v, stream);
#else
        const int64_t end = std::min(n, c + step);
#pragma omp simd
        for (int64_t i = c; i < end; ++i) {
            float v = silu_f(at(x, i));
            if constexpr (times) v *= at(y, i);
            if constexpr (std::is_same_v<O, float>) d[i] = v;
            else d[i] = f32_to_bf16(v);
        }
#endif
    }
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
        case ERF: return map1(d, a, n, erf_f);
#if defined(__AVX512F__)
        case SIGMOID: return map16(d, a, n, [](__m512 x) { return sigmoid16(x); });
        case GELU: return map16(d, a, n, [](__m512 x) { return gelu16(x); });
#else
        case SIGMOID: return map1(d, a, n, sigmoid_f);
        case GELU: return map1(d, a, n, gelu_f);
#endif
        case SIN: return sin_cos(d, a, n, 0);
        case COS: return sin_cos(d, a, n, 1);
        case NOT: return map1(d, a, n, [](float x) { return x == 0.0f ? 1.0f : 0.0f; });
        case CAST_BF16: return round_bf16(a, d, n);
        case CAST_F16: return round_f16(a, d, n);
        default: return;
    }
}

inline float truth(bool v) { return v ? 1.0f : 0.0f; }

// A run's values from column c on: in place, or a broadcast value filled into `buf`.
inline const float* chunk(const float* p, int64_t c, int64_t, float*) { return p + c; }
inline const float* chunk(float v, int64_t, int64_t m, float* buf) {
    fill(buf, v, m);
    return buf;
}

// pow with a broadcast operand: GCC hoists pow_f's tests on the invariant out of the loop
// into forms it then cannot vectorise, so the value is filled out, a chunk at a time.
template <typename A, typename B>
inline void pow_chunks(float* d, A a, B b, int64_t rows, int64_t len) {
    constexpr int64_t CHUNK = 256;
    float fa[CHUNK], fb[CHUNK];
    for (int64_t k = 0; k < rows; ++k) {
        const auto x = a.row(k);
        const auto y = b.row(k);
        for (int64_t c = 0; c < len; c += CHUNK) {
            const int64_t m = std::min(CHUNK, len - c);
            const Vec xs{chunk(x, c, m, fa), 0}, ys{chunk(y, c, m, fb), 0};
            map2(d + k * len + c, xs, ys, 1, m, pow_f);
        }
    }
}

template <typename A, typename B>
inline void binary_as(int32_t op, float* d, A a, B b, int64_t rows, int64_t len) {
    const auto go = [&](auto f) { map2(d, a, b, rows, len, f); };
    constexpr bool broadcast = !std::is_same_v<A, Vec> || !std::is_same_v<B, Vec>;
    if constexpr (broadcast) {
        if (op == POW) return pow_chunks(d, a, b, rows, len);
    }
    switch (op) {
        case ADD: return go([](float x, float y) { return x + y; });
        case SUB: return go([](float x, float y) { return x - y; });
        case MUL: return go([](float x, float y) { return x * y; });
        case DIV: return go([](float x, float y) { return x / y; });
        case POW: return go(pow_f);
        case MAX: return go(max_f);
        case MIN: return go(min_f);
        case EQ: return go([](float x, float y) { return truth(x == y); });
        case NE: return go([](float x, float y) { return truth(x != y); });
        case LT: return go([](float x, float y) { return truth(x < y); });
        case LE: return go([](float x, float y) { return truth(x <= y); });
        case GT: return go([](float x, float y) { return truth(x > y); });
        case GE: return go([](float x, float y) { return truth(x >= y); });
        case AND: return go([](float x, float y) { return truth(x != 0.0f && y != 0.0f); });
        case OR: return go([](float x, float y) { return truth(x != 0.0f || y != 0.0f); });
        default: return;
    }
}

// dst <- op(a, b) over `rows` rows of `len` elements; at least one operand full (so is the
// result).
inline void binary(int32_t op, float* d, Arg a, Arg b, int64_t rows, int64_t len) {
    if (a.full && b.full) return binary_as(op, d, Vec{a.p, 0}, Vec{b.p, 0}, 1, rows * len);
    if (flat(a) && flat(b)) {
        len *= rows;
        rows = 1;
    }
    if (a.full) return binary_as(op, d, Vec{a.p, len}, Row{b.p, b.step}, rows, len);
    binary_as(op, d, Row{a.p, a.step}, Vec{b.p, len}, rows, len);
}

// go(f) with f the arithmetic of ADD, SUB, MUL or DIV (the binary ops fused with a neighbour),
// on floats or (GCC's vector operators) 16-lane vectors.
template <typename Go>
inline void with_arithmetic(int32_t op, Go&& go) {
    switch (op) {
        case ADD: return go([](auto x, auto y) { return x + y; });
        case SUB: return go([](auto x, auto y) { return x - y; });
        case MUL: return go([](auto x, auto y) { return x * y; });
        case DIV: return go([](auto x, auto y) { return x / y; });
        default: return;
    }
}

#if defined(__AVX512F__)
// An operand's 16 lanes from element i on (a broadcast one's value in every lane).
inline __m512 lanes16(const float* p, int64_t i, __mmask16 m) { return load16(p + i, m); }
inline __m512 lanes16(const uint16_t* p, int64_t i, __mmask16 m) { return load16(p + i, m); }
inline __m512 lanes16(float v, int64_t, __mmask16) { return _mm512_set1_ps(v); }

// Asks for an operand's lines a tile ahead (see prefetch_ahead); none for a broadcast value.
template <typename T>
inline void prefetch16(const T* p, int64_t i) { prefetch_ahead(p + i, 16); }
inline void prefetch16(float, int64_t) {}

// d[k * len + i] <- gelu(f(a, b)) 16 lanes at a time, d fp32 (streamed when `stream`) or
// bf16 (rounded).
template <typename O, typename A, typename B, typename F>
inline void map2_gelu16(O* d, A a, B b, int64_t rows, int64_t len, F f, bool stream) {
    for (int64_t k = 0; k < rows; ++k) {
        const auto x = a.row(k);
        const auto y = b.row(k);
        O* dk = d + k * len;
        for (int64_t i = 0; i < len; i += 16) {
            prefetch16(x, i);
            prefetch16(y, i);
            const __mmask16 m = lanes(i, len);
            put16(dk + i, m, gelu16(f(lanes16(x, i, m), lanes16(y, i, m))), stream);
        }
    }
}
#endif

// The unary ops a binary op's loop applies to its result when only they read it (BIN_UNARY):
// the costly ones, whose own pass over the tile the fusion saves. SIGMOID has its own fusions.
inline bool fuses_after_binary(int32_t op) {
    return op == EXP || op == TANH || op == ERF || op == GELU;
}

template <typename A, typename B, typename G>
inline void binary_then(int32_t op, float* d, A a, B b, int64_t rows, int64_t len, G g) {
    with_arithmetic(op, [&](auto f) {
        map2(d, a, b, rows, len, [&](float x, float y) { return g(f(x, y)); });
    });
}

// binary_then with u's function; `stream`: see map2_gelu16 (GELU on AVX-512 builds only).
template <typename A, typename B>
inline void binary_unary_as(int32_t op, int32_t u, float* d, A a, B b, int64_t rows,
                            int64_t len, [[maybe_unused]] bool stream) {
    switch (u) {
        case EXP: return binary_then(op, d, a, b, rows, len, [](float v) { return exp_f(v); });
        case TANH: return binary_then(op, d, a, b, rows, len, [](float v) { return tanh_f(v); });
        case ERF: return binary_then(op, d, a, b, rows, len, [](float v) { return erf_f(v); });
#if defined(__AVX512F__)
        case GELU:
            return with_arithmetic(op, [&](auto f) { map2_gelu16(d, a, b, rows, len, f, stream); });
#else
        case GELU: return binary_then(op, d, a, b, rows, len, [](float v) { return gelu_f(v); });
#endif
        default: return;
    }
}

// dst <- u(op(a, b)) in one loop: an ADD/SUB/MUL/DIV whose result only the unary op u (see
// fuses_after_binary) reads next; the same operations, so the same bits, as the two apart.
inline void binary_unary(int32_t op, int32_t u, float* d, Arg a, Arg b, int64_t rows,
                         int64_t len, bool stream) {
    if (a.full && b.full)
        return binary_unary_as(op, u, d, Vec{a.p, 0}, Vec{b.p, 0}, 1, rows * len, stream);
    if (flat(a) && flat(b)) {
        len *= rows;
        rows = 1;
    }
    if (a.full)
        return binary_unary_as(op, u, d, Vec{a.p, len}, Row{b.p, b.step}, rows, len, stream);
    binary_unary_as(op, u, d, Row{a.p, a.step}, Vec{b.p, len}, rows, len, stream);
}

#if defined(__AVX512F__)
// gelu(op(x, other)) (x first) or gelu(op(other, x)), x a bf16 input read in place, into d
// (fp32, streamed when `stream`, or bf16 rounded): the AVX-512 build's LOAD_GELU loop.
template <typename O>
inline void binary_gelu_bf16(int32_t op, O* d, const uint16_t* x, bool first, Arg other,
                             int64_t rows, int64_t len, bool stream) {
    if (flat(other)) {
        len *= rows;
        rows = 1;
    }
    access(other, len, [&](auto y) {
        with_arithmetic(op, [&](auto f) {
            if (first) map2_gelu16(d, Vec16{x, len}, y, rows, len, f, stream);
            else map2_gelu16(d, y, Vec16{x, len}, rows, len, f, stream);
        });
    });
}
#endif

// dst <- op(a, b) rounded to bf16 straight into a bf16 output (the result is not read
// again): one loop instead of the op's and the store's. ADD, SUB, MUL, DIV only.
inline bool fuses_into_bf16(int32_t op) { return op >= ADD && op <= DIV; }

template <typename A, typename B>
inline void binary_bf16_as(int32_t op, uint16_t* d, A a, B b, int64_t rows, int64_t len) {
    with_arithmetic(op, [&](auto f) {
        map2(d, a, b, rows, len, [&](float x, float y) { return f32_to_bf16(f(x, y)); });
    });
}

inline void binary_bf16(int32_t op, uint16_t* d, Arg a, Arg b, int64_t rows, int64_t len) {
    if (a.full && b.full) return binary_bf16_as(op, d, Vec{a.p, 0}, Vec{b.p, 0}, 1, rows * len);
    if (flat(a) && flat(b)) {
        len *= rows;
        rows = 1;
    }
    if (a.full) return binary_bf16_as(op, d, Vec{a.p, len}, Row{b.p, b.step}, rows, len);
    binary_bf16_as(op, d, Row{a.p, a.step}, Vec{b.p, len}, rows, len);
}

// A bit select (no blend instruction needed, so SSE2 builds vectorise it too).
template <typename C, typename A, typename B>
inline void where_as(float* d, C c, A a, B b, int64_t rows, int64_t len) {
    for (int64_t k = 0; k < rows; ++k) {
        const auto ck = c.row(k);
        const auto ak = a.row(k);
        const auto bk = b.row(k);
        float* dk = d + k * len;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) {
            const uint32_t take_a = 0u - static_cast<uint32_t>(at(ck, i) != 0.0f);
            dk[i] = as_float((as_bits(at(ak, i)) & take_a) | (as_bits(at(bk, i)) & ~take_a));
        }
    }
}

// dst <- a where c != 0 else b; at least one operand full (so is the result).
inline void where(float* d, Arg c, Arg a, Arg b, int64_t rows, int64_t len) {
    if (c.full && a.full && b.full)
        return where_as(d, Vec{c.p, 0}, Vec{a.p, 0}, Vec{b.p, 0}, 1, rows * len);
    if (flat(c) && flat(a) && flat(b)) {
        len *= rows;
        rows = 1;
    }
    access(c, len, [&](auto x) {
        access(a, len, [&](auto y) {
            if constexpr (std::is_same_v<decltype(x), Row> && std::is_same_v<decltype(y), Row>)
                where_as(d, x, y, Vec{b.p, len}, rows, len);  // the full one
            else
                access(b, len, [&](auto z) { where_as(d, x, y, z, rows, len); });
        });
    });
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

// The sum of a row's products a[i] * b[i] (MUL then REDUCE_SUM/MEAN in one pass, the
// product not kept): row_sum's lanes and order, each product fused into its addition.
inline float row_dot(const float* a, const float* b, int64_t n) {
    float acc[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
    }
    for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
    for (int64_t w = LANES / 2; w > 0; w /= 2) {
#pragma omp simd
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
    }
    return acc[0];
}

// row_dot(x, x) of a bf16 row, widening it into `keep` on the way (the same lanes and order as
// widening first, then row_dot: the same sum).
inline float row_square_widen(const uint16_t* x, float* keep, int64_t n) {
    float acc[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        prefetch_ahead(x + i, LANES);
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) {
            const float v = bf16_to_f32(x[i + l]);
            keep[i + l] = v;
            acc[l] += v * v;
        }
    }
    for (int64_t l = 0; i + l < n; ++l) {
        const float v = bf16_to_f32(x[i + l]);
        keep[i + l] = v;
        acc[l] += v * v;
    }
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

// d[k] <- the reduction of row k of a (`rows` rows of `row` elements): a row-scalar.
inline void reduce(int32_t op, float* d, const float* a, int64_t rows, int64_t row) {
    for (int64_t k = 0; k < rows; ++k) {
        const float v = op == REDUCE_MAX ? row_max(a + k * row, row) : row_sum(a + k * row, row);
        d[k] = op == REDUCE_MEAN ? v / static_cast<float>(row) : v;
    }
}

// d[k] <- REDUCE_SUM or REDUCE_MEAN (op) of row k of a * b.
inline void reduce_dot(int32_t op, float* d, const float* a, const float* b, int64_t rows,
                       int64_t row) {
    for (int64_t k = 0; k < rows; ++k) {
        const float v = row_dot(a + k * row, b + k * row, row);
        d[k] = op == REDUCE_MEAN ? v / static_cast<float>(row) : v;
    }
}

// The reduction of a row of `row` elements all equal to v: the sum is the exact value rounded
// once, the mean that sum over the row's length, as `reduce` takes it (a sum past float's range
// is inf, and so is its mean, as in eager). A sum of -0.0s is +0.0, as a sum from +0.0 gives
// (row_sum, eager's kernels).
inline float reduce_constant(int32_t op, float v, int64_t row) {
    if (op == REDUCE_MAX) return v;
    const float sum = v * static_cast<float>(row) + 0.0f;
    return op == REDUCE_MEAN ? sum / static_cast<float>(row) : sum;
}

}  // namespace dvm
