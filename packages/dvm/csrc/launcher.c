// dvm._launcher: a bound launch of a VM program as a CPython object (dvm.vm.Launch).
//
// Binding reads the domain, each arg's shape and dtype, the operands' views and the outputs'
// shapes and layouts, checks them and works out each operand's strides over the domain and
// each output's allocation: dvm.vm.Kernel.bind's work, done once per compiled region. A call
// checks its args against the signature the launch was bound for, reads their strides
// and data pointers, allocates the outputs with torch.empty_strided and calls dvm_run (the
// ISA build's, by address) with the GIL released: the work of dvm.vm's former Python call
// path and its ctypes call, without either. prepare(region) makes a compiled region's launch
// from the dvm.cluster.Region itself in one call (encoding, binding, output layouts), for the
// build dvm.compile names in setup_regions(). No torch headers: torch is reached through the
// Python objects dvm.vm hands to setup().
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE  // dladdr
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "errors.h"
#include "fields.h"
#include "names.h"

// The VM's limits (csrc/vm.h): a launch over more is refused when it is made.
enum { MAX_DIMS = 6, MAX_INPUTS = 16, MAX_OUTPUTS = 8, MAX_INSTRS = 256 };
enum { MAX_ARG_DIMS = 64 };  // an arg's dims (size-1 ones beyond the domain's included)

typedef int32_t (*RunFn)(const int32_t*, const float*, int32_t, int32_t, int32_t,
                         const void* const*, const int32_t*, const int64_t*, int32_t,
                         void* const*, const int32_t*, const int64_t*, const int64_t*, int32_t,
                         int32_t);

// Mismatch kinds: indices into MISMATCH (the module's MISMATCH, which dvm.vm uses).
enum { NOT_TENSOR = 0, SHAPE = 1, DTYPE = 2, DEVICE = 3, NEGATED = 4, NEEDS_GRAD = 5,
       SUBCLASS = 6 };
static const char* const MISMATCH[] = {"not a tensor", "shape",      "dtype",
                                       "device",       "negated",    "needs grad",
                                       "a tensor subclass"};

static struct {
    // tensor and parameter: the types whose args a launch takes (a subclass's own methods could
    // say what its memory is not: its strides, its data pointer)
    PyObject *tensor, *parameter, *empty_strided, *cpu, *num_threads, *grad_enabled, *strided,
        *error;
    // torch._C._is_torch_function_mode_enabled, torch._C.DisableTorchFunction and its
    // __enter__ and __exit__ (checked())
    PyObject *tf_mode, *no_tf, *no_tf_enter, *no_tf_exit;
    PyObject *messages, *dtype_codes, *dtype_names, *kwnames;
    PyObject *s_shape, *s_dtype, *s_is_cpu, *s_layout, *s_is_neg, *s_requires_grad, *s_stride,
        *s_data_ptr, *s_view;
} g;

// The build in use and the program facts a region's preparation needs (setup_regions).
static struct {
    PyObject *address, *max_row, *rewrite;
    // resolved at setup_regions, for the objects of exactly these types: torch.fx.Node's meta
    // (its C member's offset, 0 where the generic lookup must read it), FakeTensor's shape and
    // dtype getters and stride method (NULL where it must), and a Region's and a Program's
    // fields read from their instance dicts (the type NULL where no descriptor allows it)
    PyTypeObject *node_type, *fake, *region_type, *program_type;
    Py_ssize_t meta_at;
    PyGetSetDef *get_shape, *get_dtype;
    PyObject* stride;
    PyObject *s_program, *s_out_dtypes, *s_reduced, *s_domain, *s_input_nodes, *s_input_views,
        *s_outputs, *s_output_slots, *s_encode, *s_encoded, *s_n_regs, *s_n_inputs,
        *s_n_outputs, *s_meta, *s_val;
    unsigned char op_flags[256];  // REDUCES and CASTS bits by opcode
} r;

typedef struct {
    PyObject_HEAD
    RunFn run;
    int32_t* code;  // five int32 per instruction, then imm: one block of the program's size
    float* imm;
    int32_t n_instr, n_regs, n_in, n_out, nd;
    int32_t in_codes[MAX_INPUTS], out_codes[MAX_OUTPUTS];
    Py_ssize_t n_args;
    int8_t arg_of[MAX_INPUTS];           // operand k reads arg arg_of[k]
    int8_t picks[MAX_INPUTS][MAX_DIMS];  // the arg's dim giving each domain dim its stride, -1: 0
    int8_t arg_ndim[MAX_INPUTS];         // each arg's number of dims, as bound
    PyObject* alloc[MAX_OUTPUTS][3];      // (shape, strides, dtype) of each output
    int64_t tail[MAX_OUTPUTS * MAX_DIMS + MAX_DIMS];  // output strides, then the domain
    PyObject* shapes;                     // tuple: each arg's shape, as bound
    PyObject* dtypes;                     // tuple: each arg's dtype
    PyObject* refused;                    // the message of the VMError every call raises, or NULL
    int state;                            // FRESH, BINDING (user code may run meanwhile), READY
} Launcher;

enum { FRESH = 0, BINDING = 1, READY = 2 };

// PySequence_Tuple(seq), seq itself where it is a tuple (a torch.Size, say) iterated as one:
// the tuple PySequence_Tuple would copy its entries into, without the copy.
static PyObject* as_tuple(PyObject* seq) {
    if (PyTuple_Check(seq) && Py_TYPE(seq)->tp_iter == PyTuple_Type.tp_iter)
        return Py_NewRef(seq);
    return PySequence_Tuple(seq);
}

// `seq` as a tuple of its own: user code that reading its entries runs (an __index__) cannot
// change it. NULL with a TypeError naming `what` when it is not a sequence.
static PyObject* own_tuple(PyObject* seq, const char* what) {
    PyObject* t = as_tuple(seq);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: give a sequence, got %.100s", what,
                     Py_TYPE(seq)->tp_name);
    }
    return t;
}

// The entries of the tuple `t` into out as int32; an error names `what`. Every entry is read
// before any range is checked.
static int int32s(PyObject* t, const char* what, int32_t* out) {
    long long wide = 0, outside = 0;
    int found = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); ++i) {
        wide = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (wide == -1 && PyErr_Occurred()) return -1;
        if (!found && (wide < INT32_MIN || wide > INT32_MAX)) found = 1, outside = wide;
        out[i] = (int32_t)wide;
    }
    if (found) PyErr_Format(PyExc_ValueError, "%s: %lld is not an int32", what, outside);
    return found ? -1 : 0;
}

static void launcher_dealloc(Launcher* self) {
    PyMem_Free(self->code);
    for (int k = 0; k < MAX_OUTPUTS; ++k)
        for (int j = 0; j < 3; ++j) Py_XDECREF(self->alloc[k][j]);
    Py_XDECREF(self->shapes);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->refused);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

// Tensor v's attribute `name`, through its getter `get` where v is a FakeTensor (setup_regions
// resolved it); a new reference, or NULL with an exception.
static PyObject* tensor_attr(PyObject* v, PyGetSetDef* get, PyObject* name) {
    if (get != NULL && Py_TYPE(v) == r.fake) return get->get(v, get->closure);
    return PyObject_GetAttr(v, name);
}

// Each arg's shape (a tuple, torch.Size) and dtype, as bound, into new tuples; the sizes of
// arg i in sizes[i][0..arg_ndim[i]).
static int read_args(Launcher* self, PyObject* args, int64_t sizes[][MAX_ARG_DIMS],
                     PyObject** shapes_out, PyObject** dtypes_out) {
    PyObject* own = own_tuple(args, "args");
    if (own == NULL) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(own);
    if (n > MAX_INPUTS) {
        PyErr_Format(PyExc_ValueError, "args: %zd tensors, at most %d", n, MAX_INPUTS);
        Py_DECREF(own);
        return -1;
    }
    PyObject *shapes = PyTuple_New(n), *dtypes = PyTuple_New(n);
    for (Py_ssize_t i = 0; shapes != NULL && dtypes != NULL && i < n; ++i) {
        PyObject* a = PyTuple_GET_ITEM(own, i);
        PyObject* shape = tensor_attr(a, r.get_shape, g.s_shape);
        if (shape == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "arg %zd is a %.100s, not a tensor", i,
                         Py_TYPE(a)->tp_name);
            goto fail;
        }
        PyObject* dtype = shape == NULL ? NULL : tensor_attr(a, r.get_dtype, g.s_dtype);
        if (dtype == NULL || !PyTuple_Check(shape) ||
            PyTuple_GET_SIZE(shape) > MAX_ARG_DIMS) {
            if (dtype != NULL && !PyTuple_Check(shape))
                PyErr_Format(PyExc_TypeError, "arg %zd: its shape is a %.100s, not a torch.Size",
                             i, Py_TYPE(shape)->tp_name);
            else if (dtype != NULL)
                PyErr_Format(PyExc_ValueError, "arg %zd: give a tensor of at most %d dims", i,
                             MAX_ARG_DIMS);
            Py_XDECREF(shape);
            Py_XDECREF(dtype);
            goto fail;
        }
        PyTuple_SET_ITEM(shapes, i, shape);
        PyTuple_SET_ITEM(dtypes, i, dtype);
        self->arg_ndim[i] = (int8_t)PyTuple_GET_SIZE(shape);
        for (int32_t d = 0; d < self->arg_ndim[i]; ++d) {
            sizes[i][d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
            if (sizes[i][d] == -1 && PyErr_Occurred()) goto fail;
        }
    }
    if (shapes == NULL || dtypes == NULL) goto fail;
    Py_DECREF(own);
    self->n_args = n;
    *shapes_out = shapes;
    *dtypes_out = dtypes;
    return 0;
fail:
    Py_DECREF(own);
    Py_XDECREF(shapes);
    Py_XDECREF(dtypes);
    return -1;
}

