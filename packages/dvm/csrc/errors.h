// The exception being raised, taken and raised again, on every CPython the compile's C modules
// build for (3.12 replaced PyErr_Fetch and PyErr_Restore).
#ifndef DVM_ERRORS_H
#define DVM_ERRORS_H

#include <Python.h>

// The exception being raised, taken (a new reference; NULL where none is): the error is
// cleared.
static inline PyObject* take_raised(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

// take_raised's exception (stolen; NULL: none) raised again.
static inline void raise_again(PyObject* raised) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised);
#else
    if (raised != NULL)
        PyErr_Restore(Py_NewRef((PyObject*)Py_TYPE(raised)), raised,
                      PyException_GetTraceback(raised));
#endif
}

#endif
