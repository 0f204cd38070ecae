// mean_var: mean and variance over one dimension of x viewed as [outer, n, inner], forward and
// backward. Forward is one-pass Welford in fp32: independent Welford states (SIMD lanes over n
// when inner == 1, one per column otherwise) of at most STEPS values each, combined with the
// parallel merge of Chan et al. — pairwise across segments, then across the per-thread parts of
// n when there are fewer work units than threads; one rounding per output. Backward recomputes
// the mean (fp32 sums within segments, double across them); forward saves only x. Both work on
// x less a pivot, the first value of its column (when finite): a mean far from zero against
// the spread would otherwise put its fp32 rounding into every x - mean. A column whose pivot
// turns out far from its mean against its spread (a large first value) is worked out again
// with its mean as the pivot: x - pivot would otherwise round at the pivot's magnitude.
#include <omp.h>

#include <algorithm>
#include <limits>

#include "common.h"

namespace spore {
namespace {

constexpr int64_t STEPS = 128;  // Welford steps per state (LANES states per contiguous row)
constexpr int64_t ROW_SEGMENT = LANES * STEPS;
constexpr int64_t BLOCK = 4096;      // columns per work unit when inner > 1 (rows read whole)
constexpr int64_t MIN_PART = 16384;  // fewest elements worth a task of their own

// Chan et al.: fold the moments (mean_b, m2_b) of nb values into (mean_a, m2_a) of na values,
// for width columns.
inline void merge(float* mean_a, float* m2_a, int64_t na, const float* mean_b, const float* m2_b,
                  int64_t nb, int64_t width) {
    if (nb == 0) return;
    if (na == 0) {  // nothing to fold into (and d * d * 0 would be NaN where d * d overflows)
        std::copy(mean_b, mean_b + width, mean_a);
        std::copy(m2_b, m2_b + width, m2_a);
        return;
    }
    const float fb = static_cast<float>(static_cast<double>(nb) / static_cast<double>(na + nb));
    const float fab = static_cast<float>(na) * fb;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
        const float d = mean_b[j] - mean_a[j];
        mean_a[j] += d * fb;
        m2_a[j] += m2_b[j] + d * d * fab;
    }
}

// Merges the moments of consecutive segments pairwise (a binary counter of equal-count partial
// results), so long reductions do not drift the way one running Welford state does.
class Cascade {
   public:
    explicit Cascade(int64_t width) : width_(width) {}

    // Folds in the moments of count values per column (mean and m2 are overwritten).
    void push(int64_t count, float* mean, float* m2) {
        while (!counts_.empty() && counts_.back() == count) {
            const size_t top = (counts_.size() - 1) * width_;
            merge(mean, m2, count, &means_[top], &m2s_[top], count, width_);
            count *= 2;
            pop();
        }
        counts_.push_back(count);
        means_.insert(means_.end(), mean, mean + width_);
        m2s_.insert(m2s_.end(), m2, m2 + width_);
    }

    // The moments of everything pushed, into mean and m2.
    void finish(float* mean, float* m2) {
        std::fill(mean, mean + width_, 0.0f);
        std::fill(m2, m2 + width_, 0.0f);
        int64_t total = 0;
        while (!counts_.empty()) {
            const size_t top = (counts_.size() - 1) * width_;
            merge(mean, m2, total, &means_[top], &m2s_[top], counts_.back(), width_);
            total += counts_.back();
            pop();
        }
    }

   private:
    void pop() {
        counts_.pop_back();
        means_.resize(counts_.size() * width_);
        m2s_.resize(counts_.size() * width_);
    }

    int64_t width_;
    std::vector<int64_t> counts_;
    std::vector<float> means_, m2s_;
};

// The pivot of each column x[o, :, j] (at o * inner + j), the values are taken relative to:
// its first value when finite, else 0 (and 0 when n == 0).
template <typename T>
std::vector<float> pivots(const typename T::storage* x, int64_t outer, int64_t n, int64_t inner) {
    std::vector<float> shift(static_cast<size_t>(outer * inner), 0.0f);
    if (n == 0) return shift;
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t j = 0; j < inner; ++j) {
            const float p = T::load(x[o * n * inner + j]);
            shift[o * inner + j] = std::isfinite(p) ? p : 0.0f;
        }
    }
    return shift;
}