// The sizes of `seq` (a view, a shape, strides: at most MAX_ARG_DIMS ints) into
// out[0..*n); an error names `what`[k].
static int read_sizes(PyObject* seq, const char* what, int k, int64_t* out, Py_ssize_t* n) {
    PyObject* t = as_tuple(seq);
    *n = t == NULL ? 0 : PyTuple_GET_SIZE(t);
    int failed = t == NULL || *n > MAX_ARG_DIMS;
    for (Py_ssize_t i = 0; !failed && i < *n; ++i) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        failed = out[i] == -1 && PyErr_Occurred();
    }
    if (failed && (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear();
        if (t != NULL && *n > MAX_ARG_DIMS)
            PyErr_Format(PyExc_ValueError, "%s[%d]: %zd sizes, at most %d", what, k, *n,
                         MAX_ARG_DIMS);
        else
            PyErr_Format(PyExc_TypeError, "%s[%d]: give a sequence of ints, got %R", what, k,
                         seq);
    }
    Py_XDECREF(t);
    return failed ? -1 : 0;
}

static PyObject* int_tuple(const int64_t* v, Py_ssize_t n) {
    PyObject* t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; ++i) {
        PyObject* x = PyLong_FromLongLong(v[i]);
        if (x == NULL) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

// A ValueError formatted by `form` from k and the sizes a and b as tuples; -1.
static int sizes_error(const char* form, int k, const int64_t* a, Py_ssize_t na,
                       const int64_t* b, Py_ssize_t nb) {
    PyObject *x = int_tuple(a, na), *y = x == NULL ? NULL : int_tuple(b, nb);
    if (y != NULL) PyErr_Format(PyExc_ValueError, form, k, x, y);
    Py_XDECREF(x);
    Py_XDECREF(y);
    return -1;
}

// The domain: 1 to MAX_DIMS non-negative ints.
static int read_domain(Launcher* self, PyObject* domain, int64_t* dims) {
    PyObject* t = PySequence_Tuple(domain);
    const Py_ssize_t n = t == NULL ? 0 : PyTuple_GET_SIZE(t);
    int failed = t == NULL;
    for (Py_ssize_t d = 0; !failed && d < n && d < MAX_DIMS; ++d) {
        dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, d));
        failed = dims[d] == -1 && PyErr_Occurred();
    }
    if (failed) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "domain must be a sequence of ints, got %R", domain);
        }
        Py_XDECREF(t);
        return -1;
    }
    int bad = n < 1 || n > MAX_DIMS;
    for (Py_ssize_t d = 0; !bad && d < n; ++d) bad = dims[d] < 0;
    if (bad)
        PyErr_Format(PyExc_ValueError, "domain %R: need 1 to %d non-negative sizes", t, MAX_DIMS);
    Py_DECREF(t);
    if (bad) return -1;
    self->nd = (int32_t)n;
    return 0;
}

// Operand k: arg i seen as `view` (its shape up to size-1 dims, broadcasting to the domain):
// the arg's dim giving each domain dim its stride (-1: stride 0), and its dtype's code.
static int read_operand(Launcher* self, int32_t k, PyObject* entry, const int64_t* dims,
                        int64_t sizes[][MAX_ARG_DIMS], PyObject* dtypes) {
    const int nd = self->nd;
    PyObject* pair = PySequence_Tuple(entry);
    if (pair == NULL && !PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
    int failed = -1;
    int64_t view[MAX_ARG_DIMS];
    Py_ssize_t nv = 0, i;
    if (pair == NULL || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "operands: each an (arg, view) pair");
        goto done;
    }
    i = PyNumber_AsSsize_t(PyTuple_GET_ITEM(pair, 0), PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) goto done;
    if (i < 0 || i >= self->n_args) {
        PyErr_Format(PyExc_ValueError, "operand %d reads arg %zd of %zd", k, i, self->n_args);
        goto done;
    }
    if (read_sizes(PyTuple_GET_ITEM(pair, 1), "the view in operands", k, view, &nv) < 0)
        goto done;
    self->arg_of[k] = (int8_t)i;
    const int64_t* shape = sizes[i];
    const int32_t ns = self->arg_ndim[i];
    int32_t own[MAX_ARG_DIMS], n_own = 0;  // the arg's dims other than 1
    Py_ssize_t n_view_own = 0;
    for (int32_t d = 0; d < ns; ++d)
        if (shape[d] != 1) own[n_own++] = d;
    int moves = 0;
    for (Py_ssize_t d = 0; d < nv; ++d) {
        if (view[d] == 1) continue;
        moves |= n_view_own >= n_own || view[d] != shape[own[n_view_own]];
        ++n_view_own;
    }
    if (moves || n_view_own != n_own) {
        sizes_error("input %d: view %R of %R moves elements", k, view, nv, shape, ns);
        goto done;
    }
    int same = ns == nd;
    for (int d = 0; same && d < nd; ++d) same = shape[d] == dims[d];
    if (same) {
        for (int d = 0; d < nd; ++d) self->picks[k][d] = (int8_t)d;
    } else {
        const Py_ssize_t pad = nd - nv;
        if (pad < 0) {
            PyObject* t = int_tuple(dims, nd);
            if (t != NULL) PyErr_Format(PyExc_ValueError,
                                        "input %d has %zd dims, more than the domain %R", k, nv,
                                        t);
            Py_XDECREF(t);
            goto done;
        }
        int32_t next = 0;
        for (Py_ssize_t d = 0; d < nd; ++d) {
            if (d < pad || view[d - pad] == 1) {
                self->picks[k][d] = -1;
                continue;
            }
            if (view[d - pad] != dims[d]) {
                sizes_error("input %d of shape %R does not broadcast to the domain %R", k, view,
                            nv, dims, nd);
                goto done;
            }
            self->picks[k][d] = (int8_t)own[next++];
        }
    }
    PyObject* dtype = PyTuple_GET_ITEM(dtypes, i);
    PyObject* code = PyDict_GetItemWithError(g.dtype_codes, dtype);
    if (code == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "input %d has dtype %S; the VM takes %U: cast it first",
                         k, dtype, g.dtype_names);
        goto done;
    }
    self->in_codes[k] = (int32_t)PyLong_AsLong(code);
    failed = 0;
done:
    Py_XDECREF(pair);
    return failed;
}

// Output k's strides over the domain from out_strides[k] (None: contiguous), checked dense
// and non-overlapping; into layout, with *given 1 when given.
static int read_layout(Launcher* self, int32_t k, PyObject* entry, const int64_t* dims,
                       int reduced, int64_t* layout, int* given) {
    const int nd = self->nd;
    *given = entry != Py_None;
    if (!*given) return 0;
    int64_t st[MAX_ARG_DIMS];
    Py_ssize_t n = 0;
    if (read_sizes(entry, "out_strides", k, st, &n) < 0) return -1;
    if (reduced || n != nd) {
        PyObject* t = int_tuple(st, n);
        if (t != NULL)
            PyErr_Format(PyExc_ValueError,
                         "out_strides[%d] = %R: give %d strides for a non-reduced output, or None",
                         k, t, nd);
        Py_XDECREF(t);
        return -1;
    }
    int order[MAX_DIMS];  // dims by stride, ties in dim order (a stable sort)
    for (int d = 0; d < nd; ++d) {
        int j = d;
        while (j > 0 && st[order[j - 1]] > st[d]) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = d;
    }
    int64_t expect = 1;
    for (int d = 0; d < nd; ++d)
        if (dims[d] == 0) expect = 0;
    int past = 0;  // expect passed int64: no stride reaches it
    for (int j = 0; j < nd; ++j) {
        const int d = order[j];
        if (dims[d] > 1 && (past || (expect && st[d] != expect)))
            return sizes_error("out_strides[%d] = %R is not a dense, non-overlapping layout of %R",
                               k, st, n, dims, nd);
        past |= __builtin_mul_overflow(expect, dims[d], &expect);
    }
    for (int d = 0; d < nd; ++d) layout[d] = st[d];
    return 0;
}
// Each output's allocation (shape, strides, dtype) and its strides over the domain in tail
// (then the domain), from out_shapes (None: the domain's) and the layouts read.
static int read_outputs(Launcher* self, PyObject* out_shapes, PyObject* out_dtypes,
                        const int* reduced, const int64_t* dims, int64_t layouts[][MAX_DIMS],
                        const int* given) {
    const int nd = self->nd;
    for (int32_t k = 0; k < self->n_out; ++k) {
        int64_t want[MAX_DIMS], shape[MAX_ARG_DIMS], placed[MAX_ARG_DIMS], st[MAX_DIMS];
        for (int d = 0; d < nd; ++d) want[d] = d == nd - 1 && reduced[k] ? 1 : dims[d];
        Py_ssize_t ns = nd;
        if (out_shapes == Py_None) {
            for (int d = 0; d < nd; ++d) shape[d] = want[d];
        } else if (read_sizes(PyTuple_GET_ITEM(out_shapes, k), "out_shapes", k, shape, &ns) < 0) {
            return -1;
        }
        Py_ssize_t j = 0, d = 0;
        int differs = 0;
        for (;; ++j, ++d) {  // the sizes other than 1, in order, are want's
            while (j < ns && shape[j] == 1) ++j;
            while (d < nd && want[d] == 1) ++d;
            if (j >= ns || d >= nd) {
                differs = j < ns || d < nd;
                break;
            }
            if (shape[j] != want[d]) {
                differs = 1;
                break;
            }
        }
        if (differs)
            return sizes_error("output %d: shape %R is not %R (up to 1s)", k, shape, ns, want, nd);
        if (given[k]) {  // allocated in `shape`, its dims other than 1 laid out as the domain's
            int e = 0;
            for (Py_ssize_t i = 0; i < ns; ++i) {
                if (shape[i] == 1) {
                    placed[i] = 1;
                    continue;
                }
                while (dims[e] == 1) ++e;
                placed[i] = layouts[k][e++];
            }
            for (e = 0; e < nd; ++e) st[e] = layouts[k][e];
        } else {  // contiguous (the domain's product is the shape's, up to 1s)
            int64_t step = 1;
            int past = 0;
            for (Py_ssize_t i = ns - 1; i >= 0; --i) {
                placed[i] = step;
                past |= __builtin_mul_overflow(step, shape[i] > 1 ? shape[i] : 1, &step);
            }
            if (past) {
                PyErr_Format(PyExc_ValueError, "output %d: more than 2**63 elements", k);
                return -1;
            }
            step = 1;
            for (int e = nd - 1; e >= 0; --e) st[e] = step, step *= want[e] > 1 ? want[e] : 1;
        }
        if (reduced[k]) st[nd - 1] = 0;
        for (int e = 0; e < nd; ++e) self->tail[k * nd + e] = st[e];
        PyObject* parts[3] = {int_tuple(shape, ns), int_tuple(placed, ns),
                              PyTuple_GET_ITEM(out_dtypes, k)};
        Py_INCREF(parts[2]);
        for (int i = 0; i < 3; ++i) Py_XSETREF(self->alloc[k][i], parts[i]);
        if (parts[0] == NULL || parts[1] == NULL) return -1;
    }
    for (int e = 0; e < nd; ++e) self->tail[self->n_out * nd + e] = dims[e];
    return 0;
}

