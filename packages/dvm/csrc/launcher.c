// dvm._launcher: a bound launch of a VM program as a CPython object (dvm.vm.Launch's calls).
//
// A call checks its args against the signature the launch was bound for, reads their strides
// and data pointers, allocates the outputs with torch.empty_strided and calls dvm_run (the
// ISA build's, by address) with the GIL released: the work of dvm.vm's former Python call
// path and its ctypes call, without either. No torch headers: torch is reached through the
// Python objects dvm.vm hands to setup().
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

// The VM's limits (csrc/vm.h): a launch over more is refused when it is made.
enum { MAX_DIMS = 6, MAX_INPUTS = 16, MAX_OUTPUTS = 8, MAX_INSTRS = 256 };

typedef int32_t (*RunFn)(const int32_t*, const float*, int32_t, int32_t, int32_t,
                         const void* const*, const int32_t*, const int64_t*, int32_t,
                         void* const*, const int32_t*, const int64_t*, const int64_t*, int32_t,
                         int32_t);

// Mismatch kinds: indices into MISMATCH (the module's MISMATCH, which dvm.vm uses).
enum { NOT_TENSOR = 0, SHAPE = 1, DTYPE = 2, DEVICE = 3, NEGATED = 4, NEEDS_GRAD = 5 };
static const char* const MISMATCH[] = {"not a tensor", "shape", "dtype",
                                       "device",       "negated", "needs grad"};

static struct {
    PyObject *tensor, *empty_strided, *cpu, *num_threads, *grad_enabled, *strided, *error;
    PyObject *messages, *kwnames;
    PyObject *s_shape, *s_dtype, *s_is_cpu, *s_layout, *s_is_neg, *s_requires_grad, *s_stride,
        *s_data_ptr, *s_view;
} g;

typedef struct {
    PyObject_HEAD
    RunFn run;
    int32_t code[MAX_INSTRS * 5];
    float imm[MAX_INSTRS];
    int32_t n_instr, n_regs, n_in, n_out, nd;
    int32_t in_codes[MAX_INPUTS], out_codes[MAX_OUTPUTS];
    Py_ssize_t n_args;
    Py_ssize_t arg_of[MAX_INPUTS];     // operand k reads arg arg_of[k]
    int32_t picks[MAX_INPUTS][MAX_DIMS];  // the arg's dim giving each domain dim its stride, -1: 0
    int32_t arg_ndim[MAX_INPUTS];         // each arg's number of dims, as bound
    PyObject* alloc[MAX_OUTPUTS][3];      // (shape, strides, dtype) of each output
    int64_t tail[MAX_OUTPUTS * MAX_DIMS + MAX_DIMS];  // output strides, then the domain
    PyObject* shapes;                     // tuple: each arg's shape, as bound
    PyObject* dtypes;                     // tuple: each arg's dtype
    PyObject* refused;                    // the message of the VMError every call raises, or NULL
} Launcher;

