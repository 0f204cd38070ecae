// dvm._emitter: the SSA program builder behind dvm.lower.Emitter, and its register allocation.
//
// The lowering rules (Python) call load/const/unary/binary/where/reduce/store for each aten
// node of a region; an op on the same values as an earlier one, a constant of the same bits or
// a load of the same input gives that one's value. encode() allocates physical registers (a
// value's register is free after its last read; a value nobody reads frees its register at
// once) and returns the program in the VM's encoding. Op numbers are dvm.program.Op's
// (csrc/vm.h): unary, binary and reducing ones each form one run of numbers, checked here
// (a test holds the runs to dvm.program.Op); the VM checks the whole program before it runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

enum { LOAD = 0, CONST = 1, STORE = 2, WHERE = 60 };

typedef struct {
    int32_t op, dst, a, b, c;  // dst: the SSA value made, or STORE's output index
    double imm;                // CONST's value
} Code;

typedef struct {  // a made value, by what made it (CONST: the value's bits in `bits`)
    int32_t op, a, b, c;
    uint64_t bits;
    int32_t value;  // -1: an empty slot
} Entry;

typedef struct {
    PyObject_HEAD
    Code* code;
    Py_ssize_t n_code, cap;
    Entry* table;
    size_t table_cap, table_used;
    int32_t n_values, n_outputs;
} Emitter;

static uint64_t mix(uint64_t h) {  // splitmix64's finalizer: every input bit reaches the low bits
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

static size_t entry_hash(const Entry* e) {
    uint64_t h = mix((uint64_t)(uint32_t)e->op << 32 | (uint32_t)e->a);
    h = mix(h ^ ((uint64_t)(uint32_t)e->b << 32 | (uint32_t)e->c));
    return (size_t)mix(h ^ e->bits);
}

static int same_key(const Entry* x, const Entry* y) {
    return x->op == y->op && x->a == y->a && x->b == y->b && x->c == y->c && x->bits == y->bits;
}

// The slot holding `key`, or the empty slot where it goes.
static Entry* find(Entry* table, size_t cap, const Entry* key) {
    size_t i = entry_hash(key) & (cap - 1);
    while (table[i].value >= 0 && !same_key(&table[i], key)) i = (i + 1) & (cap - 1);
    return &table[i];
}

static int grow_table(Emitter* self) {
    size_t cap = self->table_cap ? self->table_cap * 2 : 64;
    Entry* table = PyMem_Malloc(cap * sizeof(Entry));
    if (table == NULL) return -1;
    for (size_t i = 0; i < cap; ++i) table[i].value = -1;
    for (size_t i = 0; i < self->table_cap; ++i)
        if (self->table[i].value >= 0) *find(table, cap, &self->table[i]) = self->table[i];
    PyMem_Free(self->table);
    self->table = table;
    self->table_cap = cap;
    return 0;
}

static Code* append(Emitter* self) {
    if (self->n_code == self->cap) {
        Py_ssize_t cap = self->cap ? self->cap * 2 : 32;
        Code* code = PyMem_Realloc(self->code, (size_t)cap * sizeof(Code));
        if (code == NULL) return NULL;
        self->code = code;
        self->cap = cap;
    }
    return &self->code[self->n_code++];
}

// The value `key` made, made now (a new instruction) when no earlier one did. NULL on error.
static PyObject* made(Emitter* self, Entry key, double imm) {
    if (self->table_used * 2 >= self->table_cap && grow_table(self) < 0) return PyErr_NoMemory();
    Entry* slot = find(self->table, self->table_cap, &key);
    if (slot->value < 0) {
        if (self->n_values == INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "too many values for one program");
            return NULL;
        }
        Code* c = append(self);
        if (c == NULL) return PyErr_NoMemory();
        *c = (Code){key.op, self->n_values, key.a, key.b, key.c, imm};
        key.value = self->n_values++;
        *slot = key;
        self->table_used++;
    }
    return PyLong_FromLong(slot->value);
}

