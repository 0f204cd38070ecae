// triangle_attention forward and backward: for every (batch, i, head) softmax attention of the
// J query rows q[b, i, :, h] over the K keys k[b, i, :, h], with a bias[b, h, j, k] shared by
// every i and a key mask[b, i, k]; a row with no key left gives zeros. fp32 compute, bf16/fp16
// widened as read and rounded once when written. The [I, H, J, K] logits never exist: per
// thread, tiles of TQ query rows by KT keys (forward: an online softmax over the key tiles;
// backward: one strip of TQ rows by all K probabilities at a time).
//
// All products run through one register-tiled routine (gemm below) over fp32 copies padded to
// whole vectors: scores q k^T, p v, and in backward dp = do v^T, dv += p^T do, dk += ds^T q,
// dq += ds k. Scores are in base 2 (q scaled by scale * log2 e, bias by log2 e).
#include <omp.h>

#include <algorithm>
#include <limits>
#include <new>
#include <stdexcept>

#include "attention.h"

namespace spore {
namespace {

constexpr int64_t TQ = 48;      // query rows per tile
constexpr int64_t KT = 128;     // keys per tile (a multiple of VT on every build)

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// R rows of C (+)= A B over n terms: C[r][c] = sum_t A[r*ar + t*at] * B[t*ldb + c], for every
// column c < cols (a multiple of VT). A's stride pair reads it as given (ar = row length,
// at = 1) or transposed (ar = 1, at = row length).
template <int R>
inline void tile(const float* a, int64_t ar, int64_t at, const float* b, int64_t ldb, float* c,
                 int64_t ldc, int64_t cols, int64_t n, bool accumulate) {
    for (int64_t c0 = 0; c0 < cols; c0 += VT) {
        vec a0[R], a1[R];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            a0[i] = accumulate ? vload(c + i * ldc + c0) : vec{};
            a1[i] = accumulate ? vload(c + i * ldc + c0 + W) : vec{};
        }
        for (int64_t t = 0; t < n; ++t) {
            const vec b0 = vload(b + t * ldb + c0), b1 = vload(b + t * ldb + c0 + W);
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                const float x = a[i * ar + t * at];
                a0[i] = x * b0 + a0[i];
                a1[i] = x * b1 + a1[i];
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            vstore(c + i * ldc + c0, a0[i]);
            vstore(c + i * ldc + c0 + W, a1[i]);
        }
    }
}

// Any number of rows: whole register tiles, then the remaining 1..RT-1 rows.
inline void gemm(const float* a, int64_t ar, int64_t at, const float* b, int64_t ldb, float* c,
                 int64_t ldc, int64_t rows, int64_t cols, int64_t n, bool accumulate) {
    int64_t r = 0;
    for (; r + RT <= rows; r += RT) {
        tile<RT>(a + r * ar, ar, at, b, ldb, c + r * ldc, ldc, cols, n, accumulate);
    }
    const float* ar0 = a + r * ar;
    float* cr = c + r * ldc;
    switch (rows - r) {
        case 1: tile<1>(ar0, ar, at, b, ldb, cr, ldc, cols, n, accumulate); break;
        case 2: tile<2>(ar0, ar, at, b, ldb, cr, ldc, cols, n, accumulate); break;
        case 3: tile<3>(ar0, ar, at, b, ldb, cr, ldc, cols, n, accumulate); break;
        case 4: tile<4>(ar0, ar, at, b, ldb, cr, ldc, cols, n, accumulate); break;
        case 5: tile<5>(ar0, ar, at, b, ldb, cr, ldc, cols, n, accumulate); break;
        default: break;
    }
}

// Asks the caches for `rows` rows of `count` elements, `stride` elements apart: the rows of one
// (batch, i, head) are 128 bytes (D = 32, fp32) every H * D elements, a pattern whose misses
// otherwise come one after another.
template <typename S>
inline void prefetch_rows(const S* p, int64_t stride, int64_t rows, int64_t count) {
    const int64_t bytes = count * static_cast<int64_t>(sizeof(S));
    for (int64_t r = 0; r < rows; ++r) {
        const char* row = reinterpret_cast<const char*>(p + r * stride);
        for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(row + x);
    }
}

struct Dims {
    int64_t batch, ni, nj, nk, heads, d;
    int64_t kp, dp;  // keys padded to VT, head dim padded to VT

