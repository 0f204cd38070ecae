// dvm._emitter: the SSA program builder behind dvm.lower.Emitter, and its register allocation.
//
// The lowering rules (Python) call load/const/unary/binary/where/reduce/store for each aten
// node of a region; an op on the same values as an earlier one, a constant of the same bits or
// a load of the same input gives that one's value. encode() allocates physical registers (a
// value's register is free after its last read; a value nobody reads frees its register at
// once) and returns the program in the VM's encoding. Op numbers are dvm.program.Op's
// (csrc/vm.h): unary, binary and reducing ones each form one run of numbers, checked here
// (a test holds the runs to dvm.program.Op); the VM checks the whole program before it runs.
// program() builds the dvm.program.Program from the encoding.
//
// build_region (dvm.cluster.build_region) lowers one region: each member of a common rule by
// its form here (the instructions its rule emits: setup_native, from dvm.lower.NATIVE), any
// other by its rule's emit (Python, dvm.lower), handed a Resolve that gives a node argument's
// value (a constant, a member's value, or a load of the view the member sees); the members
// read outside the region stored, one output per value, dtype, row reduction and alias base;
// then the VM's limits checked and the dvm.cluster.Region made (as its dataclass __init__
// makes it, without the call: region_fields). setup(), setup_regions() and
// setup_native() hand over the Python objects this needs (no torch headers here); a node's
// fields are read from torch._C._NodeBase's slots.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "clock.h"
#include "fields.h"
#include "names.h"

enum { LOAD = 0, CONST = 1, STORE = 2, WHERE = 60 };
enum { EXP = 12, LOG = 13, RECIPROCAL = 17, SIGMOID = 19, CAST_BF16 = 24, CAST_F16 = 25 };
enum { SUB = 41, MUL = 42, DIV = 43, POW = 44, MAX = 45, NE = 48 };
enum { REDUCE_SUM = 70, REDUCE_MAX = 71 };

typedef struct {
    int32_t op, dst, a, b, c;  // dst: the SSA value made, or STORE's output index
    double imm;                // CONST's value (0.0 for any other op)
} Code;

typedef struct {  // what makes a value: its op, operands and (CONST) the value's bits
    int32_t op, a, b, c;
    uint64_t bits;
} Entry;

// The buffers start small enough for Python's small-object allocator (at most 512 bytes).
enum { CODE_CAP0 = 16, TABLE_CAP0 = 64 };