// `arg` as an int in [lo, hi); -1 with an exception naming `what` otherwise.
static int read_int(PyObject* arg, long lo, long hi, const char* what, int32_t* out) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < lo || v >= hi) {
        PyErr_Format(PyExc_ValueError, "%s %ld is not in %ld..%ld", what, v, lo, hi - 1);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int read_value(Emitter* self, PyObject* arg, int32_t* out) {
    if (self->n_values == 0) {
        PyErr_SetString(PyExc_ValueError, "value read before any value is made");
        return -1;
    }
    return read_int(arg, 0, self->n_values, "value", out);
}

static int arity(Py_ssize_t nargs, Py_ssize_t want, const char* name) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static PyObject* emitter_load(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    Entry key = {LOAD, -1, -1, -1, 0, 0};
    if (arity(nargs, 1, "load") < 0 || read_int(args[0], 0, INT32_MAX, "input", &key.a) < 0)
        return NULL;
    return made(self, key, 0.0);
}

static PyObject* emitter_const(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    if (arity(nargs, 1, "const") < 0) return NULL;
    double v = PyFloat_AsDouble(args[0]);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    Entry key = {CONST, -1, -1, -1, 0, 0};
    memcpy(&key.bits, &v, sizeof v);  // tells -0.0 from 0.0; a NaN equals a NaN of its bits
    return made(self, key, v);
}

// An op of `n` operands whose number lies in [lo, hi).
static PyObject* op_of(Emitter* self, PyObject* const* args, Py_ssize_t nargs, int n, long lo,
                       long hi, const char* name) {
    Entry key = {-1, -1, -1, -1, 0, 0};
    int32_t* operand[3] = {&key.a, &key.b, &key.c};
    if (arity(nargs, n + 1, name) < 0 || read_int(args[0], lo, hi, "op", &key.op) < 0)
        return NULL;
    for (int i = 0; i < n; ++i)
        if (read_value(self, args[i + 1], operand[i]) < 0) return NULL;
    return made(self, key, 0.0);
}

static PyObject* emitter_unary(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    return op_of(self, args, nargs, 1, 10, 27, "unary");  // NEG..GELU
}

static PyObject* emitter_binary(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    return op_of(self, args, nargs, 2, 40, 55, "binary");  // ADD..OR
}

static PyObject* emitter_reduce(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    return op_of(self, args, nargs, 1, 70, 73, "reduce");  // REDUCE_SUM..MEAN
}

static PyObject* emitter_where(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    Entry key = {WHERE, -1, -1, -1, 0, 0};
    if (arity(nargs, 3, "where") < 0 || read_value(self, args[0], &key.a) < 0 ||
        read_value(self, args[1], &key.b) < 0 || read_value(self, args[2], &key.c) < 0)
        return NULL;
    return made(self, key, 0.0);
}

static PyObject* emitter_store(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    int32_t value;
    if (arity(nargs, 1, "store") < 0 || read_value(self, args[0], &value) < 0) return NULL;
    Code* c = append(self);
    if (c == NULL) return PyErr_NoMemory();
    *c = (Code){STORE, self->n_outputs, value, -1, -1, 0.0};
    return PyLong_FromLong(self->n_outputs++);
}

// Each instruction's operand values, -1 where it has none (LOAD's and CONST's `a` is no value).
static int reads(const Code* c, int32_t out[3]) {
    if (c->op == LOAD || c->op == CONST) return 0;
    out[0] = c->a, out[1] = c->b, out[2] = c->c;
    return c->c >= 0 ? 3 : c->b >= 0 ? 2 : 1;
}

// encode() -> (codes, imms, n_regs): five ints (op, dst, a, b, c) and one float an instruction
// over physical registers, and the registers used.
static PyObject* emitter_encode(Emitter* self, PyObject* unused) {
    Py_ssize_t n = self->n_code;
    int32_t* last = PyMem_Malloc(((size_t)self->n_values * 2 + (size_t)n + 1) * sizeof(int32_t));
    if (last == NULL) return PyErr_NoMemory();
    int32_t* phys = last + self->n_values;
    int32_t* free_regs = phys + self->n_values;  // a value frees at most one register a step
    for (int32_t v = 0; v < self->n_values; ++v) last[v] = -1;
    for (Py_ssize_t k = 0; k < n; ++k) {
        int32_t ops[3];
        for (int i = 0, m = reads(&self->code[k], ops); i < m; ++i) last[ops[i]] = (int32_t)k;
    }
    PyObject* codes = PyList_New(n * 5);
    PyObject* imms = PyList_New(n);
    if (codes == NULL || imms == NULL) goto fail;
    Py_ssize_t n_free = 0;
    int32_t n_regs = 0;
    for (Py_ssize_t k = 0; k < n; ++k) {
        const Code* c = &self->code[k];
        int32_t ops[3];
        int m = reads(c, ops);
        int32_t enc[5] = {c->op, -1, -1, -1, -1};
        if (c->op == STORE) {
            enc[2] = c->dst, enc[3] = phys[c->a];
        } else {
            int32_t reg = n_free ? free_regs[--n_free] : n_regs++;
            enc[1] = reg;
            if (c->op == LOAD) enc[2] = c->a;
            for (int i = 0; i < m; ++i) enc[2 + i] = phys[ops[i]];
            phys[c->dst] = reg;
            if (last[c->dst] < 0) free_regs[n_free++] = reg;  // never read: free at once
        }
        for (int i = 0; i < m; ++i) {
            int seen = 0;
            for (int j = 0; j < i; ++j) seen |= ops[j] == ops[i];
            if (!seen && last[ops[i]] == k) free_regs[n_free++] = phys[ops[i]];
        }
        for (int i = 0; i < 5; ++i) {
            PyObject* v = PyLong_FromLong(enc[i]);
            if (v == NULL) goto fail;
            PyList_SET_ITEM(codes, k * 5 + i, v);
        }
        PyObject* imm = PyFloat_FromDouble(c->imm);
        if (imm == NULL) goto fail;
        PyList_SET_ITEM(imms, k, imm);
    }
    PyMem_Free(last);
    return Py_BuildValue("(NNi)", codes, imms, n_regs);
fail:
    PyMem_Free(last);
    Py_XDECREF(codes);
    Py_XDECREF(imms);
    return NULL;
}

static PyObject* emitter_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Emitter() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);
}

