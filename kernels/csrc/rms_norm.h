// What rms_norm.cpp and add_rms_norm.cpp share (defined in rms_norm.cpp): the forward's row
// normalisation and the RMS backward.
#pragma once

#include <cstdint>

#include "common.h"

namespace spore {

// One row of the RMS forward: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), in fp32 (LANES
// partial sums of squares, spilled into fp64 on long rows: common.h's Lanes), each y rounded
// once; x, y [cols] of T, w [cols] in fp32. The only forward arithmetic of spore_rms_norm and
// spore_add_rms_norm (which passes its rounded sum), so add_rms_norm's y is bitwise rms_norm's of
// its sum. Instantiated for F32, BF16 and F16.
template <typename T>
void rms_norm_row(const typename T::storage* x, const float* w, typename T::storage* y,
                  int64_t cols, float eps);

// For upstream g of y = rms_norm(s) and gs of s (null: zero), all [rows, cols] of `dtype`, w
// [cols]: ds = rstd * (g*w - shat * mean(g*w*shat)) + gs and dw = sum over rows of g * shat,
// in fp32, each rounded once. OK, or BAD_DTYPE for an unknown dtype; arguments unchecked.
int32_t rms_norm_backward(const void* g, const void* gs, const void* s, const void* w, void* ds,
                          void* dw, int64_t rows, int64_t cols, float eps, int32_t dtype,
                          int32_t threads);

}  // namespace spore
