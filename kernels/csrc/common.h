// Shared by every spore-kernels C++ source: status codes, dtype codes and storage types with
// their fp32 load/store (bf16/fp16 rounded to nearest even), and the dtype switch.
// No torch or Python headers: the library has a plain C ABI and is loaded with ctypes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace spore {

enum Status : int32_t { OK = 0, BAD_ARGUMENT = 1, BAD_DTYPE = 2, OUT_OF_MEMORY = 3 };
enum DType : int32_t { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

// The bits of a float and back (memcpy: the defined way; compiles to nothing).
inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

struct F32 {
    using storage = float;
    static inline float load(float v) { return v; }
    static inline float store(float v) { return v; }
};

struct BF16 {
    using storage = uint16_t;
    static inline float load(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }
    // Round to nearest, ties to even; any NaN becomes the quiet NaN 0x7fc0. Branch-free so
    // loops vectorise.
    static inline uint16_t store(float v) {
        const uint32_t bits = float_to_bits(v);
        const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        return static_cast<uint16_t>(v != v ? 0x7fc0u : rounded);
    }
};

// IEEE binary16 <-> binary32 in integer arithmetic with selects instead of branches, so loops
// over fp16 data vectorise (GCC 12 keeps _Float16 conversions scalar). Exact for every input:
// normals, subnormals, zeros, infinities; NaN stays NaN. Stores round to nearest even.
struct F16 {
    using storage = uint16_t;
    static inline float load(uint16_t v) {
        const uint32_t h = v;
        const uint32_t magnitude = (h & 0x7fffu) << 13;  // exponent and mantissa, float-aligned
        const uint32_t exponent = magnitude & 0x0f800000u;
        const uint32_t rebased = magnitude + 0x38000000u;  // exponent bias 15 -> 127
        const uint32_t special = rebased + 0x38000000u;    // inf/NaN: all-ones exponent
        // Subnormal (and zero): value = mantissa * 2^-24, computed exactly in float.
        const float sub = bits_to_float(rebased + 0x00800000u) - bits_to_float(0x38800000u);
        const uint32_t body = exponent == 0x0f800000u ? special
                              : exponent == 0 ? float_to_bits(sub)
                                              : rebased;
        return bits_to_float(body | ((h & 0x8000u) << 16));
    }
    static inline uint16_t store(float value) {
        const uint32_t u = float_to_bits(value);
        const uint32_t sign = (u >> 16) & 0x8000u;
        const uint32_t a = u & 0x7fffffffu;
        // >= 65520 rounds to inf; NaN keeps a quiet NaN.
        const uint32_t overflow = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
        // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round the mantissa
        // (to nearest even) into the low bits of the sum.
        const uint32_t sub = float_to_bits(bits_to_float(a) + 0.5f) - 0x3f000000u;
        // Normal: rebias, then round to nearest even at bit 13.
        const uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
        const uint32_t out = a >= 0x477ff000u ? overflow : a < 0x38800000u ? sub : normal;
        return static_cast<uint16_t>(out | sign);
    }
};

// Calls fn(F32{}) / fn(BF16{}) / fn(F16{}) for a dtype code; BAD_DTYPE for any other code.
template <typename Fn>
inline int32_t with_dtype(int32_t dtype, Fn&& fn) {
    switch (dtype) {
        case DT_F32:
            fn(F32{});
            return OK;
        case DT_BF16:
            fn(BF16{});
            return OK;
        case DT_F16:
            fn(F16{});
            return OK;
        default:
            return BAD_DTYPE;
    }
}

template <typename T>
inline const typename T::storage* in(const void* p) {
    return static_cast<const typename T::storage*>(p);
}

template <typename T>
inline typename T::storage* out(void* p) {
    return static_cast<typename T::storage*>(p);
}

// Independent partial sums of a row reduction (four vectors of the build's width; a row's tail
// goes into the first lanes), so sums are bound by loads, not by one accumulator's latency.
#if defined(__AVX512F__)
constexpr int64_t LANES = 64;
#else
constexpr int64_t LANES = 32;
#endif

// The total of LANES partial sums, folded pairwise (acc is overwritten).
inline float fold(float* acc) {
    for (int64_t w = LANES / 2; w >= 1; w /= 2) {
#pragma omp simd
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
    }
    return acc[0];
}

// A long row's fp32 lane sums lose their small terms once a lane is large (a lane holding 1e8
// drops every later term under 4): a row reduction moves its lanes into fp64 ones after every
// SPILL columns that more columns follow (Lanes::spill), so at most SPILL / LANES terms of a
// lane meet one fp32 total. A row of at most SPILL columns never spills: its sum is the fp32
// fold, at no extra cost.
constexpr int64_t SPILL = 16 * LANES;

struct Lanes {
    float part[LANES] = {};
    double total[LANES];  // set by the first spill
    bool spilled = false;

    void spill() {
        if (spilled) {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) total[l] += part[l];
        } else {
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) total[l] = part[l];
            spilled = true;
        }
        std::fill(part, part + LANES, 0.0f);
    }

    // Every term so far: the fp32 fold when nothing spilled, else summed pairwise in fp64 and
    // rounded once to fp32.
    float sum() {
        if (!spilled) return fold(part);
        spill();
        for (int64_t w = LANES / 2; w >= 1; w /= 2) {
            for (int64_t l = 0; l < w; ++l) total[l] += total[l + w];
        }
        return static_cast<float>(total[0]);
    }
};

// Column sums over many rows (a weight's gradient) move from fp32 into fp64 every SPILL_ROWS
// rows of a thread, for the same reason.
constexpr int64_t SPILL_ROWS = 256;

// acc[c] into wide[c], acc cleared.
inline void spill_columns(float* acc, double* wide, int64_t cols) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
        wide[c] += acc[c];
        acc[c] = 0.0f;
    }
}

}  // namespace spore

#define SPORE_EXPORT extern "C" __attribute__((visibility("default")))

#include <type_traits>

namespace spore {

// n per-column values (a weight, a bias) as fp32: p itself for F32, else converted once into
// buf, so that row loops load fp32 instead of converting the same values again for every row.
template <typename T>
inline const float* as_f32(const void* p, int64_t n, std::vector<float>& buf) {
    if constexpr (std::is_same_v<T, F32>) {
        return static_cast<const float*>(p);
    } else {
        buf.resize(static_cast<size_t>(n));
        const auto* src = in<T>(p);
        for (int64_t i = 0; i < n; ++i) buf[i] = T::load(src[i]);
        return buf.data();
    }
}

}  // namespace spore
