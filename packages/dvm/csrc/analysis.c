// dvm._analysis: the per-node analysis behind dvm.cluster._Analysis, and the merging of the
// analysed nodes into groups that dvm.cluster builds regions of, in C.
//
// For each node of an aten FX graph: its index and side-effect segment; for a call node whose
// op has a lowering rule, whether the VM takes it (each value's shape, dtype and size, a bool
// result, scalar arguments, the rule's own check) and, when it does, its domain shape, the
// operands cut from it, its footprint and instruction cost (dvm.cluster's docstring). The
// common cases are worked out here: plain CPU fake tensors of static shapes, scalars well
// within range, and the checks setup() names (reductions, views, copies, division modes,
// bitwise ops) where they pass. Whatever needs explaining (why the VM refuses a node, an
// unusual value or argument, whether an op without a rule has a side effect) is asked of
// dvm.lower and dvm.cluster in Python, which setup() hands over: the reasons are written in
// one place.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>
#include <stdint.h>

#include "analysis.h"
#include "fields.h"
#include "names.h"

// CPython 3.13 made _PyObject_LookupAttr public as PyObject_GetOptionalAttr (and removed it).
#if PY_VERSION_HEX >= 0x030D0000
#define lookup_attr PyObject_GetOptionalAttr
#else
#define lookup_attr _PyObject_LookupAttr
#endif

enum { MAX_RANK = 8 };  // shapes are compared padded with leading 1s to 8 dims

// The fields of torch.fx's Node read at their offsets (its _NodeBase's C members).
enum {
    F_OP, F_TARGET, F_META, F_USERS, F_ARGS, F_KWARGS, F_INPUT_NODES, F_NEXT, F_ERASED,
    N_FIELDS
};

static struct {
    PyObject *rules, *tensor, *cpu, *dtype_codes, *limits, *bool_dtype;
    PyObject *pointwise, *reduce, *row, *expand, *constant;
    PyObject *eager, *eager_memo, *rule_reason, *value_fact, *reduced_dims;
    PyObject *aliasing, *expand_op;  // the ops whose result is a view (a tuple), aten.expand
    PyObject* fake_tensor;           // FakeTensor, whose device is read from its fields
    PyObject* bool_out;              // the ids of the pointwise ops that may give a bool result
    // the rules' checks worked out here (dvm.lower's functions, compared by identity)
    PyObject *check_reduce, *check_view, *check_to_copy, *check_div_mode, *check_bitwise,
        *check_row[3];  // by the dim's argument: _row_check(1), _row_check(2)
    long max_rank, max_inputs, max_outputs, max_instrs, max_row;
    PyObject *no_val;  // the reason for a call node without a tensor value
    PyObject* view_refusal;  // dvm.lower._check_view's reason for a view that moves values
    // resolved at setup, for the objects of exactly these types: torch.fx.Node's fields (the
    // offset of each C member, 0 where the generic lookup must read it) and FakeTensor's
    // shape and dtype getters (NULL where it must)
    PyTypeObject* node_type;
    Py_ssize_t node_at[N_FIELDS];
    PyGetSetDef *get_shape, *get_dtype;
    int tensor_check;  // isinstance(x, torch.Tensor) is true where x's type subclasses it
    PyObject *s_op, *s_target, *s_args, *s_kwargs, *s_meta, *s_val, *s_all_input_nodes,
        *s_kind, *s_check, *s_cost, *s_dtype, *s_device, *s_shape, *s_call_function,
        *s_call_method, *s_call_module, *s_index, *s_segment, *s_fallbacks, *s_facts, *s_dshape,
        *s_cut, *s_footprint, *s_users, *s__args, *s__kwargs, *s__input_nodes, *s__fake_device,
        *s_fake_mode, *s_in_kernel_invocation, *s_dim, *s_rounding_mode, *s_placeholder;
    PyObject *s__root, *s__next, *s__erased, *s_nodes;  // read by nodes()
} g;

typedef struct {  // the _Analysis's dicts (borrowed from it)
    PyObject *index, *segment, *fallbacks, *facts, *dshape, *cut, *footprint, *cost, *args;
} Tables;

typedef struct {
    int n;
    int64_t d[MAX_RANK];
} Shape;

// `seq` (a tuple or torch.Size of ints) as a Shape; -1 with an exception when it is not one.
static int read_shape(PyObject* seq, Shape* out) {
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) > MAX_RANK) {
        PyErr_Format(PyExc_ValueError, "dvm analysis: %R is not a shape of at most %d dims", seq,
                     MAX_RANK);
        return -1;
    }
    out->n = (int)PyTuple_GET_SIZE(seq);
    for (int i = 0; i < out->n; ++i) {
        out->d[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
        if (out->d[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject* shape_tuple(const Shape* s) {
    PyObject* t = PyTuple_New(s->n);
    for (int i = 0; t != NULL && i < s->n; ++i) {
        PyObject* v = PyLong_FromLongLong(s->d[i]);
        if (v == NULL) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static void padded(const Shape* s, int rank, int64_t out[MAX_RANK]) {
    for (int i = 0; i < rank - s->n; ++i) out[i] = 1;
    for (int i = 0; i < s->n; ++i) out[rank - s->n + i] = s->d[i];
}

// Whether two shapes are equal once padded with leading 1s.
static int same(const Shape* a, const Shape* b) {
    int rank = a->n > b->n ? a->n : b->n;
    int64_t x[MAX_RANK], y[MAX_RANK];
    padded(a, rank, x);
    padded(b, rank, y);
    return memcmp(x, y, sizeof(int64_t) * (size_t)rank) == 0;
}

// The broadcast of two shapes (dvm.cluster.broadcast); 0 when they do not broadcast.
static int broadcast(const Shape* a, const Shape* b, Shape* out) {
    int rank = a->n > b->n ? a->n : b->n;
    int64_t x[MAX_RANK], y[MAX_RANK];
    padded(a, rank, x);
    padded(b, rank, y);
    out->n = rank;
    for (int i = 0; i < rank; ++i) {
        if (x[i] == y[i] || y[i] == 1) out->d[i] = x[i];
        else if (x[i] == 1) out->d[i] = y[i];
        else return 0;
    }
    return 1;
}

// facts[p]'s shape (a new reference to its torch.Size) and size; NULL with an exception when
// p has none. Every shape below is held while Python code may run (a node's __hash__ or
// __eq__ in a dict lookup, a callback): that code could replace the dict entry holding it.
static PyObject* fact_shape(Tables* t, PyObject* p, int64_t* numel) {
    PyObject* fact = PyDict_GetItemWithError(t->facts, p);
    if (fact == NULL || !PyTuple_Check(fact) || PyTuple_GET_SIZE(fact) != 3) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, p);
        return NULL;
    }
    Py_INCREF(fact);
    if (numel != NULL) {
        int overflow;
        *numel = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(fact, 2), &overflow);
        if (overflow) *numel = INT64_MAX;
        if (*numel == -1 && PyErr_Occurred()) {
            Py_DECREF(fact);
            return NULL;
        }
    }
    PyObject* shape = Py_NewRef(PyTuple_GET_ITEM(fact, 0));
    Py_DECREF(fact);
    return shape;
}

// Whether p's domain shape agrees with its real shape (both padded alike).
static int aligned(Tables* t, PyObject* p) {
    PyObject* shape = PyDict_GetItemWithError(t->dshape, p);
    if (shape == NULL) return PyErr_Occurred() ? -1 : 1;
    Py_INCREF(shape);
    PyObject* real = fact_shape(t, p, NULL);
    Shape a, b;
    int result = real == NULL ? -1
                 : shape == real ? 1
                 : read_shape(shape, &a) < 0 || read_shape(real, &b) < 0 ? -1
                                                                          : same(&a, &b);
    Py_DECREF(shape);
    Py_XDECREF(real);
    return result;
}

// The shape `reader` sees p with (a new reference; view_of in csrc/emitter.c, for the build).
static PyObject* view_of(Tables* t, PyObject* p, PyObject* cut) {
    PyObject* shape = PyDict_GetItemWithError(t->dshape, p);
    if (shape != NULL) {
        Py_INCREF(shape);
        int in_cut = PySequence_Contains(cut, p);
        if (in_cut == 0) return shape;
        Py_DECREF(shape);
        if (in_cut < 0) return NULL;
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    return fact_shape(t, p, NULL);
}

// node's field f where node is a torch.fx.Node and the field is set: what the generic lookup
// gives, read at its offset (setup resolved it), borrowed; else NULL.
static PyObject* member(PyObject* node, int f) {
    if (Py_TYPE(node) != g.node_type || g.node_at[f] == 0) return NULL;
    return *(PyObject**)((char*)node + g.node_at[f]);
}

// node.<name>, its field f; a new reference, or NULL with an exception.
static PyObject* field(PyObject* node, int f, PyObject* name) {
    PyObject* v = member(node, f);
    return v != NULL ? Py_NewRef(v) : PyObject_GetAttr(node, name);
}

// Tensor v's attribute `name`, through its getter `get` where v is a FakeTensor (setup
// resolved it); a new reference, or NULL with an exception.
static PyObject* tensor_attr(PyObject* v, PyGetSetDef* get, PyObject* name) {
    if (get != NULL && Py_TYPE(v) == (PyTypeObject*)g.fake_tensor)
        return get->get(v, get->closure);
    return PyObject_GetAttr(v, name);
}

// isinstance(v, torch.Tensor): 1, 0, or -1 with an exception.
static int is_tensor(PyObject* v) {
    if (g.tensor_check && (Py_TYPE(v) == (PyTypeObject*)g.fake_tensor ||
                           PyObject_TypeCheck(v, (PyTypeObject*)g.tensor)))
        return 1;
    return PyObject_IsInstance(v, g.tensor);
}

// Tensor v's device (a new reference): a FakeTensor's own field, which its device property
// gives outside a kernel invocation (NULL without an exception inside one, where the property
// says meta, or when the fields are missing); any other tensor's device attribute. NULL with
// an exception on an error.
static PyObject* device_of(PyObject* v) {
    if (Py_TYPE(v) != (PyTypeObject*)g.fake_tensor) return PyObject_GetAttr(v, g.s_device);
    // a torch whose FakeTensor lacks these private fields: NULL without an exception, so that
    // dvm.lower reads the device property
    PyObject *mode, *inside = NULL, *device = NULL;
    if (lookup_attr(v, g.s_fake_mode, &mode) < 0) return NULL;
    if (mode != NULL) {
        int found = lookup_attr(mode, g.s_in_kernel_invocation, &inside);
        Py_DECREF(mode);
        if (found < 0) return NULL;
    }
    if (inside == NULL) return NULL;
    int meta = PyObject_IsTrue(inside);
    Py_DECREF(inside);
    if (meta != 0) return NULL;  // inside a kernel invocation, or -1 with the error set
    if (lookup_attr(v, g.s__fake_device, &device) < 0) return NULL;
    return device;
}

// The fact of value v (shape, dtype, size), a str saying why the VM does not take it, or
// NULL with an exception. Anything but a plain supported tensor (a VM dtype, the CPU device, a
// static non-empty shape of at most MAX_DIMS dims) goes to dvm.lower.value_fact. The size is
// the shape's product: v.numel() of a fake tensor costs several times that.
static PyObject* value_fact(PyObject* v) {
    PyObject *dtype = NULL, *device = NULL, *shape = NULL, *fact = NULL;
    int plain = is_tensor(v);
    if (plain < 0) return NULL;
    if (plain) {
        if ((dtype = tensor_attr(v, g.get_dtype, g.s_dtype)) == NULL) goto done;
        int known = PyDict_Contains(g.dtype_codes, dtype);
        if (known < 0) goto done;
        if (!known) goto slow;
        if ((device = device_of(v)) == NULL) {
            if (PyErr_Occurred()) goto done;
            goto slow;
        }
        int cpu = PyObject_RichCompareBool(device, g.cpu, Py_EQ);
        if (cpu < 0) goto done;
        if (!cpu) goto slow;
        if ((shape = tensor_attr(v, g.get_shape, g.s_shape)) == NULL) goto done;
        if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > g.max_rank) goto slow;
        int64_t numel = 1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
            PyObject* size = PyTuple_GET_ITEM(shape, i);
            if (!PyLong_CheckExact(size)) goto slow;  // a symbolic size
            int overflow;
            long long d = PyLong_AsLongLongAndOverflow(size, &overflow);
            if (overflow || d < 0 || (d != 0 && numel > INT64_MAX / d)) goto slow;
            numel *= d;
        }
        if (numel == 0) goto slow;
        PyObject* size = PyLong_FromLongLong(numel);
        if (size != NULL) fact = PyTuple_Pack(3, shape, dtype, size);
        Py_XDECREF(size);
        goto done;
    }
slow:
    fact = PyObject_CallOneArg(g.value_fact, v);
done:
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(shape);
    return fact;
}

// Whether a scalar argument needs dvm.lower.rule_reason's word: a complex, or an int or float
// that may be beyond the range of the node's dtype (within half of it, it is not; nearer, or
// an int too large for a double, rule_reason decides exactly).
static int odd_scalar(PyObject* a, double limit) {
    if (PyComplex_CheckExact(a)) return 1;
    if (limit <= 0 || !(PyLong_CheckExact(a) || PyFloat_CheckExact(a))) return 0;
    double x = PyFloat_CheckExact(a) ? PyFloat_AS_DOUBLE(a) : PyLong_AsDouble(a);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return isfinite(x) && fabs(x) > 0.5 * limit;
}

// Where p has the fact of a value the VM takes, its shape into *out: 1; 0 when it has none
// (not a node, or a value the VM does not take); -1 with an exception.
static int known_shape(Tables* t, PyObject* p, Shape* out) {
    PyObject* fact = PyDict_GetItemWithError(t->facts, p);
    if (fact == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(fact) || PyTuple_GET_SIZE(fact) != 3) return 0;
    Py_INCREF(fact);
    int failed = read_shape(PyTuple_GET_ITEM(fact, 0), out);
    Py_DECREF(fact);
    return failed ? -1 : 1;
}

// The shape of a node's first argument into *out when it is one of its inputs `ops` and has a
// fact: 1; 0 when it is not or has none; -1 with an exception.
static int first_shape(Tables* t, PyObject* ops, PyObject* args, Shape* out) {
    if (PyTuple_GET_SIZE(args) == 0) return 0;
    PyObject* x = PyTuple_GET_ITEM(args, 0);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ops); ++i)
        if (PyTuple_GET_ITEM(ops, i) == x) return known_shape(t, x, out);
    return 0;
}

