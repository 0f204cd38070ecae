// The clock time.perf_counter() reads, read in C for the compile's phase times (a call of
// time.perf_counter reaches its module's code, cold in a compile right after tracing).
#ifndef DVM_CLOCK_H
#define DVM_CLOCK_H

#include <Python.h>

// perf_counter()'s seconds; -1.0 with an exception where the clock cannot be read.
static inline double perf_seconds(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    return PyTime_PerfCounter(&t) < 0 ? -1.0 : PyTime_AsSecondsDouble(t);
#else
    return _PyTime_AsSecondsDouble(_PyTime_GetPerfCounter());
#endif
}

#endif