    int64_t row(int64_t b, int64_t i) const { return b * ni + i; }
    // Offsets of element 0 of a query row, a key row, a bias row and a mask row.
    int64_t q_at(int64_t b, int64_t i, int64_t j, int64_t h) const {
        return ((row(b, i) * nj + j) * heads + h) * d;
    }
    int64_t k_at(int64_t b, int64_t i, int64_t k, int64_t h) const {
        return ((row(b, i) * nk + k) * heads + h) * d;
    }
    int64_t bias_at(int64_t b, int64_t h, int64_t j) const {
        return ((b * heads + h) * nj + j) * nk;
    }
    int64_t mask_at(int64_t b, int64_t i) const { return row(b, i) * nk; }
};

// The keys of one (batch, i, head) as fp32, padded with zeros to kp keys and dp columns:
// kt [d][kp] (transposed), kr and vr [kp][dp] (rows), vt [d][kp]; and the mask as additive
// base-2 scores (0 or -inf, -inf for padded keys) with, per key tile, whether any key is kept.
struct Keys {
    float *kt, *kr, *vr, *vt, *add;
    uint8_t* any;

    template <typename T>
    void pack(const typename T::storage* k, const typename T::storage* v, const uint8_t* mask,
              const Dims& s, int64_t b, int64_t i, int64_t h) const {
        const int64_t d = s.d, kp = s.kp, dp = s.dp;
        prefetch_rows(k + s.k_at(b, i, 0, h), s.heads * d, s.nk, d);
        prefetch_rows(v + s.k_at(b, i, 0, h), s.heads * d, s.nk, d);
        for (int64_t c = 0; c < s.nk; ++c) {
            const auto* krow = k + s.k_at(b, i, c, h);
            const auto* vrow = v + s.k_at(b, i, c, h);
            // a masked key's k and v are packed as 0: its probability (and dS) is 0, and 0 * NaN
            // or inf in padding would reach the row (and dP and dq in backward)
            const bool kept = mask == nullptr || mask[s.mask_at(b, i) + c] != 0;
            for (int64_t e = 0; e < d; ++e) {
                const float kv = kept ? T::load(krow[e]) : 0.0f;
                const float vv = kept ? T::load(vrow[e]) : 0.0f;
                if (kt != nullptr) kt[e * kp + c] = kv;
                if (kr != nullptr) kr[c * dp + e] = kv;
                if (vr != nullptr) vr[c * dp + e] = vv;
                if (vt != nullptr) vt[e * kp + c] = vv;
            }
        }
        for (int64_t c = 0; c < kp; ++c) {
            const bool kept = c < s.nk && (mask == nullptr || mask[s.mask_at(b, i) + c] != 0);
            add[c] = kept ? 0.0f : -kInf;
        }
        for (int64_t t = 0; t * KT < kp; ++t) {
            any[t] = 0;
            for (int64_t c = t * KT; c < std::min(kp, (t + 1) * KT); ++c) any[t] |= add[c] == 0.0f;
        }
    }
};

// W bias values from p as fp32 times log2 e; lanes at or past `valid` are 0. A finite bias
// beyond +-FLT_MAX / log2 e (a finfo.min mask) gives +-FLT_MAX, not an inf: a row masked with
// it keeps its order (all equal: the mean of v, as the reference), where -inf - -inf is NaN.
template <typename T>
inline vec bias_vec(const typename T::storage* p, int64_t valid) {
    vec x = {};
    if (valid >= W) {
        for (int64_t l = 0; l < W; ++l) x[l] = T::load(p[l]);
    } else {
        for (int64_t l = 0; l < valid; ++l) x[l] = T::load(p[l]);
    }
    constexpr float kMax = std::numeric_limits<float>::max();
    const vec scaled = x * kLog2e;
    vec clamped = scaled > kMax ? kMax : scaled;
    clamped = clamped < -kMax ? -kMax : clamped;
    return x - x == 0.0f ? clamped : scaled;  // inf and NaN biases as they were
}

// R rows of base-2 scores over cols (a multiple of VT) keys, with the bias and mask applied as
// they are stored: s[i][c] = sum_e q[i][e] kt[e][c] + log2e * bias[i][c] where add[c] is 0,
// add[c] (-inf: masked, or past the real keys) where it is not. top[i] (W lanes) keeps the
// lane-wise max of row i (NaN skipped). q rows have length dp; bias rows (or null) length nk,
// `real` keys valid.
template <typename T, int R>
inline void score_tile(const float* q, int64_t dp, const float* kt, int64_t kp, int64_t d,
                       const typename T::storage* bias, int64_t nk, const float* add, int64_t real,
                       float* s, int64_t ld, int64_t cols, float* top) {
    for (int64_t c0 = 0; c0 < cols; c0 += VT) {
        vec a0[R] = {}, a1[R] = {};
        for (int64_t e = 0; e < d; ++e) {
            const vec k0 = vload(kt + e * kp + c0), k1 = vload(kt + e * kp + c0 + W);
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                const float x = q[i * dp + e];
                a0[i] = x * k0 + a0[i];
                a1[i] = x * k1 + a1[i];
            }
        }
        const vec m0 = vload(add + c0), m1 = vload(add + c0 + W);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            vec s0 = a0[i], s1 = a1[i];
            if (bias != nullptr) {
                const auto* brow = bias + i * nk + c0;
                s0 += bias_vec<T>(brow, real - c0);
                s1 += bias_vec<T>(brow + W, real - c0 - W);
            }
            // a masked key's score is -inf whatever its k and bias hold: NaN or inf there
            // (garbage in padding) would make -inf + x a NaN that spreads through the row
            s0 = m0 == 0.0f ? s0 : m0;
            s1 = m1 == 0.0f ? s1 : m1;
            vstore(s + i * ld + c0, s0);
            vstore(s + i * ld + c0 + W, s1);
            vec m = vload(top + i * W);
            m = s0 > m ? s0 : m;  // false for NaN: the max skips it
            m = s1 > m ? s1 : m;
            vstore(top + i * W, m);
        }
    }
}