// The dims a reduction of a value of `rank` dims reduces (dvm.lower.reduced_dims) as a bit
// mask in *mask: 1; 0 when its dim argument is not None, an int or a list or tuple of ints
// (dvm.lower says); -1 with an exception.
static int reduce_dims(PyObject* args, PyObject* kwargs, int rank, unsigned* mask) {
    *mask = 0;
    if (rank == 0) return 1;
    unsigned all = (1u << rank) - 1;
    PyObject* dims = PyTuple_GET_SIZE(args) > 1 ? PyTuple_GET_ITEM(args, 1)
                                                : PyDict_GetItemWithError(kwargs, g.s_dim);
    if (dims == NULL && PyErr_Occurred()) return -1;
    if (dims == NULL || dims == Py_None) {
        *mask = all;
        return 1;
    }
    PyObject* const* items = &dims;
    Py_ssize_t n = 1;
    if (PyList_Check(dims) || PyTuple_Check(dims)) {
        n = PySequence_Fast_GET_SIZE(dims);
        items = PySequence_Fast_ITEMS(dims);
        if (n == 0) {
            *mask = all;
            return 1;
        }
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
        if (!PyLong_CheckExact(items[k])) return 0;
        int overflow;
        long long d = PyLong_AsLongLongAndOverflow(items[k], &overflow);
        if (overflow) return 0;
        long long at = d % rank;
        *mask |= 1u << (at < 0 ? at + rank : at);
    }
    return 1;
}

// Whether kwargs[name] is absent or None: 1, 0 when not, -1 with an exception.
static int unset(PyObject* kwargs, PyObject* name) {
    PyObject* v = PyDict_GetItemWithError(kwargs, name);
    if (v == NULL) return PyErr_Occurred() ? -1 : 1;
    return v == Py_None;
}

// dvm.lower._check_reduce passing node: only the last dim reduced (or dims of size 1), a
// row of at most MAX_ROW elements, no dtype argument.
static int reduce_passes(Tables* t, PyObject* ops, PyObject* args, PyObject* kwargs) {
    Shape x;
    unsigned mask;
    int known = unset(kwargs, g.s_dtype);
    if (known > 0) known = first_shape(t, ops, args, &x);
    if (known > 0) known = reduce_dims(args, kwargs, x.n, &mask);
    if (known <= 0) return known;
    for (int d = 0; d < x.n - 1; ++d)
        if ((mask >> d & 1) && x.d[d] != 1) return 0;
    int row = x.n > 0 && (mask >> (x.n - 1) & 1) && x.d[x.n - 1] != 1;
    return !row || x.d[x.n - 1] <= g.max_row;
}

// dvm.lower._check_view on node: 1 when it passes (a view of a tensor with the same dims but
// size-1 ones), 2 when it refuses a view of a tensor (VIEW_REFUSAL), 0 when dvm.lower must
// say (a shape not known here), -1 with an exception.
static int view_passes(Tables* t, PyObject* node, PyObject* ops, PyObject* args) {
    Shape src, dst;
    int known = first_shape(t, ops, args, &src);
    if (known > 0) known = known_shape(t, node, &dst);
    if (known <= 0) return known;
    int i = 0, j = 0;
    for (;; ++i, ++j) {
        while (i < src.n && src.d[i] == 1) ++i;
        while (j < dst.n && dst.d[j] == 1) ++j;
        if (i == src.n || j == dst.n || src.d[i] != dst.d[j]) break;
    }
    return i == src.n && j == dst.n ? 1 : 2;
}

// dvm.lower._row_check(dim_at)'s check passing node: over the last dim (argument dim_at) of
// rows of 2 to MAX_ROW elements, and for a dim_at of 1 without half_to_float (argument 2).
static int row_passes(Tables* t, PyObject* ops, PyObject* args, int dim_at) {
    Shape x;
    int known = first_shape(t, ops, args, &x);
    if (known <= 0) return known;
    if (PyTuple_GET_SIZE(args) <= 2 || x.n == 0) return 0;
    PyObject* dim = PyTuple_GET_ITEM(args, dim_at);
    if (!PyLong_CheckExact(dim)) return 0;
    int overflow;
    long long d = PyLong_AsLongLongAndOverflow(dim, &overflow);
    if (overflow || (d % x.n + x.n) % x.n != x.n - 1 || x.d[x.n - 1] == 1) return 0;
    if (dim_at == 1 && PyTuple_GET_ITEM(args, 2) != Py_False) return 0;
    return x.d[x.n - 1] <= g.max_row;
}

// A rule's kind, check and cost (a dvm.lower.Rule: a frozen dataclass), read once per rule:
// a table by the rule's address (open addressing, emptied when 3/4 full), each entry holding
// its rule.
typedef struct {
    PyObject *rule, *kind, *check;
    long cost;
} RuleInfo;

enum { N_RULE_INFOS = 256 };
static RuleInfo rule_infos[N_RULE_INFOS];
static int n_rule_infos;

// The free entry or rule's in rule_infos.
static RuleInfo* rule_slot(PyObject* rule) {
    size_t k = (((uintptr_t)rule >> 4) * 0x9E3779B97F4A7C15u) >> 56;
    while (rule_infos[k].rule != NULL && rule_infos[k].rule != rule) k = (k + 1) % N_RULE_INFOS;
    return &rule_infos[k];
}