typedef struct {
    PyObject_HEAD
    Code* code;
    Py_ssize_t n_code, cap;
    int32_t* table;  // the instruction (an index of code) making each value; -1: an empty slot
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

static Entry key_of(const Code* c) {
    Entry key = {c->op, c->a, c->b, c->c, 0};
    memcpy(&key.bits, &c->imm, sizeof c->imm);
    return key;
}

// The slot holding the instruction that makes `key`, or the empty slot where it goes.
static int32_t* find(const Emitter* self, int32_t* table, size_t cap, const Entry* key) {
    size_t i = entry_hash(key) & (cap - 1);
    for (; table[i] >= 0; i = (i + 1) & (cap - 1)) {
        Entry x = key_of(&self->code[table[i]]);
        if (x.op == key->op && x.a == key->a && x.b == key->b && x.c == key->c &&
            x.bits == key->bits)
            break;
    }
    return &table[i];
}

static int grow_table(Emitter* self) {
    size_t cap = self->table_cap ? self->table_cap * 2 : TABLE_CAP0;
    int32_t* table = PyMem_Malloc(cap * sizeof(int32_t));
    if (table == NULL) return -1;
    for (size_t i = 0; i < cap; ++i) table[i] = -1;
    for (size_t i = 0; i < self->table_cap; ++i)
        if (self->table[i] >= 0) {
            Entry key = key_of(&self->code[self->table[i]]);
            *find(self, table, cap, &key) = self->table[i];
        }
    PyMem_Free(self->table);
    self->table = table;
    self->table_cap = cap;
    return 0;
}

static Code* append(Emitter* self) {
    if (self->n_code == self->cap) {
        Py_ssize_t cap = self->cap ? self->cap * 2 : CODE_CAP0;
        Code* code = PyMem_Realloc(self->code, (size_t)cap * sizeof(Code));
        if (code == NULL) return NULL;
        self->code = code;
        self->cap = cap;
    }
    return &self->code[self->n_code++];
}

// The value `key` made, made now (a new instruction) when no earlier one did. -1 on error.
static int32_t make(Emitter* self, Entry key, double imm) {
    if (self->table_used * 2 >= self->table_cap && grow_table(self) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t* slot = find(self, self->table, self->table_cap, &key);
    if (*slot >= 0) return self->code[*slot].dst;
    if (self->n_values == INT32_MAX || self->n_code == INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "too many values for one program");
        return -1;
    }
    Code* c = append(self);
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *c = (Code){key.op, self->n_values, key.a, key.b, key.c, imm};
    *slot = (int32_t)(self->n_code - 1);
    self->table_used++;
    return self->n_values++;
}

static PyObject* as_int(int32_t value) {
    return value < 0 ? NULL : PyLong_FromLong(value);
}

static PyObject* made(Emitter* self, Entry key, double imm) {
    return as_int(make(self, key, imm));
}

// The op's value over values a, b (-1: none): 1-operand ops and 2-operand ones; -1 on error.
static int32_t op1(Emitter* self, int32_t op, int32_t a) {
    return a < 0 ? -1 : make(self, (Entry){op, a, -1, -1, 0}, 0.0);
}

static int32_t op2(Emitter* self, int32_t op, int32_t a, int32_t b) {
    return a < 0 || b < 0 ? -1 : make(self, (Entry){op, a, b, -1, 0}, 0.0);
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

static PyObject* load_of(Emitter* self, Py_ssize_t input) {
    return made(self, (Entry){LOAD, (int32_t)input, -1, -1, 0}, 0.0);
}

static PyObject* emitter_load(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    int32_t input;
    if (arity(nargs, 1, "load") < 0 || read_int(args[0], 0, INT32_MAX, "input", &input) < 0)
        return NULL;
    return load_of(self, input);
}

static int32_t const_value(Emitter* self, double v) {
    Entry key = {CONST, -1, -1, -1, 0};
    memcpy(&key.bits, &v, sizeof v);  // tells -0.0 from 0.0; a NaN equals a NaN of its bits
    return make(self, key, v);
}

static int32_t const_arg(Emitter* self, PyObject* arg) {
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return -1;
    return const_value(self, v);
}

static PyObject* const_of(Emitter* self, PyObject* arg) {
    return as_int(const_arg(self, arg));
}

static PyObject* emitter_const(Emitter* self, PyObject* const* args, Py_ssize_t nargs) {
    if (arity(nargs, 1, "const") < 0) return NULL;
    return const_of(self, args[0]);
}

// An op of `n` operands whose number lies in [lo, hi).
static PyObject* op_of(Emitter* self, PyObject* const* args, Py_ssize_t nargs, int n, long lo,
                       long hi, const char* name) {
    Entry key = {-1, -1, -1, -1, 0};
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
    Entry key = {WHERE, -1, -1, -1, 0};
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

static PyObject* zero;  // 0.0, the imm of every instruction but CONST's: one float for all

// The program over physical registers: (codes, imms), five ints (op, dst, a, b, c) and one
// float an instruction; the registers used in *n_regs. NULL on error.
static PyObject* encoded(Emitter* self, int32_t* n_regs_out) {
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
        uint64_t bits;
        memcpy(&bits, &c->imm, sizeof bits);
        PyObject* imm = bits == 0 ? Py_NewRef(zero) : PyFloat_FromDouble(c->imm);
        if (imm == NULL) goto fail;
        PyList_SET_ITEM(imms, k, imm);
    }
    PyMem_Free(last);
    *n_regs_out = n_regs;
    PyObject* pair = PyTuple_Pack(2, codes, imms);
    Py_DECREF(codes);
    Py_DECREF(imms);
    return pair;
fail:
    PyMem_Free(last);
    Py_XDECREF(codes);
    Py_XDECREF(imms);
    return NULL;
}

// encode() -> (codes, imms, n_regs): see encoded().
static PyObject* emitter_encode(Emitter* self, PyObject* unused) {
    int32_t n_regs;
    PyObject* pair = encoded(self, &n_regs);
    PyObject* out = pair ? Py_BuildValue("(OOi)", PyTuple_GET_ITEM(pair, 0),
                                         PyTuple_GET_ITEM(pair, 1), n_regs)
                         : NULL;
    Py_XDECREF(pair);
    return out;
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

enum { N_REGION_FIELDS = 10 };  // dvm.cluster.Region's

// What setup() and setup_regions() hand over: the program's pieces, then the regions'.
static struct {
    PyObject *limit_error, *built;  // dvm.lower.LimitError, dvm.program.Program.built
    PyTypeObject* program_type;     // built's class when built is a classmethod, else NULL
    long max_regs;
    PyObject *rules, *node, *region, *emitter;  // rules by id(target), Node, Region, Emitter
    PyObject *domain, *storable, *aliasing;
    long max_inputs, max_outputs, max_instrs;
    PyObject *s_target, *s_emit, *s_users, *s_args, *s_name, *s_dshape, *s_facts, *s_cut;
    PyObject* s_kwargs;
    PyObject* s_fields[4];  // Program.built's: n_inputs, n_outputs, n_regs, _encoded
    PyTypeObject* region_type;  // Region when build_region makes it bare (region_fields), else NULL
    PyObject* region_fields[N_REGION_FIELDS];  // its fields, in order: the names, held
    Py_ssize_t at_target, at_args, at_kwargs, at_users;  // Node's slots by offset; 0: none
    PyObject* dtypes[4];  // float32, bfloat16, float16, bool: what the casts tell apart
} g;

// A bare instance of `type` (object.__new__) given its n fields, set in order as the
// generic setattr does: what a class's plain __init__ (or Program.built) makes, without a call.
static PyObject* bare(PyTypeObject* type, PyObject* const* names, PyObject* const* values, int n) {
    PyObject* none = PyTuple_New(0);
    PyObject* out = none ? PyBaseObject_Type.tp_new(type, none, NULL) : NULL;
    Py_XDECREF(none);
    for (int i = 0; out != NULL && i < n; ++i)
        if (PyObject_GenericSetAttr(out, names[i], values[i]) < 0) Py_CLEAR(out);
    return out;
}

// Program.built(n_inputs, n_outputs, n_regs, encoded) as it makes one: a bare instance of its
// class given the four fields, without the call; the call where built is no classmethod of a
// class with a __dict__.
static PyObject* built(PyObject* n_inputs, int32_t n_outputs, long n_regs, PyObject* encoded) {
    PyObject* fields[4] = {n_inputs, PyLong_FromLong(n_outputs), PyLong_FromLong(n_regs), encoded};
    PyObject* out = NULL;
    if (fields[1] != NULL && fields[2] != NULL)
        out = g.program_type ? bare(g.program_type, g.s_fields, fields, 4)
                             : PyObject_Vectorcall(g.built, fields, 4, NULL);
    Py_XDECREF(fields[1]);
    Py_XDECREF(fields[2]);
    return out;
}

// program(n_inputs): allocate registers and build the dvm.program.Program; LimitError when it
// needs more than MAX_REGS registers.
static PyObject* emitter_program(Emitter* self, PyObject* n_inputs) {
    if (g.built == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "program(): dvm._emitter.setup() was not called");
        return NULL;
    }
    int32_t n_regs;
    PyObject* pair = encoded(self, &n_regs);
    if (pair == NULL) return NULL;
    PyObject* out = NULL;
    if (n_regs > g.max_regs)
        PyErr_Format(g.limit_error, "needs %d registers (the VM has %ld)", n_regs, g.max_regs);
    else
        out = built(n_inputs, self->n_outputs, n_regs > 1 ? n_regs : 1L, pair);
    Py_DECREF(pair);
    return out;
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
    {"program", (PyCFunction)emitter_program, METH_O,
     "program(n_inputs) -> the dvm.program.Program; LimitError past MAX_REGS registers."},
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

// A rule's `r` (dvm.lower.Resolve) while build_region lowers one region: r(arg) is a node
// argument's value: a constant for a non-node, the value of a member already lowered, else a
// load of the view the member being lowered (`reader`) sees; r.computed(node) whether a member
// made node's value.
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Emitter* em;
    PyObject *env, *reader;          // member -> value; the member being lowered
    PyObject *dshape, *facts, *cut;  // the analysis tables
    PyObject *input_nodes, *input_views;  // the inputs' nodes and views, by index
    Py_ssize_t rank;                      // the region's domain's
} Resolve;

// `view` (stolen) without its leading size-1 dims beyond `rank`, which broadcast to nothing:
// a value whose own domain is wider than the region's (a batch-1 row reduction's (1, 1, 1),
// read in a (1, 8) region). A new reference; NULL with an exception.
static PyObject* within_rank(PyObject* view, Py_ssize_t rank) {
    if (view == NULL || !PyTuple_Check(view)) return view;  // a torch.Size is a tuple
    Py_ssize_t n = PyTuple_GET_SIZE(view), lead = 0;
    for (; n - lead > rank; ++lead) {
        long size = PyLong_AsLong(PyTuple_GET_ITEM(view, lead));
        if (size == -1 && PyErr_Occurred()) {
            Py_DECREF(view);
            return NULL;
        }
        if (size != 1) break;
    }
    if (lead == 0) return view;
    PyObject* kept = PyTuple_GetSlice(view, lead, n);
    Py_DECREF(view);
    return kept;
}

// The view `reader` sees its operand `p` with: its domain shape unless the edge is cut, else its
// real shape (dvm.cluster._Analysis's facts).
static PyObject* view_of(Resolve* r, PyObject* p) {
    PyObject* shape = PyDict_GetItemWithError(r->dshape, p);
    if (shape == NULL && PyErr_Occurred()) return NULL;
    if (shape != NULL) {
        Py_INCREF(shape);  // held across the lookups below, which may run Python code
        PyObject* cut = PyObject_GetItem(r->cut, r->reader);
        int is_cut = cut == NULL ? -1 : PySequence_Contains(cut, p);
        Py_XDECREF(cut);
        if (is_cut == 0) return within_rank(shape, r->rank);
        Py_DECREF(shape);
        if (is_cut < 0) return NULL;
    }
    PyObject* fact = PyObject_GetItem(r->facts, p);
    if (fact == NULL) return NULL;
    PyObject* real = PySequence_GetItem(fact, 0);
    Py_DECREF(fact);
    return within_rank(real, r->rank);
}

// r(x): x's value; -1 on error.
static int32_t resolve(Resolve* r, PyObject* x) {
    if (Py_TYPE(x) != (PyTypeObject*)g.node) return const_arg(r->em, x);
    PyObject* value = PyDict_GetItemWithError(r->env, x);
    if (value != NULL) {
        int32_t v;
        return read_value(r->em, value, &v) < 0 ? -1 : v;
    }
    if (PyErr_Occurred()) return -1;
    PyObject* view = view_of(r, x);  // read from outside: a load of the view the reader sees
    if (view == NULL) return -1;
    // its input: the first of the same node and an equal view, else a new one
    Py_ssize_t index = 0;
    int same = 0;
    for (; index < PyList_GET_SIZE(r->input_nodes); ++index) {
        if (PyList_GET_ITEM(r->input_nodes, index) != x) continue;
        PyObject* seen = Py_NewRef(PyList_GET_ITEM(r->input_views, index));
        same = PyObject_RichCompareBool(seen, view, Py_EQ);
        Py_DECREF(seen);
        if (same) break;
    }
    if (same < 0 || (!same && (PyList_Append(r->input_nodes, x) < 0 ||
                               PyList_Append(r->input_views, view) < 0)))
        index = -1;
    Py_DECREF(view);
    if (index > INT32_MAX) PyErr_SetString(PyExc_OverflowError, "too many inputs for a program");
    if (index < 0 || index > INT32_MAX) return -1;
    return make(r->em, (Entry){LOAD, (int32_t)index, -1, -1, 0}, 0.0);
}

static PyObject* resolve_call(Resolve* r, PyObject* const* args, size_t nargsf, PyObject* kw) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kw != NULL && PyTuple_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "resolve(arg) takes one argument");
        return NULL;
    }
    return as_int(resolve(r, args[0]));
}