// score_tile over any number of rows (bias: row 0's keys k0.., or null; add and kt from k0).
template <typename T>
void scores(const float* q, int64_t dp, const float* kt, int64_t kp, int64_t d,
            const typename T::storage* bias, int64_t nk, const float* add, int64_t real, float* s,
            int64_t ld, int64_t rows, int64_t cols, float* top) {
    int64_t r = 0;
    const auto at = [&](int64_t row) { return bias == nullptr ? nullptr : bias + row * nk; };
    for (; r + RT <= rows; r += RT) {
        score_tile<T, RT>(q + r * dp, dp, kt, kp, d, at(r), nk, add, real, s + r * ld, ld, cols,
                          top + r * W);
    }
    const float* qr = q + r * dp;
    float* sr = s + r * ld;
    float* tr = top + r * W;
    switch (rows - r) {
        case 1: score_tile<T, 1>(qr, dp, kt, kp, d, at(r), nk, add, real, sr, ld, cols, tr); break;
        case 2: score_tile<T, 2>(qr, dp, kt, kp, d, at(r), nk, add, real, sr, ld, cols, tr); break;
        case 3: score_tile<T, 3>(qr, dp, kt, kp, d, at(r), nk, add, real, sr, ld, cols, tr); break;
        case 4: score_tile<T, 4>(qr, dp, kt, kp, d, at(r), nk, add, real, sr, ld, cols, tr); break;
        case 5: score_tile<T, 5>(qr, dp, kt, kp, d, at(r), nk, add, real, sr, ld, cols, tr); break;
        default: break;
    }
}

// The max of a row's W lanes.
inline float lanes_max(const float* top) {
    float m = -kInf;
    for (int64_t l = 0; l < W; ++l) m = std::max(m, top[l]);
    return m;
}

// Query rows j0..j0+rows of one (batch, i, head) as fp32, scaled, padded with zeros to dp.
template <typename T>
void load_rows(float* dst, const typename T::storage* src, int64_t stride, int64_t rows,
               const Dims& s, float scale) {
    prefetch_rows(src, stride, rows, s.d);
    for (int64_t r = 0; r < rows; ++r) {
        float* row = dst + r * s.dp;
        const auto* in_row = src + r * stride;
        for (int64_t e = 0; e < s.d; ++e) row[e] = T::load(in_row[e]) * scale;
        for (int64_t e = s.d; e < s.dp; ++e) row[e] = 0.0f;
    }
}