// rule's entry in rule_infos, read into it where it is not there; NULL with an exception.
// Valid until code runs that may call rule_info.
static const RuleInfo* rule_info(PyObject* rule) {
    RuleInfo* r = rule_slot(rule);
    if (r->rule == rule) return r;
    PyObject* kind = PyObject_GetAttr(rule, g.s_kind);
    PyObject* check = kind != NULL ? PyObject_GetAttr(rule, g.s_check) : NULL;
    PyObject* cost_obj = check != NULL ? PyObject_GetAttr(rule, g.s_cost) : NULL;
    long cost = cost_obj != NULL ? PyLong_AsLong(cost_obj) : -1;
    Py_XDECREF(cost_obj);
    if (cost == -1 && PyErr_Occurred()) {
        Py_XDECREF(kind);
        Py_XDECREF(check);
        return NULL;
    }
    if (4 * (n_rule_infos + 1) > 3 * N_RULE_INFOS) {  // full: emptied (a release may run code)
        RuleInfo* held = PyMem_Malloc(sizeof rule_infos);
        if (held == NULL) {
            Py_DECREF(kind);
            Py_DECREF(check);
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(held, rule_infos, sizeof rule_infos);
        memset(rule_infos, 0, sizeof rule_infos);
        n_rule_infos = 0;
        for (int k = 0; k < N_RULE_INFOS; ++k) {
            Py_XDECREF(held[k].rule);
            Py_XDECREF(held[k].kind);
            Py_XDECREF(held[k].check);
        }
        PyMem_Free(held);
    }
    r = rule_slot(rule);  // code ran since: it may have filled the entry
    if (r->rule == rule) {
        Py_DECREF(kind);
        Py_DECREF(check);
        return r;
    }
    *r = (RuleInfo){Py_NewRef(rule), kind, check, cost};
    ++n_rule_infos;
    return r;
}

// Whether node passes its rule's check, worked out here for the checks setup() names: 1 when
// it does, 0 when it does not (*refusal set to the check's reason where that is known here,
// a view that moves values; else dvm.lower must say), -1 with an exception.
static int check_passes(Tables* t, PyObject* check, PyObject* node, PyObject* ops,
                        PyObject* args, PyObject* kwargs, PyObject** refusal) {
    if (check == Py_None) return 1;
    if (check == g.check_reduce) return reduce_passes(t, ops, args, kwargs);
    if (check == g.check_view) {
        int passes = view_passes(t, node, ops, args);
        if (passes != 2) return passes;
        *refusal = g.view_refusal;
        return 0;
    }
    if (check == g.check_to_copy) return unset(kwargs, g.s_device);
    if (check == g.check_div_mode) return unset(kwargs, g.s_rounding_mode);
    if (check == g.check_row[1] || check == g.check_row[2])
        return row_passes(t, ops, args, check == g.check_row[1] ? 1 : 2);
    if (check != g.check_bitwise) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ops); ++i) {
        PyObject* fact = PyDict_GetItemWithError(t->facts, PyTuple_GET_ITEM(ops, i));
        if (fact == NULL) return PyErr_Occurred() ? -1 : 0;
        if (!PyTuple_Check(fact) || PyTuple_GET_SIZE(fact) != 3 ||
            PyTuple_GET_ITEM(fact, 1) != g.bool_dtype)
            return 0;
    }
    return 1;
}

// Whether the VM takes node (dvm.lower.rule_reason), `key` its target's id; a new reference to
// the reason, Py_None, or NULL with an exception. Any refusal's reason comes from
// dvm.lower.rule_reason itself.
static PyObject* reason(Tables* t, PyObject* node, PyObject* key, PyObject* rule, PyObject* ops,
                        PyObject* args, PyObject* kwargs) {
    Py_ssize_t n_ops = PyTuple_GET_SIZE(ops);
    for (Py_ssize_t k = -1; k < n_ops; ++k) {
        PyObject* x = k < 0 ? node : PyTuple_GET_ITEM(ops, k);
        PyObject* fact = PyDict_GetItemWithError(t->facts, x);
        if (fact == NULL) {
            if (PyErr_Occurred()) return NULL;
            PyObject* meta = field(x, F_META, g.s_meta);
            if (meta == NULL) return NULL;
            PyObject* v = PyDict_Check(meta) ? PyDict_GetItemWithError(meta, g.s_val) : NULL;
            Py_XINCREF(v);
            Py_DECREF(meta);
            if (v == NULL && PyErr_Occurred()) return NULL;
            int tensor = v != NULL ? is_tensor(v) : 0;
            if (tensor <= 0) {  // no tensor value (or an error): rule_reason's case
                Py_XDECREF(v);
                if (tensor < 0) return NULL;
                return PyObject_CallFunctionObjArgs(g.rule_reason, node, rule, ops, t->facts,
                                                    NULL);
            }
            fact = value_fact(v);
            Py_DECREF(v);
            if (fact == NULL) return NULL;
            int failed = PyDict_SetItem(t->facts, x, fact);
            Py_DECREF(fact);  // the dict holds it
            if (failed < 0) return NULL;
        }
        if (PyUnicode_Check(fact)) return Py_NewRef(fact);
    }
    PyObject* node_fact = PyDict_GetItemWithError(t->facts, node);  // code ran since: look again
    if (node_fact == NULL || !PyTuple_Check(node_fact) || PyTuple_GET_SIZE(node_fact) != 3) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, node);
        return NULL;
    }
    const RuleInfo* info = rule_info(rule);
    if (info == NULL) return NULL;
    // read now: the limits lookup below may run code (a dtype's __hash__) that empties the table
    int pointwise = info->kind == g.pointwise;
    PyObject* check = Py_NewRef(info->check);
    PyObject* dtype = Py_NewRef(PyTuple_GET_ITEM(node_fact, 1));
    PyObject* limit_obj = PyDict_GetItemWithError(g.limits, dtype);
    double limit = limit_obj != NULL ? PyFloat_AsDouble(limit_obj) : 0.0;
    int odd = 0, bool_result = dtype == g.bool_dtype;
    Py_DECREF(dtype);
    if (PyErr_Occurred()) {
        Py_DECREF(check);
        return NULL;
    }
    if (bool_result) {  // a pointwise op not known to make one: rule_reason's case
        int known = !pointwise ? 1 : PySet_Contains(g.bool_out, key);
        if (known < 0) {
            Py_DECREF(check);
            return NULL;
        }
        odd = !known;
    }
    for (Py_ssize_t i = 0; !odd && i < PyTuple_GET_SIZE(args); ++i)
        odd = odd_scalar(PyTuple_GET_ITEM(args, i), limit);
    PyObject *name, *a;
    for (Py_ssize_t at = 0; !odd && PyDict_Next(kwargs, &at, &name, &a);)
        odd = odd_scalar(a, limit);
    PyObject* refusal = NULL;  // the check's reason where worked out here (borrowed)
    int passes = odd ? 0 : check_passes(t, check, node, ops, args, kwargs, &refusal);
    Py_DECREF(check);
    if (passes < 0) return NULL;
    if (passes) Py_RETURN_NONE;
    if (refusal != NULL) return Py_NewRef(refusal);
    return PyObject_CallFunctionObjArgs(g.rule_reason, node, rule, ops, t->facts, NULL);
}

// `shape` with each dim in `dims` (a list of ints) set to 1.
static PyObject* reduced_shape(PyObject* shape, PyObject* dims) {
    Py_ssize_t n = PyTuple_GET_SIZE(shape);
    PyObject* out = PyTuple_New(n);
    for (Py_ssize_t d = 0; out != NULL && d < n; ++d) {
        PyObject* index = PyLong_FromSsize_t(d);
        int in = index != NULL ? PySequence_Contains(dims, index) : -1;
        Py_XDECREF(index);
        if (in < 0) {
            Py_CLEAR(out);
            break;
        }
        PyObject* size = in ? PyLong_FromLong(1) : Py_NewRef(PyTuple_GET_ITEM(shape, d));
        if (size == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, d, size);
    }
    return out;
}

// The ops of `candidates` of more than one element that are not aligned, as a tuple.
static PyObject* unaligned(Tables* t, PyObject* candidates) {
    Py_ssize_t n = PyTuple_GET_SIZE(candidates);
    PyObject* out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n; ++i) {
        PyObject* p = PyTuple_GET_ITEM(candidates, i);
        int64_t numel;
        PyObject* shape = fact_shape(t, p, &numel);
        if (shape == NULL) {
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(shape);
        if (numel <= 1) continue;
        int ok = aligned(t, p);
        if (ok < 0 || (!ok && PyList_Append(out, p) < 0)) Py_CLEAR(out);
    }
    if (out == NULL) return NULL;
    PyObject* tuple = PyList_AsTuple(out);
    Py_DECREF(out);
    return tuple;
}

// A POINTWISE node's domain shape (new reference) and cut; *footprint_is_shape when its
// footprint is that shape.
static PyObject* pointwise(Tables* t, PyObject* real, PyObject* ops, PyObject** cut,
                           int* footprint_is_shape) {
    Py_ssize_t n = PyTuple_GET_SIZE(ops);
    PyObject* first_big = NULL;
    int all_aligned = 1, one_pair = 1;
    int64_t pair0[2][MAX_RANK];
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* p = PyTuple_GET_ITEM(ops, i);
        int64_t numel;
        PyObject* shape = fact_shape(t, p, &numel);
        if (shape == NULL) return NULL;
        Shape real_p, seen_p;
        int failed = read_shape(shape, &real_p) < 0;
        Py_DECREF(shape);
        if (failed) return NULL;
        if (numel <= 1) continue;
        int ok = aligned(t, p);
        if (ok < 0) return NULL;
        all_aligned &= ok;
        PyObject* seen = PyDict_GetItemWithError(t->dshape, p);
        if (seen == NULL && PyErr_Occurred()) return NULL;
        if (seen == NULL) seen_p = real_p;
        else if (read_shape(seen, &seen_p) < 0) return NULL;
        int64_t pair[2][MAX_RANK];
        padded(&real_p, MAX_RANK, pair[0]);
        padded(&seen_p, MAX_RANK, pair[1]);
        if (first_big == NULL) {
            first_big = p;
            memcpy(pair0, pair, sizeof pair);
        } else if (memcmp(pair0, pair, sizeof pair) != 0) {
            one_pair = 0;
        }
    }
    *footprint_is_shape = all_aligned;
    if (all_aligned) {
        *cut = PyTuple_New(0);
        return *cut != NULL ? Py_NewRef(real) : NULL;
    }
    if (one_pair) {
        *cut = PyTuple_New(0);
        PyObject* shape = PyDict_GetItemWithError(t->dshape, first_big);
        if (shape == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, first_big);
        return *cut != NULL && shape != NULL ? Py_NewRef(shape) : NULL;  // no code ran since
    }
    *cut = unaligned(t, ops);
    return *cut != NULL ? Py_NewRef(real) : NULL;
}