static int fill_ints(PyObject* seq, const char* what, Py_ssize_t max, int64_t* out,
                     Py_ssize_t* n) {
    PyObject* fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    if (*n > max) {
        PyErr_Format(PyExc_ValueError, "%s: %zd entries, at most %zd", what, *n, max);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; ++i) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int fill_int32(PyObject* seq, const char* what, Py_ssize_t max, int32_t* out,
                      Py_ssize_t* n) {
    int64_t wide[MAX_INSTRS * 5];
    if (fill_ints(seq, what, max, wide, n) < 0) return -1;
    for (Py_ssize_t i = 0; i < *n; ++i) {
        if (wide[i] < INT32_MIN || wide[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: %lld is not an int32", what, (long long)wide[i]);
            return -1;
        }
        out[i] = (int32_t)wide[i];
    }
    return 0;
}

static void launcher_dealloc(Launcher* self) {
    for (int k = 0; k < MAX_OUTPUTS; ++k)
        for (int j = 0; j < 3; ++j) Py_XDECREF(self->alloc[k][j]);
    Py_XDECREF(self->shapes);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->refused);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

// `seq` as a fast sequence of `n` tuples, or NULL with an error naming `what`, each entry's
// `form` and what there is one `per`.
static PyObject* tuples(PyObject* seq, Py_ssize_t n, const char* what, const char* form,
                        const char* per) {
    PyObject* fast = PySequence_Fast(seq, what);
    if (fast == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: one %s tuple per %s", what, form, per);
        Py_DECREF(fast);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
        if (!PyTuple_Check(PySequence_Fast_GET_ITEM(fast, k))) {
            PyErr_Format(PyExc_TypeError, "%s: each an %s tuple", what, form);
            Py_DECREF(fast);
            return NULL;
        }
    }
    return fast;
}

// Each operand's arg and the arg's dim giving each of the nd domain dims its stride.
static int read_operands(Launcher* self, PyObject* operands, int nd) {
    PyObject* fast = tuples(operands, self->n_in, "operands", "(arg, picks)", "input code");
    if (fast == NULL) return -1;
    for (int32_t k = 0; k < self->n_in; ++k) {
        PyObject* picks;
        Py_ssize_t i, n;
        int64_t dims[MAX_DIMS];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, k), "nO", &i, &picks)) goto fail;
        if (i < 0 || i >= self->n_args) {
            PyErr_Format(PyExc_ValueError, "operand %d reads arg %zd of %zd", k, i, self->n_args);
            goto fail;
        }
        self->arg_of[k] = i;
        if (picks == Py_None) {  // the arg's own strides (its shape is the domain's)
            if (self->arg_ndim[i] != nd) {
                PyErr_Format(PyExc_ValueError, "operand %d: arg %zd has not %d dims", k, i, nd);
                goto fail;
            }
            for (int d = 0; d < nd; ++d) self->picks[k][d] = d;
            continue;
        }
        if (fill_ints(picks, "picks", MAX_DIMS, dims, &n) < 0) goto fail;
        if (n != nd) {
            PyErr_Format(PyExc_ValueError, "operand %d: give %d picks", k, nd);
            goto fail;
        }
        for (int d = 0; d < nd; ++d) {
            if (dims[d] < -1 || dims[d] >= self->arg_ndim[i]) {
                PyErr_Format(PyExc_ValueError, "operand %d: no dim %lld", k, (long long)dims[d]);
                goto fail;
            }
            self->picks[k][d] = (int32_t)dims[d];
        }
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

// Each output's (shape, strides, dtype), as torch.empty_strided takes them.
static int read_allocs(Launcher* self, PyObject* allocs) {
    PyObject* fast =
        tuples(allocs, self->n_out, "allocs", "(shape, strides, dtype)", "output code");
    if (fast == NULL) return -1;
    for (int32_t k = 0; k < self->n_out; ++k) {
        PyObject* parts[3];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, k), "O!O!O", &PyTuple_Type,
                              &parts[0], &PyTuple_Type, &parts[1], &parts[2])) {
            Py_DECREF(fast);
            return -1;
        }
        for (int j = 0; j < 3; ++j) {
            Py_INCREF(parts[j]);
            Py_XSETREF(self->alloc[k][j], parts[j]);
        }
    }
    Py_DECREF(fast);
    return 0;
}

