// dvm's VM: validates a program and its operands, coalesces the domain, and runs the program
// tile by tile (OpenMP over tiles), one pre-compiled loop per instruction and tile.
//
// A tile is a run of consecutive domain elements (row-major). Without reductions a tile is up
// to TILE elements and may span rows; with reductions it holds whole rows (one row, or as many
// as fit in TILE), so REDUCE_* see complete rows and the results do not depend on threads.
//
// A register holds a value per element of the tile, or (its shape) one per row of the tile
// (a row-scalar: a REDUCE_* result, a load broadcast along the row) or one for the whole tile
// (a scalar: CONST, a load broadcast everywhere). Ops on such registers compute that many
// values; ops mixing them broadcast the few values in the op loop; stores write them out.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#include "ops.h"

namespace dvm {
namespace {

constexpr int32_t MAX_OPERANDS = MAX_INPUTS + MAX_OUTPUTS;

int32_t kind(int32_t op) {  // number of register operands read, -1 when unknown
    if (op == LOAD || op == CONST) return 0;
    if (op == STORE) return 1;
    if (op >= NEG && op <= GELU) return 1;
    if (op >= ADD && op <= OR) return 2;
    if (op == WHERE) return 3;
    if (op >= REDUCE_SUM && op <= REDUCE_MEAN) return 1;
    return -1;
}

int32_t check_program(const int32_t* code, int32_t n_instr, int32_t n_regs, int32_t n_inputs,
                      int32_t n_outputs, bool& has_reduce) {
    if (code == nullptr || n_instr < 1 || n_instr > MAX_INSTRS || n_regs < 1 ||
        n_regs > MAX_REGS || n_inputs < 0 || n_inputs > MAX_INPUTS || n_outputs < 1 ||
        n_outputs > MAX_OUTPUTS)
        return BAD_PROGRAM;
    uint32_t written = 0, stored = 0;
    has_reduce = false;
    for (int32_t k = 0; k < n_instr; ++k) {
        const int32_t* ins = code + 5 * k;
        const int32_t op = ins[0], reads = kind(op);
        if (reads < 0) return BAD_PROGRAM;
        if (op == STORE) {
            if (ins[2] < 0 || ins[2] >= n_outputs || (stored >> ins[2]) & 1u) return BAD_PROGRAM;
            if (ins[3] < 0 || ins[3] >= n_regs || !((written >> ins[3]) & 1u)) return BAD_PROGRAM;
            stored |= 1u << ins[2];
            continue;
        }
        if (op == LOAD && (ins[2] < 0 || ins[2] >= n_inputs)) return BAD_PROGRAM;
        for (int32_t j = 0; j < reads; ++j) {
            const int32_t r = ins[2 + j];
            if (r < 0 || r >= n_regs || !((written >> r) & 1u)) return BAD_PROGRAM;
        }
        if (ins[1] < 0 || ins[1] >= n_regs) return BAD_PROGRAM;
        written |= 1u << ins[1];
        has_reduce = has_reduce || op >= REDUCE_SUM;
    }
    return stored == (1u << n_outputs) - 1 ? OK : BAD_PROGRAM;
}

struct Operand {
    const char* base;
    int32_t dtype;
    int64_t stride[MAX_DIMS];
};

// The domain after dropping size-1 dimensions and merging dimensions that every operand walks
// as one (with reductions the row, the last dimension, is kept as it is).
struct Plan {
    int32_t ndim = 0;
    int64_t size[MAX_DIMS];
    int32_t n_ops = 0;
    Operand ops[MAX_OPERANDS];
    int64_t inner = 1, total = 1;
};

void coalesce(Plan& p, const int64_t* domain, int32_t ndim, bool keep_last) {
    const int32_t last = ndim - 1;
    p.ndim = 0;
    for (int32_t d = 0; d < ndim; ++d) {
        const bool is_row = keep_last && d == last;
        if (domain[d] == 1 && !is_row) continue;
        const int32_t prev = p.ndim - 1;
        bool merge = prev >= 0 && !is_row;
        for (int32_t o = 0; merge && o < p.n_ops; ++o)
            merge = p.ops[o].stride[prev] == p.ops[o].stride[d] * domain[d];
        if (merge) {
            p.size[prev] *= domain[d];
            for (int32_t o = 0; o < p.n_ops; ++o) p.ops[o].stride[prev] = p.ops[o].stride[d];
            continue;
        }
        p.size[p.ndim] = domain[d];
        for (int32_t o = 0; o < p.n_ops; ++o) p.ops[o].stride[p.ndim] = p.ops[o].stride[d];
        ++p.ndim;
    }
    if (p.ndim == 0) {  // a single element
        p.size[0] = 1;
        for (int32_t o = 0; o < p.n_ops; ++o) p.ops[o].stride[0] = 0;
        p.ndim = 1;
    }
    p.inner = p.size[p.ndim - 1];
}

// Without reductions the domain's dims may be walked in any order. They are put in the order
// of the first output's strides, largest first (a stable sort), as eager laid that output out
// after its inputs: a transposed or channels-last output and the inputs laid out like it are
// then walked along their contiguous dim, not across a cache line (and a page) per element.
void order_by_output(Plan& p, int64_t* domain, int32_t ndim, int32_t n_inputs) {
    const int64_t* s = p.ops[n_inputs].stride;
    int32_t perm[MAX_DIMS];
    for (int32_t d = 0; d < ndim; ++d) perm[d] = d;
    std::stable_sort(perm, perm + ndim, [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS];
    for (int32_t d = 0; d < ndim; ++d) sizes[d] = domain[perm[d]];
    for (int32_t d = 0; d < ndim; ++d) domain[d] = sizes[d];
    for (int32_t o = 0; o < p.n_ops; ++o) {
        for (int32_t d = 0; d < ndim; ++d) strides[d] = p.ops[o].stride[perm[d]];
        for (int32_t d = 0; d < ndim; ++d) p.ops[o].stride[d] = strides[d];
    }
}

// Calls fn(offset, column, length, position) for each row piece of the tile [start, start+n):
// offset in elements of the operand with `stride`, column within the row, position in the tile.
template <typename Fn>
void for_pieces(const Plan& p, const int64_t* stride, int64_t start, int64_t n, Fn&& fn) {
    const int32_t outer = p.ndim - 1;
    int64_t idx[MAX_DIMS];
    int64_t row = start / p.inner, col = start % p.inner, off = 0;
    for (int32_t d = outer - 1; d >= 0; --d) {
        idx[d] = row % p.size[d];
        row /= p.size[d];
        off += idx[d] * stride[d];
    }
    for (int64_t pos = 0; pos < n;) {
        const int64_t len = std::min(p.inner - col, n - pos);
        fn(off + col * stride[outer], col, len, pos);
        pos += len;
        col = 0;
        for (int32_t d = outer - 1; d >= 0; --d) {
            off += stride[d];
            if (++idx[d] < p.size[d]) break;
            off -= p.size[d] * stride[d];
            idx[d] = 0;
        }
    }
}

template <typename T>
using Widen = void (*)(const T*, float*, int64_t);
template <typename T>
using Narrow = void (*)(const float*, T*, int64_t);

template <typename T>
void load_piece(const T* src, int64_t step, float* d, int64_t n, Widen<T> widen) {
    if (step == 1) {  // streamed from memory: see prefetch_ahead
        for (int64_t c = 0; c < n; c += 64) {
            prefetch_ahead(src + c, 64);
            widen(src + c, d + c, std::min<int64_t>(64, n - c));
        }
        return;
    }
    float v;
    if (step == 0) {
        widen(src, &v, 1);
        return fill(d, v, n);
    }
    for (int64_t i = 0; i < n; ++i) {
        widen(src + i * step, &v, 1);
        d[i] = v;
    }
}

template <typename T>
void store_piece(const float* s, T* dst, int64_t step, int64_t col, int64_t n, Narrow<T> narrow) {
    if (step == 1) return narrow(s, dst, n);
    if (step == 0) {  // a reduced row: its first value
        if (col == 0) narrow(s, dst, 1);
        return;
    }
    for (int64_t i = 0; i < n; ++i) narrow(s + i, dst + i * step, 1);
}

// v stored into n elements `step` apart (step 0: a reduced row, written at its column 0).
template <typename T>
void store_value(float v, T* dst, int64_t step, int64_t col, int64_t n, Narrow<T> narrow) {
    T t;
    narrow(&v, &t, 1);
    if (step == 0) {
        if (col == 0) *dst = t;
        return;
    }
    if (step == 1) {
        for (int64_t i = 0; i < n; ++i) dst[i] = t;
        return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i * step] = t;
}

// A register's values: one per element, one per row (a row-scalar), or one for all.
enum Shape : uint8_t { SCALAR, ROWS, FULL };

// The registers of one thread: `own` buffers for full values, `few` for row-scalars and
// scalars, and `cur`, where each register's values are (its own buffer or its few, or
// straight in an fp32 input when a load needs no conversion).
struct Registers {
    float* own[MAX_REGS];
    float* few[MAX_REGS];
    const float* cur[MAX_REGS];
    Shape shape[MAX_REGS];
    const float* row_of[MAX_INPUTS];  // a row-invariant input's widened row, or nullptr
};

struct Buffer {
    float* data = nullptr;
    size_t floats = 0;
    ~Buffer() { std::free(data); }
    bool reserve(size_t n) {
        if (n <= floats) return true;
        std::free(data);
        data = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
        floats = data ? n : 0;
        return data != nullptr;
    }
};

thread_local Buffer thread_buffer;

// The AVX-512 build's hand-vectorised loops (silu_into, the GELU loops) prefetch their inputs
// and can write non-temporal stores; the portable loops of the other builds do neither.
#if defined(__AVX512F__)
constexpr bool AVX512_LOOPS = true;
#else
constexpr bool AVX512_LOOPS = false;
#endif

// An instruction run together with the next one, when the value passed between them is
// not read again: a binary op and the bf16 store of its result (no fp32 register pass), a
// MUL and the REDUCE_SUM/MEAN of its result (the products are summed as they are made), or a
// SIGMOID and the MUL of its result by its own operand (x * sigmoid(x), SiLU, in one pass;
// SILU_BF16 when the product is only stored next, to a bf16 output: the three in one loop).
// LOAD_SILU: a bf16 input loaded only for such a SiLU is read by the SiLU's loop itself
// (widened in registers, not in a pass of its own), where the tile is one contiguous piece;
// LOAD_OPERAND: likewise a bf16 input loaded only as an operand of a binary op whose result
// is rounded straight into a bf16 output (STORE_BF16). SILU_MUL: a SiLU whose product is only
// multiplied by an input loaded right after it (x * sigmoid(x) * y, the gated MLP), the three
// instructions in one loop that reads y in place and writes the output the product goes to.
// SCALE_MUL: a MUL by a row-scalar or scalar, optionally rounded to bf16 (CAST_BF16), whose
// result is only multiplied by an input loaded right after (a norm's tail: x * rstd, cast,
// times the weight), in one loop likewise. LOAD_DOT: a bf16 input loaded for a DOT of its own
// square (a norm's sum of squares) is widened by the DOT's loop as it sums. BIN_UNARY: an
// ADD/SUB/MUL/DIV whose result only a costly unary op after it reads (exp(x - max) in a
// softmax, GELU of a biased input, tanh of a scaled one) applies that op in its own loop.
// LOAD_GELU: a bf16 input loaded only as one operand of such a BIN_UNARY into GELU is read in
// place by the AVX-512 build's GELU loop (which prefetches it), and the loop writes the output
// the result is stored to next (bf16 rounded).
enum Fuse : uint8_t {
    ALONE, STORE_BF16, DOT, SILU, SILU_BF16, LOAD_SILU, LOAD_OPERAND, SILU_MUL, SCALE_MUL,
    LOAD_DOT, BIN_UNARY, LOAD_GELU
};

struct Program {
    const int32_t* code;
    const float* imm;
    int32_t n_instr, n_regs, n_inputs;
    bool reduce;    // rows are whole within a tile
    int64_t width;  // register length
    const uint8_t* fuse;     // per instruction
    uint32_t row_invariant;  // inputs whose widened row is cached per thread (bit per input)
    uint32_t large;          // fp32 outputs of STREAM_BYTES and more (bit per output)
    uint32_t streamed;       // those its STOREs write with non-temporal stores
    uint32_t across;         // inputs copied a band of rows at a time (bit per input)
};

// An input of a 2-d elementwise domain that is contiguous down the columns and far apart along
// the rows (a transposed operand among others that are not: the walk follows the output) would
// be read a cache line and a page per element. Each thread copies it a band of BAND rows at a
// time into a row-major buffer, reading down its contiguous dim, and the tiles of those rows
// read it there. Rows of at least TILE elements (a tile then spans at most two rows), and
// bands of at most BAND_BYTES.
constexpr int64_t BAND = 32;
constexpr int64_t BAND_BYTES = int64_t{1} << 20;

int64_t dtype_size(int32_t dtype) { return dtype == F32 ? 4 : dtype == BOOL ? 1 : 2; }

uint32_t inputs_across(const Plan& p, int32_t n_inputs, bool reduce) {
    uint32_t bits = 0;
    if (reduce || p.ndim != 2 || p.inner < TILE) return 0;
    for (int32_t i = 0; i < n_inputs; ++i) {
        const Operand& o = p.ops[i];
        if (o.stride[0] == 1 && o.stride[1] * dtype_size(o.dtype) >= 64 &&
            BAND * p.inner * dtype_size(o.dtype) <= BAND_BYTES)
            bits |= 1u << i;
    }
    return bits;
}

// Rows [first, first + rows) of input `o` (see inputs_across) copied row-major into `band`,
// reading down the columns (where the input is contiguous) a cache line's worth of columns at
// a time: each band row's writes then fill whole lines, and the block's source lines stay in
// L1 across its rows. The columns AHEAD on are asked for meanwhile (the hardware prefetcher
// does not follow a few lines each from thousands of pages).
template <typename T>
void copy_band_as(const Operand& o, int64_t cols, int64_t first, int64_t rows, T* band) {
    const T* base = reinterpret_cast<const T*>(o.base) + first;
    const int64_t step = o.stride[1];
    constexpr int64_t B = 64 / static_cast<int64_t>(sizeof(T));
    constexpr int64_t AHEAD = 4 * B;  // columns
    for (int64_t c0 = 0; c0 < cols; c0 += B) {
        const int64_t c1 = std::min(cols, c0 + B);
        for (int64_t c = c0 + AHEAD; c < std::min(cols, c1 + AHEAD); ++c) {
            const char* col = reinterpret_cast<const char*>(base + c * step);
            for (int64_t b = 0; b < rows * static_cast<int64_t>(sizeof(T)); b += 64)
                __builtin_prefetch(col + b, 0, 3);
        }
        for (int64_t r = 0; r < rows; ++r) {
            T* dst = band + r * cols;
            for (int64_t c = c0; c < c1; ++c) dst[c] = base[c * step + r];
        }
    }
}

void copy_band(const Plan& p, const Operand& o, int64_t first, int64_t rows, char* band) {
    switch (dtype_size(o.dtype)) {
        case 4: return copy_band_as(o, p.inner, first, rows, reinterpret_cast<uint32_t*>(band));
        case 2: return copy_band_as(o, p.inner, first, rows, reinterpret_cast<uint16_t*>(band));
        default: return copy_band_as(o, p.inner, first, rows, reinterpret_cast<uint8_t*>(band));
    }
}

// An fp32 output of at least this many bytes is written with non-temporal stores: ordinary
// stores first read every line (a third more memory traffic), and the bursts of such reads
// stalled the cheap op passes that write outputs. In a program that makes more than one pass
// over a tile, its STORE streams the values from the register; the loops that write
// non-temporal stores themselves (silu_into and the GELU loops of an AVX-512 build) stream
// straight into it in any program, when nothing reads the values again (see AVX512_LOOPS).
constexpr int64_t STREAM_BYTES = int64_t{16} << 20;

uint32_t large_outputs(const Plan& p, int32_t n_inputs, int32_t n_outputs) {
    uint32_t bits = 0;
    for (int32_t i = 0; i < n_outputs; ++i) {
        const Operand& o = p.ops[n_inputs + i];
        if (o.dtype == F32 && o.stride[p.ndim - 1] == 1 && p.total * 4 >= STREAM_BYTES)
            bits |= 1u << i;
    }
    return bits;
}

// Longest cached row (inner + tile floats): a weight or bias row of up to 4096 columns.
constexpr int64_t ROW_CACHE = 8192;

// Inputs that read the same row at every row of the domain (a weight or bias broadcast over
// the rows): each thread widens such a row once, not once per tile.
uint32_t row_invariant_inputs(const Plan& p, int32_t n_inputs, int64_t tile) {
    uint32_t bits = 0;
    if (p.ndim < 2 || p.inner + tile > ROW_CACHE) return 0;
    for (int32_t i = 0; i < n_inputs; ++i) {
        bool same = p.ops[i].stride[p.ndim - 1] != 0;
        for (int32_t d = 0; same && d < p.ndim - 1; ++d) same = p.ops[i].stride[d] == 0;
        if (same) bits |= 1u << i;
    }
    return bits;
}

// Whether register `reg` is read by instructions [from, n_instr) before it is written.
bool read_later(const int32_t* code, int32_t n_instr, int32_t from, int32_t reg) {
    for (int32_t k = from; k < n_instr; ++k) {
        const int32_t* ins = code + 5 * k;
        if (ins[0] == STORE) {
            if (ins[3] == reg) return true;
            continue;
        }
        for (int32_t j = 0; j < kind(ins[0]); ++j)
            if (ins[2 + j] == reg) return true;
        if (ins[1] == reg) return false;
    }
    return false;
}

// fuse[k] for each instruction of a checked program (see Fuse).
void plan_fusions(const int32_t* code, int32_t n_instr, int32_t n_inputs, const Operand* ops,
                  uint8_t* fuse) {
    for (int32_t k = 0; k < n_instr; ++k) {
        fuse[k] = ALONE;
        const int32_t* ins = code + 5 * k;
        const int32_t* next = ins + 5;
        if (k + 1 >= n_instr) continue;
        // the value passed on is dead after the next instruction: not read later, or
        // overwritten by the next instruction itself (a reduction into the same register)
        const bool dead = (next[0] != STORE && next[1] == ins[1]) ||
                          !read_later(code, n_instr, k + 2, ins[1]);
        if (!dead) continue;
        if (fuses_into_bf16(ins[0]) && next[0] == STORE && next[3] == ins[1] &&
            ops[n_inputs + next[2]].dtype == BF16)
            fuse[k] = STORE_BF16;
        else if (ins[0] == MUL && (next[0] == REDUCE_SUM || next[0] == REDUCE_MEAN) &&
                 next[2] == ins[1])
            fuse[k] = DOT;
        else if (ins[0] >= ADD && ins[0] <= DIV && fuses_after_binary(next[0]) &&
                 next[2] == ins[1])
            fuse[k] = BIN_UNARY;
        else if (ins[0] == SIGMOID && next[0] == MUL && ins[1] != ins[2] &&
                 ((next[2] == ins[2] && next[3] == ins[1]) ||
                  (next[2] == ins[1] && next[3] == ins[2]))) {
            const int32_t* store = next + 5;
            const bool to_bf16 = k + 2 < n_instr && store[0] == STORE && store[3] == next[1] &&
                                 ops[n_inputs + store[2]].dtype == BF16 &&
                                 !read_later(code, n_instr, k + 3, next[1]);
            fuse[k] = to_bf16 ? SILU_BF16 : SILU;
        }
    }
    for (int32_t k = 0; k + 3 < n_instr; ++k) {
        if (fuse[k] != SILU) continue;
        const int32_t* ins = code + 5 * k;
        const int32_t s = ins[6], x = ins[2];  // the SiLU product's register, x's
        const int32_t* ld = ins + 10;
        const int32_t* mul = ins + 15;
        const int32_t y = ld[1];
        if (ld[0] == LOAD && mul[0] == MUL && y != s && y != x &&
            ((mul[2] == s && mul[3] == y) || (mul[2] == y && mul[3] == s)) &&
            !read_later(code, n_instr, k + 4, s) && !read_later(code, n_instr, k + 4, y))
            fuse[k] = SILU_MUL;
    }
    for (int32_t k = 0; k + 2 < n_instr; ++k) {
        const int32_t* ins = code + 5 * k;
        if (ins[0] != MUL || fuse[k] != ALONE) continue;
        const int32_t t = ins[1];
        const bool cast = ins[5] == CAST_BF16 && ins[7] == t;
        const int32_t c = cast ? ins[6] : t;  // the value the weight multiplies
        const int32_t* ld = ins + (cast ? 10 : 5);
        const int32_t m = k + (cast ? 3 : 2);  // the second MUL
        if (m >= n_instr || ld[0] != LOAD) continue;
        const int32_t* mul = code + 5 * m;
        const int32_t w = ld[1];
        if (w != ins[2] && w != ins[3] && w != c && mul[0] == MUL &&
            ((mul[2] == c && mul[3] == w) || (mul[2] == w && mul[3] == c)) &&
            !read_later(code, n_instr, m + 1, c) && !read_later(code, n_instr, m + 1, w) &&
            (!cast || t == c || !read_later(code, n_instr, k + 2, t)))
            fuse[k] = SCALE_MUL;
    }
    for (int32_t k = 0; k + 2 < n_instr; ++k) {
        const int32_t* ins = code + 5 * k;
        const int32_t* sig = ins + 5;
        if (ins[0] == LOAD && ops[ins[2]].dtype == BF16 && (fuse[k + 1] == SILU ||
            fuse[k + 1] == SILU_BF16 || fuse[k + 1] == SILU_MUL) && sig[2] == ins[1] &&
            !read_later(code, n_instr, k + 3, ins[1]))
            fuse[k] = LOAD_SILU;
        else if (ins[0] == LOAD && ops[ins[2]].dtype == BF16 && fuse[k + 1] == DOT &&
                 sig[2] == ins[1] && sig[3] == ins[1])
            fuse[k] = LOAD_DOT;
        else if (ins[0] == LOAD && ops[ins[2]].dtype == BF16 && fuse[k + 1] == STORE_BF16 &&
                 (sig[2] == ins[1]) != (sig[3] == ins[1]) &&
                 !read_later(code, n_instr, k + 3, ins[1]))
            fuse[k] = LOAD_OPERAND;
        else if (AVX512_LOOPS && ins[0] == LOAD && ops[ins[2]].dtype == BF16 &&
                 fuse[k + 1] == BIN_UNARY && ins[10] == GELU &&
                 (sig[2] == ins[1]) != (sig[3] == ins[1]) &&
                 !read_later(code, n_instr, k + 2, ins[1]))
            fuse[k] = LOAD_GELU;
    }
}

// The loops a tile runs: computing instructions, less those a fusion runs inside another's loop.
int32_t passes(const int32_t* code, int32_t n_instr, const uint8_t* fuse) {
    int32_t n = 0;
    for (int32_t k = 0; k < n_instr; ++k) {
        const int32_t op = code[5 * k];
        if (op == LOAD || op == CONST || op == STORE) continue;
        ++n;
        if (fuse[k] == DOT || fuse[k] == SILU || fuse[k] == SILU_BF16 || fuse[k] == BIN_UNARY)
            --n;
        if (fuse[k] == SILU_MUL) n -= 2;
        if (fuse[k] == SCALE_MUL) n -= code[5 * k + 5] == CAST_BF16 ? 2 : 1;
    }
    return n;
}

template <typename T>
float widen_one(const T* src, Widen<T> widen) {
    float v;
    widen(src, &v, 1);
    return v;
}

float load_one(const Operand& o, int64_t off) {
    switch (o.dtype) {
        case F32: return reinterpret_cast<const float*>(o.base)[off];
        case BF16: return widen_one(reinterpret_cast<const uint16_t*>(o.base) + off, widen_bf16);
        case F16: return widen_one(reinterpret_cast<const uint16_t*>(o.base) + off, widen_f16);
        default: return widen_one(reinterpret_cast<const uint8_t*>(o.base) + off, widen_bool);
    }
}

// A load broadcast along the whole domain is a scalar; with whole rows per tile, one
// broadcast along the row is a row-scalar (a value per row piece, each piece a row).
bool load_few(const Program& g, const Plan& p, const Operand& o, int64_t start, int64_t n,
              Registers& r, int32_t dst) {
    const int32_t last = p.ndim - 1;
    bool everywhere = o.stride[last] == 0;
    for (int32_t d = 0; everywhere && d < last; ++d) everywhere = o.stride[d] == 0;
    float* v = r.few[dst];
    r.cur[dst] = v;
    if (everywhere) {
        v[0] = load_one(o, 0);
        r.shape[dst] = SCALAR;
        return true;
    }
    if (!g.reduce || o.stride[last] != 0) return false;
    for_pieces(p, o.stride, start, n, [&](int64_t off, int64_t, int64_t, int64_t pos) {
        v[pos / p.inner] = load_one(o, off);
    });
    r.shape[dst] = ROWS;
    return true;
}

void load(const Plan& p, const Operand& o, int64_t start, int64_t n, Registers& r, int32_t dst) {
    r.shape[dst] = FULL;
    if (o.dtype == F32 && p.inner - start % p.inner >= n && o.stride[p.ndim - 1] == 1) {
        int64_t at = 0;  // one contiguous piece: the register reads the input in place
        auto first = [&](int64_t off, int64_t, int64_t, int64_t) { at = off; };
        for_pieces(p, o.stride, start, n, first);
        r.cur[dst] = reinterpret_cast<const float*>(o.base) + at;
        return;
    }
    float* d = r.own[dst];
    const int64_t step = o.stride[p.ndim - 1];
    const auto* f32 = reinterpret_cast<const float*>(o.base);
    const auto* u16 = reinterpret_cast<const uint16_t*>(o.base);
    const auto* u8 = reinterpret_cast<const uint8_t*>(o.base);
    for_pieces(p, o.stride, start, n, [&](int64_t off, int64_t, int64_t len, int64_t pos) {
        switch (o.dtype) {
            case F32: return load_piece(f32 + off, step, d + pos, len, widen_f32);
            case BF16: return load_piece(u16 + off, step, d + pos, len, widen_bf16);
            case F16: return load_piece(u16 + off, step, d + pos, len, widen_f16);
            default: return load_piece(u8 + off, step, d + pos, len, widen_bool);
        }
    });
    r.cur[dst] = d;
}

// An input's row widened into `cache` and repeated to `len` elements, so that any tile's
// values (a tile starts at some column and runs on, into the next rows) lie at
// cache + start % inner.
void fill_row(const Plan& p, const Operand& o, float* cache, int64_t len) {
    const int64_t step = o.stride[p.ndim - 1];
    switch (o.dtype) {
        case F32: load_piece(reinterpret_cast<const float*>(o.base), step, cache, p.inner,
                             widen_f32); break;
        case BF16: load_piece(reinterpret_cast<const uint16_t*>(o.base), step, cache, p.inner,
                              widen_bf16); break;
        case F16: load_piece(reinterpret_cast<const uint16_t*>(o.base), step, cache, p.inner,
                             widen_f16); break;
        default: load_piece(reinterpret_cast<const uint8_t*>(o.base), step, cache, p.inner,
                            widen_bool);
    }
    for (int64_t j = p.inner; j < len; ++j) cache[j] = cache[j - p.inner];
}

// A row-scalar or scalar register (`shape`) stored: each row's value, once into a reduced
// output, else broadcast along the row.
void store_few(const Plan& p, const Operand& o, int64_t start, int64_t n, const float* s,
               Shape shape) {
    const int64_t step = o.stride[p.ndim - 1], per_row = shape == ROWS ? 1 : 0;
    char* base = const_cast<char*>(o.base);  // an output's base: dvm_run got it writable
    auto* f32 = reinterpret_cast<float*>(base);
    auto* u16 = reinterpret_cast<uint16_t*>(base);
    auto* u8 = reinterpret_cast<uint8_t*>(base);
    for_pieces(p, o.stride, start, n, [&](int64_t off, int64_t col, int64_t len, int64_t pos) {
        const float v = s[pos / p.inner * per_row];
        switch (o.dtype) {
            case F32: return store_value(v, f32 + off, step, col, len, narrow_f32);
            case BF16: return store_value(v, u16 + off, step, col, len, narrow_bf16);
            case F16: return store_value(v, u16 + off, step, col, len, narrow_f16);
            default: return store_value(v, u8 + off, step, col, len, narrow_bool);
        }
    });
}

void store(const Plan& p, const Operand& o, int64_t start, int64_t n, const float* s,
           bool stream) {
    const int64_t step = o.stride[p.ndim - 1];
    char* base = const_cast<char*>(o.base);  // an output's base: dvm_run got it writable
    auto* f32 = reinterpret_cast<float*>(base);
    auto* u16 = reinterpret_cast<uint16_t*>(base);
    auto* u8 = reinterpret_cast<uint8_t*>(base);
    for_pieces(p, o.stride, start, n, [&](int64_t off, int64_t col, int64_t len, int64_t pos) {
        switch (o.dtype) {
            case F32:
                if (stream && step == 1) return stream_f32(s + pos, f32 + off, len);
                return store_piece(s + pos, f32 + off, step, col, len, narrow_f32);
            case BF16: return store_piece(s + pos, u16 + off, step, col, len, narrow_bf16);
            case F16: return store_piece(s + pos, u16 + off, step, col, len, narrow_f16);
            default: return store_piece(s + pos, u8 + off, step, col, len, narrow_bool);
        }
    });
}

// The `reads` operands of an elementwise instruction as its loop takes them at `level` (the
// widest of their shapes, the result's): values of that shape, or broadcast ones.
Shape operands(const Registers& r, const int32_t* ins, int32_t reads, Arg* args) {
    Shape level = SCALAR;
    for (int32_t j = 0; j < reads; ++j) level = std::max(level, r.shape[ins[2 + j]]);
    for (int32_t j = 0; j < reads; ++j) {
        const int32_t x = ins[2 + j];
        args[j] = Arg{r.cur[x], r.shape[x] == ROWS ? 1 : 0, r.shape[x] == level};
    }
    return level;
}

// Where a full register can be written straight into an output of `dtype` (element type T):
// its elements for the tile when they are one contiguous piece, else nullptr.
template <typename T>
T* direct(const Plan& p, const Operand& o, int64_t start, int64_t n, int32_t dtype) {
    if (o.dtype != dtype || o.stride[p.ndim - 1] != 1 || p.inner - start % p.inner < n)
        return nullptr;
    int64_t at = 0;
    for_pieces(p, o.stride, start, n, [&](int64_t off, int64_t, int64_t, int64_t) { at = off; });
    return reinterpret_cast<T*>(const_cast<char*>(o.base)) + at;
}

// The input a LOAD reads, for a loop over the tile's values: its cached row, in place (fp32
// in `f`, bf16 in `h`), or loaded into register `reg` (fp32 in `f`). False when the input
// is broadcast along the row (the loop takes full values only).
bool full_input(const Plan& p, const Operand& in, const float* row_of, int64_t start, int64_t n,
                Registers& r, int32_t reg, const float*& f, const uint16_t*& h) {
    if (in.stride[p.ndim - 1] == 0) return false;
    f = row_of ? row_of + start % p.inner : direct<float>(p, in, start, n, F32);
    h = f ? nullptr : direct<uint16_t>(p, in, start, n, BF16);
    if (f == nullptr && h == nullptr) {
        load(p, in, start, n, r, reg);
        f = r.cur[reg];
    }
    return true;
}

// Whether instruction `at` is the STORE of register `dst`.
bool stores(const Program& g, int32_t at, int32_t dst) {
    const int32_t* st = g.code + 5 * at;
    return at < g.n_instr && st[0] == STORE && st[3] == dst;
}

// The fp32 output that instruction `at` stores register `dst` to, for a loop over the tile to
// write straight into (the store then finds the values in place), when `at` is such a store,
// the tile is one piece of the output and the store does not stream; or when the output is
// large, nothing reads the values later and the loop writes non-temporal stores itself
// (`can`): `stream` is then set. Else nullptr.
float* direct_output(const Program& g, const Plan& p, int64_t start, int64_t n, int32_t at,
                     int32_t dst, bool can, bool& stream) {
    const int32_t* st = g.code + 5 * at;
    stream = false;
    if (!stores(g, at, dst)) return nullptr;
    float* out = direct<float>(p, p.ops[g.n_inputs + st[2]], start, n, F32);
    stream = AVX512_LOOPS && can && out && ((g.large >> st[2]) & 1u) &&
             !read_later(g.code, g.n_instr, at + 1, dst);
    return stream || !((g.streamed >> st[2]) & 1u) ? out : nullptr;
}

// Where a fused loop ending in the value of register `dst`, stored by instruction `at` if that
// is its store, writes: a bf16 output (`out16`, when nothing reads the value later: the store
// is then done), else direct_output, else the register.
float* fused_destination(const Program& g, const Plan& p, int64_t start, int64_t n,
                         Registers& r, int32_t at, int32_t dst, bool can, uint16_t*& out16,
                         bool& stream) {
    out16 = nullptr;
    float* out = direct_output(g, p, start, n, at, dst, can, stream);
    if (out == nullptr && stores(g, at, dst) && !read_later(g.code, g.n_instr, at + 1, dst))
        out16 = direct<uint16_t>(p, p.ops[g.n_inputs + g.code[5 * at + 2]], start, n, BF16);
    return out ? out : r.own[dst];
}

// A fused loop run into the bf16 output `out16` when fused_destination gave one (the store is
// then done: true), else into `d`; loop(dst) is called with the one chosen.
template <typename Loop>
bool into_destination(uint16_t* out16, float* d, Loop&& loop) {
    if (out16 != nullptr) loop(out16);
    else loop(d);
    return out16 != nullptr;
}

// SILU_MUL at the SIGMOID k (x: its operand, fp32 or a bf16 input in place): silu(x) * y with y
// the input the LOAD at k + 2 reads, in place or as its register, straight into the output
// the product is stored to next (bf16, or fp32 that does not stream) or else into the second
// MUL's register; k moves to the last instruction done. False (nothing done) when y is
// broadcast along the row (its register would not be full).
template <typename X>
bool run_silu_mul(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r,
                  int32_t& k, const X* x) {
    const int32_t* ld = g.code + 5 * (k + 2);
    const float* yf = nullptr;
    const uint16_t* yh = nullptr;
    if (!full_input(p, p.ops[ld[2]], r.row_of[ld[2]], start, n, r, ld[1], yf, yh)) return false;
    const int32_t dst = ld[6];  // the second MUL's
    uint16_t* out16;
    bool stream;
    float* d = fused_destination(g, p, start, n, r, k + 4, dst, true, out16, stream);
    const bool stored = into_destination(out16, d, [&](auto* o) {
        if (yh) silu_into(o, x, yh, n, stream);
        else silu_into(o, x, yf, n, stream);
    });
    r.cur[dst] = d;
    r.shape[dst] = FULL;
    k += stored ? 4 : 3;
    return true;
}

// x * s (s one value per row, or one for all), optionally rounded to bf16, times w, into out
// (fp32, or bf16 rounded), over `rows` rows of `len` elements.
template <bool CAST, typename W, typename O>
void scale_mul_into(O* out, const float* x, Row s, const W* w, int64_t rows, int64_t len) {
    for (int64_t k = 0; k < rows; ++k) {
        const float sk = s.row(k);
        const float* xk = x + k * len;
        const W* wk = w + k * len;
        O* ok = out + k * len;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) {
            float v = xk[i] * sk;
            if constexpr (CAST) v = as_float(bf16_round_bits(v) & 0xffff0000u);
            v = at(wk, i) * v;
            if constexpr (std::is_same_v<O, float>) ok[i] = v;
            else ok[i] = f32_to_bf16(v);
        }
    }
}

// SCALE_MUL at the MUL k, one operand full and the other not: see Fuse. k moves to the last
// instruction done; false (nothing done) when the loaded input is broadcast along the row.
bool run_scale_mul(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r,
                   int32_t& k, int64_t rows, int64_t len) {
    const int32_t* ins = g.code + 5 * k;
    const bool cast = ins[5] == CAST_BF16;
    const int32_t* ld = ins + (cast ? 10 : 5);
    const int32_t m = k + (cast ? 3 : 2);
    const int32_t a = ins[2], b = ins[3];
    const int32_t x = r.shape[a] == FULL ? a : b, sv = x == a ? b : a;
    const float* wf = nullptr;
    const uint16_t* wh = nullptr;
    if (!full_input(p, p.ops[ld[2]], r.row_of[ld[2]], start, n, r, ld[1], wf, wh)) return false;
    const Row s{r.cur[sv], r.shape[sv] == ROWS ? 1 : 0};
    const int32_t dst = g.code[5 * m + 1];
    uint16_t* out16;
    bool stream;  // never: scale_mul_into stores normally
    float* d = fused_destination(g, p, start, n, r, m + 1, dst, false, out16, stream);
    if (!g.reduce) {  // one run
        len *= rows;
        rows = 1;
    }
    const float* xs = r.cur[x];
    const bool stored = into_destination(out16, d, [&](auto* o) {
        if (cast && wh) scale_mul_into<true>(o, xs, s, wh, rows, len);
        else if (cast) scale_mul_into<true>(o, xs, s, wf, rows, len);
        else if (wh) scale_mul_into<false>(o, xs, s, wh, rows, len);
        else scale_mul_into<false>(o, xs, s, wf, rows, len);
    });
    r.cur[dst] = d;
    r.shape[dst] = FULL;
    k = stored ? m + 1 : m;
    return true;
}

// LOAD_SILU at instruction k: x * sigmoid(x) of the bf16 input read in place, into the
// MUL's register (or its fp32 output), or rounded into the bf16 output of a SILU_BF16; k moves
// past the instructions done. False (nothing done) when the input's tile is not one piece.
bool run_load_silu(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r,
                   int32_t& k) {
    const int32_t* ins = g.code + 5 * k;
    const auto* x = direct<uint16_t>(p, p.ops[ins[2]], start, n, BF16);
    if (x == nullptr) return false;
    int32_t sig = k + 1;
    if (g.fuse[sig] == SILU_MUL && run_silu_mul(g, p, start, n, r, sig, x)) {
        k = sig;
        return true;
    }
    const int32_t* mul = ins + 10;
    const int32_t* after = ins + 15;  // what follows the MUL (inside the program: a STORE)
    if (g.fuse[k + 1] == SILU_BF16) {
        if (uint16_t* out = direct<uint16_t>(p, p.ops[g.n_inputs + after[2]], start, n, BF16)) {
            silu_into(out, x, NO_FACTOR, n, false);
            k += 3;
            return true;
        }
    }
    bool stream;
    float* d = direct_output(g, p, start, n, k + 3, mul[1], true, stream);
    if (d == nullptr) d = r.own[mul[1]];
    silu_into(d, x, NO_FACTOR, n, stream);
    r.cur[mul[1]] = d;
    r.shape[mul[1]] = FULL;
    k += 2;
    return true;
}

// LOAD_OPERAND at instruction k: the binary op after it, with this bf16 input read in place
// as one operand and a full register as the other, rounded into its bf16 output; k moves past
// the load, the op and the store. False (nothing done) when that cannot be had for this tile.
bool run_load_operand(const Program& g, const Plan& p, int64_t start, int64_t n,
                      const Registers& r, int32_t& k) {
    const int32_t* ins = g.code + 5 * k;
    const int32_t* op = ins + 5;
    const int32_t* store = ins + 10;
    const bool first = op[2] == ins[1];  // the input is the op's first operand
    const int32_t other = first ? op[3] : op[2];
    if (r.shape[other] != FULL) return false;
    const auto* x = direct<uint16_t>(p, p.ops[ins[2]], start, n, BF16);
    uint16_t* out = direct<uint16_t>(p, p.ops[g.n_inputs + store[2]], start, n, BF16);
    if (x == nullptr || out == nullptr) return false;
    if (first) binary_bf16_as(op[0], out, Vec16{x, 0}, Vec{r.cur[other], 0}, 1, n);
    else binary_bf16_as(op[0], out, Vec{r.cur[other], 0}, Vec16{x, 0}, 1, n);
    k += 2;
    return true;
}

// LOAD_GELU at instruction k: the binary op and the GELU after it in one loop that reads this
// bf16 input in place and writes the output the result is stored to next (bf16 rounded, or
// fp32: see direct_output) or else the GELU's register; k moves to the last instruction done.
// False (nothing done) when the input's tile is not one piece, or the build has no such loop.
bool run_load_gelu(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r,
                   int32_t& k, int64_t rows, int64_t len) {
#if defined(__AVX512F__)
    const int32_t* ins = g.code + 5 * k;
    const int32_t* op = ins + 5;
    const int32_t* un = ins + 10;
    const auto* x = direct<uint16_t>(p, p.ops[ins[2]], start, n, BF16);
    if (x == nullptr) return false;
    const bool first = op[2] == ins[1];  // the input is the op's first operand
    const int32_t other = first ? op[3] : op[2];
    const Arg y{r.cur[other], r.shape[other] == ROWS ? 1 : 0, r.shape[other] == FULL};
    uint16_t* out16;
    bool stream;
    float* d = fused_destination(g, p, start, n, r, k + 3, un[1], true, out16, stream);
    const bool stored = into_destination(out16, d, [&](auto* o) {
        binary_gelu_bf16(op[0], o, x, first, y, rows, len, stream);
    });
    r.cur[un[1]] = d;
    r.shape[un[1]] = FULL;
    k += stored ? 3 : 2;
    return true;
#else
    return false;
#endif
}

// LOAD_DOT at instruction k (whole rows): the bf16 input widened into its register by the
// loop that sums its square into the reduction's row-scalars; k moves past the MUL and the
// reduction. False (nothing done) when the input's tile is not one piece.
bool run_load_dot(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r,
                  int32_t& k) {
    const int32_t* ins = g.code + 5 * k;
    const auto* x = direct<uint16_t>(p, p.ops[ins[2]], start, n, BF16);
    if (x == nullptr) return false;
    const int32_t* red = ins + 10;
    float* row = r.own[ins[1]];
    float* sums = r.few[red[1]];
    const int64_t len = p.inner;
    for (int64_t i = 0; i < n / len; ++i) {
        const float v = row_square_widen(x + i * len, row + i * len, len);
        sums[i] = red[0] == REDUCE_MEAN ? v / static_cast<float>(len) : v;
    }
    r.cur[ins[1]] = row;
    r.shape[ins[1]] = FULL;
    r.cur[red[1]] = sums;
    r.shape[red[1]] = ROWS;
    k += 2;
    return true;
}

void run_tile(const Program& g, const Plan& p, int64_t start, int64_t n, Registers& r) {
    // the tile as rows of `len` elements: whole rows with reductions, else one run
    const int64_t rows = g.reduce ? n / p.inner : 1, len = g.reduce ? p.inner : n;
    for (int32_t k = 0; k < g.n_instr; ++k) {
        const int32_t* ins = g.code + 5 * k;
        const int32_t op = ins[0], dst = ins[1], a = ins[2], b = ins[3];
        const int32_t reads = kind(op);
        if (op == LOAD && g.fuse[k] == LOAD_SILU && r.row_of[a] == nullptr &&
            run_load_silu(g, p, start, n, r, k)) {
            continue;
        }
        if (op == LOAD && g.fuse[k] == LOAD_OPERAND && r.row_of[a] == nullptr &&
            run_load_operand(g, p, start, n, r, k)) {
            continue;
        }
        if (op == LOAD && g.fuse[k] == LOAD_GELU && r.row_of[a] == nullptr &&
            run_load_gelu(g, p, start, n, r, k, rows, len)) {
            continue;
        }
        if (op == LOAD && g.fuse[k] == LOAD_DOT && g.reduce && r.row_of[a] == nullptr &&
            run_load_dot(g, p, start, n, r, k)) {
            continue;
        }
        if (op == LOAD) {
            if (r.row_of[a] != nullptr) {
                r.cur[dst] = r.row_of[a] + start % p.inner;
                r.shape[dst] = FULL;
            } else if (!load_few(g, p, p.ops[a], start, n, r, dst)) {
                load(p, p.ops[a], start, n, r, dst);
            }
            continue;
        }
        if (op == CONST) {
            r.few[dst][0] = g.imm[k];
            r.cur[dst] = r.few[dst];
            r.shape[dst] = SCALAR;
            continue;
        }
        if (op == STORE) {
            const Operand& o = p.ops[g.n_inputs + a];
            const bool stream = (g.streamed >> a) & 1u;
            if (r.shape[b] != FULL) store_few(p, o, start, n, r.cur[b], r.shape[b]);
            else if (r.cur[b] != direct<float>(p, o, start, n, F32))
                store(p, o, start, n, r.cur[b], stream);
            continue;
        }
        if (op >= REDUCE_SUM) {
            const Shape from = r.shape[a];
            if (g.reduce && from == FULL) {
                reduce(op, r.few[dst], r.cur[a], rows, p.inner);
                r.shape[dst] = ROWS;
            } else if (g.reduce) {  // a row of equal values
                for (int64_t i = 0; i < (from == ROWS ? rows : 1); ++i)
                    r.few[dst][i] = reduce_constant(op, r.cur[a][i], p.inner);
                r.shape[dst] = from;
            } else if (from == FULL) {  // rows of one element
                if (r.own[dst] != r.cur[a]) widen_f32(r.cur[a], r.own[dst], n);
                r.shape[dst] = FULL;
            } else {
                r.few[dst][0] = r.cur[a][0];
                r.shape[dst] = SCALAR;
            }
            r.cur[dst] = r.shape[dst] == FULL ? r.own[dst] : r.few[dst];
            continue;
        }
        if (g.fuse[k] == SILU_MUL && r.shape[a] == FULL &&
            run_silu_mul(g, p, start, n, r, k, r.cur[a]))
            continue;
        if (g.fuse[k] == SCALE_MUL && (r.shape[a] == FULL) != (r.shape[b] == FULL) &&
            run_scale_mul(g, p, start, n, r, k, rows, len))
            continue;
        Arg args[3] = {};
        const Shape level = operands(r, ins, reads, args);
        // the loop's rows and their length for a result of this shape
        const int64_t at_rows = level == FULL ? rows : 1;
        const int64_t at_len = level == FULL ? len : level == ROWS ? rows : 1;
        const int32_t* next = ins + 5;
        if (g.fuse[k] == STORE_BF16 && level == FULL) {
            const Operand& o = p.ops[g.n_inputs + next[2]];
            if (uint16_t* out = direct<uint16_t>(p, o, start, n, BF16)) {
                binary_bf16(op, out, args[0], args[1], at_rows, at_len);
                ++k;  // the store is done
                continue;
            }
        }
        // operands "full" at this instruction's shape; a whole row each only at level FULL
        if (g.fuse[k] == DOT && g.reduce && level == FULL && args[0].full && args[1].full) {
            float* sums = r.few[next[1]];
            reduce_dot(next[0], sums, args[0].p, args[1].p, rows, p.inner);
            r.cur[next[1]] = sums;
            r.shape[next[1]] = ROWS;
            ++k;  // the reduction is done
            continue;
        }
        if (g.fuse[k] == SILU_BF16 && level == FULL) {
            const int32_t* store = next + 5;
            const Operand& o = p.ops[g.n_inputs + store[2]];
            if (uint16_t* out = direct<uint16_t>(p, o, start, n, BF16)) {
                silu_into(out, args[0].p, NO_FACTOR, at_rows * at_len, false);
                k += 2;  // the MUL and the store are done
                continue;
            }
        }
        const bool silu = g.fuse[k] == SILU || g.fuse[k] == SILU_BF16 || g.fuse[k] == SILU_MUL;
        const bool then = g.fuse[k] == BIN_UNARY && level == FULL;
        const int32_t after_op = next[0];
        const int32_t to = silu || then ? next[1] : dst;  // the fused op writes its own register
        if (silu || then) ++k;                            // and is done here
        float* d = level == FULL ? r.own[to] : r.few[to];
        // a result stored next goes straight into its output (which later reads then use)
        bool stream = false;
        const bool can = silu || (then && after_op == GELU);
        if (level == FULL) {
            if (float* out = direct_output(g, p, start, n, k + 1, to, can, stream)) d = out;
        }
        if (silu || then) {
            if (silu) silu_into(d, args[0].p, NO_FACTOR, at_rows * at_len, stream);
            else binary_unary(op, after_op, d, args[0], args[1], at_rows, at_len, stream);
            r.cur[to] = d;
            r.shape[to] = level;
            continue;
        }
        if (reads == 1) unary(op, d, args[0].p, at_rows * at_len);
        else if (reads == 2) binary(op, d, args[0], args[1], at_rows, at_len);
        else where(d, args[0], args[1], args[2], at_rows, at_len);
        r.cur[dst] = d;
        r.shape[dst] = level;
    }
}

thread_local Buffer band_buffer;

// Runs tiles [first, last) on the calling thread; false when its registers cannot be had.
bool run_tiles(const Program& g, const Plan& shared, int64_t tile, int64_t first, int64_t last) {
    // this thread's view of the operands: inputs read across are pointed at its band copies
    Plan p = shared;
    const int64_t band_floats = BAND * p.inner;  // each band copy: at most 4 bytes an element
    int32_t across[MAX_INPUTS], n_across = 0;
    for (int32_t i = 0; i < g.n_inputs; ++i)
        if ((g.across >> i) & 1u) across[n_across++] = i;
    if (n_across && !band_buffer.reserve(static_cast<size_t>(n_across * band_floats)))
        return false;
    int64_t band_first = -1;
    // Registers 4 KiB apart would alias in the load/store unit (a load after a store to the
    // same address modulo 4096 waits for it): space them by 32 extra floats, a cache line
    // pair, so consecutive registers fall on different offsets.
    const int64_t pitch = g.width + 32;
    const int64_t few = ((g.reduce ? g.width / p.inner : 1) + 15) / 16 * 16;  // rows per tile
    const int64_t row_len = (p.inner + tile + 15) / 16 * 16;  // a cached row, repeated
    Buffer& buf = thread_buffer;
    const auto floats = static_cast<size_t>(g.n_regs) * static_cast<size_t>(pitch + few) +
                        static_cast<size_t>(__builtin_popcount(g.row_invariant) * row_len);
    if (!buf.reserve(floats)) return false;
    Registers r;
    for (int32_t i = 0; i < g.n_regs; ++i) {
        r.own[i] = buf.data + i * pitch;
        r.few[i] = buf.data + g.n_regs * pitch + i * few;
        r.cur[i] = r.own[i];
        r.shape[i] = FULL;
    }
    float* cache = buf.data + g.n_regs * (pitch + few);
    for (int32_t i = 0; i < g.n_inputs; ++i) {
        r.row_of[i] = nullptr;
        if (!((g.row_invariant >> i) & 1u)) continue;
        fill_row(p, p.ops[i], cache, p.inner + tile);
        r.row_of[i] = cache;
        cache += row_len;
    }
    for (int64_t t = first; t < last; ++t) {
        const int64_t start = t * tile, n = std::min(tile, p.total - start);
        const int64_t row = start / p.inner, last_row = (start + n - 1) / p.inner;
        if (n_across && (band_first < 0 || last_row >= band_first + BAND)) {
            band_first = row;
            const int64_t rows = std::min(BAND, p.size[0] - row);
            for (int32_t k = 0; k < n_across; ++k) {
                const Operand& o = shared.ops[across[k]];
                char* band = reinterpret_cast<char*>(band_buffer.data + k * band_floats);
                copy_band(p, o, row, rows, band);
                // element (i, j) of the band at band + ((i - row) * inner + j) * size
                const uintptr_t shift = static_cast<uintptr_t>(row * p.inner * dtype_size(o.dtype));
                p.ops[across[k]].base = reinterpret_cast<const char*>(
                    reinterpret_cast<uintptr_t>(band) - shift);
                p.ops[across[k]].stride[0] = p.inner;
                p.ops[across[k]].stride[1] = 1;
            }
        }
        run_tile(g, p, start, n, r);
    }
    if (g.large) stream_fence();  // this thread's non-temporal stores, before the join
    return true;
}

}  // namespace
}  // namespace dvm