static PyObject* resolve_computed(Resolve* r, PyObject* node) {
    int in = PyDict_Contains(r->env, node);
    return in < 0 ? NULL : PyBool_FromLong(in);
}

static int resolve_traverse(Resolve* r, visitproc visit, void* arg) {
    Py_VISIT(r->em);
    Py_VISIT(r->env);
    Py_VISIT(r->reader);
    Py_VISIT(r->dshape);
    Py_VISIT(r->facts);
    Py_VISIT(r->cut);
    Py_VISIT(r->input_nodes);
    Py_VISIT(r->input_views);
    return 0;
}

static int resolve_clear(Resolve* r) {
    Py_CLEAR(r->em);
    Py_CLEAR(r->env);
    Py_CLEAR(r->reader);
    Py_CLEAR(r->dshape);
    Py_CLEAR(r->facts);
    Py_CLEAR(r->cut);
    Py_CLEAR(r->input_nodes);
    Py_CLEAR(r->input_views);
    return 0;
}

static void resolve_dealloc(Resolve* r) {
    PyObject_GC_UnTrack(r);
    resolve_clear(r);
    Py_TYPE(r)->tp_free((PyObject*)r);
}

static PyMethodDef resolve_methods[] = {
    {"computed", (PyCFunction)resolve_computed, METH_O,
     "computed(node) -> whether the region computes node (else it is loaded)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ResolveType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dvm._emitter.Resolve",
    .tp_basicsize = sizeof(Resolve),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A rule's r while build_region lowers a region (dvm.lower.Resolve).",
    .tp_vectorcall_offset = offsetof(Resolve, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)resolve_dealloc,
    .tp_traverse = (traverseproc)resolve_traverse,
    .tp_clear = (inquiry)resolve_clear,
    .tp_methods = resolve_methods,
};

// A torch.fx Node's field: read from its slot (a member of torch._C._NodeBase, found by
// setup_regions) when n is exactly a Node, else by name. A new reference; NULL on error.
static PyObject* field(PyObject* n, Py_ssize_t at, PyObject* name) {
    if (at > 0 && Py_TYPE(n) == (PyTypeObject*)g.node) {
        PyObject* v = *(PyObject**)((char*)n + at);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(n, name);
}

// The rules emitted here, without calling the Python rule (setup_native, from dvm.lower's
// NATIVE): each target's form, and its op where the form takes one. A form emits exactly
// what its Python rule emits for the node (same instructions in the same order), or leaves
// the node to the rule (argument shapes it does not take: keywords, an alpha, a float16
// square root), before emitting anything.
enum {
    F_UNARY,             // op(x)
    F_BINARY,            // op(a, b)
    F_ADD_SUB,           // op(a, b), b resolved first; alpha 1 (none given)
    F_POW,               // x ** e, a scalar e of 1, 2, 3 or -1 by mul and reciprocal
    F_SQUARE,            // x * x
    F_REDUCE,            // op over x's row when it reduces the last dim, else x
    F_WHERE,             // where(c, a, b)
    F_IDENTITY,          // x (views, clone, expand)
    F_SILU,              // x * sigmoid(x)
    F_RELU,              // max(0, x)
    F_SOFTMAX,           // _softmax
    F_LOG_SOFTMAX,       // _log_softmax
    F_SOFTMAX_BACKWARD,  // _softmax_backward_data
    F_LOG_SOFTMAX_BACKWARD,
    F_TO_COPY,           // _to_copy to the node's dtype
    F_CONVERT,           // prims.convert_element_type
    N_FORMS,
};

enum { NATIVE_CAP = 256 };  // slots of the table: a power of two, at most half of it filled

static struct {
    PyObject* target;  // a strong reference; NULL: an empty slot
    int32_t form, op;
} native[NATIVE_CAP];

static size_t native_slot(PyObject* target) {
    return (size_t)(((uintptr_t)target >> 4) * 0x9E3779B97F4A7C15ull >> 56) & (NATIVE_CAP - 1);
}

// The form of target's rule; -1 when its Python rule lowers it.
static int native_form(PyObject* target, int32_t* op) {
    for (size_t i = native_slot(target); native[i].target != NULL; i = (i + 1) & (NATIVE_CAP - 1))
        if (native[i].target == target) {
            *op = native[i].op;
            return native[i].form;
        }
    return -1;
}

// facts[x] (dvm.cluster._Analysis.facts): its shape (k = 0) or dtype (k = 1), borrowed;
// NULL with no exception when there is none.
static PyObject* fact_of(Resolve* r, PyObject* x, Py_ssize_t k) {
    if (!PyDict_CheckExact(r->facts)) return NULL;
    PyObject* fact = PyDict_GetItemWithError(r->facts, x);
    if (fact == NULL || !PyTuple_CheckExact(fact) || PyTuple_GET_SIZE(fact) != 3) return NULL;
    return PyTuple_GET_ITEM(fact, k);
}

// Whether reducing x (of `shape`) over `dims` (dvm.lower.reduced_dims' argument: absent,
// None, an int or a sequence of ints) reduces a row of more than one element (dvm.lower's
// row_reduction): 1 or 0; -1 when the form leaves it to the rule.
static int reduces_row(PyObject* shape, PyObject* dims) {
    if (shape == NULL || !PyTuple_Check(shape)) return -1;
    Py_ssize_t rank = PyTuple_GET_SIZE(shape);
    if (rank == 0) return 0;
    PyObject* last = PyTuple_GET_ITEM(shape, rank - 1);
    if (!PyLong_CheckExact(last)) return -1;
    int overflow;
    long long size = PyLong_AsLongLongAndOverflow(last, &overflow);
    if (overflow || (size == -1 && PyErr_Occurred())) return -1;
    if (size == 1) return 0;
    PyObject* one[1] = {dims};
    PyObject* const* each = one;
    Py_ssize_t n = 1;
    if (dims == NULL || dims == Py_None) return 1;
    if (PyList_Check(dims) || PyTuple_Check(dims)) {
        n = PySequence_Fast_GET_SIZE(dims);
        each = PySequence_Fast_ITEMS(dims);
        if (n == 0) return 1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyLong_CheckExact(each[i])) return -1;
        long long d = PyLong_AsLongLongAndOverflow(each[i], &overflow);
        if (overflow || (d == -1 && PyErr_Occurred())) return -1;
        if (((d % rank) + rank) % rank == rank - 1) return 1;
    }
    return 0;
}

// dvm.lower._cast: value rounded as `dtype` holds it.
static int32_t cast(Emitter* em, int32_t value, PyObject* dtype) {
    if (dtype == g.dtypes[1]) return op1(em, CAST_BF16, value);
    if (dtype == g.dtypes[2]) return op1(em, CAST_F16, value);
    if (dtype == g.dtypes[3]) return op2(em, NE, value, value < 0 ? -1 : const_value(em, 0.0));
    return value;
}

// dvm.lower._converted: x cast to `dtype`, x's own dtype `own` (NULL: x is no node); x rounded
// first to a 16-bit `own` when the region computed it, unless dtype is float32.
static int32_t converted(Resolve* r, PyObject* x, PyObject* own, PyObject* dtype) {
    if (dtype == g.dtypes[0]) return resolve(r, x);
    if (own == g.dtypes[1] || own == g.dtypes[2]) {
        int computed = PyDict_Contains(r->env, x);
        if (computed < 0) return -1;
        if (computed) return cast(r->em, cast(r->em, resolve(r, x), own), dtype);
    }
    return cast(r->em, resolve(r, x), dtype);
}

// Node n lowered by its form: its value, -1 on error, -2 when the form leaves it to the rule.
static int32_t emit_form(Resolve* r, PyObject* n, int form, int32_t op, PyObject* args,
                         Py_ssize_t n_kw) {
    Emitter* em = r->em;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    PyObject* const* a = &PyTuple_GET_ITEM(args, 0);
    if (nargs == 0 || (n_kw && form != F_IDENTITY && form != F_TO_COPY)) return -2;
    int32_t x, y, t;
    switch (form) {
        case F_UNARY:
            return nargs == 1 ? op1(em, op, resolve(r, a[0])) : -2;
        case F_BINARY:
            if (nargs != 2) return -2;
            x = resolve(r, a[0]);
            return x < 0 ? -1 : op2(em, op, x, resolve(r, a[1]));
        case F_ADD_SUB:
            if (nargs != 2) return -2;
            y = resolve(r, a[1]);
            return y < 0 ? -1 : op2(em, op, resolve(r, a[0]), y);
        case F_POW: {
            if (nargs != 2) return -2;
            PyObject* e = a[1];
            if (Py_TYPE(a[0]) != (PyTypeObject*)g.node || !(PyFloat_Check(e) || PyLong_Check(e))) {
                x = resolve(r, a[0]);
                return x < 0 ? -1 : op2(em, POW, x, resolve(r, e));
            }
            if (!PyFloat_CheckExact(e) && !PyLong_CheckExact(e)) return -2;  // a bool: the rule
            double v = PyFloat_AsDouble(e);
            if (v == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();  // too large for a float: the rule raises its error
                return -2;
            }
            if (v == 0.5 || v == -0.5) return -2;  // by dtype (dvm.lower._POW_AS_POW)
            x = resolve(r, a[0]);
            if (x < 0 || v == 1.0) return x;
            if (v == 2.0) return op2(em, MUL, x, x);
            if (v == 3.0) return op2(em, MUL, op2(em, MUL, x, x), x);
            if (v == -1.0) return op1(em, RECIPROCAL, x);
            return op2(em, POW, x, const_value(em, v));
        }
        case F_SQUARE:
            if (nargs != 1) return -2;
            x = resolve(r, a[0]);
            return op2(em, MUL, x, x);
        case F_REDUCE: {
            if (nargs > 3 || Py_TYPE(a[0]) != (PyTypeObject*)g.node) return -2;
            PyObject* shape = fact_of(r, a[0], 0);
            if (shape == NULL && PyErr_Occurred()) return -1;
            int row = reduces_row(shape, nargs > 1 ? a[1] : NULL);
            if (row < 0) return -2;
            x = resolve(r, a[0]);
            return row ? op1(em, op, x) : x;
        }
        case F_WHERE:
            if (nargs != 3) return -2;
            x = resolve(r, a[0]);
            y = x < 0 ? -1 : resolve(r, a[1]);
            t = y < 0 ? -1 : resolve(r, a[2]);
            return t < 0 ? -1 : make(em, (Entry){WHERE, x, y, t, 0}, 0.0);
        case F_IDENTITY:
            return resolve(r, a[0]);
        case F_SILU:
            if (nargs != 1) return -2;
            x = resolve(r, a[0]);
            return op2(em, MUL, x, op1(em, SIGMOID, x));
        case F_RELU:
            if (nargs != 1) return -2;
            x = resolve(r, a[0]);
            return x < 0 ? -1 : op2(em, MAX, const_value(em, 0.0), x);
        case F_SOFTMAX:
        case F_LOG_SOFTMAX:
            if (nargs != 3) return -2;
            x = resolve(r, a[0]);
            y = op2(em, SUB, x, op1(em, REDUCE_MAX, x));
            if (form == F_LOG_SOFTMAX)
                return op2(em, SUB, y, op1(em, LOG, op1(em, REDUCE_SUM, op1(em, EXP, y))));
            t = op1(em, EXP, y);
            return op2(em, DIV, t, op1(em, REDUCE_SUM, t));
        case F_SOFTMAX_BACKWARD:
        case F_LOG_SOFTMAX_BACKWARD:
            if (nargs != 4) return -2;
            x = resolve(r, a[0]);  // grad
            y = x < 0 ? -1 : resolve(r, a[1]);  // the forward's output
            if (form == F_LOG_SOFTMAX_BACKWARD) {
                t = op1(em, REDUCE_SUM, x);
                return op2(em, SUB, x, op2(em, MUL, op1(em, EXP, y), t));
            }
            t = op2(em, MUL, x, y);
            return op2(em, SUB, t, op2(em, MUL, y, op1(em, REDUCE_SUM, t)));
        case F_TO_COPY:
        case F_CONVERT: {
            if (nargs != (form == F_TO_COPY ? 1 : 2)) return -2;
            PyObject* dtype = form == F_TO_COPY ? fact_of(r, n, 1) : a[1];
            PyObject* own = NULL;
            if (dtype != NULL && Py_TYPE(a[0]) == (PyTypeObject*)g.node)
                own = fact_of(r, a[0], 1);
            if (PyErr_Occurred()) return -1;
            if (dtype == NULL || (own == NULL && Py_TYPE(a[0]) == (PyTypeObject*)g.node))
                return -2;
            return converted(r, a[0], own, dtype);
        }
    }
    return -2;
}

// Node n lowered by its form (see emit_form), its args read from its slots.
static int32_t emit_native(Resolve* r, PyObject* n, int form, int32_t op) {
    PyObject* args = field(n, g.at_args, g.s_args);
    PyObject* kwargs = args ? field(n, g.at_kwargs, g.s_kwargs) : NULL;
    int32_t value = -1;
    if (kwargs != NULL)
        value = PyTuple_Check(args) && PyDict_Check(kwargs)
                    ? emit_form(r, n, form, op, args, PyDict_GET_SIZE(kwargs))
                    : -2;
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    return value;
}

// A region's members: their nodes scanned while they are few and each exactly a Node (which
// equals only itself), else a set of them, made when first needed.
typedef struct {
    PyObject* seq;  // the members (PySequence_Fast)
    PyObject* set;  // NULL until made
    int scan;
} Members;

enum { SCAN_MAX = 32 };  // members looked through one by one, at most

static int scan_members(Members* m) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(m->seq);
    m->scan = n <= SCAN_MAX;
    for (Py_ssize_t i = 0; m->scan && i < n; ++i)
        m->scan = Py_TYPE(PySequence_Fast_GET_ITEM(m->seq, i)) == (PyTypeObject*)g.node;
    return m->scan || (m->set = PySet_New(m->seq)) != NULL ? 0 : -1;
}

