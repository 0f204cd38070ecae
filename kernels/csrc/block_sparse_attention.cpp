// block_sparse_attention forward: each query block attends to the KV blocks its list names, with
// an online softmax (running max and sum per query row) in fp32; bf16/fp16 inputs are widened
// as they are read and the output is rounded once. OpenMP over (batch x head, query block).
// Scores and the probability-weighted sum of values run in register tiles of RT rows by VT
// columns over zero-padded fp32 copies of the listed blocks, so the inner loops are
// fixed-width; a query of at most kDirectRows rows (decoding) reads k and v where they lie.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <type_traits>

#include "attention.h"

namespace spore {
namespace {

// Sizes of the scratch and packed buffers, which the library's caller may state beyond any
// memory: where one passes int64, std::bad_alloc (OUT_OF_MEMORY) rather than a wrapped size.
inline int64_t round_up(int64_t n, int64_t to) {
    if (n > std::numeric_limits<int64_t>::max() - to) throw std::bad_alloc();
    return (n + to - 1) / to * to;
}
inline int64_t times(int64_t a, int64_t b) {
    int64_t product;
    if (__builtin_mul_overflow(a, b, &product)) throw std::bad_alloc();
    return product;
}
inline int64_t plus(int64_t a, int64_t b) {
    int64_t total;
    if (__builtin_add_overflow(a, b, &total)) throw std::bad_alloc();
    return total;
}
inline size_t floats(int64_t a, int64_t b) { return static_cast<size_t>(times(a, b)); }

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

// A key block's keys padded to whole vectors (fewer than bs where the sequence is shorter) and a
// query block's rows padded to whole row tiles (likewise): one query row over a block of 8192
// keys needs scratch for RT rows, not 8192.
inline int64_t key_pad(const Shape& s) {
    return round_up(std::max<int64_t>(1, std::min(s.bs, s.skv)), VT);
}
inline int64_t row_pad(const Shape& s) { return round_up(std::min(s.bs, s.sq), RT); }

// Up to `heads` heads' keys and values as fp32, packed once and read by every query block: block
// slot t (head t / nk, block t % nk) holds its keys transposed ([d][cp], zero-padded keys) and
// its values ([cp][dp], zero-padded columns). Left unset where no block is packed: a slot is
// written whole (padding included) when its block is, and read only where it is listed.
struct Packed {
    int64_t cp, dp, heads;
    std::unique_ptr<float[]> kt, v;

    // As many heads as fit kMaxFloats (at least one).
    static constexpr int64_t kMaxFloats = int64_t{1} << 23;

    explicit Packed(const Shape& s)
        : cp(key_pad(s)),
          dp(round_up(s.d, VT)),
          heads(std::clamp<int64_t>(
              kMaxFloats / std::max<int64_t>(1, times(times(s.nk, cp), plus(s.d, dp))), 1, s.bh)),
          kt(new float[floats(times(heads, s.nk), times(s.d, cp))]),
          v(new float[floats(times(heads, s.nk), times(cp, dp))]) {}

