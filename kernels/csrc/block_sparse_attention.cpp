// block_sparse_attention forward: each query block attends to the KV blocks its list names, with
// an online softmax (running max and sum per query row) in fp32; bf16/fp16 inputs are widened
// as they are read and the output is rounded once. OpenMP over (batch x head, query block).
// Scores and the probability-weighted sum of values run in register tiles of RT rows by VT
// columns over zero-padded fp32 copies of the blocks, so the inner loops are fixed-width.
#include <omp.h>

#include <algorithm>
#include <limits>

#include "elementwise.h"

namespace spore {
namespace {

constexpr int64_t RT = 4;   // query rows per tile
constexpr int64_t VT = 16;  // key (scores) or value-dimension (output) columns per tile

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Shape {
    int64_t bh, sq, skv, d, m, bs, nq, nk;
};

// The block lists' entry: an int32 or int64 array.
inline int64_t entry(const void* p, int64_t at, bool wide) {
    return wide ? static_cast<const int64_t*>(p)[at] : static_cast<const int32_t*>(p)[at];
}

// Every count in 0..m and every listed id in 0..nk-1 (entries past a count are not read).
bool lists_valid(const void* index, const void* count, bool wide, const Shape& s) {
    for (int64_t task = 0; task < s.bh * s.nq; ++task) {
        const int64_t n = entry(count, task, wide);
        if (n < 0 || n > s.m) return false;
        for (int64_t t = 0; t < n; ++t) {
            const int64_t id = entry(index, task * s.m + t, wide);
            if (id < 0 || id >= s.nk) return false;
        }
    }
    return true;
}

// One thread's fp32 scratch, zero-padded to whole tiles.
struct Scratch {
    int64_t rp, cp, dp;   // rows, keys and value columns, padded to RT, VT and VT
    std::vector<float> q;  // [rp][d], scaled
    std::vector<float> kt; // [d][cp], the KV block's keys transposed
    std::vector<float> v;  // [cp][dp]
    std::vector<float> p;  // [rp][cp], scores, then probabilities
    std::vector<float> o;  // [rp][dp], unnormalised output
    std::vector<float> mx, sum, alpha;  // per row: running max, running sum, this block's rescale

    Scratch(const Shape& s)
        : rp(round_up(s.bs, RT)),
          cp(round_up(s.bs, VT)),
          dp(round_up(s.d, VT)),
          q(rp * s.d),
          kt(s.d * cp),
          v(cp * dp),
          p(rp * cp),
          o(rp * dp),
          mx(rp),
          sum(rp),
          alpha(rp) {}
};

// p[r][c] = sum_d q[r][d] kt[d][c] over every padded row and key.
inline void scores(Scratch& w, int64_t d) {
    for (int64_t r0 = 0; r0 < w.rp; r0 += RT) {
        for (int64_t c0 = 0; c0 < w.cp; c0 += VT) {
            float acc[RT][VT] = {};
            for (int64_t k = 0; k < d; ++k) {
                const float* kv = w.kt.data() + k * w.cp + c0;
#pragma GCC unroll 4
                for (int64_t i = 0; i < RT; ++i) {
                    const float qv = w.q[(r0 + i) * d + k];
#pragma omp simd
                    for (int64_t l = 0; l < VT; ++l) acc[i][l] = fmadd(qv, kv[l], acc[i][l]);
                }
            }
            for (int64_t i = 0; i < RT; ++i)
                std::copy(acc[i], acc[i] + VT, w.p.data() + (r0 + i) * w.cp + c0);
        }
    }
}

// The online-softmax step of one row over its c scores: new max, rescale of what came before,
// scores replaced by exp(score - max), running sum updated.
inline void softmax_step(Scratch& w, int64_t r, int64_t c) {
    float* row = w.p.data() + r * w.cp;
    float top = w.mx[r];
    for (int64_t j = 0; j < c; ++j) top = std::max(top, row[j]);
    const float before = w.mx[r];
    w.alpha[r] = before == -std::numeric_limits<float>::infinity()
                     ? 0.0f
                     : exp_nonpositive(before - top);
    w.mx[r] = top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < c; ++j) {
        const float e = exp_nonpositive(row[j] - top);
        row[j] = e;
        total += e;
    }
    w.sum[r] = w.sum[r] * w.alpha[r] + total;
}

// o[r] = alpha[r] o[r] + sum_{j < c} p[r][j] v[j] over every padded row (padded rows of p are 0).
inline void accumulate(Scratch& w, int64_t c) {
    for (int64_t r0 = 0; r0 < w.rp; r0 += RT) {
        for (int64_t d0 = 0; d0 < w.dp; d0 += VT) {
            float acc[RT][VT];
            for (int64_t i = 0; i < RT; ++i) {
                const float* orow = w.o.data() + (r0 + i) * w.dp + d0;
#pragma omp simd
                for (int64_t l = 0; l < VT; ++l) acc[i][l] = orow[l] * w.alpha[r0 + i];
            }
            for (int64_t j = 0; j < c; ++j) {
                const float* vv = w.v.data() + j * w.dp + d0;
#pragma GCC unroll 4
                for (int64_t i = 0; i < RT; ++i) {
                    const float pv = w.p[(r0 + i) * w.cp + j];
#pragma omp simd
                    for (int64_t l = 0; l < VT; ++l) acc[i][l] = fmadd(pv, vv[l], acc[i][l]);
                }
            }
            for (int64_t i = 0; i < RT; ++i)
                std::copy(acc[i], acc[i] + VT, w.o.data() + (r0 + i) * w.dp + d0);
        }
    }
}

template <typename T>
void query_block(const typename T::storage* q, const typename T::storage* k,
                 const typename T::storage* v, typename T::storage* out, const void* index,
                 int64_t count, bool wide, int64_t task, int64_t i, const Shape& s, float scale,
                 Scratch& w) {
    const int64_t d = s.d;
    const int64_t r0 = i * s.bs, rows = std::min(s.bs, s.sq - r0);
    std::fill(w.q.begin(), w.q.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const auto* src = q + (r0 + r) * d;
        for (int64_t c = 0; c < d; ++c) w.q[r * d + c] = T::load(src[c]) * scale;
    }
    std::fill(w.o.begin(), w.o.end(), 0.0f);
    std::fill(w.p.begin(), w.p.end(), 0.0f);
    std::fill(w.mx.begin(), w.mx.end(), -std::numeric_limits<float>::infinity());
    std::fill(w.sum.begin(), w.sum.end(), 0.0f);
    std::fill(w.alpha.begin(), w.alpha.end(), 0.0f);
    for (int64_t t = 0; t < count; ++t) {
        const int64_t c0 = entry(index, task * s.m + t, wide) * s.bs;
        const int64_t keys = std::min(s.bs, s.skv - c0);
        for (int64_t j = 0; j < keys; ++j) {
            const auto* krow = k + (c0 + j) * d;
            const auto* vrow = v + (c0 + j) * d;
            float* vdst = w.v.data() + j * w.dp;
            for (int64_t c = 0; c < d; ++c) {
                w.kt[c * w.cp + j] = T::load(krow[c]);
                vdst[c] = T::load(vrow[c]);
            }
        }
        scores(w, d);
        for (int64_t r = 0; r < rows; ++r) softmax_step(w, r, keys);
        for (int64_t r = rows; r < w.rp; ++r) {  // padded rows: no contribution, kept at zero
            std::fill(w.p.begin() + r * w.cp, w.p.begin() + (r + 1) * w.cp, 0.0f);
        }
        accumulate(w, keys);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = w.sum[r] > 0.0f ? 1.0f / w.sum[r] : 0.0f;
        const float* orow = w.o.data() + r * w.dp;
        auto* dst = out + (r0 + r) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) dst[c] = T::store(orow[c] * inv);
    }
}