// Floats of per-thread scratch each pass needs.
int64_t forward_scratch(const Dims& s) {
    return s.d * s.kp + s.kp * s.dp + s.kp + s.kp / KT + 1 + TQ * s.dp * 2 + TQ * KT + 3 * TQ +
           TQ * W;
}

int64_t backward_scratch(const Dims& s) {
    return 2 * s.d * s.kp + 3 * s.kp * s.dp + s.kp + s.kp / KT + 1 + 4 * TQ * s.dp +
           2 * TQ * s.kp + 2 * TQ + TQ * W;
}

// Forward of query tiles [t0, t1) of one (batch, i, head), keys already packed: per key tile
// the scores (bias and mask added, lane maxima kept), then per row the online-softmax step.
template <typename T>
void forward_rows(const typename T::storage* q, const typename T::storage* bias,
                  typename T::storage* out, const Keys& keys, float* qs, float* sc, float* o,
                  float* mx, float* sum, float* top, int64_t b, int64_t i, int64_t h,
                  int64_t t0, int64_t t1, const Dims& s, float scale) {
    const int64_t stride = s.heads * s.d;
    const float scale2 = scale * kLog2e;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t j0 = t * TQ, rows = std::min(TQ, s.nj - j0);
        load_rows<T>(qs, q + s.q_at(b, i, j0, h), stride, rows, s, scale2);
        std::fill(o, o + rows * s.dp, 0.0f);
        std::fill(mx, mx + rows, -kInf);
        std::fill(sum, sum + rows, 0.0f);
        const auto* brow = bias == nullptr ? nullptr : bias + s.bias_at(b, h, j0);
        for (int64_t k0 = 0, kt = 0; k0 < s.kp; k0 += KT, ++kt) {
            if (!keys.any[kt]) continue;  // every key masked: nothing to add
            const int64_t kc = std::min(KT, s.kp - k0), real = std::min(kc, s.nk - k0);
            std::fill(top, top + rows * W, -kInf);
            scores<T>(qs, s.dp, keys.kt + k0, s.kp, s.d, brow == nullptr ? nullptr : brow + k0,
                      s.nk, keys.add + k0, real, sc, KT, rows, kc, top);
            for (int64_t r = 0; r < rows; ++r) {
                float* row = sc + r * KT;
                const float before = mx[r];
                const float high = std::max(before, lanes_max(top + r * W));
                const float total = shifted_exp2_sum(row, kc, high);
                const float alpha = before == -kInf ? 0.0f : exp2_nonpositive(before - high);
                mx[r] = high;
                sum[r] = sum[r] * alpha + total;
                float* orow = o + r * s.dp;
                const vec a = splat(alpha);
                for (int64_t e = 0; e < s.dp; e += W) vstore(orow + e, vload(orow + e) * a);
            }
            gemm(sc, KT, 1, keys.vr + k0 * s.dp, s.dp, o, s.dp, rows, s.dp, real, true);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
            const float* orow = o + r * s.dp;
            auto* dst = out + s.q_at(b, i, j0 + r, h);
#pragma omp simd
            for (int64_t e = 0; e < s.d; ++e) dst[e] = T::store(orow[e] * inv);
        }
    }
}

template <typename T>
void forward(const void* qp, const void* kp, const void* vp, const void* biasp,
             const uint8_t* mask, void* outp, const Dims& s, float scale, int32_t threads,
             float* scratch, int64_t per_thread, int64_t chunks) {
    const auto* q = in<T>(qp);
    const auto* k = in<T>(kp);
    const auto* v = in<T>(vp);
    const auto* bias = biasp == nullptr ? nullptr : in<T>(biasp);
    auto* out = spore::out<T>(outp);
    const int64_t tiles = (s.nj + TQ - 1) / TQ;
    const int64_t per_chunk = (tiles + chunks - 1) / chunks;
    const int64_t tasks = s.batch * s.ni * s.heads * chunks;
#pragma omp parallel num_threads(threads)
    {
        float* w = scratch + omp_get_thread_num() * per_thread;
        Keys keys{};
        keys.kt = w;
        keys.vr = keys.kt + s.d * s.kp;
        keys.add = keys.vr + s.kp * s.dp;
        keys.any = reinterpret_cast<uint8_t*>(keys.add + s.kp);
        float* qs = keys.add + s.kp + s.kp / KT + 1;
        float* o = qs + TQ * s.dp;
        float* sc = o + TQ * s.dp;
        float* mx = sc + TQ * KT;
        float* sum = mx + TQ;
        float* top = sum + TQ;
        std::fill(keys.kt, keys.kt + s.d * s.kp, 0.0f);  // padded keys stay zero
        std::fill(keys.vr, keys.vr + s.kp * s.dp, 0.0f);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t chunk = task % chunks, bih = task / chunks;
            const int64_t h = bih % s.heads, bi = bih / s.heads;
            const int64_t i = bi % s.ni, b = bi / s.ni;
            const int64_t t0 = chunk * per_chunk, t1 = std::min(tiles, t0 + per_chunk);
            if (t0 >= t1) continue;
            keys.pack<T>(k, v, mask, s, b, i, h);
            forward_rows<T>(q, bias, out, keys, qs, sc, o, mx, sum, top, b, i, h, t0, t1, s,
                            scale);
        }
    }
}