constexpr float FAR = 64.0f;  // a pivot is far from the mean past sqrt(FAR) standard deviations

// The pivot that replaces `shift` for values whose mean less shift is `dev` and whose mean
// square deviation is `var`: shift + dev when shift is far from the mean, else shift itself.
inline float repivot(float shift, float dev, float var) {
    const float moved = shift + dev;
    return dev * dev > FAR * var && std::isfinite(moved) ? moved : shift;
}

// Moments of at most ROW_SEGMENT contiguous values less `shift`: LANES Welford states (one SIMD
// step per LANES values, all lanes sharing the count), merged pairwise, then the tail.
template <typename T>
void row_segment(const typename T::storage* x, int64_t len, float shift, float* mean_out,
                 float* m2_out) {
    float mean[LANES] = {}, m2[LANES] = {};
    const int64_t chunks = len / LANES;
    for (int64_t k = 0; k < chunks; ++k) {
        const float inv = 1.0f / static_cast<float>(k + 1);
        const auto* xk = x + k * LANES;
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) {
            const float v = T::load(xk[l]) - shift;
            const float d = v - mean[l];
            mean[l] += d * inv;
            m2[l] += d * (v - mean[l]);
        }
    }
    int64_t count = chunks;
    for (int64_t width = LANES / 2; width >= 1; width /= 2) {
        merge(mean, m2, count, mean + width, m2 + width, count, width);
        count *= 2;
    }
    float tail_mean = 0.0f, tail_m2 = 0.0f;
    const int64_t done = chunks * LANES;
    for (int64_t i = done; i < len; ++i) {
        const float v = T::load(x[i]) - shift;
        const float d = v - tail_mean;
        tail_mean += d / static_cast<float>(i - done + 1);
        tail_m2 += d * (v - tail_mean);
    }
    merge(mean, m2, done, &tail_mean, &tail_m2, len - done, 1);
    *mean_out = mean[0];
    *m2_out = m2[0];
}

// Moments of len contiguous values less `shift`: segments of ROW_SEGMENT, merged pairwise.
template <typename T>
void row_moments(const typename T::storage* x, int64_t len, float shift, float* mean,
                 float* m2) {
    if (len <= ROW_SEGMENT) {
        row_segment<T>(x, len, shift, mean, m2);
        return;
    }
    Cascade cascade(1);
    for (int64_t i = 0; i < len; i += ROW_SEGMENT) {
        const int64_t count = std::min(ROW_SEGMENT, len - i);
        row_segment<T>(x + i, count, shift, mean, m2);
        cascade.push(count, mean, m2);
    }
    cascade.finish(mean, m2);
}

// Moments of at most STEPS rows of width columns (rows stride apart) less the row `shift`: a
// Welford state per column, updated by four rows at a time in registers (one load and store of
// the state per four rows).
template <typename T>
void block_segment(const typename T::storage* x, int64_t len, int64_t stride, int64_t width,
                   const float* shift, float* mean, float* m2) {
    std::fill(mean, mean + width, 0.0f);
    std::fill(m2, m2 + width, 0.0f);
    int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
        float inv[4];
        for (int64_t k = 0; k < 4; ++k) inv[k] = 1.0f / static_cast<float>(i + k + 1);
        const auto* xi = x + i * stride;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
            float m = mean[j], q = m2[j];
            for (int64_t k = 0; k < 4; ++k) {
                const float v = T::load(xi[k * stride + j]) - shift[j];
                const float d = v - m;
                m += d * inv[k];
                q += d * (v - m);
            }
            mean[j] = m;
            m2[j] = q;
        }
    }
    for (; i < len; ++i) {
        const float inv = 1.0f / static_cast<float>(i + 1);
        const auto* xi = x + i * stride;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
            const float v = T::load(xi[j]) - shift[j];
            const float d = v - mean[j];
            mean[j] += d * inv;
            m2[j] += d * (v - mean[j]);
        }
    }
}