// The message of the VMError each call raises for rows the VM does not reduce, or NULL (with
// an error set only when making it failed).
static PyObject* rows_refused(const int64_t* dims, int nd, PyObject* max_row, const int* reduced,
                              int n_out) {
    if (max_row == Py_None) return NULL;
    long long most = PyLong_AsLongLong(max_row);
    if (most == -1 && PyErr_Occurred()) return NULL;
    const long long row = dims[nd - 1];
    if (row > most)
        return PyUnicode_FromFormat(
            "rows of %lld elements: the VM reduces rows of at most %lld (run this region "
            "eagerly)",
            row, most);
    int any_reduced = 0, empty = row == 0;
    for (int k = 0; k < n_out; ++k) any_reduced |= reduced[k];
    for (int d = 0; d < nd - 1; ++d) empty &= dims[d] != 0;
    if (empty && any_reduced)
        return PyUnicode_FromString(
            "rows of 0 elements: a row-reduced output has no value for an empty row (eager's sum "
            "gives 0, amax raises); run it eagerly");
    return NULL;
}

// The program's code (five int32 per instruction) and immediates (one float each), into a
// block of their size.
static int read_program(Launcher* self, PyObject* code, PyObject* imm) {
    PyObject *words = own_tuple(code, "code"), *floats = NULL;
    if (words == NULL) return -1;
    const Py_ssize_t n = PyTuple_GET_SIZE(words);
    int32_t* block = NULL;
    int failed = 1;
    if (n > MAX_INSTRS * 5) {
        PyErr_Format(PyExc_ValueError, "code: %zd entries, at most %d", n, MAX_INSTRS * 5);
        goto done;
    }
    block = PyMem_Malloc((size_t)n * sizeof(int32_t) + (size_t)(n / 5) * sizeof(float));
    if (block == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (int32s(words, "code", block) < 0) goto done;
    if (n % 5 != 0) {
        PyErr_SetString(PyExc_ValueError, "code: five int32 per instruction");
        goto done;
    }
    floats = own_tuple(imm, "imm");
    if (floats == NULL) goto done;
    if (PyTuple_GET_SIZE(floats) != n / 5) {
        PyErr_SetString(PyExc_ValueError, "imm: one float per instruction");
        goto done;
    }
    float* values = (float*)(block + n);
    for (Py_ssize_t i = 0; i < n / 5; ++i) {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(floats, i));
        if (v == -1.0 && PyErr_Occurred()) goto done;
        values[i] = (float)v;
    }
    PyMem_Free(self->code);  // a binding that failed may have left one
    self->code = block;
    self->imm = values;
    self->n_instr = (int32_t)(n / 5);
    block = NULL;
    failed = 0;
done:
    PyMem_Free(block);
    Py_DECREF(words);
    Py_XDECREF(floats);
    return failed ? -1 : 0;
}

// Each output's row-reduced flag.
static int read_reduced(PyObject* seq, Py_ssize_t n, int* reduced) {
    PyObject* own = own_tuple(seq, "reduced");
    if (own == NULL) return -1;
    int failed = PyTuple_GET_SIZE(own) != n;
    if (failed) PyErr_SetString(PyExc_ValueError, "reduced: one flag per output");
    for (Py_ssize_t k = 0; !failed && k < n; ++k)
        failed = (reduced[k] = PyObject_IsTrue(PyTuple_GET_ITEM(own, k))) < 0;
    Py_DECREF(own);
    return failed ? -1 : 0;
}

// Whether `p` is the dvm_run of a loaded shared library (a VM build): the address a launch
// calls, checked once (the last few found are remembered).
static int is_dvm_run(void* p) {
    static void* known[8];
    for (int i = 0; i < 8; ++i)
        if (known[i] == p) return 1;
    Dl_info info;
    if (dladdr(p, &info) == 0 || info.dli_saddr != p || info.dli_sname == NULL ||
        strcmp(info.dli_sname, "dvm_run") != 0)
        return 0;
    memmove(known + 1, known, sizeof known - sizeof known[0]);
    known[0] = p;
    return 1;
}

// The VM's code for the dtype of output k (out_dtypes a tuple) into *code: 0, or -1 with a
// TypeError where the VM does not store it.
static int out_code(PyObject* out_dtypes, Py_ssize_t k, int32_t* code) {
    PyObject* dtype = PyTuple_GET_ITEM(out_dtypes, k);
    PyObject* found = PyDict_GetItemWithError(g.dtype_codes, dtype);
    if (found == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError,
                         "output %zd has dtype %S; the VM takes %U: cast it first", k, dtype,
                         g.dtype_names);
        return -1;
    }
    long c = PyLong_AsLong(found);
    if (c == -1 && PyErr_Occurred()) return -1;
    *code = (int32_t)c;
    return 0;
}

// The binding (see launcher_init), while self->state is BINDING.
static int bind(Launcher* self, PyObject* address, PyObject* code, PyObject* imm, int n_regs,
                int n_in, PyObject* out_dtypes, PyObject* reduced_seq,
                PyObject* max_row, PyObject* domain, PyObject* targs, PyObject* operands,
                PyObject* out_shapes, PyObject* out_strides) {
    self->run = (RunFn)PyLong_AsVoidPtr(address);
    if (self->run == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run_address is null");
        return -1;
    }
    if (!is_dvm_run((void*)self->run)) {
        PyErr_Format(PyExc_ValueError,
                     "run_address %R is not the address of a loaded build's dvm_run (see "
                     "dvm._lib.run_address)", address);
        return -1;
    }
    if (read_program(self, code, imm) < 0) return -1;
    self->n_regs = n_regs;
    Py_ssize_t n = PyTuple_GET_SIZE(out_dtypes);
    if (n_in < 0 || n_in > MAX_INPUTS || n > MAX_OUTPUTS) {
        PyErr_Format(PyExc_ValueError, "n_in %d (at most %d), %zd out_dtypes (at most %d)", n_in,
                     MAX_INPUTS, n, MAX_OUTPUTS);
        return -1;
    }
    self->n_out = (int32_t)n;
    for (Py_ssize_t k = 0; k < n; ++k)  // the VM writes each output's dtype by its code
        if (out_code(out_dtypes, k, &self->out_codes[k]) < 0) return -1;
    self->n_in = n_in;
    int reduced[MAX_OUTPUTS];
    int64_t dims[MAX_ARG_DIMS];
    if (read_reduced(reduced_seq, n, reduced) < 0 || read_domain(self, domain, dims) < 0)
        return -1;
    int64_t sizes[MAX_INPUTS][MAX_ARG_DIMS];  // 8 KiB on the stack: not malloc's, cold in a compile
    PyObject *shapes = NULL, *dtypes = NULL, *ops = NULL, *own_shapes = NULL, *layouts_own = NULL,
             *refused;
    int64_t layouts[MAX_OUTPUTS][MAX_DIMS];
    int given[MAX_OUTPUTS] = {0};
    if (read_args(self, targs, sizes, &shapes, &dtypes) < 0) goto fail;
    ops = own_tuple(operands, "operands");
    if (ops == NULL) goto fail;
    own_shapes = out_shapes == Py_None ? Py_NewRef(Py_None) : own_tuple(out_shapes, "out_shapes");
    if (own_shapes == NULL) goto fail;
    Py_ssize_t n_shapes = out_shapes == Py_None ? self->n_out : PyTuple_GET_SIZE(own_shapes);
    if (PyTuple_GET_SIZE(ops) != n_in || n_shapes != self->n_out) {
        PyErr_Format(PyExc_ValueError,
                     "the program takes %d inputs and %d outputs, got %zd operands and %zd "
                     "output shapes",
                     n_in, self->n_out, PyTuple_GET_SIZE(ops), n_shapes);
        goto fail;
    }
    for (int32_t k = 0; k < n_in; ++k)
        if (read_operand(self, k, PyTuple_GET_ITEM(ops, k), dims, sizes, dtypes) < 0) goto fail;
    if (out_strides != Py_None) {
        layouts_own = own_tuple(out_strides, "out_strides");
        if (layouts_own == NULL) goto fail;
        if (PyTuple_GET_SIZE(layouts_own) != self->n_out) {
            PyErr_Format(PyExc_ValueError, "out_strides: give one entry per output (%d)",
                         self->n_out);
            goto fail;
        }
        for (int32_t k = 0; k < self->n_out; ++k)
            if (read_layout(self, k, PyTuple_GET_ITEM(layouts_own, k), dims, reduced[k],
                            layouts[k], &given[k]) < 0)
                goto fail;
    }
    if (read_outputs(self, own_shapes, out_dtypes, reduced, dims, layouts, given) < 0) goto fail;
    refused = rows_refused(dims, self->nd, max_row, reduced, self->n_out);
    if (refused == NULL && PyErr_Occurred()) goto fail;
    Py_XSETREF(self->refused, refused);
    Py_XSETREF(self->shapes, shapes);
    Py_XSETREF(self->dtypes, dtypes);
    Py_DECREF(ops);
    Py_DECREF(own_shapes);
    Py_XDECREF(layouts_own);
    return 0;
fail:
    Py_XDECREF(shapes);
    Py_XDECREF(dtypes);
    Py_XDECREF(ops);
    Py_XDECREF(own_shapes);
    Py_XDECREF(layouts_own);
    return -1;
}