// Whether x is a member: 1 or 0, -1 on error.
static int is_member(Members* m, PyObject* x) {
    if (m->scan && Py_TYPE(x) == (PyTypeObject*)g.node) {
        PyObject* const* items = PySequence_Fast_ITEMS(m->seq);
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(m->seq); ++i)
            if (items[i] == x) return 1;
        return 0;
    }
    if (m->set == NULL && (m->set = PySet_New(m->seq)) == NULL) return -1;
    return PySet_Contains(m->set, x);
}

// The member whose values n holds: n, or through views inside the region the value they view
// (eager returns a view of it; another node of equal values is a tensor of its own). A new
// reference; NULL on error.
static PyObject* alias_base(PyObject* n, Members* members) {
    Py_INCREF(n);
    for (;;) {
        PyObject* target = field(n, g.at_target, g.s_target);
        if (target == NULL) goto fail;
        int aliasing = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g.aliasing); ++i)
            aliasing |= PyTuple_GET_ITEM(g.aliasing, i) == target;
        Py_DECREF(target);
        if (!aliasing) return n;
        PyObject* args = field(n, g.at_args, g.s_args);
        PyObject* base = args ? PySequence_GetItem(args, 0) : NULL;
        Py_XDECREF(args);
        int inside = base ? is_member(members, base) : -1;
        if (inside <= 0) {
            Py_XDECREF(base);
            if (inside == 0) return n;
            goto fail;
        }
        Py_SETREF(n, base);
    }