// Backward of one (batch, i, head): dq for its rows, dk and dv for its keys, and its ds
// summed into the dbias partial `part` ([J][kp] of this (batch, head)). Per 48-row tile: the
// strip of all K scores (bias and mask added, lane maxima kept), exponentiated in place
// (unnormalised: e), the strip of dp = do v^T and delta = rowsum(p dp) from them, then per key
// tile p = e / sum and ds = p (dp - delta). delta is not taken as rowsum(do out): out rounded
// to 16 bits would put its rounding into every ds of the row (dq off by 2.5 % at K = 3, D = 1).
template <typename T>
void backward_one(const typename T::storage* g, const typename T::storage* q,
                  const typename T::storage* bias, typename T::storage* dq,
                  typename T::storage* dk, typename T::storage* dv, float* part,
                  const Keys& keys, float* dkacc, float* dvacc, float* qs, float* go,
                  float* gn, float* dqacc, float* strip, float* ds, float* delta, float* inv,
                  float* top, int64_t b, int64_t i, int64_t h, const Dims& s, float scale) {
    const int64_t stride = s.heads * s.d, dp = s.dp, kp = s.kp;
    const float scale2 = scale * kLog2e;
    std::fill(dkacc, dkacc + kp * dp, 0.0f);
    std::fill(dvacc, dvacc + kp * dp, 0.0f);
    const auto* brow0 = bias == nullptr ? nullptr : bias + s.bias_at(b, h, 0);
    for (int64_t j0 = 0; j0 < s.nj; j0 += TQ) {
        const int64_t rows = std::min(TQ, s.nj - j0);
        const int64_t at = s.q_at(b, i, j0, h);
        load_rows<T>(qs, q + at, stride, rows, s, scale2);
        load_rows<T>(go, g + at, stride, rows, s, 1.0f);
        std::fill(dqacc, dqacc + rows * dp, 0.0f);
        std::fill(top, top + rows * W, -kInf);
        for (int64_t k0 = 0, kt = 0; k0 < kp; k0 += KT, ++kt) {
            const int64_t kc = std::min(KT, kp - k0), real = std::min(kc, s.nk - k0);
            if (!keys.any[kt]) {
                for (int64_t r = 0; r < rows; ++r) std::fill_n(strip + r * kp + k0, kc, -kInf);
                continue;
            }
            const auto* brow = brow0 == nullptr ? nullptr : brow0 + j0 * s.nk + k0;
            scores<T>(qs, dp, keys.kt + k0, kp, s.d, brow, s.nk, keys.add + k0, real,
                      strip + k0, kp, rows, kc, top);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float total = shifted_exp2_sum(strip + r * kp, kp, lanes_max(top + r * W));
            inv[r] = total == 0.0f ? 0.0f : 1.0f / total;  // all masked: 0; a NaN row: NaN
            const vec scale_r = splat(inv[r]);  // do / sum: dv += e^T (do / sum) = p^T do
            for (int64_t e = 0; e < dp; e += W) {
                vstore(gn + r * dp + e, vload(go + r * dp + e) * scale_r);
            }
        }
        std::fill(delta, delta + rows, 0.0f);
        for (int64_t k0 = 0, kt = 0; k0 < kp; k0 += KT, ++kt) {
            if (!keys.any[kt]) continue;  // probabilities and ds are zero there
            const int64_t kc = std::min(KT, kp - k0);
            gemm(go, dp, 1, keys.vt + k0, kp, ds + k0, kp, rows, kc, s.d, false);
            for (int64_t r = 0; r < rows; ++r) {
                const float* erow = strip + r * kp + k0;
                const float* drow = ds + r * kp + k0;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t c = 0; c < kc; ++c) acc += erow[c] * drow[c];
                delta[r] += acc;
            }
        }
        for (int64_t r = 0; r < rows; ++r) delta[r] *= inv[r];
        for (int64_t k0 = 0, kt = 0; k0 < kp; k0 += KT, ++kt) {
            if (!keys.any[kt]) continue;
            const int64_t kc = std::min(KT, kp - k0), real = std::min(kc, s.nk - k0);
            // ds = (e / sum) (dp - delta) in place, summed into dbias
            for (int64_t r = 0; r < rows; ++r) {
                float* drow = ds + r * kp + k0;
                const float* erow = strip + r * kp + k0;
                const vec dl = splat(delta[r]), iv = splat(inv[r]);
                if (part != nullptr) {
                    float* bp = part + (j0 + r) * kp + k0;
                    for (int64_t c = 0; c < kc; c += W) {
                        const vec d = vload(erow + c) * iv * (vload(drow + c) - dl);
                        vstore(drow + c, d);
                        vstore(bp + c, vload(bp + c) + d);
                    }
                } else {
                    for (int64_t c = 0; c < kc; c += W) {
                        vstore(drow + c, vload(erow + c) * iv * (vload(drow + c) - dl));
                    }
                }
            }
            // dv += e^T (do / sum), dk += ds^T (q scale log2e), dq += ds k
            gemm(strip + k0, 1, kp, gn, dp, dvacc + k0 * dp, dp, real, dp, rows, true);
            gemm(ds + k0, 1, kp, qs, dp, dkacc + k0 * dp, dp, real, dp, rows, true);
            gemm(ds + k0, kp, 1, keys.kr + k0 * dp, dp, dqacc, dp, rows, dp, real, true);
        }
        for (int64_t r = 0; r < rows; ++r) {
            auto* dst = dq + at + r * stride;
            const float* src = dqacc + r * dp;
#pragma omp simd
            for (int64_t e = 0; e < s.d; ++e) dst[e] = T::store(src[e] * scale);
        }
    }
    const float unscale = 1.0f / kLog2e;  // dk = scale ds^T q = ds^T (q scale log2e) / log2e
    for (int64_t c = 0; c < s.nk; ++c) {
        auto* kdst = dk + s.k_at(b, i, c, h);
        auto* vdst = dv + s.k_at(b, i, c, h);
        const float* ks = dkacc + c * dp;
        const float* vs = dvacc + c * dp;
#pragma omp simd
        for (int64_t e = 0; e < s.d; ++e) {
            kdst[e] = T::store(ks[e] * unscale);
            vdst[e] = T::store(vs[e]);
        }
    }
}