// Moments of len rows of width columns (rows stride apart) less the row `shift`: segments of
// STEPS rows, merged pairwise.
template <typename T>
void block_moments(const typename T::storage* x, int64_t len, int64_t stride, int64_t width,
                   const float* shift, float* mean, float* m2) {
    if (len <= STEPS) {
        block_segment<T>(x, len, stride, width, shift, mean, m2);
        return;
    }
    Cascade cascade(width);
    for (int64_t i = 0; i < len; i += STEPS) {
        const int64_t count = std::min(STEPS, len - i);
        block_segment<T>(x + i * stride, count, stride, width, shift, mean, m2);
        cascade.push(count, mean, m2);
    }
    cascade.finish(mean, m2);
}

// How the work is cut: units of (outer index, block of up to BLOCK columns), each split into
// parts along n when there are fewer units than threads (about four tasks per thread then).
struct Plan {
    int64_t n, block, blocks, units, parts;

    Plan(int64_t outer, int64_t n_, int64_t inner, int32_t threads) : n(n_) {
        block = std::min(BLOCK, inner);
        blocks = (inner + block - 1) / block;
        units = outer * blocks;
        const int64_t busy = std::max<int64_t>(units, 1);
        const int64_t wanted = units >= threads ? 1 : (4 * threads + busy - 1) / busy;
        parts = std::max<int64_t>(1, std::min(wanted, n * block / MIN_PART));
    }

    int64_t begin(int64_t part) const { return part * n / parts; }
    int64_t length(int64_t part) const { return begin(part + 1) - begin(part); }
    int64_t outer_of(int64_t unit) const { return unit / blocks; }
    int64_t column_of(int64_t unit) const { return (unit % blocks) * block; }
};

// The moments of x[o, :, j] less shift[o * inner + j], part p's at pmean and pm2's
// (o * parts + p) * inner + j, then merged into part 0's.
template <typename T>
void moments(const typename T::storage* x, const Plan& plan, int64_t outer, int64_t inner,
             const float* shift, float* pmean, float* pm2, int32_t threads) {
    const int64_t n = plan.n, parts = plan.parts;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < plan.units * parts; ++task) {
        const int64_t unit = task / parts, p = task % parts;
        const int64_t o = plan.outer_of(unit), j0 = plan.column_of(unit);
        const auto* base = x + (o * n + plan.begin(p)) * inner + j0;
        const int64_t at = (o * parts + p) * inner + j0;
        const float* s = &shift[o * inner + j0];
        if (inner == 1) {
            row_moments<T>(base, plan.length(p), s[0], &pmean[at], &pm2[at]);
        } else {
            const int64_t width = std::min(plan.block, inner - j0);
            block_moments<T>(base, plan.length(p), inner, width, s, &pmean[at], &pm2[at]);
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < outer; ++o) {
        float* mean = &pmean[o * parts * inner];
        float* m2 = &pm2[o * parts * inner];
        int64_t count = plan.length(0);
        for (int64_t p = 1; p < parts; ++p) {
            merge(mean, m2, count, mean + p * inner, m2 + p * inner, plan.length(p), inner);
            count += plan.length(p);
        }
    }
}

