// spore-kernels CPU library: plain C ABI (no torch or Python headers), loaded with ctypes.
// Every entry point validates its arguments and returns a status code instead of crashing;
// the Python side has already checked shapes, strides and dtypes.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };
enum Status : int32_t { OK = 0, BAD_ARGUMENT = 1, BAD_DTYPE = 2 };

inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline uint16_t f32_to_bf16(float v) {  // round to nearest, ties to even; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;  // branch-free: vectorisable
    return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

inline float f16_to_f32(uint16_t v) {
    _Float16 h;
    std::memcpy(&h, &v, sizeof(h));
    return static_cast<float>(h);
}

inline uint16_t f32_to_f16(float v) {
    _Float16 h = static_cast<_Float16>(v);  // IEEE round to nearest even
    uint16_t out;
    std::memcpy(&out, &h, sizeof(out));
    return out;
}

template <typename Load, typename Store, typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t cols, float eps,
                   int32_t threads, Load load, Store store) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; ++c) {
            float v = load(xr[c]);
            sum += v * v;
        }
        const float scale = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) yr[c] = store(load(xr[c]) * scale * load(w[c]));
    }
}

}  // namespace

extern "C" {

int32_t spore_abi_version() { return 1; }

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, computed in fp32, rounded once.
// x, y: contiguous [rows, cols]; w: contiguous [cols]; all of `dtype`.
#if defined(__x86_64__) && defined(__GNUC__)
// One build runs everywhere: GCC emits AVX-512, AVX2+FMA+F16C and baseline versions and picks
// one at load time for this CPU.
#define SPORE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPORE_CLONES
#endif

SPORE_CLONES
int32_t spore_rms_norm(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                       float eps, int32_t dtype, int32_t threads) {
    if (!x || !w || !y || rows < 0 || cols <= 0 || threads < 1) return BAD_ARGUMENT;
    switch (dtype) {
        case F32:
            rms_norm_rows(static_cast<const float*>(x), static_cast<const float*>(w),
                          static_cast<float*>(y), rows, cols, eps, threads,
                          [](float v) { return v; }, [](float v) { return v; });
            return OK;
        case BF16:
            rms_norm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                          static_cast<uint16_t*>(y), rows, cols, eps, threads,
                          [](uint16_t v) { return bf16_to_f32(v); },
                          [](float v) { return f32_to_bf16(v); });
            return OK;
        case F16:
            rms_norm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                          static_cast<uint16_t*>(y), rows, cols, eps, threads,
                          [](uint16_t v) { return f16_to_f32(v); },
                          [](float v) { return f32_to_f16(v); });
            return OK;
        default:
            return BAD_DTYPE;
    }
}

}  // extern "C"