// Tasks are (batch, head, chunk of I): a task owns its rows' dq, dk and dv, and sums its ds
// into partial `chunk` of dbias; the partials are added up (fp32) after the parallel loop.
template <typename T>
void backward(const void* gp, const void* qp, const void* kp, const void* vp,
              const void* biasp, const uint8_t* mask, void* dqp, void* dkp,
              void* dvp, void* dbiasp, const Dims& s, float scale, int32_t threads,
              float* scratch, int64_t per_thread, float* partials, int64_t chunks) {
    const auto* g = in<T>(gp);
    const auto* q = in<T>(qp);
    const auto* k = in<T>(kp);
    const auto* v = in<T>(vp);
    const auto* bias = biasp == nullptr ? nullptr : in<T>(biasp);
    auto* dq = spore::out<T>(dqp);
    auto* dk = spore::out<T>(dkp);
    auto* dv = spore::out<T>(dvp);
    const int64_t per_chunk = (s.ni + chunks - 1) / chunks;
    const int64_t plane = s.nj * s.kp, bh = s.batch * s.heads;  // partials: rows of kp
#pragma omp parallel num_threads(threads)
    {
        float* w = scratch + omp_get_thread_num() * per_thread;
        Keys keys{};
        keys.kt = w;
        keys.vt = keys.kt + s.d * s.kp;
        keys.kr = keys.vt + s.d * s.kp;
        float* dkacc = keys.kr + s.kp * s.dp;
        float* dvacc = dkacc + s.kp * s.dp;
        keys.add = dvacc + s.kp * s.dp;
        keys.any = reinterpret_cast<uint8_t*>(keys.add + s.kp);
        float* qs = keys.add + s.kp + s.kp / KT + 1;
        float* go = qs + TQ * s.dp;
        float* gn = go + TQ * s.dp;
        float* dqacc = gn + TQ * s.dp;
        float* strip = dqacc + TQ * s.dp;
        float* ds = strip + TQ * s.kp;
        float* delta = ds + TQ * s.kp;
        float* inv = delta + TQ;
        float* top = inv + TQ;
        std::fill(keys.kt, keys.kt + 2 * s.d * s.kp + s.kp * s.dp, 0.0f);  // padding stays 0
        if (partials != nullptr) {
#pragma omp for schedule(static)
            for (int64_t x = 0; x < chunks * bh * plane; ++x) partials[x] = 0.0f;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < bh * chunks; ++task) {
            const int64_t chunk = task % chunks, bhi = task / chunks;
            const int64_t h = bhi % s.heads, b = bhi / s.heads;
            float* part = partials == nullptr ? nullptr : partials + (chunk * bh + bhi) * plane;
            const int64_t i1 = std::min(s.ni, (chunk + 1) * per_chunk);
            for (int64_t i = chunk * per_chunk; i < i1; ++i) {
                keys.pack<T>(k, v, mask, s, b, i, h);
                backward_one<T>(g, q, bias, dq, dk, dv, part, keys, dkacc, dvacc, qs, go, gn,
                                dqacc, strip, ds, delta, inv, top, b, i, h, s, scale);
            }
        }
        if (partials != nullptr) {
            auto* db = spore::out<T>(dbiasp);
#pragma omp for schedule(static)
            for (int64_t row = 0; row < bh * s.nj; ++row) {
                for (int64_t c = 0; c < s.nk; ++c) {
                    float total = 0.0f;
                    for (int64_t n = 0; n < chunks; ++n) {
                        total += partials[n * bh * plane + row * s.kp + c];
                    }
                    db[row * s.nk + c] = T::store(total);
                }
            }
        }
    }
}