template <typename T>
void mean_var_fwd(const void* xp, void* meanp, void* varp, int64_t outer, int64_t n,
                  int64_t inner, int64_t correction, int32_t threads) {
    const auto* x = in<T>(xp);
    const Plan plan(outer, n, inner, threads);
    const int64_t parts = plan.parts;
    // Moments of part p of x[o, :, j] less shift[o * inner + j] at (o * parts + p) * inner + j.
    std::vector<float> pmean(static_cast<size_t>(outer * parts * inner));
    std::vector<float> pm2(pmean.size());
    std::vector<float> shift = pivots<T>(x, outer, n, inner);
    moments<T>(x, plan, outer, inner, shift.data(), pmean.data(), pm2.data(), threads);
    bool moved = false;
    for (int64_t o = 0; n > 0 && o < outer; ++o) {
        for (int64_t j = 0; j < inner; ++j) {
            const int64_t at = o * parts * inner + j;
            float& s = shift[o * inner + j];
            const float pivot = repivot(s, pmean[at], pm2[at] / static_cast<float>(n));
            moved = moved || pivot != s;
            s = pivot;
        }
    }
    if (moved) moments<T>(x, plan, outer, inner, shift.data(), pmean.data(), pm2.data(), threads);
    auto* mean_out = out<T>(meanp);
    auto* var_out = out<T>(varp);
    const float divisor = static_cast<float>(std::max<int64_t>(n - correction, 0));
    const float nan = std::numeric_limits<float>::quiet_NaN();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < outer; ++o) {
        const float* mean = &pmean[o * parts * inner];
        const float* m2 = &pm2[o * parts * inner];
        for (int64_t j = 0; j < inner; ++j) {
            mean_out[o * inner + j] = T::store(n > 0 ? mean[j] + shift[o * inner + j] : nan);
            var_out[o * inner + j] = T::store(n > 0 ? m2[j] / divisor : nan);
        }
    }
}

// Column sums of len rows of width columns (rows stride apart) less the row `shift`, and of
// their squares, added into sum and sq: fp32 within segments (ROW_SEGMENT values, or STEPS
// rows), double across them. scratch holds 2 * width floats.
template <typename T>
void block_sums(const typename T::storage* x, int64_t len, int64_t stride, int64_t width,
                const float* shift, double* sum, double* sq, float* scratch) {
    if (stride == 1) {  // inner == 1: one contiguous column
        const float s0 = shift[0];
        for (int64_t i0 = 0; i0 < len; i0 += ROW_SEGMENT) {
            const int64_t i1 = std::min(len, i0 + ROW_SEGMENT);
            float s = 0.0f, q = 0.0f;
#pragma omp simd reduction(+ : s, q)
            for (int64_t i = i0; i < i1; ++i) {
                const float d = T::load(x[i]) - s0;
                s += d;
                q += d * d;
            }
            sum[0] += s;
            sq[0] += q;
        }
        return;
    }
    float* ps = scratch;
    float* pq = scratch + width;
    for (int64_t i0 = 0; i0 < len; i0 += STEPS) {
        const int64_t i1 = std::min(len, i0 + STEPS);
        std::fill(scratch, scratch + 2 * width, 0.0f);
        int64_t i = i0;
        for (; i + 4 <= i1; i += 4) {  // four rows per load and store of the partial sums
            const auto* xi = x + i * stride;
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) {
                const float s = shift[j];
                const float d0 = T::load(xi[j]) - s, d1 = T::load(xi[stride + j]) - s;
                const float d2 = T::load(xi[2 * stride + j]) - s;
                const float d3 = T::load(xi[3 * stride + j]) - s;
                ps[j] += (d0 + d1) + (d2 + d3);
                pq[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
            }
        }
        for (; i < i1; ++i) {
            const auto* xi = x + i * stride;
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) {
                const float d = T::load(xi[j]) - shift[j];
                ps[j] += d;
                pq[j] += d * d;
            }
        }
        for (int64_t j = 0; j < width; ++j) {
            sum[j] += ps[j];
            sq[j] += pq[j];
        }
    }
}

// dx = a + b * ((x - shift) - mean) over len rows of width columns, a, b, shift and mean (of
// x less shift) per column.
template <typename T>
void block_grads(const typename T::storage* x, typename T::storage* dx, int64_t len,
                 int64_t stride, int64_t width, const float* a, const float* b,
                 const float* shift, const float* mean) {
    if (stride == 1) {  // inner == 1: one contiguous column
        const float a0 = a[0], b0 = b[0], s0 = shift[0], m0 = mean[0];
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) {
            dx[i] = T::store(a0 + b0 * ((T::load(x[i]) - s0) - m0));
        }
        return;
    }
    for (int64_t i = 0; i < len; ++i) {
        const auto* xi = x + i * stride;
        auto* di = dx + i * stride;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
            di[j] = T::store(a[j] + b[j] * ((T::load(xi[j]) - shift[j]) - mean[j]));
        }
    }
}