// Analyse a node the VM takes (dvm.cluster's docstring). 0, or -1 with an exception.
static int analyse(Tables* t, PyObject* node, PyObject* rule, PyObject* ops, PyObject* args,
                   PyObject* kwargs) {
    PyObject *kind = NULL, *cut = NULL, *shape = NULL, *foot = NULL, *empty = NULL;
    int result = -1, foot_is_shape = 0;
    if (PyDict_SetItem(t->args, node, ops) < 0) return -1;
    const RuleInfo* info = rule_info(rule);
    if (info == NULL) return -1;
    kind = Py_NewRef(info->kind);  // held, and its cost read: the entry may change as code runs
    long cost = info->cost;
    PyObject* real = fact_shape(t, node, NULL);
    if (real == NULL) goto done;
    if ((empty = PyTuple_New(0)) == NULL) goto done;
    PyObject* x = PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, 0) : NULL;
    if (x == NULL && kind != g.pointwise && kind != g.row && kind != g.constant) {
        PyErr_SetString(PyExc_IndexError,
                        "dvm analysis: the op's input is not its first positional argument");
        goto done;
    }
    if (kind == g.pointwise) {
        shape = pointwise(t, real, ops, &cut, &foot_is_shape);
    } else if (kind == g.reduce) {
        int64_t numel;
        PyObject* x_shape = fact_shape(t, x, &numel);
        if (x_shape == NULL) goto done;
        int ok = aligned(t, x);
        if (ok < 0) {
            Py_DECREF(x_shape);
            goto done;
        }
        cut = !ok && numel > 1 ? PyTuple_Pack(1, x) : Py_NewRef(empty);
        Shape reduced;
        unsigned mask;
        int known = read_shape(x_shape, &reduced) < 0
                        ? -1
                        : reduce_dims(args, kwargs, reduced.n, &mask);
        if (known > 0) {
            for (int d = 0; d < reduced.n; ++d)
                if (mask >> d & 1) reduced.d[d] = 1;
            shape = shape_tuple(&reduced);
        } else if (known == 0) {  // dims dvm.lower.reduced_dims works out
            PyObject* dims = PyObject_CallOneArg(g.reduced_dims, node);
            if (dims != NULL) shape = reduced_shape(x_shape, dims);
            Py_XDECREF(dims);
        }
        Py_DECREF(x_shape);
        if (shape == NULL) goto done;
    } else if (kind == g.row) {
        cut = unaligned(t, ops);
        shape = Py_NewRef(real);
        foot_is_shape = 1;
    } else if (kind == g.expand) {
        int ok = aligned(t, x);
        if (ok < 0) goto done;
        cut = !ok ? PyTuple_Pack(1, x) : Py_NewRef(empty);
        shape = Py_NewRef(real);
    } else if (kind == g.constant) {
        cut = Py_NewRef(empty);
        shape = Py_NewRef(real);
    } else {  // VIEW: the values it views, seen as they are
        cut = Py_NewRef(empty);
        shape = view_of(t, x, empty);
    }
    if (cut == NULL || shape == NULL) goto done;
    if (PyDict_SetItem(t->cut, node, cut) < 0 || PyDict_SetItem(t->dshape, node, shape) < 0)
        goto done;
    if (foot_is_shape) {
        foot = Py_NewRef(shape);
    } else {
        Shape acc, seen_p, out;
        if (read_shape(shape, &acc) < 0) goto done;
        foot = Py_NewRef(shape);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ops); ++i) {
            PyObject* seen = view_of(t, PyTuple_GET_ITEM(ops, i), cut);
            if (seen == NULL) goto done;
            int failed = read_shape(seen, &seen_p) < 0;
            Py_DECREF(seen);
            if (failed) goto done;
            if (broadcast(&acc, &seen_p, &out) && out.n > 0) {  // `broadcast(...) or foot`
                acc = out;
                Py_SETREF(foot, shape_tuple(&acc));
                if (foot == NULL) goto done;
            }
        }
    }
    if (PyDict_SetItem(t->footprint, node, foot) < 0) goto done;
    PyObject *name, *a;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
        a = PyTuple_GET_ITEM(args, i);
        cost += PyLong_Check(a) || PyFloat_Check(a);
    }
    for (Py_ssize_t at = 0; PyDict_Next(kwargs, &at, &name, &a);)
        cost += PyLong_Check(a) || PyFloat_Check(a);
    PyObject* cost_obj = PyLong_FromLong(cost);
    if (cost_obj == NULL) goto done;
    result = PyDict_SetItem(t->cost, node, cost_obj);
    Py_DECREF(cost_obj);
done:
    Py_XDECREF(real);
    Py_XDECREF(kind);
    Py_XDECREF(cut);
    Py_XDECREF(shape);
    Py_XDECREF(foot);
    Py_XDECREF(empty);
    return result;
}

// An attribute table of the _Analysis, by name (a new reference); NULL with an exception.
static PyObject* table(PyObject* analysis, PyObject* name, int list) {
    PyObject* v = PyObject_GetAttr(analysis, name);
    if (v == NULL || (list ? PyList_CheckExact(v) : PyDict_CheckExact(v))) return v;
    Py_DECREF(v);
    PyErr_Format(PyExc_TypeError, "dvm analysis: %U must be a %s", name, list ? "list" : "dict");
    return NULL;
}

// The analysis's tables, each a new reference in *t; 0, or -1 with an exception.
static int open_tables(PyObject* analysis, Tables* t) {
    PyObject** slots[] = {&t->index, &t->segment, &t->fallbacks, &t->facts, &t->dshape,
                          &t->cut,   &t->footprint, &t->cost,    &t->args};
    PyObject* names[] = {g.s_index, g.s_segment, g.s_fallbacks, g.s_facts, g.s_dshape,
                         g.s_cut,   g.s_footprint, g.s_cost,    g.s_args};  // node.args's name too
    *t = (Tables){NULL};
    for (size_t k = 0; k < sizeof slots / sizeof slots[0]; ++k)
        if ((*slots[k] = table(analysis, names[k], names[k] == g.s_fallbacks)) == NULL) return -1;
    return 0;
}

static void close_tables(Tables* t) {
    PyObject* held[] = {t->index, t->segment, t->fallbacks, t->facts, t->dshape,
                        t->cut,   t->footprint, t->cost,    t->args};
    for (size_t k = 0; k < sizeof held / sizeof held[0]; ++k) Py_XDECREF(held[k]);
}

// The nodes argument of call(analysis, nodes) as a tuple of its own (a new reference); NULL
// with an exception when it is not a list or setup() was not called.
static PyObject* graph_nodes(const char* call, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 2 || !PyList_Check(argv[1]))
        return PyErr_Format(PyExc_TypeError, "%s(analysis, nodes): nodes must be a list", call);
    if (g.rules == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._analysis.setup() was not called");
        return NULL;
    }
    return PySequence_Tuple(argv[1]);
}

static int set_int(PyObject* dict, PyObject* key, Py_ssize_t value) {
    PyObject* v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int failed = PyDict_SetItem(dict, key, v);
    Py_DECREF(v);
    return failed;
}

static int fallback(Tables* t, PyObject* node, PyObject* why) {
    if (why == NULL) return -1;
    PyObject* pair = PyTuple_Pack(2, node, why);
    Py_DECREF(why);
    if (pair == NULL) return -1;
    int failed = PyList_Append(t->fallbacks, pair);
    Py_DECREF(pair);
    return failed;
}

// node.<name> read through its C member `held` (torch.fx's _NodeBase: _args or _kwargs) when
// it has one, else through the property; a new reference, or NULL with an exception.
static PyObject* node_field(PyObject* node, PyObject* held, PyObject* name) {
    PyObject* v = member(node, held == g.s__args ? F_ARGS : F_KWARGS);
    if (v != NULL) return Py_NewRef(v);
    int found = lookup_attr(node, held, &v);
    return found != 0 ? v : PyObject_GetAttr(node, name);
}

// The keys of a dict as a tuple; NULL with an exception.
static PyObject* keys_tuple(PyObject* dict) {
    PyObject* out = PyTuple_New(PyDict_GET_SIZE(dict));
    PyObject *key, *value;
    for (Py_ssize_t at = 0, i = 0; out != NULL && PyDict_Next(dict, &at, &key, &value); ++i)
        PyTuple_SET_ITEM(out, i, Py_NewRef(key));
    return out;
}

// node.all_input_nodes as a tuple: the keys of its _input_nodes dict (torch.fx's C member)
// when it has one. NULL with an exception.
static PyObject* input_nodes(PyObject* node) {
    PyObject* held = member(node, F_INPUT_NODES);
    if (held != NULL && PyDict_Check(held)) {  // held: making the tuple may run a finalizer
        Py_INCREF(held);
        PyObject* keys = keys_tuple(held);
        Py_DECREF(held);
        return keys;
    }
    int found = lookup_attr(node, g.s__input_nodes, &held);
    if (found < 0) return NULL;
    if (found && PyDict_Check(held)) {
        PyObject* keys = keys_tuple(held);
        Py_DECREF(held);
        return keys;
    }
    Py_XDECREF(held);
    PyObject* listed = PyObject_GetAttr(node, g.s_all_input_nodes);
    PyObject* ops = listed != NULL ? PySequence_Tuple(listed) : NULL;
    Py_XDECREF(listed);
    return ops;
}

// Whether fx op `op` is `name` (an interned str): an interned str other than it is not, without
// comparing their text. 1, 0, or -1 with an exception.
static int is_op(PyObject* op, PyObject* name) {
    if (op == name) return 1;
    if (PyUnicode_CheckExact(op) && PyUnicode_CHECK_INTERNED(op)) return 0;
    return PyObject_RichCompareBool(op, name, Py_EQ);
}

// Whether `node`, of fx op `op`, lacks the fake value dvm.compile fills in: a placeholder or a
// call_function node without meta["val"], unless it is a call nothing reads (an
// _assert_scalar). 1, 0, or -1 with an exception.
static int lacks_meta(PyObject* node, PyObject* op) {
    int call = is_op(op, g.s_call_function);
    int input = call == 0 ? is_op(op, g.s_placeholder) : 0;
    if (call <= 0 && input <= 0) return call < 0 || input < 0 ? -1 : 0;
    PyObject* meta = field(node, F_META, g.s_meta);
    if (meta == NULL) return -1;
    int has = PyDict_Check(meta) ? PyDict_Contains(meta, g.s_val)
                                 : PySequence_Contains(meta, g.s_val);
    Py_DECREF(meta);
    if (has != 0 || !call) return has < 0 ? -1 : !has;
    PyObject* users = field(node, F_USERS, g.s_users);
    if (users == NULL) return -1;
    int read = PyObject_IsTrue(users);
    Py_DECREF(users);
    return read;
}