// a * b into *out unless it overflows int64.
inline bool mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// The dims of a call with valid sizes: none negative, and no element count, offset or scratch
// size (for `threads` threads) overflowing int64.
bool make_dims(int64_t batch, int64_t ni, int64_t nj, int64_t nk, int64_t heads, int64_t d,
               int32_t threads, Dims* s) {
    if (batch < 0 || ni < 0 || nj < 0 || nk < 0 || heads < 0 || d < 0 || threads < 1) {
        return false;
    }
    if (nk > (int64_t{1} << 40) || d > (int64_t{1} << 20)) return false;
    int64_t rows, plane, scratch;
    const bool fits = mul(batch, ni, &rows) && mul(rows, std::max(nj, nk), &rows) &&
                      mul(rows, heads, &rows) && mul(rows, d + VT, &rows) &&
                      mul(batch, heads, &plane) && mul(plane, nj, &plane) &&
                      mul(plane, nk + VT, &plane) &&
                      mul(TQ + 2 * d + 4 * VT, nk + 2 * KT, &scratch) &&
                      mul(scratch, 4, &scratch) && mul(scratch, threads, &scratch);
    if (!fits) return false;
    *s = Dims{batch, ni, nj, nk, heads, d, round_up(nk, VT), round_up(d, VT)};
    return true;
}

// n elements of a dtype's storage set to +0.
void zero(void* p, int64_t n, int32_t dtype) {
    if (p == nullptr || n <= 0) return;
    std::memset(p, 0, static_cast<size_t>(n) * (dtype == DT_F32 ? 4 : 2));
}

}  // namespace
}  // namespace spore

using namespace spore;

