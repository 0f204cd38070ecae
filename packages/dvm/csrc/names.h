// The interned strings each C module of the compile looks attributes and keys up by, made
// once when the module is imported.
#ifndef DVM_NAMES_H
#define DVM_NAMES_H

#include <Python.h>

typedef struct {
    PyObject** slot;  // where the interned string goes
    const char* text;
} Name;

// Each name's text interned into its slot: 0, or -1 with an exception.
static inline int intern_names(const Name* names, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return -1;
    return 0;
}

#define INTERN_NAMES(names) intern_names(names, sizeof names / sizeof names[0])

#endif