    const float* keys(int64_t t, int64_t d) const { return kt.get() + t * d * cp; }
    const float* values(int64_t t) const { return v.get() + t * cp * dp; }
};

// Block j of one head's k and v into slot t, with the slot's padding zeroed.
template <typename T>
void pack_block(const typename T::storage* k, const typename T::storage* v, int64_t j, int64_t t,
                const Shape& s, Packed& pk) {
    const int64_t d = s.d, c0 = j * s.bs, keys = std::min(s.bs, s.skv - c0);
    float* kt = pk.kt.get() + t * d * pk.cp;
    float* vb = pk.v.get() + t * pk.cp * pk.dp;
    // keys transposed VT at a time: each of the d rows written gets one whole vector (a long
    // block's rows lie cp floats apart, key by key a write to another line and page each time)
    for (int64_t c1 = 0; c1 < keys; c1 += VT) {
        const int64_t n = std::min(VT, keys - c1);
        const auto* kblock = k + (c0 + c1) * d;
        for (int64_t e = 0; e < d; ++e) {
            float* dst = kt + e * pk.cp + c1;
            for (int64_t c = 0; c < n; ++c) dst[c] = T::load(kblock[c * d + e]);
        }
    }
    for (int64_t e = 0; e < d; ++e) std::fill(kt + e * pk.cp + keys, kt + (e + 1) * pk.cp, 0.0f);
    for (int64_t c = 0; c < keys; ++c) {
        const auto* vrow = v + (c0 + c) * d;
        float* dst = vb + c * pk.dp;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = T::load(vrow[e]);
        std::fill(dst + d, dst + pk.dp, 0.0f);
    }
    std::fill(vb + keys * pk.dp, vb + pk.cp * pk.dp, 0.0f);
}

// One thread's fp32 scratch for a query block, zero-padded to whole tiles.
struct Scratch {
    int64_t rp, cp, dp;                 // rows, keys and value columns, padded to RT, VT, VT
    std::vector<float> q;               // [rp][d], scaled
    std::vector<float> p;               // [rp][cp], scores, then probabilities
    std::vector<float> o;               // [rp][dp], unnormalised output
    std::vector<float> mx, sum, alpha;  // per row: running max, running sum, this block's rescale
    std::vector<float> top;             // [rp][W]: lane-wise max of this block's scores per row

    explicit Scratch(const Shape& s)
        : rp(row_pad(s)),
          cp(key_pad(s)),
          dp(round_up(s.d, VT)),
          q(floats(rp, s.d)),
          p(floats(rp, cp)),
          o(floats(rp, dp)),
          mx(static_cast<size_t>(rp)),
          sum(static_cast<size_t>(rp)),
          alpha(static_cast<size_t>(rp)),
          top(floats(rp, W)) {}
};

// p[r][c] = sum_e q[r][e] kt[e][c] over every padded row and the key tiles holding c keys;
// top[r] the lane-wise max of row r's tiles (NaN scores skipped).
inline void scores(Scratch& w, const float* kt, int64_t d, int64_t c) {
    for (int64_t r0 = 0; r0 < w.rp; r0 += RT) {
        const float* qr = w.q.data() + r0 * d;
        for (int64_t i = 0; i < RT; ++i) {
            vstore(w.top.data() + (r0 + i) * W, splat(-kInf));
        }
        for (int64_t c0 = 0; c0 < c; c0 += VT) {
            vec a0[RT] = {}, a1[RT] = {};
            for (int64_t e = 0; e < d; ++e) {
                const vec k0 = vload(kt + e * w.cp + c0), k1 = vload(kt + e * w.cp + c0 + W);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RT; ++i) {
                    const float qv = qr[i * d + e];
                    a0[i] = qv * k0 + a0[i];
                    a1[i] = qv * k1 + a1[i];
                }
            }
#pragma GCC unroll 8
            for (int64_t i = 0; i < RT; ++i) {
                float* prow = w.p.data() + (r0 + i) * w.cp + c0;
                vstore(prow, a0[i]);
                vstore(prow + W, a1[i]);
                float* t = w.top.data() + (r0 + i) * W;
                vec m = vload(t);
                m = a0[i] > m ? a0[i] : m;  // false for a NaN score: the max skips it
                m = a1[i] > m ? a1[i] : m;
                vstore(t, m);
            }
        }
    }
}

// The online-softmax step of one row over its c scores: new max, rescale of what came before,
// scores replaced by 2^(score - max) (shifted_exp2: NaN stays NaN, -inf gives 0), running sum
// updated.
// A whole row of padded width (c == cp) runs in vectors; a short last block lane by lane.
inline void softmax_step(Scratch& w, int64_t r, int64_t c) {
    float* row = w.p.data() + r * w.cp;
    const float before = w.mx[r];
    float top = before, total = 0.0f;
    if (c == w.cp) {
        const float* m = w.top.data() + r * W;  // the scores' lane-wise max
        for (int64_t l = 0; l < W; ++l) top = std::max(top, m[l]);
        total = shifted_exp2_sum(row, c, top);
    } else {
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < c; ++j) top = std::max(top, row[j]);
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < c; ++j) {
            const float e = shifted_exp2(row[j], top);
            row[j] = e;
            total += e;
        }
    }
    w.alpha[r] = before == -kInf ? 0.0f : exp2_nonpositive(before - top);
    w.mx[r] = top;
    w.sum[r] = w.sum[r] * w.alpha[r] + total;
}