// q, out: [batch, ni, nj, heads, d]; k, v: [batch, ni, nk, heads, d]; bias: [batch, heads, nj,
// nk] or null; mask: bool bytes [batch, ni, nk] or null (non-zero = attend). BAD_ARGUMENT for a
// null tensor that has elements, a negative size or threads < 1 or sizes whose products
// overflow; BAD_DTYPE for an unknown dtype code; OUT_OF_MEMORY (3) when scratch cannot be had.
SPORE_EXPORT int32_t spore_triangle_attention(const void* q, const void* k, const void* v,
                                              const void* bias, const void* mask, void* out,
                                              int64_t batch, int64_t ni, int64_t nj, int64_t nk,
                                              int64_t heads, int64_t d, float scale,
                                              int32_t dtype, int32_t threads) {
    Dims s{};
    if (!make_dims(batch, ni, nj, nk, heads, d, threads, &s)) return BAD_ARGUMENT;
    if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return BAD_DTYPE;
    const int64_t elements = batch * ni * nj * heads * d;
    if (elements == 0) return OK;
    if (q == nullptr || out == nullptr) return BAD_ARGUMENT;
    if (nk == 0) {  // no key for any row: zeros
        zero(out, elements, dtype);
        return OK;
    }
    if (k == nullptr || v == nullptr) return BAD_ARGUMENT;
    const int64_t tasks = batch * ni * heads;
    const int64_t tiles = (nj + TQ - 1) / TQ;
    const int64_t chunks = std::clamp<int64_t>((4 * threads + tasks - 1) / tasks, 1, tiles);
    const int64_t per_thread = forward_scratch(s);
    try {
        std::vector<float> scratch(static_cast<size_t>(per_thread * threads));
        return with_dtype(dtype, [&](auto t) {
            forward<decltype(t)>(q, k, v, bias, static_cast<const uint8_t*>(mask), out, s, scale,
                                 threads, scratch.data(), per_thread, chunks);
        });
    } catch (const std::bad_alloc&) {
        return OUT_OF_MEMORY;
    } catch (const std::length_error&) {
        return OUT_OF_MEMORY;
    }
}

// grad and dq like q; dk, dv like k; dbias like bias (both null, or both given). The same
// statuses as the forward; BAD_ARGUMENT also when exactly one of bias and dbias is null.
SPORE_EXPORT int32_t spore_triangle_attention_backward(
    const void* grad, const void* q, const void* k, const void* v, const void* bias,
    const void* mask, void* dq, void* dk, void* dv, void* dbias, int64_t batch,
    int64_t ni, int64_t nj, int64_t nk, int64_t heads, int64_t d, float scale, int32_t dtype,
    int32_t threads) {
    Dims s{};
    if (!make_dims(batch, ni, nj, nk, heads, d, threads, &s)) return BAD_ARGUMENT;
    if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return BAD_DTYPE;
    if ((bias == nullptr) != (dbias == nullptr)) return BAD_ARGUMENT;
    const int64_t rows = batch * ni * nj * heads * d, keys = batch * ni * nk * heads * d;
    if (rows > 0 && (grad == nullptr || q == nullptr || dq == nullptr)) {
        return BAD_ARGUMENT;
    }
    if (keys > 0 && (k == nullptr || v == nullptr || dk == nullptr || dv == nullptr)) {
        return BAD_ARGUMENT;
    }
    if (rows == 0 || keys == 0) {  // no query row meets a key (or d = 0): every gradient is 0
        zero(dq, rows, dtype);
        zero(dk, keys, dtype);
        zero(dv, keys, dtype);
        zero(dbias, batch * heads * nj * nk, dtype);
        return OK;
    }
    const int64_t bh = batch * heads, plane = nj * s.kp;
    // Chunks of I: enough tasks for the threads, partials at most 2^26 floats beyond one.
    const int64_t wanted = (4 * threads + bh - 1) / bh;
    const int64_t room = std::max<int64_t>(1, (int64_t{1} << 26) / (bh * plane));
    const int64_t chunks = std::clamp<int64_t>(std::min(wanted, room), 1, ni);
    const int64_t per_thread = backward_scratch(s);
    try {
        std::vector<float> scratch(static_cast<size_t>(per_thread * threads));
        std::vector<float> partials;
        if (bias != nullptr) partials.resize(static_cast<size_t>(chunks * bh * plane));
        return with_dtype(dtype, [&](auto t) {
            backward<decltype(t)>(grad, q, k, v, bias, static_cast<const uint8_t*>(mask),
                                  dq, dk, dv, dbias, s, scale, threads, scratch.data(),
                                  per_thread, bias != nullptr ? partials.data() : nullptr,
                                  chunks);
        });
    } catch (const std::bad_alloc&) {
        return OUT_OF_MEMORY;
    } catch (const std::length_error&) {
        return OUT_OF_MEMORY;
    }
}