// Launcher(run_address, code, imm, n_regs, n_in, out_dtypes, reduced, max_row,
//          domain, args, operands, out_shapes, out_strides): dvm.vm.Kernel.bind's binding,
// whose docstring says what the last five are (out_shapes None: the domain's); max_row is
// None for a program that does not reduce.
static int launcher_init(Launcher* self, PyObject* args, PyObject* kwds) {
    PyObject *address, *code, *imm, *out_dtypes, *reduced_seq, *max_row, *domain, *targs,
        *operands, *out_shapes, *out_strides;
    int n_regs, n_in;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) > 0) {
        PyErr_SetString(PyExc_TypeError, "Launcher takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOiiO!OOOOOOO", &address, &code, &imm, &n_regs, &n_in,
                          &PyTuple_Type, &out_dtypes, &reduced_seq, &max_row, &domain, &targs,
                          &operands, &out_shapes, &out_strides))
        return -1;
    if (g.tensor == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._launcher.setup() was not called");
        return -1;
    }
    if (self->state != FRESH) {
        PyErr_SetString(PyExc_TypeError, "a Launcher is initialised once");
        return -1;
    }
    self->state = BINDING;
    if (bind(self, address, code, imm, n_regs, n_in, out_dtypes, reduced_seq, max_row, domain,
             targs, operands, out_shapes, out_strides) < 0) {
        self->state = FRESH;
        return -1;
    }
    self->state = READY;
    return 0;
}

// 1 when `t`'s attribute `name` is `want`, 0 when not, -1 on error.
static int attr_is(PyObject* t, PyObject* name, PyObject* want) {
    PyObject* v = PyObject_GetAttr(t, name);
    if (v == NULL) return -1;
    int same = v == want;
    Py_DECREF(v);
    return same;
}

// The first arg that cannot run as bound: its index and kind, or -1 when all can (-2: error).
static int find_mismatch(Launcher* self, PyObject* fast, int grad, int* kind) {
    for (Py_ssize_t i = 0; i < self->n_args; ++i) {
        PyObject* t = PyTuple_GET_ITEM(fast, i);
        int r = PyObject_IsInstance(t, g.tensor);
        if (r <= 0) return r < 0 ? -2 : (*kind = NOT_TENSOR, (int)i);
        if (Py_TYPE(t) != (PyTypeObject*)g.tensor && Py_TYPE(t) != (PyTypeObject*)g.parameter)
            return (*kind = SUBCLASS, (int)i);
        PyObject* shape = PyObject_GetAttr(t, g.s_shape);
        if (shape == NULL) return -2;
        r = PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(self->shapes, i), Py_EQ);
        Py_DECREF(shape);
        if (r <= 0) return r < 0 ? -2 : (*kind = SHAPE, (int)i);
        r = attr_is(t, g.s_dtype, PyTuple_GET_ITEM(self->dtypes, i));
        if (r <= 0) return r < 0 ? -2 : (*kind = DTYPE, (int)i);
        r = attr_is(t, g.s_is_cpu, Py_True);
        if (r > 0) r = attr_is(t, g.s_layout, g.strided);
        if (r <= 0) return r < 0 ? -2 : (*kind = DEVICE, (int)i);
        PyObject* neg = PyObject_CallMethodNoArgs(t, g.s_is_neg);
        if (neg == NULL) return -2;
        r = neg == Py_False;
        Py_DECREF(neg);
        if (!r) return (*kind = NEGATED, (int)i);
        if (grad) {
            r = attr_is(t, g.s_requires_grad, Py_True);
            if (r != 0) return r < 0 ? -2 : (*kind = NEEDS_GRAD, (int)i);
        }
    }
    return -1;
}

// The args as a tuple of our own (a tuple given is taken as it is): code the call runs (a
// tensor subclass's attributes) or another thread while the VM runs may drop the caller's
// references, not these.
static PyObject* seq_of_args(Launcher* self, PyObject* args) {
    if (self->state != READY) {
        PyErr_SetString(PyExc_TypeError, "this Launcher was not initialised");
        return NULL;
    }
    PyObject* own = PySequence_Tuple(args);
    if (own == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "args must be a sequence of tensors, got %.100s",
                         Py_TYPE(args)->tp_name);
        }
        return NULL;
    }
    if (PyTuple_GET_SIZE(own) != self->n_args) {
        PyErr_Format(PyExc_ValueError, "bound for %zd args, got %zd", self->n_args,
                     PyTuple_GET_SIZE(own));
        Py_CLEAR(own);
    }
    return own;
}

static int read_ptr(PyObject* t, void** out) {
    PyObject* v = PyObject_CallMethodNoArgs(t, g.s_data_ptr);
    if (v == NULL) return -1;
    *out = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

// The outputs of one run on args already checked, or NULL with an exception set.
static PyObject* launch(Launcher* self, PyObject* fast, int threads) {
    if (self->refused != NULL) {  // a fresh error each call: a stored one would keep tracebacks
        PyErr_SetObject(g.error, self->refused);
        return NULL;
    }
    const int nd = self->nd;
    int64_t longs[(MAX_INPUTS + MAX_OUTPUTS) * MAX_DIMS + MAX_DIMS];
    const void* in_ptrs[MAX_INPUTS];
    void* out_ptrs[MAX_OUTPUTS];
    for (int32_t k = 0; k < self->n_in; ++k) {
        PyObject* t = PyTuple_GET_ITEM(fast, self->arg_of[k]);
        PyObject* strides = PyObject_CallMethodNoArgs(t, g.s_stride);
        if (strides == NULL) return NULL;
        if (!PyTuple_Check(strides) ||
            PyTuple_GET_SIZE(strides) != self->arg_ndim[self->arg_of[k]]) {
            Py_DECREF(strides);
            PyErr_SetString(PyExc_ValueError, "an arg's strides do not match its shape");
            return NULL;
        }
        for (int d = 0; d < nd; ++d) {
            const int32_t j = self->picks[k][d];
            longs[k * nd + d] = j < 0 ? 0 : PyLong_AsLongLong(PyTuple_GET_ITEM(strides, j));
        }
        Py_DECREF(strides);
        if (PyErr_Occurred()) return NULL;
        if (read_ptr(t, (void**)&in_ptrs[k]) < 0) return NULL;
    }
    PyObject* outs = PyList_New(self->n_out);
    if (outs == NULL) return NULL;
    for (int32_t k = 0; k < self->n_out; ++k) {
        PyObject* call[4] = {self->alloc[k][0], self->alloc[k][1], self->alloc[k][2], g.cpu};
        PyObject* out = PyObject_Vectorcall(g.empty_strided, call, 2, g.kwnames);
        if (out == NULL || (PyList_SET_ITEM(outs, k, out), read_ptr(out, &out_ptrs[k]) < 0)) {
            Py_DECREF(outs);
            return NULL;
        }
    }
    for (Py_ssize_t j = 0; j < (Py_ssize_t)(self->n_out + 1) * nd; ++j)
        longs[self->n_in * nd + j] = self->tail[j];
    if (threads < 1) {
        PyObject* v = PyObject_CallNoArgs(g.num_threads);
        if (v == NULL) {
            Py_DECREF(outs);
            return NULL;
        }
        long asked = PyLong_AsLong(v);
        Py_DECREF(v);
        if (asked == -1 && PyErr_Occurred()) {
            Py_DECREF(outs);
            return NULL;
        }
        threads = asked > INT32_MAX ? INT32_MAX : asked < 1 ? 1 : (int)asked;
    }
    int32_t status;
    const int64_t* out_strides = longs + self->n_in * nd;
    Py_BEGIN_ALLOW_THREADS
    status = self->run(self->code, self->imm, self->n_instr, self->n_regs, self->n_in, in_ptrs,
                       self->in_codes, longs, self->n_out, out_ptrs, self->out_codes,
                       out_strides, out_strides + self->n_out * nd, nd, threads);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyObject* key = PyLong_FromLong(status);
        PyObject* why = key == NULL ? NULL : PyDict_GetItemWithError(g.messages, key);
        Py_XDECREF(key);
        if (why != NULL)
            PyErr_Format(g.error, "dvm_run refused the call: %U", why);
        else if (!PyErr_Occurred())
            PyErr_Format(g.error, "dvm_run refused the call: status %d", (int)status);
        Py_DECREF(outs);
        return NULL;
    }
    return outs;
}