fail:
    Py_DECREF(n);
    return NULL;
}

// Whether a node outside `members` reads n: 1 or 0, -1 on error.
static int read_outside(PyObject* n, Members* members) {
    PyObject* users = field(n, g.at_users, g.s_users);
    if (users == NULL) return -1;
    int outside = 0;
    if (PyDict_CheckExact(users)) {  // a Node's users: its keys, read without an iterator
        Py_ssize_t pos = 0;
        PyObject* u;
        while (!outside && PyDict_Next(users, &pos, &u, NULL)) {
            Py_INCREF(u);
            int inside = is_member(members, u);
            Py_DECREF(u);
            outside = inside < 0 ? -1 : !inside;
        }
        Py_DECREF(users);
        return outside;
    }
    PyObject* it = PyObject_GetIter(users);
    Py_DECREF(users);
    if (it == NULL) return -1;
    PyObject* u;
    while (!outside && (u = PyIter_Next(it)) != NULL) {
        int inside = is_member(members, u);
        Py_DECREF(u);
        outside = inside < 0 ? -1 : !inside;
    }
    Py_DECREF(it);
    return outside == 0 && PyErr_Occurred() ? -1 : outside;
}

// One member lowered into r->em; stored, with its output slot, when read outside the region.
// The per-region lists are in `out`: outputs, output slots, out dtypes, reduced. 0 or -1.
static int lower_member(Resolve* r, PyObject* n, Members* mset, PyObject* domain,
                        PyObject* stored, PyObject* out[4]) {
    Py_XSETREF(r->reader, Py_NewRef(n));
    PyObject* target = field(n, g.at_target, g.s_target);
    if (target == NULL) return -1;
    int32_t op, form = native_form(target, &op);
    int32_t v = form < 0 ? -2 : emit_native(r, n, form, op);
    PyObject* value = NULL;
    if (v == -2) {  // the rule's emit
        PyObject* id = PyLong_FromVoidPtr(target);
        PyObject* rule = id ? PyObject_GetItem(g.rules, id) : NULL;
        Py_XDECREF(id);
        PyObject* emit = rule ? PyObject_GetAttr(rule, g.s_emit) : NULL;
        Py_XDECREF(rule);
        PyObject* call[3] = {(PyObject*)r->em, n, (PyObject*)r};
        value = emit ? PyObject_Vectorcall(emit, call, 3, NULL) : NULL;
        Py_XDECREF(emit);
    } else {
        value = as_int(v);
    }
    Py_DECREF(target);
    if (value == NULL || PyDict_SetItem(r->env, n, value) < 0) goto fail;
    int outside = read_outside(n, mset);
    if (outside <= 0) {
        Py_DECREF(value);
        return outside;
    }
    PyObject* shape = PyObject_GetItem(r->dshape, n);
    if (shape == NULL) goto fail;
    PyObject* pair[2] = {shape, domain};
    PyObject* red = PyObject_Vectorcall(g.storable, pair, 2, NULL);
    if (red == Py_None) {
        PyObject* name = PyObject_GetAttr(n, g.s_name);
        if (name != NULL)
            PyErr_Format(PyExc_ValueError, "output %S %S is neither %S nor row-reduced", name,
                         shape, domain);
        Py_XDECREF(name);
        Py_CLEAR(red);
    }
    Py_DECREF(shape);
    if (red == NULL) goto fail;
    // a view shares its base's output only (a clone of the same value has its own)
    PyObject* fact = PyObject_GetItem(r->facts, n);
    PyObject* dtype = fact ? PySequence_GetItem(fact, 1) : NULL;
    Py_XDECREF(fact);
    PyObject* base = dtype ? alias_base(n, mset) : NULL;
    PyObject* key = base ? PyTuple_Pack(4, value, dtype, red, base) : NULL;
    Py_XDECREF(base);
    PyObject* slot = key ? PyDict_GetItemWithError(stored, key) : NULL;
    int failed = key == NULL || (slot == NULL && PyErr_Occurred());
    if (!failed && slot != NULL) {
        Py_INCREF(slot);
    } else if (!failed) {
        failed = (slot = emitter_store(r->em, &value, 1)) == NULL ||
                 PyDict_SetItem(stored, key, slot) < 0 || PyList_Append(out[2], dtype) < 0 ||
                 PyList_Append(out[3], red) < 0;
    }
    failed = failed || PyList_Append(out[0], n) < 0 || PyList_Append(out[1], slot) < 0;
    Py_XDECREF(slot);
    Py_XDECREF(key);
    Py_XDECREF(dtype);
    Py_DECREF(red);
    Py_DECREF(value);
    return failed ? -1 : 0;
fail:
    Py_XDECREF(value);
    return -1;
}