template <typename T>
void block_sparse_attention(const void* qp, const void* kp, const void* vp, const void* index,
                            const void* count, void* outp, bool wide, const Shape& s, float scale,
                            int32_t threads) {
    const auto* q = in<T>(qp);
    const auto* k = in<T>(kp);
    const auto* v = in<T>(vp);
    auto* out = spore::out<T>(outp);
    const int64_t tasks = s.bh * s.nq;
#pragma omp parallel num_threads(threads)
    {
        Scratch w(s);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t head = task / s.nq, i = task % s.nq;
            const int64_t kv = head * s.skv * s.d;
            query_block<T>(q + head * s.sq * s.d, k + kv, v + kv, out + head * s.sq * s.d, index,
                           entry(count, task, wide), wide, task, i, s, scale, w);
        }
    }
}

}  // namespace
}  // namespace spore

using namespace spore;

// q, out: [bh, sq, d]; k, v: [bh, skv, d]; index: [bh, ceil(sq/bs), m] and count:
// [bh, ceil(sq/bs)], int64 when index_is_64 else int32. BAD_ARGUMENT (nothing written) for a
// null pointer, a negative size, a block size below 1, a count outside 0..m or a listed id
// outside 0..ceil(skv/bs)-1; BAD_DTYPE for an unknown dtype code.
SPORE_EXPORT int32_t spore_block_sparse_attention(const void* q, const void* k, const void* v,
                                                  const void* index, const void* count, void* out,
                                                  int64_t bh, int64_t sq, int64_t skv, int64_t d,
                                                  int64_t m, int64_t bs, float scale,
                                                  int32_t index_is_64, int32_t dtype,
                                                  int32_t threads) {
    if (bh < 0 || sq < 0 || skv < 0 || d < 0 || m < 0 || bs < 1 || threads < 1) {
        return BAD_ARGUMENT;
    }
    if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return BAD_DTYPE;
    const Shape s{bh, sq, skv, d, m, bs, (sq + bs - 1) / bs, (skv + bs - 1) / bs};
    if (bh == 0 || sq == 0) return OK;
    if (count == nullptr || (m > 0 && index == nullptr)) return BAD_ARGUMENT;
    const bool wide = index_is_64 != 0;
    if (!lists_valid(index, count, wide, s)) return BAD_ARGUMENT;
    if (d == 0) return OK;
    if (q == nullptr || out == nullptr || (skv > 0 && (k == nullptr || v == nullptr))) {
        return BAD_ARGUMENT;
    }
    return with_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        block_sparse_attention<T>(q, k, v, index, count, out, wide, s, scale, threads);
    });
}