// o[r] = alpha[r] o[r] + sum_{j < c} p[r][j] v[j] over every padded row (padded rows of p are 0).
inline void accumulate(Scratch& w, const float* v, int64_t c) {
    for (int64_t r0 = 0; r0 < w.rp; r0 += RT) {
        const float* pr = w.p.data() + r0 * w.cp;
        for (int64_t d0 = 0; d0 < w.dp; d0 += VT) {
            vec a0[RT], a1[RT];
#pragma GCC unroll 8
            for (int64_t i = 0; i < RT; ++i) {
                const float* orow = w.o.data() + (r0 + i) * w.dp + d0;
                a0[i] = vload(orow) * w.alpha[r0 + i];
                a1[i] = vload(orow + W) * w.alpha[r0 + i];
            }
            for (int64_t j = 0; j < c; ++j) {
                const vec v0 = vload(v + j * w.dp + d0), v1 = vload(v + j * w.dp + d0 + W);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RT; ++i) {
                    const float pv = pr[i * w.cp + j];
                    a0[i] = pv * v0 + a0[i];
                    a1[i] = pv * v1 + a1[i];
                }
            }
#pragma GCC unroll 8
            for (int64_t i = 0; i < RT; ++i) {
                float* orow = w.o.data() + (r0 + i) * w.dp + d0;
                vstore(orow, a0[i]);
                vstore(orow + W, a1[i]);
            }
        }
    }
}

template <typename T>
void query_block(const typename T::storage* q, typename T::storage* out, const Packed& pk,
                 const void* index, int64_t count, bool wide, int64_t task, int64_t i,
                 int64_t slot0, const Shape& s, float scale, Scratch& w) {
    const int64_t d = s.d;
    const int64_t r0 = i * s.bs, rows = std::min(s.bs, s.sq - r0);
    const float scale2 = scale * kLog2e;  // scores in base 2
    std::fill(w.q.begin(), w.q.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const auto* src = q + (r0 + r) * d;
        for (int64_t e = 0; e < d; ++e) w.q[r * d + e] = T::load(src[e]) * scale2;
    }
    std::fill(w.o.begin(), w.o.end(), 0.0f);
    std::fill(w.p.begin(), w.p.end(), 0.0f);  // padded rows stay zero: they add nothing
    std::fill(w.mx.begin(), w.mx.end(), -kInf);
    std::fill(w.sum.begin(), w.sum.end(), 0.0f);
    std::fill(w.alpha.begin(), w.alpha.end(), 0.0f);
    for (int64_t t = 0; t < count; ++t) {
        const int64_t j = entry(index, task * s.m + t, wide);
        const int64_t keys = std::min(s.bs, s.skv - j * s.bs);
        scores(w, pk.keys(slot0 + j, d), d, keys);
        for (int64_t r = 0; r < rows; ++r) softmax_step(w, r, keys);
        for (int64_t r = rows; r < w.rp; ++r) {
            std::fill(w.p.begin() + r * w.cp, w.p.begin() + (r + 1) * w.cp, 0.0f);
        }
        accumulate(w, pk.values(slot0 + j), keys);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = w.sum[r] > 0.0f ? 1.0f / w.sum[r] : 0.0f;
        const float* orow = w.o.data() + r * w.dp;
        auto* dst = out + (r0 + r) * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = T::store(orow[e] * inv);
    }
}