using namespace dvm;

DVM_EXPORT int32_t dvm_run(const int32_t* code, const float* imm, int32_t n_instr, int32_t n_regs,
                           int32_t n_inputs, const void* const* in_ptrs, const int32_t* in_dtypes,
                           const int64_t* in_strides, int32_t n_outputs, void* const* out_ptrs,
                           const int32_t* out_dtypes, const int64_t* out_strides,
                           const int64_t* domain, int32_t ndim, int32_t threads) {
    bool has_reduce = false;
    const int32_t status = check_program(code, n_instr, n_regs, n_inputs, n_outputs, has_reduce);
    if (status != OK) return status;
    if (imm == nullptr || domain == nullptr || ndim < 1 || ndim > MAX_DIMS) return BAD_ARGUMENT;
    if (n_inputs > 0 && (in_ptrs == nullptr || in_dtypes == nullptr || in_strides == nullptr))
        return BAD_ARGUMENT;
    if (out_ptrs == nullptr || out_dtypes == nullptr || out_strides == nullptr) return BAD_ARGUMENT;
    int64_t total = 1;
    for (int32_t d = 0; d < ndim; ++d) {
        if (domain[d] < 0 || domain[d] > (int64_t{1} << 40)) return BAD_ARGUMENT;
        if (domain[d] == 0) total = 0;
        else if (total > 0 && total > (int64_t{1} << 48) / domain[d]) return BAD_ARGUMENT;
        else total *= domain[d];
    }
    Plan plan;
    plan.n_ops = n_inputs + n_outputs;
    for (int32_t o = 0; o < plan.n_ops; ++o) {
        const bool out = o >= n_inputs;
        const int32_t i = out ? o - n_inputs : o;
        Operand& op = plan.ops[o];
        op.dtype = out ? out_dtypes[i] : in_dtypes[i];
        op.base = static_cast<const char*>(out ? out_ptrs[i] : in_ptrs[i]);
        if (op.dtype < F32 || op.dtype > BOOL) return BAD_DTYPE;
        if (op.base == nullptr && total > 0) return BAD_ARGUMENT;
        const int64_t* s = (out ? out_strides : in_strides) + static_cast<int64_t>(i) * ndim;
        for (int32_t d = 0; d < ndim; ++d) {
            // an output may repeat elements only along the row (a reduced row)
            if (out && s[d] == 0 && domain[d] > 1 && d != ndim - 1) return BAD_ARGUMENT;
            op.stride[d] = s[d];
        }
    }
    const bool reduce = has_reduce && domain[ndim - 1] > 1;
    if (reduce && domain[ndim - 1] > MAX_ROW) return ROW_TOO_LONG;
    if (total == 0) return OK;

    int64_t dims[MAX_DIMS];
    std::copy(domain, domain + ndim, dims);
    bool rows_repeat = false;  // an output that takes each row's first value keeps the row last
    for (int32_t o = n_inputs; o < plan.n_ops; ++o)
        rows_repeat = rows_repeat || (plan.ops[o].stride[ndim - 1] == 0 && dims[ndim - 1] > 1);
    if (!reduce && !rows_repeat) order_by_output(plan, dims, ndim, n_inputs);
    coalesce(plan, dims, ndim, reduce);
    plan.total = total;
    const int64_t tile = reduce ? std::max<int64_t>(1, TILE / plan.inner) * plan.inner : TILE;
    uint8_t fuse[MAX_INSTRS];
    plan_fusions(code, n_instr, n_inputs, plan.ops, fuse);
    const uint32_t invariant = row_invariant_inputs(plan, n_inputs, tile);
    const uint32_t large = large_outputs(plan, n_inputs, n_outputs);
    const uint32_t streamed = passes(code, n_instr, fuse) > 1 ? large : 0;
    const uint32_t across = inputs_across(plan, n_inputs, reduce);
    const Program g{code, imm, n_instr, n_regs, n_inputs, reduce,
                    tile, fuse, invariant, large, streamed, across};
    const int64_t n_tiles = (total + tile - 1) / tile;
    // Small calls stay on the calling thread: starting a team costs more than they take.
    // Results do not depend on the team size; more threads than 4 per processor only cost.
    const int64_t most = std::min<int64_t>(n_tiles, 4 * int64_t{omp_get_num_procs()});
    int64_t team = std::min<int64_t>(std::max(threads, 1), most);
    if (total < 32768) team = 1;
    if (team == 1) return run_tiles(g, plan, tile, 0, n_tiles) ? OK : NO_MEMORY;
    bool ok = true;
#pragma omp parallel num_threads(static_cast<int>(team)) reduction(&& : ok)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        ok = run_tiles(g, plan, tile, n_tiles * t / nt, n_tiles * (t + 1) / nt);
    }
    return ok ? OK : NO_MEMORY;
}

DVM_EXPORT int32_t dvm_abi_version() { return DVM_ABI_VERSION; }

DVM_EXPORT int64_t dvm_max_row() { return MAX_ROW; }

// The best x86-64 level this CPU runs, which picks the build: 4 (AVX-512), 3 (AVX2, FMA, F16C)
// or 1 (anything else, and other architectures).
DVM_EXPORT int32_t dvm_cpu_level() {
    int32_t level = 1;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    level = __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 1;
#endif
    return level;
}