// torch function handling turned off where a TorchFunctionMode is on: the DisableTorchFunction
// entered, or None where no mode is on (a new reference), or NULL with an exception. While a
// call reads its args and runs the VM, a mode's code would otherwise see those reads and could
// misstate a plain tensor's shape, strides or data pointer to the VM (a subclass's own code
// does not run: find_mismatch refuses subclasses first).
static PyObject* tf_off(void) {
    PyObject* on = PyObject_CallNoArgs(g.tf_mode);
    if (on == NULL) return NULL;
    int mode = on == Py_True;
    Py_DECREF(on);
    if (!mode) return Py_NewRef(Py_None);
    PyObject* guard = PyObject_CallNoArgs(g.no_tf);
    PyObject* entered = guard != NULL ? PyObject_CallOneArg(g.no_tf_enter, guard) : NULL;
    if (entered == NULL) Py_CLEAR(guard);
    Py_XDECREF(entered);
    return guard;
}

// tf_off's guard exited (and released), an exception being raised kept: 0, or -1 with the exit's
// own exception (the one being raised dropped).
static int tf_on(PyObject* guard) {
    if (guard == Py_None) {
        Py_DECREF(guard);
        return 0;
    }
    PyObject* pending = take_raised();
    PyObject* argv[4] = {guard, Py_None, Py_None, Py_None};
    PyObject* exited = PyObject_Vectorcall(g.no_tf_exit, argv, 4, NULL);
    Py_DECREF(guard);
    if (exited == NULL) {
        Py_XDECREF(pending);
        return -1;
    }
    Py_DECREF(exited);
    raise_again(pending);
    return 0;
}

// With torch function handling off (tf_off): the first arg of `fast` that cannot run as bound
// (find_mismatch, grad mode counted where `grad`) in *at and its kind in *kind (*at -1 where
// all can), and where all can and `run` is set, the outputs of a launch over `threads`.
// NULL with *at -2 and an exception on an error; NULL otherwise where nothing ran.
static PyObject* checked(Launcher* self, PyObject* fast, int grad, int run, int threads, int* at,
                         int* kind) {
    PyObject* guard = tf_off();
    if (guard == NULL) {
        *at = -2;
        return NULL;
    }
    *at = find_mismatch(self, fast, grad, kind);
    PyObject* outs = *at == -1 && run ? launch(self, fast, threads) : NULL;
    if (*at == -1 && run && outs == NULL) *at = -2;  // the launch failed
    if (tf_on(guard) < 0) {
        Py_CLEAR(outs);
        *at = -2;
    }
    return outs;
}

static PyObject* launcher_mismatch(Launcher* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "mismatch(args, grad)");
        return NULL;
    }
    int grad = PyObject_IsTrue(args[1]);
    if (grad < 0) return NULL;
    PyObject* fast = seq_of_args(self, args[0]);
    if (fast == NULL) return NULL;
    int kind = 0, i;
    checked(self, fast, grad, 0, 0, &i, &kind);
    Py_DECREF(fast);
    if (i == -2) return NULL;
    if (i == -1) Py_RETURN_NONE;
    return Py_BuildValue("(ii)", i, kind);
}

static PyObject* launcher_run(Launcher* self, PyObject* const* args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "run(args, threads=0)");
        return NULL;
    }
    int threads = 0;
    if (n == 2) {
        int overflow = 0;
        long long asked = PyLong_AsLongLongAndOverflow(args[1], &overflow);
        if (asked == -1 && PyErr_Occurred()) return NULL;
        if (overflow) asked = overflow > 0 ? INT32_MAX : 0;
        threads = asked > INT32_MAX ? INT32_MAX : asked < 0 ? 0 : (int)asked;
    }
    PyObject* fast = seq_of_args(self, args[0]);
    if (fast == NULL) return NULL;
    int kind = 0, i;
    PyObject* outs = checked(self, fast, 0, 1, threads, &i, &kind);
    if (i >= 0)
        PyErr_Format(kind == NOT_TENSOR || kind == SUBCLASS ? PyExc_TypeError : PyExc_ValueError,
                     "arg %d does not match the launch: %s (calling the Launch says more)", i,
                     MISMATCH[kind]);
    Py_DECREF(fast);
    return outs;
}

// guarded(args, results): None when an arg cannot run as bound (grad mode counted), else the
// tuple of results, each output k as it is or viewed as `shape` for each (k, shape or None).
static PyObject* launcher_guarded(Launcher* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "guarded(args, results: tuple)");
        return NULL;
    }
    PyObject* fast = seq_of_args(self, args[0]);  // refuses a Launcher not initialised
    if (fast == NULL) return NULL;
    PyObject* grad_obj = PyObject_CallNoArgs(g.grad_enabled);
    if (grad_obj == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    int grad = grad_obj == Py_True;
    Py_DECREF(grad_obj);
    int kind = 0, i;
    PyObject* outs = checked(self, fast, grad, 1, 0, &i, &kind);
    Py_DECREF(fast);
    if (i == -2) return NULL;
    if (i >= 0) Py_RETURN_NONE;
    PyObject* spec = args[1];
    Py_ssize_t m = PyTuple_GET_SIZE(spec);
    PyObject* results = PyTuple_New(m);
    for (Py_ssize_t j = 0; results != NULL && j < m; ++j) {
        PyObject *entry = PyTuple_GET_ITEM(spec, j), *k_obj, *shape, *r;
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "results: (k, shape or None) pairs");
            Py_CLEAR(results);
            break;
        }
        k_obj = PyTuple_GET_ITEM(entry, 0);
        shape = PyTuple_GET_ITEM(entry, 1);
        Py_ssize_t k = PyLong_AsSsize_t(k_obj);
        if (k < 0 || k >= self->n_out) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "results: no such output");
            Py_CLEAR(results);
            break;
        }
        PyObject* out = PyList_GET_ITEM(outs, k);
        if (shape == Py_None) {
            Py_INCREF(out);
            r = out;
        } else {
            r = PyObject_CallMethodOneArg(out, g.s_view, shape);
        }
        if (r == NULL) {
            Py_CLEAR(results);
            break;
        }
        PyTuple_SET_ITEM(results, j, r);
    }
    Py_DECREF(outs);
    return results;
}