static void emitter_dealloc(Emitter* self) {
    PyMem_Free(self->code);
    PyMem_Free(self->table);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

static PyObject* emitter_n_instrs(Emitter* self, void* unused) {
    return PyLong_FromSsize_t(self->n_code);
}

static PyMethodDef emitter_methods[] = {
    {"load", (PyCFunction)(void (*)(void))emitter_load, METH_FASTCALL,
     "load(index) -> the value of input ``index``."},
    {"const", (PyCFunction)(void (*)(void))emitter_const, METH_FASTCALL,
     "const(value) -> a value holding ``value`` (a float)."},
    {"unary", (PyCFunction)(void (*)(void))emitter_unary, METH_FASTCALL,
     "unary(op, a) -> the value op(a)."},
    {"binary", (PyCFunction)(void (*)(void))emitter_binary, METH_FASTCALL,
     "binary(op, a, b) -> the value op(a, b)."},
    {"where", (PyCFunction)(void (*)(void))emitter_where, METH_FASTCALL,
     "where(cond, a, b) -> b's value where cond is 0, else a's."},
    {"reduce", (PyCFunction)(void (*)(void))emitter_reduce, METH_FASTCALL,
     "reduce(op, a) -> op over a's row, broadcast back along it."},
    {"store", (PyCFunction)(void (*)(void))emitter_store, METH_FASTCALL,
     "store(value) -> the index of the next output, which holds ``value``."},
    {"encode", (PyCFunction)emitter_encode, METH_NOARGS,
     "encode() -> (codes, imms, n_regs): the program over physical registers."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef emitter_members[] = {
    {"n_outputs", T_INT, offsetof(Emitter, n_outputs), READONLY, "Outputs stored so far."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef emitter_getset[] = {
    {"n_instrs", (getter)emitter_n_instrs, NULL, "Instructions so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dvm._emitter.Emitter",
    .tp_basicsize = sizeof(Emitter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Builds one VM program in SSA form (dvm.lower.Emitter).",
    .tp_new = emitter_new,
    .tp_dealloc = (destructor)emitter_dealloc,
    .tp_methods = emitter_methods,
    .tp_members = emitter_members,
    .tp_getset = emitter_getset,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._emitter", "The SSA builder of VM programs.", -1, NULL,
};

PyMODINIT_FUNC PyInit__emitter(void) {
    if (PyType_Ready(&EmitterType) < 0) return NULL;
    PyObject* m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&EmitterType);
    if (PyModule_AddObject(m, "Emitter", (PyObject*)&EmitterType) < 0) {
        Py_DECREF(&EmitterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