// A query of few rows, Sq <= kDirectRows (decoding): each query block reads its listed keys'
// k and v rows straight from the inputs, where packing would copy them to fp32 first for rows
// too few to reuse them.
constexpr int64_t kDirectRows = 8;

// One thread's fp32 scratch for the direct path: a block's rows by d (q scaled, o), by its keys
// (p), and kDirectKeys rows of k or v widened to fp32 (16-bit inputs; fp32 ones are read as
// they are).
constexpr int64_t kDirectKeys = 4;  // keys whose scores one pass over q's row takes

struct Direct {
    int64_t rows, cap;
    std::vector<float> q, o, p, widened, mx, sum;

    explicit Direct(const Shape& s)
        : rows(std::min(s.bs, s.sq)),
          cap(std::max<int64_t>(1, std::min(s.bs, s.skv))),
          q(floats(rows, s.d)),
          o(floats(rows, s.d)),
          p(floats(rows, cap)),
          widened(floats(kDirectKeys, s.d)),
          mx(static_cast<size_t>(rows)),
          sum(static_cast<size_t>(rows)) {}
};

// n rows of src (d apart) as fp32: src itself for fp32, else widened into buf.
template <typename T>
inline const float* as_fp32(const typename T::storage* src, int64_t n, int64_t d, float* buf) {
    if constexpr (std::is_same<T, F32>::value) {
        return src;
    } else {
        for (int64_t i = 0; i < n * d; ++i) buf[i] = T::load(src[i]);
        return buf;
    }
}