enum { GUARDED = 2 };  // launcher_methods' guarded, the method prepare() gives
static PyMethodDef launcher_methods[] = {
    {"mismatch", (PyCFunction)(void (*)(void))launcher_mismatch, METH_FASTCALL,
     "mismatch(args, grad) -> (arg, kind) | None: the first arg that cannot run as bound."},
    {"run", (PyCFunction)(void (*)(void))launcher_run, METH_FASTCALL,
     "run(args, threads=0) -> list of outputs (threads < 1: torch.get_num_threads())."},
    {"guarded", (PyCFunction)(void (*)(void))launcher_guarded, METH_FASTCALL,
     "guarded(args, results) -> tuple | None: run unless a guard fails (grad mode counted)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef launcher_members[] = {
    {"shapes", T_OBJECT, offsetof(Launcher, shapes), READONLY, "Each arg's shape, as bound."},
    {"dtypes", T_OBJECT, offsetof(Launcher, dtypes), READONLY, "Each arg's dtype, as bound."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LauncherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dvm._launcher.Launcher",
    .tp_basicsize = sizeof(Launcher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A VM program bound to one signature (dvm.vm.Kernel.bind makes it).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)launcher_init,
    .tp_dealloc = (destructor)launcher_dealloc,
    .tp_methods = launcher_methods,
    .tp_members = launcher_members,
};

// ---- A compiled region's launch, prepared from the region itself (dvm.compile.RegionRunner).

enum { REDUCES = 1, CASTS = 2 };

// The flag bit of each opcode in `ops` (ints 0-255) set in r.op_flags.
static int set_op_flags(PyObject* ops, unsigned char bit, const char* what) {
    PyObject* own = own_tuple(ops, what);
    if (own == NULL) return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(own); ++i) {
        long op = PyLong_AsLong(PyTuple_GET_ITEM(own, i));
        if (op == -1 && PyErr_Occurred()) {
            Py_DECREF(own);
            return -1;
        }
        if (op < 0 || op > 255) {
            PyErr_Format(PyExc_ValueError, "%s: opcode %ld is not 0-255", what, op);
            Py_DECREF(own);
            return -1;
        }
        r.op_flags[op] |= bit;
    }
    Py_DECREF(own);
    return 0;
}

// Whether an object of `type` has each of `names` where its instance dict holds it: the type's
// __getattribute__ is object's and no data descriptor of the type takes the name first.
static int dict_fields(PyTypeObject* type, PyObject* const* names, int n) {
    static PyObject* s_getattribute;
    if (s_getattribute == NULL &&
        (s_getattribute = PyUnicode_InternFromString("__getattribute__")) == NULL)
        return -1;
    if (type->tp_dictoffset == 0 ||
        _PyType_Lookup(type, s_getattribute) != _PyType_Lookup(&PyBaseObject_Type, s_getattribute))
        return 0;
    for (int i = 0; i < n; ++i) {
        PyObject* d = _PyType_Lookup(type, names[i]);
        if (d != NULL && Py_TYPE(d)->tp_descr_set != NULL) return 0;
    }
    return 1;
}

enum { R_PROGRAM, R_OUT_DTYPES, R_REDUCED, R_DOMAIN, R_INPUT_NODES, R_INPUT_VIEWS, R_OUTPUTS,
       R_OUTPUT_SLOTS, R_FIELDS };

// The types of `types` (torch.fx.Node, FakeTensor, dvm.cluster.Region, dvm.program.Program)
// resolved into r; None: none read directly. 0, or -1 with an exception (r unchanged).
static int resolve_types(PyObject* types) {
    PyTypeObject* t[4] = {NULL};
    if (types != Py_None &&
        !PyArg_ParseTuple(types, "O!O!O!O!;types: (Node, FakeTensor, Region, Program)",
                          &PyType_Type, &t[0], &PyType_Type, &t[1], &PyType_Type, &t[2],
                          &PyType_Type, &t[3]))
        return -1;
    PyObject* const region_names[R_FIELDS] = {r.s_program,     r.s_out_dtypes,  r.s_reduced,
                                              r.s_domain,      r.s_input_nodes, r.s_input_views,
                                              r.s_outputs,     r.s_output_slots};
    PyObject* const program_names[] = {r.s_encoded, r.s_n_regs, r.s_n_inputs, r.s_n_outputs};
    int region_direct = t[2] != NULL ? dict_fields(t[2], region_names, R_FIELDS) : 0;
    int program_direct = t[3] != NULL ? dict_fields(t[3], program_names, 4) : 0;
    if (region_direct < 0 || program_direct < 0) return -1;
    r.meta_at = t[0] != NULL ? member_at(t[0], r.s_meta) : 0;
    r.get_shape = t[1] != NULL ? getter_of(t[1], g.s_shape) : NULL;
    r.get_dtype = t[1] != NULL ? getter_of(t[1], g.s_dtype) : NULL;
    Py_XSETREF(r.stride, Py_XNewRef(t[1] != NULL ? method_of(t[1], g.s_stride) : NULL));
    PyTypeObject* kept[4] = {r.meta_at ? t[0] : NULL, t[1], region_direct ? t[2] : NULL,
                             program_direct ? t[3] : NULL};
    PyTypeObject** slots[4] = {&r.node_type, &r.fake, &r.region_type, &r.program_type};
    for (int i = 0; i < 4; ++i) Py_XSETREF(*slots[i], (PyTypeObject*)Py_XNewRef(kept[i]));
    return 0;
}

// setup_regions(run_address, max_row, reductions, casts, without_redundant_casts, types=None):
// the build prepare() binds for (its dvm_run's address and longest reduced row), the reducing
// and the rounding opcodes, the rewrite a program with a rounding opcode goes through, and
// (torch.fx.Node, FakeTensor, Region, Program), whose objects prepare() reads directly.
static PyObject* setup_regions(PyObject* module, PyObject* args) {
    PyObject *address, *max_row, *reductions, *casts, *rewrite, *types = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!OOO|O", &PyLong_Type, &address, &PyLong_Type, &max_row,
                          &reductions, &casts, &rewrite, &types))
        return NULL;
    if (PyLong_AsVoidPtr(address) == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run_address is null");
        return NULL;
    }
    if (!PyCallable_Check(rewrite)) {
        PyErr_SetString(PyExc_TypeError, "without_redundant_casts must be callable");
        return NULL;
    }
    if (types != Py_None && !PyTuple_Check(types)) {
        PyErr_Format(PyExc_TypeError, "types: give a tuple or None, got %.100s",
                     Py_TYPE(types)->tp_name);
        return NULL;
    }
    unsigned char kept[256];
    memcpy(kept, r.op_flags, sizeof kept);
    memset(r.op_flags, 0, sizeof r.op_flags);
    if (set_op_flags(reductions, REDUCES, "reductions") < 0 ||
        set_op_flags(casts, CASTS, "casts") < 0 || resolve_types(types) < 0) {
        memcpy(r.op_flags, kept, sizeof kept);
        return NULL;
    }
    Py_INCREF(address);
    Py_XSETREF(r.address, address);
    Py_INCREF(max_row);
    Py_XSETREF(r.max_row, max_row);
    Py_INCREF(rewrite);
    Py_XSETREF(r.rewrite, rewrite);
    Py_RETURN_NONE;
}

// obj.<name> (a new reference): from `attrs`, obj's instance dict, where that holds it (the
// caller gives it only where setup_regions found the type's fields read so), else by name.
static PyObject* attr_of(PyObject* obj, PyObject* attrs, PyObject* name) {
    PyObject* v = attrs != NULL ? PyDict_GetItemWithError(attrs, name) : NULL;
    if (v != NULL) return Py_NewRef(v);
    return PyErr_Occurred() ? NULL : PyObject_GetAttr(obj, name);
}

// obj's instance dict (a new reference) where obj is exactly `type` (setup_regions' NULL where
// none is); else NULL, with an exception only when reading it failed.
static PyObject* attrs_of(PyObject* obj, PyTypeObject* type) {
    return type != NULL && Py_TYPE(obj) == type ? PyObject_GenericGetDict(obj, NULL) : NULL;
}

// `node`.meta["val"] (a new reference), or NULL with an error naming the node; a Node's meta
// read from its field.
static PyObject* traced_val(PyObject* node) {
    PyObject* meta = r.node_type != NULL && Py_TYPE(node) == r.node_type
                         ? *(PyObject**)((char*)node + r.meta_at)
                         : NULL;
    meta = meta != NULL ? Py_NewRef(meta) : PyObject_GetAttr(node, r.s_meta);
    if (meta == NULL) return NULL;
    PyObject* val = PyObject_GetItem(meta, r.s_val);
    Py_DECREF(meta);
    if (val == NULL && PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "node %S has no traced value (meta['val'])", node);
    }
    return val;
}

// The sizes of the tuple `t` (a shape or strides, at most MAX_ARG_DIMS) into out; -1 on error.
static int tuple_sizes(PyObject* t, const char* what, int64_t* out, Py_ssize_t* n) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) > MAX_ARG_DIMS) {
        PyErr_Format(PyExc_TypeError, "an output's %s: give a tuple of at most %d ints, got %R",
                     what, MAX_ARG_DIMS, t);
        return -1;
    }
    *n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < *n; ++i) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

// Whether sizes/strides are torch's contiguous layout (size-1 dims skipped; no elements is).
static int contiguous(const int64_t* size, const int64_t* stride, Py_ssize_t n) {
    int64_t expect = 1;
    for (Py_ssize_t d = 0; d < n; ++d)
        if (size[d] == 0) return 1;
    for (Py_ssize_t d = n - 1; d >= 0; --d) {
        if (size[d] == 1) continue;
        if (stride[d] != expect) return 0;
        if (__builtin_mul_overflow(expect, size[d], &expect)) return 0;
    }
    return 1;
}

// Whether sizes/strides cover their memory once without gaps: the dims of size above 1,
// ordered by stride, are contiguous (as dvm.compile._dense, which the reference executor uses).
static int dense(const int64_t* size, const int64_t* stride, Py_ssize_t n) {
    int64_t numel = 1;
    int big = 0;
    for (Py_ssize_t d = 0; d < n; ++d) big |= __builtin_mul_overflow(numel, size[d], &numel);
    if (!big && numel < 2) return 1;
    int order[MAX_ARG_DIMS];  // dims by stride, ties in dim order
    for (Py_ssize_t d = 0; d < n; ++d) {
        Py_ssize_t j = d;
        while (j > 0 && stride[order[j - 1]] > stride[d]) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = (int)d;
    }
    int64_t expect = 1;
    for (Py_ssize_t j = 0; j < n; ++j) {
        const int d = order[j];
        if (size[d] == 1) continue;
        if (stride[d] != expect || __builtin_mul_overflow(expect, size[d], &expect)) return 0;
    }
    return 1;
}

// An output's strides over the domain when its shape is the domain's up to size-1 dims (those
// take stride 0; all its strides when its shape is the domain), as a new tuple; None (a new
// reference) when it is not.
static PyObject* over_domain(const int64_t* size, const int64_t* stride, Py_ssize_t n,
                             const int64_t* dims, Py_ssize_t nd) {
    int same = n == nd;
    for (Py_ssize_t d = 0; same && d < n; ++d) same = size[d] == dims[d];
    if (same) return int_tuple(stride, n);
    int64_t st[MAX_DIMS];
    Py_ssize_t j = 0;
    for (Py_ssize_t d = 0; d < nd; ++d) {
        if (dims[d] == 1) {
            st[d] = 0;
            continue;
        }
        while (j < n && size[j] == 1) ++j;
        if (j >= n || size[j] != dims[d]) Py_RETURN_NONE;
        st[d] = stride[j++];
    }
    while (j < n && size[j] == 1) ++j;
    if (j < n) Py_RETURN_NONE;
    return int_tuple(st, nd);
}