// Launcher(run_address, code, imm, n_regs, in_codes, out_codes, operands, allocs, tail, nd,
//          shapes, dtypes, refused): see dvm.vm.Launch, which makes it.
static int launcher_init(Launcher* self, PyObject* args, PyObject* kwds) {
    PyObject *address, *code, *imm, *in_codes, *out_codes, *operands, *allocs, *tail, *shapes,
        *dtypes, *refused;
    int n_regs, nd;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) > 0) {
        PyErr_SetString(PyExc_TypeError, "Launcher takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOiOOOOOiO!O!O", &address, &code, &imm, &n_regs, &in_codes,
                          &out_codes, &operands, &allocs, &tail, &nd, &PyTuple_Type, &shapes,
                          &PyTuple_Type, &dtypes, &refused))
        return -1;
    if (g.tensor == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._launcher.setup() was not called");
        return -1;
    }
    if (self->shapes != NULL) {
        PyErr_SetString(PyExc_TypeError, "a Launcher is initialised once");
        return -1;
    }
    self->run = (RunFn)PyLong_AsVoidPtr(address);
    if (self->run == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run_address is null");
        return -1;
    }
    Py_ssize_t n;
    if (fill_int32(code, "code", MAX_INSTRS * 5, self->code, &n) < 0) return -1;
    if (n % 5 != 0) {
        PyErr_SetString(PyExc_ValueError, "code: five int32 per instruction");
        return -1;
    }
    self->n_instr = (int32_t)(n / 5);
    PyObject* fast = PySequence_Fast(imm, "imm");
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != self->n_instr) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "imm: one float per instruction");
        return -1;
    }
    for (int32_t i = 0; i < self->n_instr; ++i) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        self->imm[i] = (float)v;
    }
    Py_DECREF(fast);
    self->n_regs = n_regs;
    if (fill_int32(in_codes, "in_codes", MAX_INPUTS, self->in_codes, &n) < 0) return -1;
    self->n_in = (int32_t)n;
    if (fill_int32(out_codes, "out_codes", MAX_OUTPUTS, self->out_codes, &n) < 0) return -1;
    self->n_out = (int32_t)n;
    if (nd < 1 || nd > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "nd %d: need 1 to %d", nd, MAX_DIMS);
        return -1;
    }
    self->nd = nd;
    Py_ssize_t n_tail;
    if (fill_ints(tail, "tail", MAX_OUTPUTS * MAX_DIMS + MAX_DIMS, self->tail, &n_tail) < 0)
        return -1;
    if (n_tail != (Py_ssize_t)(self->n_out + 1) * nd) {
        PyErr_SetString(PyExc_ValueError, "tail: nd strides per output, then the nd-dim domain");
        return -1;
    }
    self->n_args = PyTuple_GET_SIZE(shapes);
    if (PyTuple_GET_SIZE(dtypes) != self->n_args || self->n_args > MAX_INPUTS) {
        PyErr_SetString(PyExc_ValueError, "shapes, dtypes: one per arg, at most 16 args");
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->n_args; ++i) {
        PyObject* shape = PyTuple_GET_ITEM(shapes, i);
        if (!PyTuple_Check(shape)) {
            PyErr_SetString(PyExc_TypeError, "shapes: each a tuple (torch.Size)");
            return -1;
        }
        self->arg_ndim[i] = (int32_t)PyTuple_GET_SIZE(shape);
    }
    if (read_operands(self, operands, nd) < 0 || read_allocs(self, allocs) < 0) return -1;
    Py_INCREF(dtypes);
    Py_XSETREF(self->dtypes, dtypes);
    if (refused != Py_None && !PyUnicode_Check(refused)) {
        PyErr_SetString(PyExc_TypeError, "refused: a message (str) or None");
        return -1;
    }
    if (refused == Py_None) {
        Py_CLEAR(self->refused);
    } else {
        Py_INCREF(refused);
        Py_XSETREF(self->refused, refused);
    }
    Py_INCREF(shapes);
    self->shapes = shapes;  // last: a Launcher with shapes set is ready
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
    if (self->shapes == NULL) {
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

static PyObject* launcher_mismatch(Launcher* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "mismatch(args, grad)");
        return NULL;
    }
    int grad = PyObject_IsTrue(args[1]);
    if (grad < 0) return NULL;
    PyObject* fast = seq_of_args(self, args[0]);
    if (fast == NULL) return NULL;
    int kind = 0;
    int i = find_mismatch(self, fast, grad, &kind);
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
    int kind = 0;
    int i = find_mismatch(self, fast, 0, &kind);
    PyObject* outs = NULL;
    if (i == -1)
        outs = launch(self, fast, threads);
    else if (i >= 0)
        PyErr_Format(kind == NOT_TENSOR ? PyExc_TypeError : PyExc_ValueError,
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
    PyObject* grad_obj = PyObject_CallNoArgs(g.grad_enabled);
    if (grad_obj == NULL) return NULL;
    int grad = grad_obj == Py_True;
    Py_DECREF(grad_obj);
    PyObject* fast = seq_of_args(self, args[0]);
    if (fast == NULL) return NULL;
    int kind = 0;
    int i = find_mismatch(self, fast, grad, &kind);
    if (i != -1) {
        Py_DECREF(fast);
        if (i == -2) return NULL;
        Py_RETURN_NONE;
    }
    PyObject* outs = launch(self, fast, 0);
    Py_DECREF(fast);
    if (outs == NULL) return NULL;
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

static PyMethodDef launcher_methods[] = {
    {"mismatch", (PyCFunction)(void (*)(void))launcher_mismatch, METH_FASTCALL,
     "mismatch(args, grad) -> (arg, kind) | None: the first arg that cannot run as bound."},
    {"run", (PyCFunction)(void (*)(void))launcher_run, METH_FASTCALL,
     "run(args, threads=0) -> list of outputs (threads < 1: torch.get_num_threads())."},
    {"guarded", (PyCFunction)(void (*)(void))launcher_guarded, METH_FASTCALL,
     "guarded(args, results) -> tuple | None: run unless a guard fails (grad mode counted)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LauncherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dvm._launcher.Launcher",
    .tp_basicsize = sizeof(Launcher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A VM program bound to one signature (made by dvm.vm.Launch).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)launcher_init,
    .tp_dealloc = (destructor)launcher_dealloc,
    .tp_methods = launcher_methods,
};

// setup(tensor_type, empty_strided, cpu, get_num_threads, is_grad_enabled, strided, error,
//       messages): the torch objects calls use, and VMError with its status messages.
static PyObject* setup(PyObject* module, PyObject* args) {
    PyObject* got[8];
    if (!PyArg_ParseTuple(args, "OOOOOOOO!", &got[0], &got[1], &got[2], &got[3], &got[4],
                          &got[5], &got[6], &PyDict_Type, &got[7]))
        return NULL;
    PyObject** slots[8] = {&g.tensor,       &g.empty_strided, &g.cpu,   &g.num_threads,
                           &g.grad_enabled, &g.strided,       &g.error, &g.messages};
    for (int i = 0; i < 8; ++i) {
        Py_INCREF(got[i]);
        Py_XSETREF(*slots[i], got[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "Hand the module the torch objects its calls use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._launcher", "Bound launches of VM programs.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__launcher(void) {
    struct {
        PyObject** slot;
        const char* text;
    } names[] = {{&g.s_shape, "shape"},         {&g.s_dtype, "dtype"},
                 {&g.s_is_cpu, "is_cpu"},       {&g.s_layout, "layout"},
                 {&g.s_is_neg, "is_neg"},       {&g.s_requires_grad, "requires_grad"},
                 {&g.s_stride, "stride"},       {&g.s_data_ptr, "data_ptr"},
                 {&g.s_view, "view"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return NULL;
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