// build_region(members, analysis): see its docstring.
static PyObject* build_region(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    if (g.region == NULL || g.built == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "build_region: setup() and setup_regions() must be called first");
        return NULL;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "build_region(members, analysis)");
        return NULL;
    }
    double t0 = perf_seconds();
    if (t0 < 0 && PyErr_Occurred()) return NULL;
    PyObject *members = NULL, *domain = NULL, *stored = NULL, *region = NULL;
    PyObject* out[4] = {NULL, NULL, NULL, NULL};  // outputs, their slots, out dtypes, reduced
    Members mset = {NULL, NULL, 0};
    Resolve* r = PyObject_GC_New(Resolve, &ResolveType);
    if (r == NULL) goto done;
    r->vectorcall = (vectorcallfunc)resolve_call;
    r->em = NULL, r->reader = NULL, r->dshape = NULL, r->facts = NULL, r->cut = NULL;
    r->rank = 0;
    r->env = PyDict_New();
    r->input_nodes = PyList_New(0), r->input_views = PyList_New(0);
    PyObject_GC_Track(r);
    if (r->env == NULL || r->input_nodes == NULL || r->input_views == NULL)
        goto done;
    members = PySequence_Fast(args[0], "build_region: members must be a sequence of nodes");
    if (members == NULL || (mset.seq = members, scan_members(&mset)) < 0) goto done;
    PyObject* pair[2] = {args[1], args[0]};
    if ((domain = PyObject_Vectorcall(g.domain, pair, 2, NULL)) == NULL) goto done;
    int spans = PyObject_IsTrue(domain);  // 0-d values only (a scale worked out from a scalar)
    if (spans < 0) goto done;
    if (!spans) {  // one element
        Py_SETREF(domain, Py_BuildValue("(i)", 1));
        if (domain == NULL) goto done;
    }
    if ((r->rank = PyObject_Length(domain)) < 0) goto done;
    PyObject* em = PyObject_CallNoArgs(g.emitter);
    if (em == NULL) goto done;
    r->em = (Emitter*)em;
    if (!PyObject_TypeCheck(em, &EmitterType)) {
        PyErr_SetString(PyExc_TypeError, "build_region: the emitter class is no Emitter");
        goto done;
    }
    if ((r->dshape = PyObject_GetAttr(args[1], g.s_dshape)) == NULL ||
        (r->facts = PyObject_GetAttr(args[1], g.s_facts)) == NULL ||
        (r->cut = PyObject_GetAttr(args[1], g.s_cut)) == NULL || (stored = PyDict_New()) == NULL)
        goto done;
    if (!PyDict_Check(r->dshape)) {
        PyErr_Format(PyExc_TypeError, "build_region: the analysis's dshape must be a dict, not %.100s",
                     Py_TYPE(r->dshape)->tp_name);
        goto done;
    }
    for (int i = 0; i < 4; ++i)
        if ((out[i] = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(members); ++k)
        if (lower_member(r, PySequence_Fast_GET_ITEM(members, k), &mset, domain, stored, out) < 0)
            goto done;
    Py_ssize_t n_inputs = PyList_GET_SIZE(r->input_nodes);
    if (PyList_GET_SIZE(out[0]) == 0) {
        PyErr_SetString(PyExc_ValueError, "no output");
    } else if (n_inputs > g.max_inputs) {
        PyErr_Format(g.limit_error, "%zd inputs (the VM takes %ld)", n_inputs, g.max_inputs);
    } else if (r->em->n_outputs > g.max_outputs) {
        PyErr_Format(g.limit_error, "%d outputs (the VM takes %ld)", r->em->n_outputs,
                     g.max_outputs);
    } else if (r->em->n_code > g.max_instrs) {
        PyErr_Format(g.limit_error, "%zd instructions (the VM takes %ld)", r->em->n_code,
                     g.max_instrs);
    } else {
        PyObject* n_in = PyLong_FromSsize_t(n_inputs);
        PyObject* program = n_in ? emitter_program(r->em, n_in) : NULL;
        Py_XDECREF(n_in);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(members);
        PyObject* nodes = program ? PyList_New(n) : NULL;
        for (Py_ssize_t k = 0; nodes != NULL && k < n; ++k)
            PyList_SET_ITEM(nodes, k, Py_NewRef(PySequence_Fast_GET_ITEM(members, k)));
        double t1 = nodes ? perf_seconds() : -1.0;
        PyObject* build_us = t1 >= 0 ? PyFloat_FromDouble((t1 - t0) * 1e6) : NULL;
        if (build_us != NULL) {
            PyObject* fields[N_REGION_FIELDS] = {nodes,   r->input_nodes, r->input_views, out[0], out[1],
                                    domain,  program,        out[2],         out[3], build_us};
            region = g.region_type
                         ? bare(g.region_type, g.region_fields, fields, N_REGION_FIELDS)
                         : PyObject_Vectorcall(g.region, fields, N_REGION_FIELDS, NULL);
        }
        Py_XDECREF(build_us);
        Py_XDECREF(nodes);
        Py_XDECREF(program);
    }
done:
    for (int i = 0; i < 4; ++i) Py_XDECREF(out[i]);
    Py_XDECREF(stored);
    Py_XDECREF(domain);
    Py_XDECREF(mset.set);
    Py_XDECREF(members);
    Py_XDECREF(r);
    return region;
}