// One node: 0, or -1 with an exception; *missing set to 1 when it lacks a fake value it needs
// (lacks_meta), looked at while *missing is 0.
static int node_step(Tables* t, PyObject* node, Py_ssize_t i, Py_ssize_t* seg, int* missing) {
    if (set_int(t->index, node, i) < 0 || set_int(t->segment, node, *seg) < 0) return -1;
    PyObject* op = field(node, F_OP, g.s_op);
    if (op == NULL) return -1;
    int lacks = *missing ? 0 : lacks_meta(node, op);
    if (lacks > 0) *missing = 1;
    int call = lacks < 0 ? -1 : is_op(op, g.s_call_function);
    int other = 0;  // a call_method or call_module: no VM rule, asked of Python as eager ops
    if (call == 0) other = is_op(op, g.s_call_method);
    if (call == 0 && other == 0) other = is_op(op, g.s_call_module);
    Py_DECREF(op);
    if (call < 0 || other < 0) return -1;
    if (!call && !other) return 0;
    PyObject* target = field(node, F_TARGET, g.s_target);
    if (target == NULL) return -1;
    PyObject* key = PyLong_FromVoidPtr(target);  // id(target): an OpOverload hashes in Python
    Py_DECREF(target);
    if (key == NULL) return -1;
    PyObject* rule = call ? PyDict_GetItemWithError(g.rules, key) : NULL;
    // eager: (whether it has a side effect, why it stays eager); remembered by op in Python
    // (a method's or a module's target is a name: such a call is asked each time)
    if (rule == NULL) {
        PyObject* fact = PyErr_Occurred() || !call ? NULL
                                                   : PyDict_GetItemWithError(g.eager_memo, key);
        Py_DECREF(key);
        if (fact != NULL)
            Py_INCREF(fact);
        else if (!PyErr_Occurred())
            fact = PyObject_CallOneArg(g.eager, node);
        if (fact == NULL) return -1;
        if (!PyTuple_Check(fact) || PyTuple_GET_SIZE(fact) != 2) {
            Py_DECREF(fact);
            PyErr_SetString(PyExc_TypeError, "dvm analysis: _eager must give (bool, str)");
            return -1;
        }
        PyObject* why = Py_NewRef(PyTuple_GET_ITEM(fact, 1));
        int barrier = PyTuple_GET_ITEM(fact, 0) == Py_True;
        Py_DECREF(fact);
        if (barrier) {  // a side effect: a segment of its own, between those around it
            if (set_int(t->segment, node, *seg + 1) < 0) {
                Py_DECREF(why);
                return -1;
            }
            *seg += 2;
        }
        return fallback(t, node, why);
    }
    Py_INCREF(rule);
    int result = -1;
    PyObject *ops = NULL, *args = NULL, *kwargs = NULL, *why = NULL, *listed;
    if ((ops = input_nodes(node)) == NULL) goto done;
    if ((listed = node_field(node, g.s__args, g.s_args)) == NULL) goto done;
    args = PySequence_Tuple(listed);  // fx keeps a tuple, or an immutable_list once reassigned
    Py_DECREF(listed);
    if (args == NULL || (kwargs = node_field(node, g.s__kwargs, g.s_kwargs)) == NULL) goto done;
    if (!PyDict_Check(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "dvm analysis: a node's kwargs must be a dict");
        goto done;
    }
    if ((why = reason(t, node, key, rule, ops, args, kwargs)) == NULL) goto done;
    if (why != Py_None) {
        result = fallback(t, node, Py_NewRef(why));
        goto done;
    }
    result = analyse(t, node, rule, ops, args, kwargs);
done:
    Py_DECREF(key);
    Py_DECREF(rule);
    Py_XDECREF(ops);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(why);
    return result;
}

// run(analysis, nodes): fill the analysis's tables for nodes (a list, in graph order); whether
// a node lacks a fake value it needs (lacks_meta).
PyObject* dvm_run(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    PyObject* nodes = graph_nodes("run", argv, argc);
    if (nodes == NULL) return NULL;
    Tables t;
    int failed = open_tables(argv[0], &t) < 0;
    Py_ssize_t seg = 0;
    int missing = 0;
    for (Py_ssize_t i = 0; !failed && i < PyTuple_GET_SIZE(nodes); ++i)
        failed = node_step(&t, PyTuple_GET_ITEM(nodes, i), i, &seg, &missing) < 0;
    close_tables(&t);
    Py_DECREF(nodes);
    if (failed) return NULL;
    return PyBool_FromLong(missing);
}

// ---- Merging (dvm.cluster's docstring): groups of analysed nodes grown along edges. ----
//
// dvm.cluster's regions before they are built: every analysed node starts as a group of its
// own; groups merge along producer->consumer edges in graph order, then siblings (groups
// reading one value). Nodes are numbered by their place in the graph (the analysis's index).

typedef struct {  // owned when cap > 0; else borrowed (a slice of another's), copied on a push
    int *v, n, cap;
} Ints;

static int push(Ints* s, int x) {
    if (s->n >= s->cap) {
        int cap = s->n > 2 ? 2 * s->n : 4;
        int* v = PyMem_Malloc(sizeof(int) * (size_t)cap);
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (s->n) memcpy(v, s->v, sizeof(int) * (size_t)s->n);
        if (s->cap) PyMem_Free(s->v);
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
    return 0;
}

static void drop(Ints* s) {
    if (s->cap) PyMem_Free(s->v);
    *s = (Ints){NULL, 0, 0};
}

typedef struct {
    Ints members, inputs, outputs, ext, partners;  // partners: nodes it must not hold
    Shape domain;
    int64_t big;  // the domain's size
    long long cost, seg;
    int lo, hi;
} Group;

enum { ALIASING = 1, EXPANDS = 2, WORKS = 4 };  // WORKS: its op stands for an eager kernel

typedef struct {
    int n;
    int* group;     // each node's group (numbered by a node it started at), -1 when not analysed
    Group* groups;  // by number
    Shape* dshape;  // each analysed node's domain shape
    // node i's users: users.v[users_at[i] .. users_at[i + 1]]; likewise an analysed node's
    // distinct tensor arguments (args) and cut operands (cut)
    Ints users, args, cut;
    int *users_at, *args_at, *cut_at;
    int* arg0;             // an aliasing node's first argument, -1 when it is not a node
    int* ids;              // ids[i] == i: a group's first member and output, borrowed
    unsigned char* flags;  // ALIASING, EXPANDS, WORKS
    int *seen, *crossed, gen;  // generation stamps of nodes and groups
    Ints stack;
} Merge;

static int64_t numel(const Shape* s) {  // saturates at INT64_MAX
    int64_t n = 1;
    for (int i = 0; i < s->n; ++i) {
        if (s->d[i] != 0 && n > INT64_MAX / s->d[i]) return INT64_MAX;
        n *= s->d[i];
    }
    return n;
}

static int equal(const Shape* a, const Shape* b) {
    return a->n == b->n && memcmp(a->d, b->d, sizeof(int64_t) * (size_t)a->n) == 0;
}

// 0 when an output of domain shape s is stored full over dom, 1 when
// row-reduced, -1 when the VM cannot store it.
static int storable(const Shape* s, const Shape* dom) {
    int64_t p[MAX_RANK];
    int n = s->n > dom->n ? s->n : dom->n;
    padded(s, n, p);
    if (n == dom->n && memcmp(p, dom->d, sizeof(int64_t) * (size_t)n) == 0) return 0;
    if (n != (dom->n ? dom->n : 1) || p[n - 1] != 1) return -1;
    return n == 1 || memcmp(p, dom->d, sizeof(int64_t) * (size_t)(n - 1)) == 0 ? 1 : -1;
}

static int in_union(const Merge* m, int node, int x, int y) {
    return node >= 0 && (m->group[node] == x || m->group[node] == y);
}

// Whether a path leaves group s through a node outside x | y and enters group d; s and d are
// x and y. Another group on the way runs as one unit: reaching any of its nodes reaches every
// node its outputs feed (two regions that each read the other's output would deadlock even
// though no node-level path leaves either and comes back).
static int reaches(Merge* m, int s, int d, int x, int y) {
    Group* src = &m->groups[s];
    int hi = m->groups[d].hi;
    m->stack.n = 0;
    for (int k = 0; k < src->ext.n; ++k)
        if (!in_union(m, src->ext.v[k], x, y) && push(&m->stack, src->ext.v[k]) < 0) return -1;
    int gen = ++m->gen;
    while (m->stack.n) {
        int at = m->stack.v[--m->stack.n];
        if (m->seen[at] == gen) continue;
        m->seen[at] = gen;
        int g = m->group[at];
        const int* feeds_from = &at;
        int n_from = 1;
        if (g >= 0 && m->groups[g].members.n > 1) {
            if (m->crossed[g] == gen || m->groups[g].lo > hi) continue;
            m->crossed[g] = gen;
            feeds_from = m->groups[g].members.v;
            n_from = m->groups[g].members.n;
        } else if (at > hi) {
            continue;
        }
        for (int f = 0; f < n_from; ++f) {
            int from = feeds_from[f];
            for (int k = m->users_at[from]; k < m->users_at[from + 1]; ++k) {
                int u = m->users.v[k];
                if (m->group[u] == d) return 1;
                if (!in_union(m, u, x, y) && push(&m->stack, u) < 0) return -1;
            }
        }
    }
    return 0;
}

// The values x | y read from outside (into *out, distinct); 0, or -1 with an exception.
static int outside(Merge* m, const Ints* a, const Ints* b, int x, int y, Ints* out) {
    int gen = ++m->gen;
    for (int part = 0; part < 2; ++part) {
        const Ints* s = part ? b : a;
        for (int k = 0; k < s->n; ++k) {
            int p = s->v[k];
            if (in_union(m, p, x, y) || m->seen[p] == gen) continue;
            m->seen[p] = gen;
            if (push(out, p) < 0) return -1;
        }
    }
    return 0;
}

// The values of v[from .. to] that group x reads from outside (distinct) as *out, a slice of
// v where that is all of them; 0, or -1 with an exception.
static int outside_of(Merge* m, const Ints* v, int from, int to, int x, Ints* out) {
    Ints slice = {to > from ? v->v + from : NULL, to - from, 0};
    int gen = ++m->gen, all = 1;
    for (int k = 0; all && k < slice.n; ++k) {
        int p = slice.v[k];
        all = !in_union(m, p, x, x) && m->seen[p] != gen;
        m->seen[p] = gen;
    }
    if (all) *out = slice;
    return all ? 0 : outside(m, &slice, &(Ints){0}, x, x, out);
}

static int concat(Ints* out, const Ints* a, const Ints* b) {
    for (int part = 0; part < 2; ++part) {
        const Ints* s = part ? b : a;
        for (int k = 0; k < s->n; ++k)
            if (push(out, s->v[k]) < 0) return -1;
    }
    return 0;
}

// Merge groups x and y when the union makes a valid region (dvm.cluster's docstring): 1 when
// merged, 0 when not, -1 with an exception.
static int try_merge(Merge* m, int x, int y) {
    Group *gx = &m->groups[x], *gy = &m->groups[y];
    if (gx->seg != gy->seg) return 0;
    for (int k = 0; k < gx->partners.n; ++k)
        if (m->group[gx->partners.v[k]] == y) return 0;
    for (int k = 0; k < gy->partners.n; ++k)
        if (m->group[gy->partners.v[k]] == x) return 0;
    Shape domain = gx->domain;
    if (!equal(&gx->domain, &gy->domain)) {
        int64_t big = gx->big > gy->big ? gx->big : gy->big;
        if (!broadcast(&gx->domain, &gy->domain, &domain) || numel(&domain) != big) return 0;
    }
    Ints inputs = {0}, outputs = {0}, ext = {0}, partners = {0};
    int result = -1;
    if (outside(m, &gx->inputs, &gy->inputs, x, y, &inputs) < 0) goto done;
    result = 0;
    if (inputs.n > g.max_inputs) goto done;
    int stores = 0;
    for (int part = 0; part < 2; ++part) {
        const Ints* s = part ? &gy->outputs : &gx->outputs;
        for (int k = 0; k < s->n; ++k) {
            int o = s->v[k], read_outside = 0;
            for (int u = m->users_at[o]; !read_outside && u < m->users_at[o + 1]; ++u)
                read_outside = !in_union(m, m->users.v[u], x, y);
            if (!read_outside) continue;
            if (storable(&m->dshape[o], &domain) < 0) goto done;
            int base = o;  // stored, a view of a value outside would be a copy: eager's view
            while (m->flags[base] & ALIASING && in_union(m, m->arg0[base], x, y))
                base = m->arg0[base];  // sees that value's updates
            if (m->flags[base] & ALIASING) goto done;
            if (m->flags[o] & EXPANDS && in_union(m, m->arg0[o], x, y) &&
                numel(&m->dshape[o]) > numel(&m->dshape[m->arg0[o]]))
                goto done;  // stored, it would widen the domain: eager's expand is a view
            result = -1;
            if (push(&outputs, o) < 0) goto done;
            result = 0;
            stores += !(m->flags[o] & ALIASING && in_union(m, m->arg0[o], x, y));
        }
    }
    if (stores > g.max_outputs) goto done;
    long long cost = gx->cost + gy->cost;
    if (cost + inputs.n + outputs.n > g.max_instrs) goto done;
    int found = reaches(m, x, y, x, y);
    if (found == 0) found = reaches(m, y, x, x, y);
    if (found != 0) {
        result = found < 0 ? -1 : 0;
        goto done;
    }
    result = -1;
    if (outside(m, &gx->ext, &gy->ext, x, y, &ext) < 0 ||
        concat(&partners, &gx->partners, &gy->partners) < 0)
        goto done;
    int keep = gx->members.n >= gy->members.n ? x : y, gone = keep == x ? y : x;
    Group *big = &m->groups[keep], *small = &m->groups[gone];
    for (int k = 0; k < small->members.n; ++k) {
        if (push(&big->members, small->members.v[k]) < 0) goto done;
        m->group[small->members.v[k]] = keep;
    }
    big->lo = gx->lo < gy->lo ? gx->lo : gy->lo;
    big->hi = gx->hi > gy->hi ? gx->hi : gy->hi;
    big->domain = domain;
    big->big = numel(&domain);
    big->cost = cost;
    Ints* fresh[] = {&inputs, &outputs, &ext, &partners};
    Ints* held[] = {&big->inputs, &big->outputs, &big->ext, &big->partners};
    for (int k = 0; k < 4; ++k) {
        drop(held[k]);
        *held[k] = *fresh[k];
        *fresh[k] = (Ints){NULL, 0, 0};
    }
    Ints* others[] = {&small->members, &small->inputs, &small->outputs, &small->ext,
                      &small->partners};
    for (int k = 0; k < 5; ++k) drop(others[k]);
    result = 1;
done:
    drop(&inputs);
    drop(&outputs);
    drop(&ext);
    drop(&partners);
    return result;
}

// The ops of merge's work_ids (a frozenset of their ids), kept for the frozenset last given
// (held): a table of their addresses, open addressing, NULL where empty.
static struct {
    PyObject* set;
    void** ops;
    size_t mask;
} work;

static size_t slot_of(const void* op) {
    return (size_t)((((uintptr_t)op >> 4) * 0x9E3779B97F4A7C15u) >> 32) & work.mask;
}

// Whether op stands for an eager kernel: its id in the work_ids that work holds.
static int is_work(const void* op) {
    for (size_t k = slot_of(op); work.ops[k] != NULL; k = (k + 1) & work.mask)
        if (work.ops[k] == op) return 1;
    return 0;
}

// Hold the ops of `set` (work_ids) in work unless they are held; 0, or -1 with an exception.
static int hold_work(PyObject* set) {
    if (set == work.set) return 0;
    size_t cap = 8;
    while (cap < 2 * (size_t)PySet_GET_SIZE(set)) cap *= 2;
    void** ops = PyMem_Calloc(cap, sizeof(void*));
    PyObject *it = ops != NULL ? PyObject_GetIter(set) : NULL, *id;
    if (ops == NULL) PyErr_NoMemory();
    PyMem_Free(work.ops);
    Py_CLEAR(work.set);
    work.ops = ops;
    work.mask = cap - 1;
    while (it != NULL && (id = PyIter_Next(it)) != NULL) {
        void* op = PyLong_Check(id) ? PyLong_AsVoidPtr(id) : NULL;
        Py_DECREF(id);
        if (op == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "merge: work_ids must hold the ids of ops");
            break;
        }
        size_t k = slot_of(op);
        while (ops[k] != NULL && ops[k] != op) k = (k + 1) & work.mask;
        ops[k] = op;
    }
    Py_XDECREF(it);
    if (PyErr_Occurred()) return -1;
    work.set = Py_NewRef(set);
    return 0;
}