// dx = gm / n + gv * 2 (x - mean) / (n - correction); gm or gv null means zero, and a zero gv
// adds nothing even where n == correction (an unused variance). With one part per unit each
// unit's sums and gradients run back to back (a row is still in cache); otherwise all partial
// sums first, then the gradients. A unit whose pivots moved has its sums taken again.
template <typename T>
void mean_var_bwd(const void* gmp, const void* gvp, const void* xp, void* dxp, int64_t outer,
                  int64_t n, int64_t inner, int64_t correction, int32_t threads) {
    const auto* gm = in<T>(gmp);
    const auto* gv = in<T>(gvp);
    const auto* x = in<T>(xp);
    auto* dx = out<T>(dxp);
    const Plan plan(outer, n, inner, threads);
    const int64_t parts = plan.parts;
    // Partial sums of part p at (o * parts + p) * inner + j; their squares `cells` further on.
    const int64_t cells = parts > 1 ? outer * parts * inner : 0;
    std::vector<double> psum(static_cast<size_t>(2 * cells), 0.0);
    std::vector<char> moved(static_cast<size_t>(plan.units), 0);
    const float inv_n = 1.0f / static_cast<float>(n);
    const float twice_inv_dof = 2.0f / static_cast<float>(n - correction);
    std::vector<float> shift = pivots<T>(x, outer, n, inner);
    auto width_of = [&](int64_t unit) { return std::min(plan.block, inner - plan.column_of(unit)); };
    auto sums = [&](int64_t unit, int64_t p, double* sum, double* sq, float* scratch) {
        const int64_t o = plan.outer_of(unit), j0 = plan.column_of(unit);
        const auto* base = x + (o * n + plan.begin(p)) * inner + j0;
        block_sums<T>(base, plan.length(p), inner, width_of(unit), &shift[o * inner + j0], sum, sq,
                      scratch);
    };
    // Moves the unit's pivots that are far from their column's mean (sum, sq: its totals).
    auto repivoted = [&](int64_t unit, const double* sum, const double* sq) {
        const int64_t at = plan.outer_of(unit) * inner + plan.column_of(unit);
        bool any = false;
        for (int64_t j = 0; j < width_of(unit); ++j) {
            const double dev = sum[j] / static_cast<double>(n);
            const double var = std::max(sq[j] / static_cast<double>(n) - dev * dev, 0.0);
            const float pivot = repivot(shift[at + j], static_cast<float>(dev), static_cast<float>(var));
            any = any || pivot != shift[at + j];
            shift[at + j] = pivot;
        }
        return any;
    };
    // scratch: 3 * block floats for a, b and the mean.
    auto grads = [&](int64_t unit, int64_t p, const double* sum, float* scratch) {
        const int64_t o = plan.outer_of(unit), j0 = plan.column_of(unit);
        const int64_t width = width_of(unit);
        float* a = scratch;
        float* b = scratch + plan.block;
        float* mean = scratch + 2 * plan.block;
        for (int64_t j = 0; j < width; ++j) {
            const int64_t k = o * inner + j0 + j;
            mean[j] = static_cast<float>(sum[j] / static_cast<double>(n));
            a[j] = gm ? T::load(gm[k]) * inv_n : 0.0f;
            const float g = gv ? T::load(gv[k]) : 0.0f;
            b[j] = g == 0.0f ? 0.0f : g * twice_inv_dof;  // n == correction: 0 * inf is not NaN
        }
        const int64_t at = (o * n + plan.begin(p)) * inner + j0;
        block_grads<T>(x + at, dx + at, plan.length(p), inner, width, a, b, &shift[o * inner + j0],
                       mean);
    };
    // The unit's sums over all parts, into sum and sq.
    auto totals = [&](int64_t unit, double* sum, double* sq) {
        const int64_t o = plan.outer_of(unit), j0 = plan.column_of(unit);
        std::fill(sum, sum + plan.block, 0.0);
        std::fill(sq, sq + plan.block, 0.0);
        for (int64_t q = 0; q < parts; ++q) {
            const int64_t at = (o * parts + q) * inner + j0;
            for (int64_t j = 0; j < width_of(unit); ++j) {
                sum[j] += psum[at + j];
                sq[j] += psum[cells + at + j];
            }
        }
    };
#pragma omp parallel num_threads(threads)
    {
        std::vector<double> sum(plan.block), sq(plan.block);
        std::vector<float> scratch(3 * plan.block);
        auto part_sums = [&](int64_t task) {
            const int64_t unit = task / parts, p = task % parts;
            const int64_t at = (plan.outer_of(unit) * parts + p) * inner + plan.column_of(unit);
            std::fill(&psum[at], &psum[at] + width_of(unit), 0.0);
            std::fill(&psum[cells + at], &psum[cells + at] + width_of(unit), 0.0);
            sums(unit, p, &psum[at], &psum[cells + at], scratch.data());
        };
        if (parts == 1) {
#pragma omp for schedule(static)
            for (int64_t unit = 0; unit < plan.units; ++unit) {
                for (int pass = 0; pass < 2; ++pass) {
                    std::fill(sum.begin(), sum.end(), 0.0);
                    std::fill(sq.begin(), sq.end(), 0.0);
                    sums(unit, 0, sum.data(), sq.data(), scratch.data());
                    if (pass == 1 || !repivoted(unit, sum.data(), sq.data())) break;
                }
                grads(unit, 0, sum.data(), scratch.data());
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < plan.units * parts; ++task) part_sums(task);
#pragma omp for schedule(static)
            for (int64_t unit = 0; unit < plan.units; ++unit) {
                totals(unit, sum.data(), sq.data());
                moved[unit] = repivoted(unit, sum.data(), sq.data());
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < plan.units * parts; ++task) {
                if (moved[task / parts]) part_sums(task);
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < plan.units * parts; ++task) {
                const int64_t unit = task / parts;
                totals(unit, sum.data(), sq.data());
                grads(unit, task % parts, sum.data(), scratch.data());
            }
        }
    }
}

}  // namespace
}  // namespace spore