// setup(limit_error, built, max_regs): what program() needs, from dvm.lower (built:
// Program.built, whose work program() does itself for a classmethod: see built()).
static PyObject* setup(PyObject* module, PyObject* args) {
    PyObject *limit_error, *built;
    long max_regs;
    if (!PyArg_ParseTuple(args, "OOl", &limit_error, &built, &max_regs)) return NULL;
    if (!PyExceptionClass_Check(limit_error) || !PyCallable_Check(built)) {
        PyErr_SetString(PyExc_TypeError, "setup: an exception class and a callable");
        return NULL;
    }
    Py_XSETREF(g.limit_error, Py_NewRef(limit_error));
    Py_XSETREF(g.built, Py_NewRef(built));
    PyObject* cls = PyMethod_Check(built) ? PyMethod_GET_SELF(built) : NULL;
    // a class made by object's constructor (bare() makes it so; a dict's or a set's own
    // constructor would be skipped) whose objects have a __dict__
    g.program_type = cls != NULL && PyType_Check(cls) &&
                             ((PyTypeObject*)cls)->tp_new == PyBaseObject_Type.tp_new &&
                             ((PyTypeObject*)cls)->tp_dictoffset
                         ? (PyTypeObject*)cls
                         : NULL;  // held through built
    g.max_regs = max_regs;
    Py_RETURN_NONE;
}

// Whether region(*values), for ten fresh objects, is a `region` holding exactly those under
// `names` in that order, as bare() makes it: 0 where not (an __init__ of the class's own, which
// a dataclass keeps, or a __new__, doing more or less), 1 where so, -1 with an exception.
static int inits_plainly(PyObject* region, PyObject* const* names) {
    PyObject* values[N_REGION_FIELDS] = {NULL};
    int plain = 1;
    for (int i = 0; plain > 0 && i < N_REGION_FIELDS; ++i)
        if ((values[i] = PyObject_CallNoArgs((PyObject*)&PyBaseObject_Type)) == NULL) plain = -1;
    PyObject* made = plain > 0 ? PyObject_Vectorcall(region, values, N_REGION_FIELDS, NULL) : NULL;
    if (made == NULL && plain > 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) plain = -1;
        else PyErr_Clear(), plain = 0;
    }
    PyObject* dict = made && Py_TYPE(made) == (PyTypeObject*)region
                         ? PyObject_GenericGetDict(made, NULL) : NULL;
    if (made != NULL && dict == NULL) plain = PyErr_Occurred() ? -1 : 0;
    if (dict != NULL && (!PyDict_CheckExact(dict) || PyDict_GET_SIZE(dict) != N_REGION_FIELDS))
        plain = 0;
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    for (int i = 0; dict != NULL && plain > 0 && PyDict_Next(dict, &pos, &name, &value); ++i)
        if (value != values[i] || !PyUnicode_CheckExact(name) ||
            PyUnicode_Compare(name, names[i]) != 0)
            plain = 0;
    Py_XDECREF(dict);
    Py_XDECREF(made);
    for (int i = 0; i < N_REGION_FIELDS; ++i) Py_XDECREF(values[i]);
    return plain;
}

// Whether build_region makes `region` bare (see bare()) rather than calling it: a dataclass
// whose generated __init__ sets its ten fields (positional, no __post_init__) through the
// generic setattr, and which does just that when called (inits_plainly); g.region_type and
// g.region_fields set when it is. 0 or -1.
static int region_fields(PyObject* region) {
    g.region_type = NULL;  // held through g.region
    PyTypeObject* type = (PyTypeObject*)region;
    if (!PyType_Check(region) || type->tp_setattro != PyObject_GenericSetAttr ||
        type->tp_dictoffset == 0 || type->tp_new != PyBaseObject_Type.tp_new)
        return 0;  // bare() makes it with object's constructor: not a dict's, say
    PyObject* params = PyObject_GetAttrString(region, "__dataclass_params__");
    PyObject* init = params ? PyObject_GetAttrString(params, "init") : NULL;
    Py_XDECREF(params);
    int plain = init ? PyObject_IsTrue(init) : -1;
    Py_XDECREF(init);
    if (plain < 0 && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    if (plain < 0) return -1;
    if (plain > 0) plain = !PyObject_HasAttrString(region, "__post_init__");
    PyObject* dataclasses = plain > 0 ? PyImport_ImportModule("dataclasses") : NULL;
    PyObject* fields = dataclasses ? PyObject_CallMethod(dataclasses, "fields", "O", region) : NULL;
    Py_XDECREF(dataclasses);
    if (fields == NULL || !PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != N_REGION_FIELDS) {
        Py_XDECREF(fields);
        return plain > 0 && PyErr_Occurred() ? -1 : 0;
    }
    PyObject* names[N_REGION_FIELDS] = {NULL};
    for (Py_ssize_t i = 0; plain > 0 && i < N_REGION_FIELDS; ++i) {
        PyObject* f = PyTuple_GET_ITEM(fields, i);
        PyObject* flags[2] = {PyObject_GetAttrString(f, "init"), PyObject_GetAttrString(f, "kw_only")};
        int in_init = flags[0] ? PyObject_IsTrue(flags[0]) : -1;
        int kw_only = flags[1] ? PyObject_IsTrue(flags[1]) : -1;
        Py_XDECREF(flags[0]);
        Py_XDECREF(flags[1]);
        names[i] = PyObject_GetAttrString(f, "name");
        plain = in_init < 0 || kw_only < 0 || names[i] == NULL ? -1 : in_init && !kw_only;
        if (plain > 0 && !PyUnicode_CheckExact(names[i])) plain = 0;
    }
    Py_DECREF(fields);
    if (plain > 0) plain = inits_plainly(region, names);
    if (plain > 0) {
        for (int i = 0; i < N_REGION_FIELDS; ++i) Py_XSETREF(g.region_fields[i], names[i]);
        g.region_type = type;
        return 0;
    }
    for (int i = 0; i < N_REGION_FIELDS; ++i) Py_XDECREF(names[i]);
    return plain;
}

// setup_regions(rules, node, region, emitter, domain, storable, aliasing, limits): what
// build_region needs, from dvm.cluster.
static PyObject* setup_regions(PyObject* module, PyObject* args) {
    PyObject *rules, *node, *region, *emitter, *domain, *storable, *aliasing;
    long max_in, max_out, max_instrs;
    if (!PyArg_ParseTuple(args, "O!O!OO!OOO!(lll)", &PyDict_Type, &rules, &PyType_Type, &node,
                          &region, &PyType_Type, &emitter, &domain, &storable, &PyTuple_Type,
                          &aliasing, &max_in, &max_out, &max_instrs))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject*)emitter, &EmitterType)) {
        PyErr_SetString(PyExc_TypeError, "setup_regions: emitter must subclass Emitter");
        return NULL;
    }
    if (!PyCallable_Check(region) || !PyCallable_Check(domain) || !PyCallable_Check(storable)) {
        PyErr_SetString(PyExc_TypeError, "setup_regions: region, domain and storable are callables");
        return NULL;
    }
    PyObject* given[] = {rules, node, region, emitter, domain, storable, aliasing};
    PyObject** held[] = {&g.rules,  &g.node,     &g.region,  &g.emitter,
                         &g.domain, &g.storable, &g.aliasing};
    for (int i = 0; i < 7; ++i) Py_XSETREF(*held[i], Py_NewRef(given[i]));
    if (region_fields(region) < 0) return NULL;
    const char* names[] = {"target", "_args", "_kwargs", "users"};
    Py_ssize_t* at[] = {&g.at_target, &g.at_args, &g.at_kwargs, &g.at_users};
    for (int i = 0; i < 4; ++i) {
        PyObject* name = PyUnicode_InternFromString(names[i]);
        if (name == NULL) return NULL;
        *at[i] = member_at((PyTypeObject*)node, name);
        Py_DECREF(name);
    }
    g.max_inputs = max_in;
    g.max_outputs = max_out;
    g.max_instrs = max_instrs;
    Py_RETURN_NONE;
}