// Node `p`'s number (the analysis's index of it); -1 with an exception when it has none.
static int number(PyObject* index, PyObject* p, int n) {
    Py_INCREF(p);  // a lookup may run Python code (__hash__, __eq__) that drops it
    PyObject* at = PyDict_GetItemWithError(index, p);
    if (at == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, p);
    Py_DECREF(p);
    long k = at != NULL ? PyLong_AsLong(at) : -1;
    if (k == -1 && PyErr_Occurred()) return -1;
    if (k < 0 || k >= n) {
        PyErr_Format(PyExc_ValueError, "dvm merge: index %ld of a node is not among %d", k, n);
        return -1;
    }
    return (int)k;
}

// The numbers of the nodes in `seq` (a node's users, a dict: its keys; or a sequence)
// appended to *out; 0, or -1.
static int numbers(PyObject* index, PyObject* seq, int n, Ints* out) {
    PyObject *key, *value;
    if (PyDict_CheckExact(seq)) {
        for (Py_ssize_t at = 0; PyDict_Next(seq, &at, &key, &value);) {
            int k = number(index, key, n);
            if (k < 0 || push(out, k) < 0) return -1;
        }
        return 0;
    }
    PyObject* items =
        PySequence_Fast(seq, "dvm merge: a node's users and operands must be iterable");
    if (items == NULL) return -1;
    int failed = 0;
    for (Py_ssize_t k = 0; !failed && k < PySequence_Fast_GET_SIZE(items); ++k) {
        int at = number(index, PySequence_Fast_GET_ITEM(items, k), n);
        failed = at < 0 || push(out, at) < 0;
    }
    Py_DECREF(items);
    return failed ? -1 : 0;
}

// `dict[node]`, a new reference; NULL with an exception (KeyError when missing).
static PyObject* entry(PyObject* dict, PyObject* node) {
    PyObject* v = PyDict_GetItemWithError(dict, node);
    if (v == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, node);
    return Py_XNewRef(v);
}

static int read_held_shape(PyObject* dict, PyObject* node, Shape* out) {
    PyObject* shape = entry(dict, node);
    if (shape == NULL) return -1;
    int failed = read_shape(shape, out);
    Py_DECREF(shape);
    return failed;
}

static long long read_int(PyObject* dict, PyObject* node) {
    PyObject* v = entry(dict, node);
    long long x = v != NULL ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    return x;
}

// Node i of the graph read into m (its users, and an analysed node's arguments and cut
// operands, appended to m's lists); 0, or -1 with an exception.
static int read_node(Merge* m, Tables* t, PyObject* node, int i) {
    if (number(t->index, node, m->n) != i) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "dvm merge: the nodes are not the analysis's");
        return -1;
    }
    PyObject* users = field(node, F_USERS, g.s_users);
    if (users == NULL) return -1;
    int failed = numbers(t->index, users, m->n, &m->users);
    Py_DECREF(users);
    if (failed) return -1;
    int analysed = PyDict_Contains(t->dshape, node);
    if (analysed <= 0) return analysed;
    Group* gr = &m->groups[i];
    *gr = (Group){.lo = i, .hi = i};
    m->group[i] = i;
    gr->seg = read_int(t->segment, node);
    if (PyErr_Occurred()) return -1;
    gr->cost = read_int(t->cost, node);
    if (PyErr_Occurred() || read_held_shape(t->dshape, node, &m->dshape[i]) < 0 ||
        read_held_shape(t->footprint, node, &gr->domain) < 0)
        return -1;
    gr->big = numel(&gr->domain);
    PyObject* seq = entry(t->args, node);
    failed = seq == NULL || numbers(t->index, seq, m->n, &m->args) < 0;
    Py_XDECREF(seq);
    seq = failed ? NULL : entry(t->cut, node);
    failed = seq == NULL || numbers(t->index, seq, m->n, &m->cut) < 0;
    Py_XDECREF(seq);
    if (failed) return -1;
    PyObject* target = field(node, F_TARGET, g.s_target);
    if (target == NULL) return -1;
    int aliasing = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(g.aliasing); ++k)
        aliasing |= PyTuple_GET_ITEM(g.aliasing, k) == target;
    m->flags[i] = (aliasing ? ALIASING : 0) | (target == g.expand_op ? EXPANDS : 0) |
                  (is_work(target) ? WORKS : 0);
    Py_DECREF(target);
    if (!aliasing) return 0;
    PyObject* args = node_field(node, g.s__args, g.s_args);
    PyObject* x = args != NULL ? PySequence_GetItem(args, 0) : NULL;
    Py_XDECREF(args);
    if (x == NULL) return -1;
    int known = PyDict_Contains(t->index, x);
    m->arg0[i] = known > 0 ? number(t->index, x, m->n) : -1;
    Py_DECREF(x);
    return known < 0 || (known > 0 && m->arg0[i] < 0) ? -1 : 0;
}

