// dvm's VM: the C ABI, the instruction numbers (shared with src/dvm/program.py: change both
// together and bump DVM_ABI_VERSION with dvm._lib.ABI_VERSION), status codes and limits.
// No torch or Python headers: the library is loaded with ctypes.
#pragma once

#include <cstdint>

#define DVM_EXPORT extern "C" __attribute__((visibility("default")))
#define DVM_ABI_VERSION 2

namespace dvm {

enum Op : int32_t {
    LOAD = 0, CONST = 1, STORE = 2,
    NEG = 10, ABS = 11, EXP = 12, LOG = 13, LOG1P = 14, SQRT = 15, RSQRT = 16, RECIPROCAL = 17,
    TANH = 18, SIGMOID = 19, ERF = 20, SIN = 21, COS = 22, NOT = 23, CAST_BF16 = 24,
    CAST_F16 = 25, GELU = 26,
    ADD = 40, SUB = 41, MUL = 42, DIV = 43, POW = 44, MAX = 45, MIN = 46, EQ = 47, NE = 48,
    LT = 49, LE = 50, GT = 51, GE = 52, AND = 53, OR = 54,
    WHERE = 60,
    REDUCE_SUM = 70, REDUCE_MAX = 71, REDUCE_MEAN = 72,
};

enum Status : int32_t {
    OK = 0,
    BAD_PROGRAM = 1,   // unknown opcode, operand out of range, read before write, outputs
    BAD_ARGUMENT = 2,  // counts, ndim, domain sizes, strides, null pointers
    BAD_DTYPE = 3,
    ROW_TOO_LONG = 4,  // a reducing program over rows longer than MAX_ROW
    NO_MEMORY = 5,
};

enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2, BOOL = 3 };

constexpr int32_t MAX_DIMS = 6, MAX_REGS = 32, MAX_INPUTS = 16, MAX_OUTPUTS = 8;
constexpr int32_t MAX_INSTRS = 256;
constexpr int64_t MAX_ROW = int64_t{1} << 16;
// Elements per tile (register length) without reductions: 4 KiB per fp32 register.
constexpr int64_t TILE = 1024;

}  // namespace dvm

// Runs a program (n_instr x {op, dst, a, b, c} in code, one imm each) over `domain` (ndim
// sizes, the last one the row). Operand strides are in elements, ndim per operand (0 along a
// broadcast dimension). An output's stride may be 0 only along the last dimension: it then
// receives each row's first value (a reduced row). Outputs must not overlap inputs.
// Returns a Status; never writes anything when the status is not OK.
DVM_EXPORT int32_t dvm_run(const int32_t* code, const float* imm, int32_t n_instr, int32_t n_regs,
                           int32_t n_inputs, const void* const* in_ptrs, const int32_t* in_dtypes,
                           const int64_t* in_strides, int32_t n_outputs, void* const* out_ptrs,
                           const int32_t* out_dtypes, const int64_t* out_strides,
                           const int64_t* domain, int32_t ndim, int32_t threads);
DVM_EXPORT int32_t dvm_abi_version();
DVM_EXPORT int32_t dvm_cpu_level();
DVM_EXPORT int64_t dvm_max_row();