// mean[o, j] and var[o, j] (divisor max(n - correction, 0)) of x[o, :, j] for x contiguous
// [outer, n, inner]; mean and var contiguous [outer, inner]; all of `dtype`. n == 0 gives NaN.
SPORE_EXPORT int32_t spore_mean_var(const void* x, void* mean, void* var, int64_t outer,
                                    int64_t n, int64_t inner, int64_t correction, int32_t dtype,
                                    int32_t threads) {
    if (!x || !mean || !var || outer < 0 || n < 0 || inner < 1 || correction < 0 ||
        threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        spore::mean_var_fwd<decltype(t)>(x, mean, var, outer, n, inner, correction, threads);
    });
}

// Gradient of spore_mean_var for upstream gm (of mean) and gv (of var), [outer, inner], either
// null for zero: dx [outer, n, inner] = gm / n + gv * 2 (x - mean) / (n - correction).
SPORE_EXPORT int32_t spore_mean_var_backward(const void* gm, const void* gv, const void* x,
                                             void* dx, int64_t outer, int64_t n, int64_t inner,
                                             int64_t correction, int32_t dtype, int32_t threads) {
    if (!x || !dx || outer < 0 || n < 1 || inner < 1 || correction < 0 || threads < 1) {
        return spore::BAD_ARGUMENT;
    }
    return spore::with_dtype(dtype, [&](auto t) {
        spore::mean_var_bwd<decltype(t)>(gm, gv, x, dx, outer, n, inner, correction, threads);
    });
}