// Each analysed node's group: itself, reading its arguments from outside, read by its users,
// kept apart from its cut operands (a cut edge keeps its ends apart both ways); 0, or -1.
static int start_groups(Merge* m) {
    for (int i = 0; i < m->n; ++i) {
        m->ids[i] = i;
        if (m->group[i] < 0) continue;
        Group* gr = &m->groups[i];
        gr->members = gr->outputs = (Ints){&m->ids[i], 1, 0};
        gr->partners = (Ints){m->cut.v + m->cut_at[i], m->cut_at[i + 1] - m->cut_at[i], 0};
        if (outside_of(m, &m->args, m->args_at[i], m->args_at[i + 1], i, &gr->inputs) < 0 ||
            outside_of(m, &m->users, m->users_at[i], m->users_at[i + 1], i, &gr->ext) < 0)
            return -1;
    }
    for (int c = 0; c < m->n; ++c)
        for (int k = m->cut_at[c]; k < m->cut_at[c + 1]; ++k) {
            int p = m->cut.v[k];
            if (m->group[p] >= 0 && push(&m->groups[p].partners, c) < 0) return -1;
        }
    return 0;
}

static void free_merge(Merge* m) {
    for (int i = 0; i < m->n; ++i) {
        if (m->group[i] < 0) continue;  // an analysed node's group, or one merged into another
        Group* gr = &m->groups[i];
        Ints* held[] = {&gr->members, &gr->inputs, &gr->outputs, &gr->ext, &gr->partners};
        for (int k = 0; k < 5; ++k) drop(held[k]);
    }
    Ints* lists[] = {&m->users, &m->args, &m->cut, &m->stack};
    for (int k = 0; k < 4; ++k) drop(lists[k]);
}

// The `count` live (seen at the current generation) or other `members` of a group, as a new
// list of their nodes in graph order; NULL with an exception.
static PyObject* members_list(Merge* m, Ints* members, PyObject* nodes, int count, int live) {
    PyObject* list = PyList_New(count);
    for (int k = 0, at = 0; list != NULL && at < count; ++k) {
        int x = members->v[k];
        if ((m->seen[x] == m->gen) == live)
            PyList_SET_ITEM(list, at++, Py_NewRef(PyTuple_GET_ITEM(nodes, x)));
    }
    return list;
}