// Output k's layout from one graph output holding it, whose traced value is `val` of `shape`
// (a FakeTensor's strides read through its stride method, only for an output not reduced),
// into *layout (replaced when this output decides it): strides over the domain where the value
// is laid out densely but otherwise than contiguously and its shape is the domain's up to
// size-1 dims; None where it is dense and non-contiguous in another shape. An expanded value
// (a stride 0) is not dense: it is stored contiguous (dvm.compile.RegionRunner says why).
static int output_layout(PyObject* val, PyObject* shape, int reduced, const int64_t* dims,
                         Py_ssize_t nd, PyObject** layout) {
    int64_t size[MAX_ARG_DIMS], stride[MAX_ARG_DIMS];
    Py_ssize_t n, ns;
    if (tuple_sizes(shape, "shape", size, &n) < 0) return -1;
    if (reduced) return 0;
    PyObject* strides = r.stride != NULL && Py_TYPE(val) == r.fake
                            ? PyObject_Vectorcall(r.stride, &val, 1, NULL)
                            : PyObject_CallMethodNoArgs(val, g.s_stride);
    if (strides == NULL) return -1;
    int failed = tuple_sizes(strides, "strides", stride, &ns) < 0;
    if (!failed && ns != n) {
        PyErr_Format(PyExc_ValueError, "an output's strides %R do not match its shape %R",
                     strides, shape);
        failed = 1;
    }
    Py_DECREF(strides);
    if (failed) return -1;
    if (contiguous(size, stride, n) || !dense(size, stride, n)) return 0;
    PyObject* found = over_domain(size, stride, n, dims, nd);
    if (found == NULL) return -1;
    Py_XSETREF(*layout, found);
    return 0;
}

// program.encode(): the form a built program (dvm.program.Program.built) keeps in its
// `_encoded` (in `attrs`, its instance dict, or NULL) read as it is, without the Python call,
// a new reference.
static PyObject* encoded_form(PyObject* program, PyObject* attrs) {
    PyObject* kept = attrs == NULL ? NULL : PyDict_GetItemWithError(attrs, r.s_encoded);
    if (kept != NULL || PyErr_Occurred()) return Py_XNewRef(kept);
    return PyObject_CallMethodNoArgs(program, r.s_encode);
}

// The region's program encoded, its rounding casts into outputs of their dtype dropped
// (dvm.vm.without_redundant_casts, asked only when the program rounds): (code, imm) in *code
// and *imm (new references), its REDUCES flag in *reduces; `rewrite` is that function, `attrs`
// the program's instance dict or NULL.
static int encode_program(PyObject* program, PyObject* attrs, PyObject* out_dtypes,
                          PyObject* rewrite, PyObject** code, PyObject** imm, int* reduces) {
    PyObject* encoded = encoded_form(program, attrs);
    for (int pass = 0; encoded != NULL; ++pass) {
        if (!PyTuple_Check(encoded) || PyTuple_GET_SIZE(encoded) != 2) {
            PyErr_Format(PyExc_TypeError, "program.encode() gave %R, not (code, imm)", encoded);
            break;
        }
        PyObject* fast = PySequence_Fast(PyTuple_GET_ITEM(encoded, 0), "code: give a sequence");
        if (fast == NULL) break;
        unsigned char flags = 0;
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
        for (Py_ssize_t k = 0; k < n; k += 5) {
            long op = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, k));
            if (op == -1 && PyErr_Occurred()) break;
            if (op >= 0 && op < 256) flags |= r.op_flags[op];
        }
        Py_DECREF(fast);
        if (PyErr_Occurred()) break;
        if (pass > 0 || !(flags & CASTS)) {
            *reduces = flags & REDUCES;
            *code = Py_NewRef(PyTuple_GET_ITEM(encoded, 0));
            *imm = Py_NewRef(PyTuple_GET_ITEM(encoded, 1));
            Py_DECREF(encoded);
            return 0;
        }
        Py_DECREF(encoded);
        PyObject* kept = PyObject_CallFunctionObjArgs(rewrite, program, out_dtypes, NULL);
        encoded = kept == NULL ? NULL : PyObject_CallMethodNoArgs(kept, r.s_encode);
        Py_XDECREF(kept);
    }
    Py_XDECREF(encoded);
    return -1;
}

// An int attribute of `obj` (`attrs`: attr_of's) into *out, in int32's range.
static int int_attr(PyObject* obj, PyObject* attrs, PyObject* name, int* out) {
    PyObject* v = attr_of(obj, attrs, name);
    if (v == NULL) return -1;
    long x = PyLong_AsLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < INT32_MIN || x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "program.%U = %ld is not an int32", name, x);
        return -1;
    }
    *out = (int)x;
    return 0;
}

// prepare(region) -> (guarded, inputs, results): a dvm.cluster.Region's launch bound in one
// call, dvm.compile.RegionRunner's preparation: its program encoded for the build setup_regions
// named (dvm.vm.Kernel's work), bound (Kernel.bind's) for its distinct inputs' traced values
// (`inputs`, the graph nodes in first-read order), each operand the input's position with its
// view, each output allocated in the shape of the first graph output that holds it and laid
// out as that one's traced value where it is dense but not contiguous (over the domain). Gives
// the launch's guarded method and the results it takes: (output, shape or None) for each graph
// output, a later graph output of one VM output being a view of it in its own shape.
static PyObject* prepare(PyObject* module, PyObject* region) {
    if (g.tensor == NULL || r.address == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "dvm._launcher.setup() and setup_regions() must be called first");
        return NULL;
    }
    // the build's facts held for the call: code it runs may call setup_regions again
    PyObject *address = Py_NewRef(r.address), *max_row = Py_NewRef(r.max_row),
             *rewrite = Py_NewRef(r.rewrite);
    PyObject* const names[R_FIELDS] = {r.s_program,     r.s_out_dtypes,  r.s_reduced,
                                       r.s_domain,      r.s_input_nodes, r.s_input_views,
                                       r.s_outputs,     r.s_output_slots};
    static const char* const what[R_FIELDS] = {"program", "out_dtypes",  "reduced",
                                               "domain",  "input_nodes", "input_views",
                                               "outputs", "output_slots"};
    PyObject* f[R_FIELDS] = {NULL};  // the region's fields, the sequences as tuples of our own
    PyObject *attrs = NULL, *code = NULL, *imm = NULL, *out_dtypes = NULL,
             *position = NULL, *inputs = NULL, *vals = NULL, *operands = NULL, *results = NULL,
             *out_shapes = NULL, *out_strides = NULL, *guarded = NULL, *answer = NULL;
    PyObject *firsts[MAX_OUTPUTS] = {NULL}, *layouts[MAX_OUTPUTS] = {NULL};
    Launcher* launcher = NULL;
    int n_regs, n_in, n_out, reduces = 0, reduced[MAX_OUTPUTS];
    int64_t dims[MAX_ARG_DIMS];
    attrs = attrs_of(region, r.region_type);
    if (attrs == NULL && PyErr_Occurred()) goto done;
    for (int i = 0; i < R_FIELDS; ++i) {
        PyObject* v = attr_of(region, attrs, names[i]);
        if (v == NULL) goto done;
        if (i == R_PROGRAM || i == R_DOMAIN) {
            f[i] = v;
        } else {
            f[i] = own_tuple(v, what[i]);
            Py_DECREF(v);
            if (f[i] == NULL) goto done;
        }
    }
    PyObject* program = f[R_PROGRAM];
    Py_XSETREF(attrs, attrs_of(program, r.program_type));
    if ((attrs == NULL && PyErr_Occurred()) || int_attr(program, attrs, r.s_n_regs, &n_regs) < 0 ||
        int_attr(program, attrs, r.s_n_inputs, &n_in) < 0 ||
        int_attr(program, attrs, r.s_n_outputs, &n_out) < 0)
        goto done;
    out_dtypes = Py_NewRef(f[R_OUT_DTYPES]);
    if (n_out < 1 || n_out > MAX_OUTPUTS) {
        PyErr_Format(PyExc_ValueError, "the program has %d outputs (1 to %d)", n_out,
                     MAX_OUTPUTS);
        goto done;
    }
    if (PyTuple_GET_SIZE(out_dtypes) != n_out ||
        PyTuple_GET_SIZE(f[R_REDUCED]) != n_out) {
        PyErr_Format(PyExc_ValueError,
                     "the program has %d outputs: give %d out_dtypes and reduced flags (got %zd "
                     "and %zd)",
                     n_out, n_out, PyTuple_GET_SIZE(out_dtypes), PyTuple_GET_SIZE(f[R_REDUCED]));
        goto done;
    }
    if (read_reduced(f[R_REDUCED], n_out, reduced) < 0) goto done;
    for (int k = 0; k < n_out; ++k) {  // before encoding, which reads them too
        int32_t unused;
        if (out_code(out_dtypes, k, &unused) < 0) goto done;
    }
    if (encode_program(program, attrs, out_dtypes, rewrite, &code, &imm, &reduces) < 0)
        goto done;
    launcher = (Launcher*)PyType_GenericNew(&LauncherType, NULL, NULL);
    if (launcher == NULL || read_domain(launcher, f[R_DOMAIN], dims) < 0) goto done;
    // the distinct inputs in first-read order, each operand their position with its view
    PyObject *nodes = f[R_INPUT_NODES], *views = f[R_INPUT_VIEWS];
    const Py_ssize_t n_ops = PyTuple_GET_SIZE(nodes);
    if (PyTuple_GET_SIZE(views) != n_ops) {
        PyErr_Format(PyExc_ValueError, "the region has %zd input nodes and %zd input views",
                     n_ops, PyTuple_GET_SIZE(views));
        goto done;
    }
    position = PyDict_New();
    inputs = PyList_New(0);
    operands = PyTuple_New(n_ops);
    if (position == NULL || inputs == NULL || operands == NULL) goto done;
    for (Py_ssize_t k = 0; k < n_ops; ++k) {
        PyObject* node = PyTuple_GET_ITEM(nodes, k);
        PyObject* at = PyDict_GetItemWithError(position, node);
        if (at == NULL) {
            if (PyErr_Occurred()) goto done;
            PyObject* fresh = PyLong_FromSsize_t(PyList_GET_SIZE(inputs));
            int failed = fresh == NULL || PyDict_SetItem(position, node, fresh) < 0 ||
                         PyList_Append(inputs, node) < 0;
            Py_XDECREF(fresh);  // the dict holds it
            if (failed) goto done;
            at = fresh;
        }
        PyObject* pair = PyTuple_Pack(2, at, PyTuple_GET_ITEM(views, k));
        if (pair == NULL) goto done;
        PyTuple_SET_ITEM(operands, k, pair);
    }
    vals = PyTuple_New(PyList_GET_SIZE(inputs));
    for (Py_ssize_t i = 0; vals != NULL && i < PyList_GET_SIZE(inputs); ++i) {
        PyObject* val = traced_val(PyList_GET_ITEM(inputs, i));
        if (val == NULL) goto done;
        PyTuple_SET_ITEM(vals, i, val);
    }
    if (vals == NULL) goto done;
    // each graph output: its VM output, and the shape of the view it is of that output
    PyObject *outputs = f[R_OUTPUTS], *slots = f[R_OUTPUT_SLOTS];
    const Py_ssize_t n_res = PyTuple_GET_SIZE(outputs);
    if (PyTuple_GET_SIZE(slots) != n_res) {
        PyErr_Format(PyExc_ValueError, "the region has %zd outputs and %zd output slots", n_res,
                     PyTuple_GET_SIZE(slots));
        goto done;
    }
    results = PyTuple_New(n_res);
    if (results == NULL) goto done;
    for (Py_ssize_t j = 0; j < n_res; ++j) {
        PyObject* slot = PyTuple_GET_ITEM(slots, j);
        Py_ssize_t k = PyNumber_AsSsize_t(slot, PyExc_IndexError);
        if (k == -1 && PyErr_Occurred()) goto done;
        if (k < 0 || k >= n_out) {
            PyErr_Format(PyExc_ValueError, "output slot %zd of a program with %d outputs", k,
                         n_out);
            goto done;
        }
        PyObject* val = traced_val(PyTuple_GET_ITEM(outputs, j));
        PyObject* shape = val == NULL ? NULL : tensor_attr(val, r.get_shape, g.s_shape);
        int failed = shape == NULL ||
                     output_layout(val, shape, reduced[k], dims, launcher->nd, &layouts[k]) < 0;
        Py_XDECREF(val);
        PyObject* pair = NULL;
        if (!failed) {
            pair = PyTuple_Pack(2, slot, firsts[k] == NULL ? Py_None : shape);
            if (firsts[k] == NULL) firsts[k] = Py_NewRef(shape);
        }
        Py_XDECREF(shape);
        if (pair == NULL) goto done;
        PyTuple_SET_ITEM(results, j, pair);
    }
    out_shapes = PyTuple_New(n_out);
    if (out_shapes == NULL) goto done;
    int laid_out = 0;
    for (int k = 0; k < n_out; ++k) {
        if (firsts[k] == NULL) {
            PyErr_Format(PyExc_ValueError, "no graph output holds the region's output %d", k);
            goto done;
        }
        PyTuple_SET_ITEM(out_shapes, k, Py_NewRef(firsts[k]));
        laid_out |= layouts[k] != NULL && layouts[k] != Py_None;
    }
    out_strides = laid_out ? PyTuple_New(n_out) : Py_NewRef(Py_None);
    for (int k = 0; laid_out && out_strides != NULL && k < n_out; ++k)
        PyTuple_SET_ITEM(out_strides, k, Py_NewRef(layouts[k] ? layouts[k] : Py_None));
    if (out_strides == NULL) goto done;
    launcher->state = BINDING;
    if (bind(launcher, address, code, imm, n_regs, n_in, out_dtypes, f[R_REDUCED],
             reduces ? max_row : Py_None, f[R_DOMAIN], vals, operands, out_shapes,
             out_strides) < 0)
        goto done;
    launcher->state = READY;
    guarded = PyCFunction_New(&launcher_methods[GUARDED], (PyObject*)launcher);
    if (guarded != NULL) answer = PyTuple_Pack(3, guarded, inputs, results);
