// dvm._analysis's two sources: csrc/analysis.c (the per-node analysis, the merging) and
// csrc/compile.c (the whole compile's common case), which calls these directly.
#ifndef DVM_ANALYSIS_H
#define DVM_ANALYSIS_H

#include <Python.h>

PyObject* dvm_nodes(PyObject* module, PyObject* graph);
PyObject* dvm_run(PyObject* module, PyObject* const* argv, Py_ssize_t argc);
PyObject* dvm_merge(PyObject* module, PyObject* const* argv, Py_ssize_t argc);
int dvm_add_compile(PyObject* module);  // compile.c's functions added to the module

#endif