// The groups ordered by their first node, each (live, dead, work): its members in graph order
// whose values something reads (a node outside the group, or a live member), the others (an
// empty tuple when none: dead code), and how many live ones stand for an eager kernel.
static PyObject* groups_of(Merge* m, PyObject* nodes) {
    PyObject* out = PyList_New(0);
    PyObject* none = PyTuple_New(0);
    int gen = ++m->gen;
    for (int i = 0; i < m->n; ++i) {  // each merged group's members refilled in graph order
        int g = m->group[i];
        Ints* members = g >= 0 ? &m->groups[g].members : NULL;
        if (members == NULL || !members->cap) continue;  // a group of one borrows its member
        if (m->crossed[g] != gen) members->n = 0;
        m->crossed[g] = gen;
        members->v[members->n++] = i;
    }
    gen = ++m->gen;
    for (int i = 0; out != NULL && none != NULL && i < m->n; ++i) {
        int g = m->group[i];
        if (g < 0 || m->crossed[g] == gen) continue;
        m->crossed[g] = gen;
        Ints* members = &m->groups[g].members;
        int live = 0;
        long work = 0;
        for (int k = members->n - 1; k >= 0; --k) {  // users come later in the graph
            int x = members->v[k], read = 0;
            for (int j = m->users_at[x]; !read && j < m->users_at[x + 1]; ++j) {
                int u = m->users.v[j];
                read = m->group[u] != g || m->seen[u] == gen;
            }
            if (read) {
                m->seen[x] = gen;
                ++live;
                work += (m->flags[x] & WORKS) != 0;
            }
        }
        PyObject* item = PyTuple_New(3);
        if (item != NULL) {
            PyTuple_SET_ITEM(item, 0, members_list(m, members, nodes, live, 1));
            PyTuple_SET_ITEM(item, 1, live < members->n
                                          ? members_list(m, members, nodes, members->n - live, 0)
                                          : Py_NewRef(none));
            PyTuple_SET_ITEM(item, 2, PyLong_FromLong(work));
        }
        if (item == NULL || !PyTuple_GET_ITEM(item, 0) || !PyTuple_GET_ITEM(item, 1) ||
            !PyTuple_GET_ITEM(item, 2) || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    Py_XDECREF(none);
    if (none == NULL) Py_CLEAR(out);
    return out;
}

// Merge along producer->consumer edges in graph order, then siblings: groups reading one
// value load it once. 0, or -1 with an exception.
static int grow(Merge* m) {
    for (int c = 0; c < m->n; ++c) {
        if (m->group[c] < 0) continue;
        for (int k = m->args_at[c]; k < m->args_at[c + 1]; ++k) {
            int p = m->args.v[k], gp = m->group[p], cut = 0;
            for (int j = m->cut_at[c]; j < m->cut_at[c + 1]; ++j) cut |= m->cut.v[j] == p;
            if (gp >= 0 && gp != m->group[c] && !cut && try_merge(m, gp, m->group[c]) < 0)
                return -1;
        }
    }
    for (int p = 0; p < m->n; ++p) {
        int first = -1;
        for (int k = m->users_at[p]; k < m->users_at[p + 1]; ++k) {
            int u = m->users.v[k], gu = m->group[u];
            if (gu < 0) continue;
            if (first < 0) {
                first = gu;
            } else if (gu != first) {
                int merged = try_merge(m, first, gu);
                if (merged < 0) return -1;
                if (merged) first = m->group[u];
            }
        }
    }
    return 0;
}

// merge(analysis, nodes, work_ids): the groups (see groups_of) of the analysed nodes of
// nodes (the list the analysis ran on), ordered by their first node; work_ids the ids of the
// ops that stand for an eager kernel (a frozenset).
PyObject* dvm_merge(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 3 || !PyFrozenSet_CheckExact(argv[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "merge(analysis, nodes, work_ids): work_ids must be a frozenset");
        return NULL;
    }
    PyObject* nodes = graph_nodes("merge", argv, 2);
    if (nodes == NULL) return NULL;
    Py_ssize_t size = PyTuple_GET_SIZE(nodes);
    if (size >= INT32_MAX / 2) {
        Py_DECREF(nodes);
        return PyErr_Format(PyExc_ValueError, "dvm merge: %zd nodes is too many", size);
    }
    // the per-node arrays in one block, on the stack for a graph of up to some 50 nodes; an
    // analysed node's group set as it is read, the generation stamps zeroed
    Merge m = {.n = (int)size};
    size_t n = (size_t)size + 1;
    size_t bytes = n * (sizeof(Group) + sizeof(Shape) + 8 * sizeof(int) + 1);
    int64_t local[2048];  // its end, next to the callers' frames, the likelier in cache
    char* block = bytes <= sizeof local ? (char*)(local + 2048 - (bytes + 7) / 8)
                                        : PyMem_Malloc(bytes);
    PyObject* out = NULL;
    Tables t = {NULL};
    int failed = block == NULL;
    if (failed) {
        PyErr_NoMemory();
    } else {
        m.groups = (Group*)block;
        m.dshape = (Shape*)(m.groups + n);
        int** ints[] = {&m.group, &m.arg0, &m.users_at, &m.args_at,
                        &m.cut_at, &m.ids, &m.seen,     &m.crossed};
        for (int k = 0; k < 8; ++k) *ints[k] = (int*)(m.dshape + n) + k * n;
        m.flags = (unsigned char*)(m.group + 8 * n);
        memset(m.seen, 0, 2 * n * sizeof(int));
        m.users_at[0] = m.args_at[0] = m.cut_at[0] = 0;
        for (int i = 0; i < m.n; ++i) m.group[i] = m.arg0[i] = -1;
        failed = hold_work(argv[2]) < 0 || open_tables(argv[0], &t) < 0;
    }
    for (int i = 0; !failed && i < m.n; ++i) {
        failed = read_node(&m, &t, PyTuple_GET_ITEM(nodes, i), i) < 0;
        m.users_at[i + 1] = m.users.n;
        m.args_at[i + 1] = m.args.n;
        m.cut_at[i + 1] = m.cut.n;
    }
    if (!failed && start_groups(&m) == 0 && grow(&m) == 0) out = groups_of(&m, nodes);
    close_tables(&t);
    if (block != NULL) free_merge(&m);
    if (bytes > sizeof local) PyMem_Free(block);
    Py_DECREF(nodes);
    return out;
}

// n.<name>, its field f read directly where set (member()), else looked up by name: 1 with a
// new reference in *out, 0 when n has none, -1 with an exception.
static int node_link(PyObject* n, int f, PyObject* name, PyObject** out) {
    PyObject* v = member(n, f);
    if (v != NULL) {
        *out = Py_NewRef(v);
        return 1;
    }
    return lookup_attr(n, name, out);
}

// nodes(graph): list(graph.nodes) of a torch.fx Graph, read from its linked list (the graph's
// _root, each node's _next; a node marked _erased skipped, as torch.fx's iterator does) where
// the graph and its nodes have those fields, else through graph.nodes.
PyObject* dvm_nodes(PyObject* module, PyObject* graph) {
    PyObject *root, *out = PyList_New(0);
    int found = out != NULL ? lookup_attr(graph, g.s__root, &root) : -1;
    if (found <= 0) goto slow;
    PyObject* n = NULL;
    found = lookup_attr(root, g.s__next, &n);
    while (found > 0 && n != root) {
        PyObject* erased;
        found = node_link(n, F_ERASED, g.s__erased, &erased);
        if (found > 0) {
            int skip = erased == Py_False ? 0 : PyObject_IsTrue(erased);
            Py_DECREF(erased);
            found = skip < 0 || (!skip && PyList_Append(out, n) < 0) ? -1 : 1;
        }
        PyObject* next = NULL;
        if (found > 0) found = node_link(n, F_NEXT, g.s__next, &next);
        Py_SETREF(n, next);
    }
    Py_XDECREF(n);
    Py_DECREF(root);
    if (found > 0) return out;
slow:
    if (found == 0) {  // not torch.fx's linked list: its iterator then
        Py_DECREF(out);
        PyObject* view = PyObject_GetAttr(graph, g.s_nodes);
        out = view != NULL ? PySequence_List(view) : NULL;
        Py_XDECREF(view);
        return out;
    }
    Py_XDECREF(out);
    return NULL;
}

// domain(analysis, members): the shape the members' footprints broadcast to, when one of them
// spans it; ValueError when they do not broadcast or only to an outer product.
static PyObject* domain(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 2) {
        PyErr_SetString(PyExc_TypeError, "domain(analysis, members)");
        return NULL;
    }
    PyObject* members = PySequence_Fast(argv[1], "domain: members must be a sequence of nodes");
    if (members == NULL) return NULL;
    PyObject* feet = PySequence_Fast_GET_SIZE(members) ? table(argv[0], g.s_footprint, 0) : NULL;
    PyObject* out = NULL;
    Shape acc = {0}, foot, wider;
    int64_t widest = 0;
    if (feet == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "domain: no members");
    for (Py_ssize_t k = 0; feet != NULL && k < PySequence_Fast_GET_SIZE(members); ++k) {
        if (read_held_shape(feet, PySequence_Fast_GET_ITEM(members, k), &foot) < 0) goto done;
        if (k == 0) acc = foot;
        if (!equal(&acc, &foot)) {
            if (!broadcast(&acc, &foot, &wider)) {
                PyErr_SetString(PyExc_ValueError, "members do not broadcast to one domain");
                goto done;
            }
            acc = wider;
        }
        int64_t size = numel(&foot);
        widest = size > widest ? size : widest;
    }
    if (feet == NULL || (out = shape_tuple(&acc)) == NULL) goto done;
    if (numel(&acc) != widest) {
        PyErr_Format(PyExc_ValueError, "domain %R spans more than any member (an outer product)",
                     out);
        Py_CLEAR(out);
    }
done:
    Py_XDECREF(feet);
    Py_DECREF(members);
    return out;
}

// storable(shape, domain): False when an output of domain shape `shape` is stored full over
// `domain`, True when row-reduced, None when the VM cannot store it.
static PyObject* py_storable(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    Shape shape, dom;
    if (argc != 2) {
        PyErr_SetString(PyExc_TypeError, "storable(shape, domain)");
        return NULL;
    }
    if (read_shape(argv[0], &shape) < 0 || read_shape(argv[1], &dom) < 0) return NULL;
    int kind = storable(&shape, &dom);
    if (kind < 0) Py_RETURN_NONE;
    return PyBool_FromLong(kind);
}

// Resolve the attributes read directly (g.node_type's fields, FakeTensor's getters) and
// whether isinstance(x, torch.Tensor) is the subtype check; 0, or -1 with an exception.
static int resolve(PyTypeObject* node_type) {
    PyObject* names[N_FIELDS] = {g.s_op,    g.s_target,  g.s_meta,         g.s_users, g.s__args,
                                 g.s__kwargs, g.s__input_nodes, g.s__next, g.s__erased};
    Py_XSETREF(g.node_type, (PyTypeObject*)Py_XNewRef(node_type));
    for (int f = 0; f < N_FIELDS; ++f)
        g.node_at[f] = node_type != NULL ? member_at(node_type, names[f]) : 0;
    PyTypeObject* fake = (PyTypeObject*)g.fake_tensor;
    g.get_shape = getter_of(fake, g.s_shape);
    g.get_dtype = getter_of(fake, g.s_dtype);
    g.tensor_check = 0;
    if (!PyType_Check(g.tensor) || !PyType_IsSubtype(fake, (PyTypeObject*)g.tensor)) return 0;
    PyObject* check = PyUnicode_InternFromString("__instancecheck__");
    if (check == NULL) return -1;
    g.tensor_check = _PyType_Lookup(Py_TYPE(g.tensor), check) ==
                     _PyType_Lookup(&PyType_Type, check);  // type's own
    Py_DECREF(check);
    return 0;
}

// setup(rules, tensor, cpu, dtype_codes, limits, bool_dtype, max_dims, kinds, callbacks,
// merging): rules by id(target); torch.Tensor; torch.device("cpu"); the VM's dtypes; each
// float dtype's largest finite value; torch.bool; MAX_DIMS; (POINTWISE, REDUCE, ROW, EXPAND,
// CONST); (eager, eager_memo, rule_reason, value_fact, reduced_dims), eager(node) giving
// (whether it has a side effect, why it stays eager) for a node with no rule, and eager_memo
// the dict of those results by id(target) that it fills where the op alone decides; (the
// aliasing ops, aten.expand, MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS); (FakeTensor, the ids of
// the pointwise ops that may give a bool result (a set), (_check_reduce, _check_view,
// _check_to_copy, _check_div_mode, _check_bitwise, _row_check(1), _row_check(2)), MAX_ROW,
// VIEW_REFUSAL) [, torch.fx.Node, whose fields are read at their offsets].
static PyObject* setup(PyObject* module, PyObject* args) {
    PyObject *rules, *tensor, *cpu, *codes, *limits, *bool_dtype, *max_dims, *kinds, *callbacks;
    PyObject *aliasing, *expand_op, *fake_tensor, *bool_out, *checks, *view_refusal;
    PyTypeObject* node_type = NULL;
    long max_in, max_out, max_instrs, max_row;
    if (!PyArg_ParseTuple(args, "O!OOO!O!OO!O!O!(O!Olll)(O!O!O!lU)|O!", &PyDict_Type, &rules, &tensor,
                          &cpu, &PyDict_Type, &codes, &PyDict_Type, &limits, &bool_dtype,
                          &PyLong_Type, &max_dims, &PyTuple_Type, &kinds, &PyTuple_Type,
                          &callbacks, &PyTuple_Type, &aliasing, &expand_op, &max_in, &max_out,
                          &max_instrs, &PyType_Type, &fake_tensor, &PyFrozenSet_Type, &bool_out,
                          &PyTuple_Type, &checks, &max_row, &view_refusal, &PyType_Type,
                          &node_type))
        return NULL;
    PyObject** check_slots[] = {&g.check_reduce,   &g.check_view,    &g.check_to_copy,
                                &g.check_div_mode, &g.check_bitwise, &g.check_row[1],
                                &g.check_row[2]};
    Py_ssize_t n_checks = sizeof check_slots / sizeof check_slots[0];
    if (PyTuple_GET_SIZE(checks) != n_checks) {
        PyErr_Format(PyExc_TypeError, "setup: %zd checks, not %zd", n_checks,
                     PyTuple_GET_SIZE(checks));
        return NULL;
    }
    if (PyTuple_GET_SIZE(kinds) != 5 || PyTuple_GET_SIZE(callbacks) != 5 ||
        !PyDict_Check(PyTuple_GET_ITEM(callbacks, 1))) {
        PyErr_SetString(PyExc_TypeError, "setup: 5 kinds and 5 callbacks, the second a dict");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_checks; ++i)
        Py_XSETREF(*check_slots[i], Py_NewRef(PyTuple_GET_ITEM(checks, i)));
    Py_XSETREF(g.fake_tensor, Py_NewRef(fake_tensor));
    Py_XSETREF(g.bool_out, Py_NewRef(bool_out));
    Py_XSETREF(g.view_refusal, Py_NewRef(view_refusal));
    g.max_row = max_row;
    PyObject* given[] = {rules, tensor, cpu, codes, limits, bool_dtype, aliasing, expand_op};
    PyObject** held[] = {&g.rules,  &g.tensor,     &g.cpu,      &g.dtype_codes,
                         &g.limits, &g.bool_dtype, &g.aliasing, &g.expand_op};
    for (int i = 0; i < 8; ++i) Py_XSETREF(*held[i], Py_NewRef(given[i]));
    g.max_rank = PyLong_AsLong(max_dims);
    if (g.max_rank == -1 && PyErr_Occurred()) return NULL;
    g.max_inputs = max_in;
    g.max_outputs = max_out;
    g.max_instrs = max_instrs;
    PyObject** kind_slots[] = {&g.pointwise, &g.reduce, &g.row, &g.expand, &g.constant};
    PyObject** call_slots[] = {&g.eager, &g.eager_memo, &g.rule_reason, &g.value_fact,
                               &g.reduced_dims};
    for (int i = 0; i < 5; ++i) {
        Py_XSETREF(*kind_slots[i], Py_NewRef(PyTuple_GET_ITEM(kinds, i)));
        Py_XSETREF(*call_slots[i], Py_NewRef(PyTuple_GET_ITEM(callbacks, i)));
    }
    if (resolve(node_type) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "Hand the module dvm.lower's rules, constants and helpers."},
    {"run", (PyCFunction)(void (*)(void))dvm_run, METH_FASTCALL,
     "run(analysis, nodes): fill a dvm.cluster._Analysis's tables for nodes; whether one "
     "lacks the fake value it needs."},
    {"merge", (PyCFunction)(void (*)(void))dvm_merge, METH_FASTCALL,
     "merge(analysis, nodes, work_ids): the groups of analysed nodes that make regions, each "
     "(live members, dead members, how many live ones stand for an eager kernel)."},
    {"nodes", dvm_nodes, METH_O, "nodes(graph): list(graph.nodes) of a torch.fx Graph."},
    {"domain", (PyCFunction)(void (*)(void))domain, METH_FASTCALL,
     "domain(analysis, members): the domain of a region of members."},
    {"storable", (PyCFunction)(void (*)(void))py_storable, METH_FASTCALL,
     "storable(shape, domain): False stored full, True row-reduced, None not storable."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._analysis",
    "The per-node analysis and merging of dvm's clustering.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__analysis(void) {
    Name names[] = {
        {&g.s_op, "op"},           {&g.s_target, "target"},
        {&g.s_args, "args"},       {&g.s_kwargs, "kwargs"},
        {&g.s_meta, "meta"},       {&g.s_val, "val"},
        {&g.s_all_input_nodes, "all_input_nodes"},
        {&g.s_kind, "kind"},       {&g.s_check, "check"},
        {&g.s_cost, "cost"},       {&g.s_dtype, "dtype"},
        {&g.s_device, "device"},   {&g.s_shape, "shape"},
        {&g.s_call_function, "call_function"},
        {&g.s_call_method, "call_method"}, {&g.s_call_module, "call_module"},
        {&g.s_index, "index"},     {&g.s_segment, "segment"},
        {&g.s_fallbacks, "fallbacks"}, {&g.s_facts, "facts"},
        {&g.s_dshape, "dshape"},   {&g.s_cut, "cut"},
        {&g.s_footprint, "footprint"}, {&g.s_users, "users"},
        {&g.s__args, "_args"},     {&g.s__kwargs, "_kwargs"},
        {&g.s__input_nodes, "_input_nodes"}, {&g.s__fake_device, "_fake_device"},
        {&g.s_fake_mode, "fake_mode"}, {&g.s_in_kernel_invocation, "in_kernel_invocation"},
        {&g.s_dim, "dim"},         {&g.s_rounding_mode, "rounding_mode"},
        {&g.s_placeholder, "placeholder"},
        {&g.s__root, "_root"},     {&g.s__next, "_next"},
        {&g.s__erased, "_erased"}, {&g.s_nodes, "nodes"},
    };
    if (INTERN_NAMES(names) < 0) return NULL;
    PyObject* module = PyModule_Create(&module_def);
    if (module != NULL && dvm_add_compile(module) < 0) Py_CLEAR(module);
    return module;
}