// One query block by the direct path: per listed block, its scores kDirectKeys keys at a time,
// the online softmax step of each row (shifted_exp2: NaN stays NaN, -inf gives 0), then its
// values.
template <typename T>
void direct_block(const typename T::storage* q, typename T::storage* out,
                  const typename T::storage* k, const typename T::storage* v, const void* index,
                  int64_t count, bool wide, int64_t task, int64_t i, const Shape& s, float scale,
                  Direct& w) {
    const int64_t d = s.d, r0 = i * s.bs, rows = std::min(s.bs, s.sq - r0);
    const float scale2 = scale * kLog2e;  // scores in base 2
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t e = 0; e < d; ++e) w.q[r * d + e] = T::load(q[(r0 + r) * d + e]) * scale2;
    }
    std::fill(w.o.begin(), w.o.end(), 0.0f);
    std::fill(w.mx.begin(), w.mx.end(), -kInf);
    std::fill(w.sum.begin(), w.sum.end(), 0.0f);
    for (int64_t t = 0; t < count; ++t) {
        const int64_t c0 = entry(index, task * s.m + t, wide) * s.bs;
        const int64_t keys = std::min(s.bs, s.skv - c0);
        for (int64_t c = 0; c < keys; c += kDirectKeys) {
            const int64_t n = std::min(kDirectKeys, keys - c);
            const float* kr = as_fp32<T>(k + (c0 + c) * d, n, d, w.widened.data());
            for (int64_t r = 0; r < rows; ++r) {
                const float* qr = w.q.data() + r * d;
                float* pr = w.p.data() + r * w.cap + c;
                if (n == kDirectKeys) {  // four sums in vectors, then the odd columns
                    vec a[kDirectKeys] = {};
                    int64_t e = 0;
                    for (; e + W <= d; e += W) {
                        const vec x = vload(qr + e);
                        for (int64_t j = 0; j < kDirectKeys; ++j) a[j] += x * vload(kr + j * d + e);
                    }
                    for (int64_t j = 0; j < kDirectKeys; ++j) {
                        float total = 0.0f;
                        for (int64_t l = 0; l < W; ++l) total += a[j][l];
                        for (int64_t f = e; f < d; ++f) total += qr[f] * kr[j * d + f];
                        pr[j] = total;
                    }
                    continue;
                }
                for (int64_t j = 0; j < n; ++j) {
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t e = 0; e < d; ++e) acc += qr[e] * kr[j * d + e];
                    pr[j] = acc;
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            float* row = w.p.data() + r * w.cap;
            const float before = w.mx[r];
            float top = before;
            for (int64_t c = 0; c < keys; ++c) top = std::max(top, row[c]);  // NaN skipped
            const float total = shifted_exp2_sum(row, keys, top);
            const float alpha = before == -kInf ? 0.0f : exp2_nonpositive(before - top);
            float* orow = w.o.data() + r * d;
            for (int64_t e = 0; e < d; ++e) orow[e] *= alpha;
            w.sum[r] = w.sum[r] * alpha + total;
            w.mx[r] = top;
        }
        for (int64_t c = 0; c < keys; c += kDirectKeys) {
            const int64_t n = std::min(kDirectKeys, keys - c);
            const float* vr = as_fp32<T>(v + (c0 + c) * d, n, d, w.widened.data());
            for (int64_t r = 0; r < rows; ++r) {
                const float* pr = w.p.data() + r * w.cap + c;
                float* orow = w.o.data() + r * d;
                if (n == kDirectKeys) {  // one pass over the row for four keys
                    const float p0 = pr[0], p1 = pr[1], p2 = pr[2], p3 = pr[3];
                    int64_t e = 0;
                    for (; e + W <= d; e += W) {
                        const vec sum = p0 * vload(vr + e) + p1 * vload(vr + d + e) +
                                        p2 * vload(vr + 2 * d + e) + p3 * vload(vr + 3 * d + e);
                        vstore(orow + e, vload(orow + e) + sum);
                    }
                    for (; e < d; ++e) {
                        orow[e] += p0 * vr[e] + p1 * vr[d + e] + p2 * vr[2 * d + e] +
                                   p3 * vr[3 * d + e];
                    }
                    continue;
                }
                for (int64_t j = 0; j < n; ++j) {
                    const float pc = pr[j];
                    const float* vj = vr + j * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) orow[e] += pc * vj[e];
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = w.sum[r] > 0.0f ? 1.0f / w.sum[r] : 0.0f;
        const float* orow = w.o.data() + r * d;
        auto* dst = out + (r0 + r) * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = T::store(orow[e] * inv);
    }
}

// The direct path over every (batch x head, query block).
template <typename T>
void direct(const typename T::storage* q, const typename T::storage* k,
            const typename T::storage* v, const void* index, const void* count,
            typename T::storage* y, bool wide, const Shape& s, float scale, int32_t threads) {
    const auto used = static_cast<int32_t>(std::min<int64_t>(threads, s.bh * s.nq));
    std::vector<Direct> scratch;  // for no more threads than there are tasks
    scratch.reserve(static_cast<size_t>(used));
    for (int32_t t = 0; t < used; ++t) scratch.emplace_back(s);
#pragma omp parallel for num_threads(used) schedule(dynamic)
    for (int64_t task = 0; task < s.bh * s.nq; ++task) {
        const int64_t head = task / s.nq, i = task % s.nq;
        const int64_t at = head * s.sq * s.d, kv = head * s.skv * s.d;
        direct_block<T>(q + at, y + at, k + kv, v + kv, index, entry(count, task, wide), wide,
                        task, i, s, scale, scratch[static_cast<size_t>(omp_get_thread_num())]);
    }
}

// Group by group of heads (as many as Packed holds): the threads pack the group's listed keys
// and values, then share all its query blocks (one barrier per group, not per head). Scratch is
// allocated before the parallel region: std::bad_alloc cannot leave one.
template <typename T>
void block_sparse_attention(const void* qp, const void* kp, const void* vp, const void* index,
                            const void* count, void* outp, bool wide, const Shape& s, float scale,
                            int32_t threads) {
    const auto* q = in<T>(qp);
    const auto* k = in<T>(kp);
    const auto* v = in<T>(vp);
    auto* y = out<T>(outp);
    if (s.sq <= kDirectRows) {
        direct<T>(q, k, v, index, count, y, wide, s, scale, threads);
        return;
    }
    Packed pk(s);
    // which heads' KV blocks some query block lists: only those are packed (one query block
    // listing a quarter of a long sequence's blocks packs that quarter)
    std::vector<uint8_t> listed(static_cast<size_t>(times(s.bh, s.nk)), 0);
    for (int64_t task = 0; task < s.bh * s.nq; ++task) {
        const int64_t head = task / s.nq, n = entry(count, task, wide);
        for (int64_t t = 0; t < n; ++t) {
            listed[head * s.nk + entry(index, task * s.m + t, wide)] = 1;
        }
    }
    std::vector<Scratch> scratch;
    scratch.reserve(static_cast<size_t>(threads));
    for (int32_t t = 0; t < threads; ++t) scratch.emplace_back(s);
#pragma omp parallel num_threads(threads)
    {
        Scratch& w = scratch[static_cast<size_t>(omp_get_thread_num())];
        for (int64_t h0 = 0; h0 < s.bh; h0 += pk.heads) {
            const int64_t hn = std::min(pk.heads, s.bh - h0);
#pragma omp for schedule(dynamic, 4)
            for (int64_t t = 0; t < hn * s.nk; ++t) {
                if (!listed[h0 * s.nk + t]) continue;
                const int64_t kv = (h0 + t / s.nk) * s.skv * s.d;
                pack_block<T>(k + kv, v + kv, t % s.nk, t, s, pk);
            }
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < hn * s.nq; ++t) {
                const int64_t g = t / s.nq, i = t % s.nq, head = h0 + g;
                const int64_t task = head * s.nq + i, at = head * s.sq * s.d;
                query_block<T>(q + at, y + at, pk, index, entry(count, task, wide), wide, task, i,
                               g * s.nk, s, scale, w);
            }
        }
    }
}

}  // namespace
}  // namespace spore

