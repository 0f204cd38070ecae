// The RMS backward that rms_norm.cpp and add_rms_norm.cpp share (defined in rms_norm.cpp).
#pragma once

#include <cstdint>

namespace spore {

// For upstream g of y = rms_norm(s) and gs of s (null: zero), all [rows, cols] of `dtype`, w
// [cols]: ds = rstd * (g*w - shat * mean(g*w*shat)) + gs and dw = sum over rows of g * shat,
// in fp32, each rounded once. OK, or BAD_DTYPE for an unknown dtype; arguments unchecked.
int32_t rms_norm_backward(const void* g, const void* gs, const void* s, const void* w, void* ds,
                          void* dw, int64_t rows, int64_t cols, float eps, int32_t dtype,
                          int32_t threads);

}  // namespace spore