done:
    Py_XDECREF(attrs);
    for (int i = 0; i < R_FIELDS; ++i) Py_XDECREF(f[i]);
    for (int k = 0; k < MAX_OUTPUTS; ++k) {
        Py_XDECREF(firsts[k]);
        Py_XDECREF(layouts[k]);
    }
    Py_XDECREF(code);
    Py_XDECREF(imm);
    Py_XDECREF(out_dtypes);
    Py_XDECREF(position);
    Py_XDECREF(inputs);
    Py_XDECREF(vals);
    Py_XDECREF(operands);
    Py_XDECREF(results);
    Py_XDECREF(out_shapes);
    Py_XDECREF(out_strides);
    Py_XDECREF(guarded);
    Py_XDECREF(launcher);
    Py_DECREF(address);
    Py_DECREF(max_row);
    Py_DECREF(rewrite);
    return answer;
}

// setup(tensor_type, parameter_type, empty_strided, cpu, get_num_threads, is_grad_enabled,
//       strided, error, messages, dtype_codes, dtype_names, is_torch_function_mode_enabled,
//       DisableTorchFunction): the torch objects calls use, VMError with its status messages,
//       the VM's dtype codes (a dict) with their names for errors, and what turns torch
//       function handling off while a call runs (checked()).
static PyObject* setup(PyObject* module, PyObject* args) {
    PyObject* got[13];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOO!O!UOO!", &PyType_Type, &got[0], &PyType_Type,
                          &got[1], &got[2], &got[3], &got[4], &got[5], &got[6], &got[7],
                          &PyDict_Type, &got[8], &PyDict_Type, &got[9], &got[10], &got[11],
                          &PyType_Type, &got[12]))
        return NULL;
    PyObject* enter = PyObject_GetAttrString(got[12], "__enter__");
    PyObject* exit = enter != NULL ? PyObject_GetAttrString(got[12], "__exit__") : NULL;
    if (exit == NULL) {
        Py_XDECREF(enter);
        return NULL;
    }
    Py_XSETREF(g.no_tf_enter, enter);
    Py_XSETREF(g.no_tf_exit, exit);
    PyObject** slots[13] = {&g.tensor,      &g.parameter,    &g.empty_strided, &g.cpu,
                            &g.num_threads, &g.grad_enabled, &g.strided,       &g.error,
                            &g.messages,    &g.dtype_codes,  &g.dtype_names,   &g.tf_mode,
                            &g.no_tf};
    for (int i = 0; i < 13; ++i) {
        Py_INCREF(got[i]);
        Py_XSETREF(*slots[i], got[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "Hand the module the torch objects its calls use."},
    {"setup_regions", setup_regions, METH_VARARGS,
     "setup_regions(run_address, max_row, reductions, casts, without_redundant_casts): the "
     "build and program facts prepare() uses."},
    {"prepare", prepare, METH_O,
     "prepare(region) -> (guarded, inputs, results): a dvm.cluster.Region's launch, bound."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._launcher", "Bound launches of VM programs.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__launcher(void) {
    Name names[] = {{&g.s_shape, "shape"},         {&g.s_dtype, "dtype"},
                 {&g.s_is_cpu, "is_cpu"},       {&g.s_layout, "layout"},
                 {&g.s_is_neg, "is_neg"},       {&g.s_requires_grad, "requires_grad"},
                 {&g.s_stride, "stride"},       {&g.s_data_ptr, "data_ptr"},
                 {&g.s_view, "view"},           {&r.s_program, "program"},
                 {&r.s_out_dtypes, "out_dtypes"}, {&r.s_reduced, "reduced"},
                 {&r.s_domain, "domain"},       {&r.s_input_nodes, "input_nodes"},
                 {&r.s_input_views, "input_views"}, {&r.s_outputs, "outputs"},
                 {&r.s_output_slots, "output_slots"}, {&r.s_encode, "encode"},
                 {&r.s_encoded, "_encoded"},
                 {&r.s_n_regs, "n_regs"},       {&r.s_n_inputs, "n_inputs"},
                 {&r.s_n_outputs, "n_outputs"}, {&r.s_meta, "meta"},
                 {&r.s_val, "val"}};
    if (INTERN_NAMES(names) < 0) return NULL;
    if ((g.kwnames = Py_BuildValue("(ss)", "dtype", "device")) == NULL) return NULL;
    if (PyType_Ready(&LauncherType) < 0) return NULL;
    PyObject* m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    PyObject* kinds = PyTuple_New(sizeof MISMATCH / sizeof MISMATCH[0]);
    for (Py_ssize_t i = 0; kinds != NULL && i < PyTuple_GET_SIZE(kinds); ++i) {
        PyObject* name = PyUnicode_FromString(MISMATCH[i]);
        if (name == NULL) Py_CLEAR(kinds);
        else PyTuple_SET_ITEM(kinds, i, name);
    }
    if (kinds == NULL || PyModule_AddObject(m, "MISMATCH", kinds) < 0) {
        Py_XDECREF(kinds);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LauncherType);
    if (PyModule_AddObject(m, "Launcher", (PyObject*)&LauncherType) < 0) {
        Py_DECREF(&LauncherType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