using namespace spore;

// q, out: [bh, sq, d]; k, v: [bh, skv, d]; index: [bh, ceil(sq/bs), m] and count:
// [bh, ceil(sq/bs)], int64 when index_is_64 else int32. BAD_ARGUMENT (nothing written) for a
// null pointer, a negative size, a block size below 1, a count outside 0..m or a listed id
// outside 0..ceil(skv/bs)-1; BAD_DTYPE for an unknown dtype code; OUT_OF_MEMORY (nothing
// written) when the packed blocks or a thread's scratch (a block's rows, min(bs, sq), by its
// keys, min(bs, skv)) cannot be had, sizes past int64 included.
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
    const Shape s{bh, sq, skv, d, m, bs, sq / bs + (sq % bs != 0), skv / bs + (skv % bs != 0)};
    if (bh == 0 || sq == 0) return OK;
    if (count == nullptr || (m > 0 && index == nullptr)) return BAD_ARGUMENT;
    const bool wide = index_is_64 != 0;
    if (!lists_valid(index, count, wide, s)) return BAD_ARGUMENT;
    if (d == 0) return OK;
    if (q == nullptr || out == nullptr || (skv > 0 && (k == nullptr || v == nullptr))) {
        return BAD_ARGUMENT;
    }
    try {
        return with_dtype(dtype, [&](auto t) {
            using T = decltype(t);
            block_sparse_attention<T>(q, k, v, index, count, out, wide, s, scale, threads);
        });
    } catch (const std::bad_alloc&) {
        return OUT_OF_MEMORY;
    } catch (const std::length_error&) {
        return OUT_OF_MEMORY;
    }
}
