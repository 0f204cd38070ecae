// Storage dtypes <-> the VM's fp32 registers, a run of n elements at a time. 16-bit stores
// round to nearest even and keep NaN a NaN; bool loads give 0/1 and bool stores write v != 0
// (so NaN is true, as torch's .bool()). fp16 uses the F16C instructions where the build has
// them (x86-64-v3 and up), else exact integer code written with selects.
#pragma once

#include <cstdint>

#include "vmath.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace dvm {

inline float bf16_to_f32(uint16_t h) { return as_float(static_cast<uint32_t>(h) << 16); }

// v rounded to nearest even at bf16 precision, as fp32 bits (the low 16 bits are garbage):
// NaN keeps its sign and payload's top bits and is made quiet. Selecting among 32-bit values
// before narrowing lets the vector loops pack once per vector instead of once per select arm.
inline uint32_t bf16_round_bits(float v) {
    const uint32_t u = as_bits(v);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return v == v ? rounded : u | 0x00400000u;
}

inline uint16_t f32_to_bf16(float v) { return static_cast<uint16_t>(bf16_round_bits(v) >> 16); }

// binary16 -> binary32: shifting the exponent and mantissa into a float's places and
// multiplying by 2^112 rebases the exponent (exact, subnormals included); inf/NaN keep their
// mantissa under an all-ones exponent.
inline float f16_to_f32(uint16_t h) {
    const uint32_t body = static_cast<uint32_t>(h & 0x7fffu);
    const uint32_t scaled = as_bits(as_float(body << 13) * 5.192296858534828e33f);  // 2^112
    const uint32_t mag = body >= 0x7c00u ? (body << 13) | 0x7f800000u : scaled;
    return as_float(mag | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// binary32 -> binary16, round to nearest even: below 2^-14 the FPU rounds |v| + 0.5 to the
// subnormal's mantissa; above, the exponent is rebased and bit 13 rounded; >= 65520 is inf.
inline uint16_t f32_to_f16(float v) {
    const uint32_t u = as_bits(v);
    const uint32_t a = u & 0x7fffffffu;
    const uint32_t sub = as_bits(as_float(a) + 0.5f) - 0x3f000000u;
    const uint32_t norm = ((a - 0x38000000u) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    uint32_t h = a < 0x38800000u ? sub : norm;
    h = a >= 0x477ff000u ? 0x7c00u : h;
    h = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : h;
    return static_cast<uint16_t>(h | ((u >> 16) & 0x8000u));
}

#if defined(__AVX512F__)
// 16 lanes of fp32 or bf16 storage <-> a register, the lanes outside mask m not touched (a
// run's tail); the bf16 store rounds as f32_to_bf16.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
// The lanes of a 16-lane step at i of a run of n: all, or the tail's.
inline __mmask16 lanes(int64_t i, int64_t n) {
    return n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
}
#endif

inline void widen_f32(const float* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];
}
inline void widen_bf16(const uint16_t* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}
inline void widen_bool(const uint8_t* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] != 0 ? 1.0f : 0.0f;
}
inline void widen_f16(const uint16_t* s, float* d, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) d[i] = f16_to_f32(s[i]);
}

inline void narrow_f32(const float* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];
}
inline void narrow_bf16(const float* s, uint16_t* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
}
inline void narrow_bool(const float* s, uint8_t* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] != 0.0f;
}
inline void narrow_f16(const float* s, uint16_t* d, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
    }
#endif
    for (; i < n; ++i) d[i] = f32_to_f16(s[i]);
}

// s copied to d with non-temporal stores where the ISA has them (x86): the lines go to memory
// without being read first and without evicting the caches. For outputs too large to stay
// in cache; the writer fences (stream_fence) before anyone reads them.
inline void stream_f32(const float* s, float* d, int64_t n) {
    int64_t i = 0;
#if defined(__AVX__)
    for (; i < n && (reinterpret_cast<uintptr_t>(d + i) & 31u); ++i) d[i] = s[i];
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(s + i));
#elif defined(__SSE2__)
    for (; i < n && (reinterpret_cast<uintptr_t>(d + i) & 15u); ++i) d[i] = s[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(d + i, _mm_loadu_ps(s + i));
#endif
    for (; i < n; ++i) d[i] = s[i];
}

inline void stream_fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

// v rounded to bf16 / fp16 precision, staying fp32 (the CAST_* instructions).
inline void round_bf16(const float* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = as_float(bf16_round_bits(s[i]) & 0xffff0000u);
}
inline void round_f16(const float* s, float* d, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) d[i] = f16_to_f32(f32_to_f16(s[i]));
}

}  // namespace dvm