// setup_native(forms, dtypes): the rules emitted here (dvm.lower.NATIVE), replacing those
// before: forms maps an op (a node's target) to (form, op), the op one of the form's run
// (0 for a form of none); dtypes is (float32, bfloat16, float16, bool).
static PyObject* setup_native(PyObject* module, PyObject* args) {
    PyObject *forms, *dtypes[4];
    if (!PyArg_ParseTuple(args, "O!(OOOO)", &PyDict_Type, &forms, &dtypes[0], &dtypes[1],
                          &dtypes[2], &dtypes[3]))
        return NULL;
    // the entries as they are now, held: an op's __index__ (read_int) may change forms
    PyObject* items = PyDict_Items(forms);
    if (items == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (n > NATIVE_CAP / 2) {
        Py_DECREF(items);
        PyErr_Format(PyExc_ValueError, "setup_native: more than %d forms", NATIVE_CAP / 2);
        return NULL;
    }
    static const long runs[N_FORMS][2] = {
        [F_UNARY] = {10, 27}, [F_BINARY] = {40, 55}, [F_ADD_SUB] = {40, 42}, [F_REDUCE] = {70, 73},
    };
    int32_t form[NATIVE_CAP / 2], op[NATIVE_CAP / 2];
    for (Py_ssize_t k = 0; k < n; ++k) {
        PyObject* key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, k), 0);
        PyObject* value = PyTuple_GET_ITEM(PyList_GET_ITEM(items, k), 1);
        int failed = !PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2;
        if (failed) PyErr_Format(PyExc_TypeError, "setup_native: %R's form is no (form, op) pair", key);
        failed = failed || read_int(PyTuple_GET_ITEM(value, 0), 0, N_FORMS, "form", &form[k]) < 0;
        if (!failed) {
            long lo = runs[form[k]][0], hi = runs[form[k]][1];
            failed = read_int(PyTuple_GET_ITEM(value, 1), lo, hi ? hi : 1, "op", &op[k]) < 0;
        }
        if (failed) {
            Py_DECREF(items);
            return NULL;
        }
    }
    for (size_t i = 0; i < NATIVE_CAP; ++i) Py_CLEAR(native[i].target);
    for (Py_ssize_t k = 0; k < n; ++k) {
        PyObject* key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, k), 0);
        size_t i = native_slot(key);
        while (native[i].target != NULL) i = (i + 1) & (NATIVE_CAP - 1);
        native[i].target = Py_NewRef(key);
        native[i].form = form[k], native[i].op = op[k];
    }
    Py_DECREF(items);
    for (int i = 0; i < 4; ++i) Py_XSETREF(g.dtypes[i], Py_NewRef(dtypes[i]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "setup(limit_error, built, max_regs): for program()."},
    {"setup_regions", setup_regions, METH_VARARGS,
     "setup_regions(rules, node, region, emitter, domain, storable, aliasing, limits): for "
     "build_region."},
    {"setup_native", setup_native, METH_VARARGS,
     "setup_native(forms, dtypes): the rules build_region emits in C, by target."},
    {"build_region", (PyCFunction)(void (*)(void))build_region, METH_FASTCALL,
     "build_region(members, analysis) -> Region\n\n"
     "Lower ``members`` (graph order) to one region: each member by its rule's ``emit``, the\n"
     "members read outside the region stored (one output per value, dtype, row reduction and\n"
     "alias base); ``ValueError`` (a ``LimitError`` for the VM's limits) when they do not\n"
     "make one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._emitter", "The SSA builder of VM programs.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__emitter(void) {
    Name names[] = {
        {&g.s_target, "target"}, {&g.s_emit, "emit"},     {&g.s_users, "users"},
        {&g.s_args, "args"},     {&g.s_name, "name"},     {&g.s_dshape, "dshape"},
        {&g.s_facts, "facts"},   {&g.s_cut, "cut"},       {&g.s_kwargs, "kwargs"},
        {&g.s_fields[0], "n_inputs"}, {&g.s_fields[1], "n_outputs"}, {&g.s_fields[2], "n_regs"},
        {&g.s_fields[3], "_encoded"},
    };
    if (INTERN_NAMES(names) < 0) return NULL;
    if ((zero = PyFloat_FromDouble(0.0)) == NULL) return NULL;
    if (PyType_Ready(&EmitterType) < 0 || PyType_Ready(&ResolveType) < 0) return NULL;
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
