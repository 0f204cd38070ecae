// Shared by every spore-kernels C++ source: status codes, dtype codes and storage types with
// their fp32 load/store (bf16/fp16 rounded to nearest even), and the dtype switch.
// No torch or Python headers: the library has a plain C ABI and is loaded with ctypes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace spore {

enum Status : int32_t { OK = 0, BAD_ARGUMENT = 1, BAD_DTYPE = 2 };
enum DType : int32_t { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

struct F32 {
    using storage = float;
    static inline float load(float v) { return v; }
    static inline float store(float v) { return v; }
};

struct BF16 {
    using storage = uint16_t;
    static inline float load(uint16_t v) {
        const uint32_t bits = static_cast<uint32_t>(v) << 16;
        float out;
        std::memcpy(&out, &bits, sizeof(out));
        return out;
    }
    // Round to nearest, ties to even; NaN stays a (quiet) NaN. Branch-free so loops vectorise.
    static inline uint16_t store(float v) {
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const uint32_t quiet_nan = (bits >> 16) | 0x40u;
        const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
        return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
    }
};

struct F16 {
    using storage = uint16_t;
    static inline float load(uint16_t v) {
        _Float16 h;
        std::memcpy(&h, &v, sizeof(h));
        return static_cast<float>(h);
    }
    static inline uint16_t store(float v) {  // IEEE conversion: round to nearest even
        const _Float16 h = static_cast<_Float16>(v);
        uint16_t out;
        std::memcpy(&out, &h, sizeof(out));
        return out;
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
