// dvm._executor: the schedule's common case and the steps of a dvm.executor.Executor, in C.
//
// in_place(nodes, runners), the order dvm.compile._schedule tries first: the graph order with
// each region called where its last node was, or None when a node outside a region, placed
// between its nodes, reads one of them. build(gm, units) is what an Executor runs: the value
// slots (the inputs, the get_attr constants, then each call's results), each step's arguments
// with its nodes as _Slot references (inside tuples, lists and dicts too), the slots each step
// clears after their last use, and the output with its nodes as references. schedule(gm,
// nodes, runners) is both in one call, giving the Executor itself. dvm.executor's types and
// helpers come through setup().
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fields.h"
#include "names.h"

// The fields of torch.fx's Node read at their offsets (its _NodeBase's C members).
enum { F_OP, F_TARGET, F_INPUT_NODES, F_ARGS, F_KWARGS, N_FIELDS };
enum { N_EXECUTOR = 5 };  // an Executor's fields: n_inputs, n_slots, _constants, steps, _output

static struct {
    PyTypeObject *node, *slot, *step, *region_call, *executor;
    Py_ssize_t node_at[N_FIELDS];  // each field's offset (setup resolves it), 0: read by name
    PyObject *method, *attr;  // dvm.executor._method(name), _attr(gm, target)
    PyObject *s_args, *s_kwargs;  // a node's argument fields (the C members where torch has them)
    PyObject* s_fields[N_EXECUTOR];  // the names of an Executor's fields
    Py_ssize_t executor_at[N_EXECUTOR];  // their offsets (its __slots__), 0: set by name
    PyObject *s_op, *s_target, *s_input_nodes, *s_region, *s_nodes, *s_outputs, *s_inputs,
        *s_get_submodule, *s_placeholder, *s_call_function, *s_get_attr, *s_output,
        *s_call_module;
} g;

// A new `type` (a NamedTuple class: setup checked it subclasses tuple) holding the n `items`,
// made as that type directly (PyTuple_Pack then tuple.__new__ would make and copy a tuple).
// From 3.14 a tuple caches its hash, which tp_alloc's zeroed memory would leave as a cached 0:
// there only tuple.__new__ (which resets the cache) makes one.
static PyObject* typed(PyTypeObject* type, Py_ssize_t n, PyObject* const* items) {
#if PY_VERSION_HEX >= 0x030E0000
    PyObject* tuple = PyTuple_New(n);
    for (Py_ssize_t i = 0; tuple != NULL && i < n; ++i)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(items[i]));
    PyObject* packed = tuple ? PyTuple_Pack(1, tuple) : NULL;
    Py_XDECREF(tuple);
    PyObject* made = packed ? PyTuple_Type.tp_new(type, packed, NULL) : NULL;
    Py_XDECREF(packed);
#else
    PyObject* made = type->tp_alloc(type, n);
    for (Py_ssize_t i = 0; made != NULL && i < n; ++i)
        PyTuple_SET_ITEM(made, i, Py_NewRef(items[i]));
#endif
    return made;
}

// node.<name>, its field f: read at its offset where node is exactly a torch.fx.Node and the
// field is set, else by name; a new reference, or NULL with an exception.
static PyObject* field(PyObject* node, int f, PyObject* name) {
    if (Py_TYPE(node) == g.node && g.node_at[f] != 0) {
        PyObject* v = *(PyObject**)((char*)node + g.node_at[f]);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(node, name);
}

// Whether `op` is the str `name`; -1 with an exception when comparing fails.
static int is_op(PyObject* op, PyObject* name) {
    if (op == name) return 1;
    if (!PyUnicode_Check(op)) return 0;
    int cmp = PyUnicode_Compare(op, name);
    return cmp == -1 && PyErr_Occurred() ? -1 : cmp == 0;
}

// The slot number `slots` gives `node`; -1 with a KeyError when it gives none.
static Py_ssize_t slot_of(PyObject* slots, PyObject* node) {
    PyObject* s = PyDict_GetItemWithError(slots, node);
    if (s == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, node);
        return -1;
    }
    return PyLong_AsSsize_t(s);
}

// ---------------------------------------------------------------------------------------------
// in_place

// A RegionCall(runner, runner._inputs, runner.region.outputs).
static PyObject* region_call(PyObject* runner) {
    PyObject* inputs = PyObject_GetAttr(runner, g.s_inputs);
    PyObject* region = inputs ? PyObject_GetAttr(runner, g.s_region) : NULL;
    PyObject* outputs = region ? PyObject_GetAttr(region, g.s_outputs) : NULL;
    PyObject* fields[] = {runner, inputs, outputs};
    PyObject* call = outputs ? typed(g.region_call, 3, fields) : NULL;
    Py_XDECREF(inputs);
    Py_XDECREF(region);
    Py_XDECREF(outputs);
    return call;
}

// Whether `node` reads a node of a region that `owner` numbers other than `own` (its own, -1
// for none) begun and not ended (seen[r] of its count[r] nodes met): 1 when it does, 0 when
// not, -1 with an exception.
static int reads_open(PyObject* node, PyObject* owner, Py_ssize_t own, const Py_ssize_t* seen,
                      const Py_ssize_t* count) {
    PyObject* inputs = field(node, F_INPUT_NODES, g.s_input_nodes);
    if (inputs == NULL) return -1;
    if (!PyDict_Check(inputs)) {
        PyErr_Format(PyExc_TypeError, "dvm in_place: a node's inputs are %R, not a dict", inputs);
        Py_DECREF(inputs);
        return -1;
    }
    PyObject *p, *unused;
    Py_ssize_t pos = 0;
    int open = 0;
    while (open == 0 && PyDict_Next(inputs, &pos, &p, &unused)) {
        Py_INCREF(p);  // held: a key's __eq__ could change the dict
        PyObject* k = PyDict_GetItemWithError(owner, p);
        Py_ssize_t r = k != NULL ? PyLong_AsSsize_t(k) : -1;
        Py_DECREF(p);
        if (PyErr_Occurred()) open = -1;
        else if (r >= 0 && r != own) open = seen[r] > 0 && seen[r] < count[r];
    }
    Py_DECREF(inputs);
    return open;
}

// The order of in_place(node_list, runner_list) (the method's docstring): a list, or None
// when a reader comes earlier; NULL with an exception. One walk of the nodes: a region's call
// at its last node, the nodes outside regions as they come; a node that reads a region begun
// and not ended is such a reader.
static PyObject* placed(PyObject* node_list, PyObject* runner_list) {
    PyObject* nodes = PySequence_Tuple(node_list);  // held: a callback could change the lists
    PyObject* runners = nodes ? PySequence_Tuple(runner_list) : NULL;
    PyObject* owner = runners ? PyDict_New() : NULL;  // node -> its region's number
    PyObject* members = owner ? PyList_New(0) : NULL;  // each region's nodes, a tuple
    Py_ssize_t n_runners = runners ? PyTuple_GET_SIZE(runners) : 0;
    Py_ssize_t* count = PyMem_Calloc(2 * (size_t)n_runners + 1, sizeof(Py_ssize_t));
    Py_ssize_t* seen = count + n_runners;  // how many of count[r] nodes the walk met
    PyObject* order = NULL;
    if (count == NULL && members != NULL) PyErr_NoMemory();
    if (count == NULL || members == NULL) goto done;
    for (Py_ssize_t r = 0; r < n_runners; ++r) {
        PyObject* region = PyObject_GetAttr(PyTuple_GET_ITEM(runners, r), g.s_region);
        PyObject* list = region ? PyObject_GetAttr(region, g.s_nodes) : NULL;
        Py_XDECREF(region);
        PyObject* own = list ? PySequence_Tuple(list) : NULL;  // held, as the nodes
        Py_XDECREF(list);
        PyObject* k = own ? PyLong_FromSsize_t(r) : NULL;
        int failed = k == NULL || PyList_Append(members, own) < 0;
        if (!failed && PyTuple_GET_SIZE(own) == 0) {
            PyErr_Format(PyExc_ValueError, "dvm in_place: region %zd has no nodes", r);
            failed = 1;
        }
        Py_ssize_t before = PyDict_GET_SIZE(owner);
        for (Py_ssize_t i = 0; !failed && i < PyTuple_GET_SIZE(own); ++i)
            failed = PyDict_SetItem(owner, PyTuple_GET_ITEM(own, i), k) < 0;
        count[r] = PyDict_GET_SIZE(owner) - before;  // its distinct nodes
        Py_XDECREF(own);
        Py_XDECREF(k);
        if (failed) goto done;
    }
    order = PyList_New(0);
    for (Py_ssize_t i = 0; order != NULL && i < PyTuple_GET_SIZE(nodes); ++i) {
        PyObject* n = PyTuple_GET_ITEM(nodes, i);
        PyObject* k = PyDict_GetItemWithError(owner, n);
        Py_ssize_t r = k != NULL ? PyLong_AsSsize_t(k) : -1;
        int early = PyErr_Occurred() ? -1 : reads_open(n, owner, r, seen, count);
        if (early != 0) {
            Py_SETREF(order, early > 0 ? Py_NewRef(Py_None) : NULL);
            goto done;
        }
        PyObject* unit = NULL;
        if (r < 0) unit = Py_NewRef(n);
        else if (++seen[r] == count[r]) unit = region_call(PyTuple_GET_ITEM(runners, r));
        else continue;
        if (unit == NULL || PyList_Append(order, unit) < 0) Py_CLEAR(order);
        Py_XDECREF(unit);
    }
    for (Py_ssize_t r = 0; order != NULL && r < n_runners; ++r) {
        if (seen[r] == count[r]) continue;
        PyObject* own = PyList_GET_ITEM(members, r);  // a region node not among the nodes
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(own) && !PyErr_Occurred(); ++i) {
            int in = PySequence_Contains(nodes, PyTuple_GET_ITEM(own, i));
            if (in == 0) PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(own, i));
        }
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "dvm in_place: region %zd shares a node with another",
                         r);
        Py_CLEAR(order);
    }
done:
    PyMem_Free(count);
    Py_XDECREF(nodes);
    Py_XDECREF(runners);
    Py_XDECREF(owner);
    Py_XDECREF(members);
    return order;
}

// Whether the two arguments of `call` are lists and setup() was called; 0, or -1 with an
// exception.
static int two_lists(const char* call, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 2 || !PyList_Check(argv[0]) || !PyList_Check(argv[1])) {
        PyErr_Format(PyExc_TypeError, "%s takes two lists", call);
        return -1;
    }
    if (g.node == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._executor.setup() was not called");
        return -1;
    }
    return 0;
}

// in_place(nodes, runners): the order with each region called at its last node (the
// method's docstring), None when a reader comes earlier.
static PyObject* in_place(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    return two_lists("in_place(nodes, runners)", argv, argc) < 0 ? NULL : placed(argv[0], argv[1]);
}

// ---------------------------------------------------------------------------------------------
// build

typedef struct {  // one call of the schedule (references owned)
    PyObject *fn, *args, *kwargs, *outs;  // args and outs tuples; after map_call, with slots
    int region, flat;
} Call;

typedef struct {
    PyObject* slots;  // node -> slot number
    PyObject** refs;  // the _Slot of each slot number, made on its first use
    Py_ssize_t* last;  // the last step reading each slot, -1 before any
    Py_ssize_t* seen;  // the slots in the order of their first use by a step
    char* kept;  // whether the output holds the slot
    Py_ssize_t n_slots, n_seen, step;  // step: -1 while mapping the output
    int found;  // whether a node was met since it was last cleared
} Build;

// The _Slot of `node`, its use recorded (new reference); NULL with an exception.
static PyObject* use(Build* b, PyObject* node) {
    Py_ssize_t s = slot_of(b->slots, node);
    if (s < 0) return NULL;
    if (s >= b->n_slots) {
        PyErr_Format(PyExc_RuntimeError, "dvm executor: slot %zd out of range", s);
        return NULL;
    }
    if (b->refs[s] == NULL) {
        PyObject* index = PyLong_FromSsize_t(s);
        b->refs[s] = index ? typed(g.slot, 1, &index) : NULL;
        Py_XDECREF(index);
        if (b->refs[s] == NULL) return NULL;
    }
    b->found = 1;
    if (b->step < 0) b->kept[s] = 1;
    else {
        if (b->last[s] < 0) b->seen[b->n_seen++] = s;
        b->last[s] = b->step;
    }
    return Py_NewRef(b->refs[s]);
}

// `value` with each node inside tuples, lists and dicts its _Slot (dvm.executor._map's walk):
// a dict becomes a plain dict, a tuple or list without a node stays as it is (new reference).
static PyObject* ref(Build* b, PyObject* value) {
    if (PyObject_TypeCheck(value, g.node)) return use(b, value);
    if (PySlice_Check(value)) {  // torch.fx keeps nodes inside slices too: x[:, : x.size(1)]
        PySliceObject* s = (PySliceObject*)value;
        PyObject* lo = ref(b, s->start);
        PyObject* hi = lo != NULL ? ref(b, s->stop) : NULL;
        PyObject* step = hi != NULL ? ref(b, s->step) : NULL;
        PyObject* out = NULL;
        if (step != NULL) {
            int same = lo == s->start && hi == s->stop && step == s->step;
            out = same ? Py_NewRef(value) : PySlice_New(lo, hi, step);
        }
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        Py_XDECREF(step);
        return out;
    }
    int seq = (PyTuple_Check(value) || PyList_Check(value)) && !Py_IS_TYPE(value, g.slot);
    if (!seq && !PyDict_Check(value)) return Py_NewRef(value);
    if (Py_EnterRecursiveCall(" in dvm's executor build")) return NULL;
    PyObject* out = NULL;
    if (seq) {
        PyObject* items = PySequence_Tuple(value);  // held: the walk may run a subclass's code
        Py_ssize_t n = items ? PyTuple_GET_SIZE(items) : 0;
        PyObject* mapped = items ? PyTuple_New(n) : NULL;
        int changed = 0;
        for (Py_ssize_t i = 0; mapped != NULL && i < n; ++i) {
            PyObject* m = ref(b, PyTuple_GET_ITEM(items, i));
            if (m == NULL) Py_CLEAR(mapped);
            else {
                changed |= m != PyTuple_GET_ITEM(items, i);
                PyTuple_SET_ITEM(mapped, i, m);
            }
        }
        if (mapped != NULL && !changed) out = Py_NewRef(value);
        else if (mapped != NULL && PyTuple_CheckExact(value)) out = Py_NewRef(mapped);
        else if (mapped != NULL && PyList_CheckExact(value)) out = PySequence_List(mapped);
        else if (mapped != NULL) out = PyObject_CallOneArg((PyObject*)Py_TYPE(value), mapped);
        Py_XDECREF(items);
        Py_XDECREF(mapped);
    } else {
        PyObject* items = PyDict_Items(value);
        out = items ? PyDict_New() : NULL;
        for (Py_ssize_t i = 0; out != NULL && i < PyList_GET_SIZE(items); ++i) {
            PyObject* kv = PyList_GET_ITEM(items, i);
            PyObject* m = ref(b, PyTuple_GET_ITEM(kv, 1));
            if (m == NULL || PyDict_SetItem(out, PyTuple_GET_ITEM(kv, 0), m) < 0) Py_CLEAR(out);
            Py_XDECREF(m);
        }
        Py_XDECREF(items);
    }
    Py_LeaveRecursiveCall();
    return out;
}

// A node's argument field (its args tuple, or its kwargs); NULL with an exception.
static PyObject* node_field(PyObject* node, int f, int tuple) {
    PyObject* v = field(node, f, f == F_ARGS ? g.s_args : g.s_kwargs);
    if (v != NULL && tuple && !PyTuple_Check(v)) Py_SETREF(v, PySequence_Tuple(v));
    return v;
}

// The next slot (the count so far) given to `node` in `slots`, its number in *number where
// that is given (borrowed: `slots` holds it): 0, or -1 with a ValueError where a unit already
// gave it one (two units would share a slot) or another exception.
static int new_slot(PyObject* slots, PyObject* node, PyObject** number) {
    int there = PyDict_Contains(slots, node);
    if (there != 0) {
        if (there > 0) PyErr_Format(PyExc_ValueError, "dvm executor: %R is given twice", node);
        return -1;
    }
    PyObject* k = PyLong_FromSsize_t(PyDict_GET_SIZE(slots));
    int failed = k == NULL || PyDict_SetItem(slots, node, k) < 0;
    Py_XDECREF(k);
    if (!failed && number != NULL) *number = k;
    return failed ? -1 : 0;
}

// Each call of the units in `calls` (their count in *n_calls); the placeholders' slots, then
// the get_attr constants', in `slots` (the placeholders' count in *n_inputs), the constants'
// (slot, value) pairs in `constants`, the output node's value in *output. -1 with an
// exception.
static int read_units(PyObject* gm, PyObject* units, PyObject* slots, PyObject* constants,
                      Call* calls, Py_ssize_t* n_calls, Py_ssize_t* n_inputs,
                      PyObject** output) {
    Py_ssize_t n = PyTuple_GET_SIZE(units);
    for (Py_ssize_t i = 0; i < n; ++i) {  // the inputs first
        PyObject* u = PyTuple_GET_ITEM(units, i);
        if (Py_IS_TYPE(u, g.region_call)) continue;
        PyObject* op = field(u, F_OP, g.s_op);
        int is = op ? is_op(op, g.s_placeholder) : -1;
        Py_XDECREF(op);
        if (is < 0 || (is == 1 && new_slot(slots, u, NULL) < 0)) return -1;
    }
    *n_inputs = PyDict_GET_SIZE(slots);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* u = PyTuple_GET_ITEM(units, i);
        Call* c = &calls[*n_calls];
        if (Py_IS_TYPE(u, g.region_call)) {
            if (PyTuple_GET_SIZE(u) != 3) {
                PyErr_SetString(PyExc_TypeError, "dvm executor: a RegionCall of 3 fields");
                return -1;
            }
            c->region = 1;
            c->fn = Py_NewRef(PyTuple_GET_ITEM(u, 0));
            ++*n_calls;
            if ((c->args = PySequence_Tuple(PyTuple_GET_ITEM(u, 1))) == NULL ||
                (c->kwargs = PyDict_New()) == NULL ||
                (c->outs = PySequence_Tuple(PyTuple_GET_ITEM(u, 2))) == NULL)
                return -1;
            continue;
        }
        PyObject* op = field(u, F_OP, g.s_op);
        if (op == NULL) return -1;
        int kind = -1;  // 0 placeholder, 1 call_function, 2 get_attr, 3 output, 4 module, 5 other
        PyObject* names[] = {g.s_placeholder, g.s_call_function, g.s_get_attr, g.s_output,
                             g.s_call_module};
        for (int j = 0; j < 5 && kind < 0; ++j) {
            int is = is_op(op, names[j]);
            if (is < 0) {
                Py_DECREF(op);
                return -1;
            }
            if (is) kind = j;
        }
        Py_DECREF(op);
        if (kind == 0) continue;
        if (kind == 3) {
            PyObject* args = node_field(u, F_ARGS, 1);
            if (args == NULL) return -1;
            PyObject* value = PySequence_GetItem(args, 0);
            Py_DECREF(args);
            if (value == NULL) return -1;
            Py_XSETREF(*output, value);
            continue;
        }
        PyObject* target = field(u, F_TARGET, g.s_target);
        if (target == NULL) return -1;
        if (kind == 2) {
            PyObject* k = NULL;  // its slot's number, held by slots
            PyObject* value = new_slot(slots, u, &k) < 0
                                  ? NULL
                                  : PyObject_CallFunctionObjArgs(g.attr, gm, target, NULL);
            PyObject* pair = value ? PyTuple_Pack(2, k, value) : NULL;
            int failed = pair == NULL || PyList_Append(constants, pair) < 0;
            Py_XDECREF(value);
            Py_XDECREF(pair);
            Py_DECREF(target);
            if (failed) return -1;
            continue;
        }
        c->region = 0;
        if (kind == 1) c->fn = target;
        else {
            c->fn = kind == 4 ? PyObject_CallMethodOneArg(gm, g.s_get_submodule, target)
                              : PyObject_CallOneArg(g.method, target);
            Py_DECREF(target);
        }
        if (c->fn == NULL) return -1;
        ++*n_calls;
        if ((c->args = node_field(u, F_ARGS, 1)) == NULL ||
            (c->kwargs = node_field(u, F_KWARGS, 0)) == NULL ||
            (c->outs = PyTuple_Pack(1, u)) == NULL)
            return -1;
    }
    return 0;
}


// Call `k`'s arguments with slot references and its results as slot numbers, in place;
// whether it is flat (slots only at the top level of its args, none in its kwargs). -1 with
// an exception.
static int map_call(Build* b, Call* c, Py_ssize_t k) {
    b->step = k;
    c->flat = 1;
    Py_ssize_t n = PyTuple_GET_SIZE(c->args);
    PyObject* args = PyTuple_New(n);
    for (Py_ssize_t i = 0; args != NULL && i < n; ++i) {
        PyObject* a = PyTuple_GET_ITEM(c->args, i);
        b->found = 0;
        PyObject* m = ref(b, a);
        if (m == NULL) Py_CLEAR(args);
        else {
            c->flat &= !b->found || PyObject_TypeCheck(a, g.node);
            PyTuple_SET_ITEM(args, i, m);
        }
    }
    if (args == NULL) return -1;
    Py_SETREF(c->args, args);
    if (!PyDict_Check(c->kwargs)) {
        PyErr_Format(PyExc_TypeError, "dvm executor: kwargs %R are not a dict", c->kwargs);
        return -1;
    }
    if (PyDict_GET_SIZE(c->kwargs) > 0) {
        b->found = 0;
        PyObject* kwargs = ref(b, c->kwargs);  // a plain dict
        if (kwargs == NULL) return -1;
        Py_SETREF(c->kwargs, kwargs);
        c->flat &= !b->found;
    }
    Py_ssize_t n_outs = PyTuple_GET_SIZE(c->outs);
    PyObject* outs = PyTuple_New(n_outs);
    for (Py_ssize_t i = 0; outs != NULL && i < n_outs; ++i) {
        Py_ssize_t s = slot_of(b->slots, PyTuple_GET_ITEM(c->outs, i));
        PyObject* o = s < 0 ? NULL : PyLong_FromSsize_t(s);
        if (o == NULL) Py_CLEAR(outs);
        else PyTuple_SET_ITEM(outs, i, o);
    }
    if (outs == NULL) return -1;
    Py_SETREF(c->outs, outs);
    return 0;
}

// Each step's free slots (a list of tuples): the input and result slots the output does not
// hold, each at the step that reads it last, in the order of their first use.
static PyObject* frees(Build* b, Py_ssize_t n_steps, Py_ssize_t n_inputs, Py_ssize_t n_fixed) {
    Py_ssize_t* start = PyMem_Calloc((size_t)n_steps + 1, sizeof(Py_ssize_t));
    Py_ssize_t* order = PyMem_Calloc((size_t)b->n_seen + 1, sizeof(Py_ssize_t));
    PyObject* out = start && order ? PyList_New(n_steps) : NULL;
    if (out == NULL) {
        PyMem_Free(start);
        PyMem_Free(order);
        return start && order ? NULL : PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < b->n_seen; ++i) {  // count each step's frees, then place them
        Py_ssize_t s = b->seen[i];
        if ((s < n_inputs || s >= n_fixed) && !b->kept[s]) ++start[b->last[s] + 1];
    }
    for (Py_ssize_t k = 0; k < n_steps; ++k) start[k + 1] += start[k];
    for (Py_ssize_t i = 0; i < b->n_seen; ++i) {
        Py_ssize_t s = b->seen[i];
        if ((s < n_inputs || s >= n_fixed) && !b->kept[s]) order[start[b->last[s]]++] = s;
    }
    for (Py_ssize_t k = 0, from = 0; out != NULL && k < n_steps; from = start[k++]) {
        PyObject* free = PyTuple_New(start[k] - from);
        for (Py_ssize_t i = from; free != NULL && i < start[k]; ++i) {
            PyObject* v = PyLong_FromSsize_t(order[i]);
            if (v == NULL) Py_CLEAR(free);
            else PyTuple_SET_ITEM(free, i - from, v);
        }
        if (free == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, free);
    }
    PyMem_Free(start);
    PyMem_Free(order);
    return out;
}

// The Step of a mapped call with its free slots; NULL with an exception.
static PyObject* make_step(const Call* c, PyObject* free, PyObject* no_outs, PyObject* minus) {
    PyObject* fields[] = {c->fn,
                          c->args,
                          c->kwargs,
                          c->flat ? Py_True : Py_False,
                          c->region ? minus : PyTuple_GET_ITEM(c->outs, 0),
                          c->region ? c->outs : no_outs,
                          free};
    return typed(g.step, 7, fields);
}

// The fields of Executor(gm, units) (build's docstring) in `fields`, new references; 0, or
// -1 with an exception. `units` is a tuple, stolen.
static int built(PyObject* gm, PyObject* units, PyObject* fields[N_EXECUTOR]) {
    Py_ssize_t n_units = PyTuple_GET_SIZE(units), n_calls = 0, n_inputs = 0;
    Call* calls = PyMem_Calloc((size_t)n_units + 1, sizeof(Call));
    Build b = {.slots = PyDict_New()};
    PyObject *constants = PyList_New(0), *output = Py_NewRef(Py_None);
    int result = -1;
    PyObject *steps = NULL, *free = NULL, *no_outs = NULL, *minus = NULL;
    if (calls == NULL) PyErr_NoMemory();
    if (calls == NULL || b.slots == NULL || constants == NULL ||
        read_units(gm, units, b.slots, constants, calls, &n_calls, &n_inputs, &output) < 0)
        goto done;
    Py_ssize_t n_fixed = PyDict_GET_SIZE(b.slots);  // the inputs, then the constants
    for (Py_ssize_t k = 0; k < n_calls; ++k) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(calls[k].outs); ++i)
            if (new_slot(b.slots, PyTuple_GET_ITEM(calls[k].outs, i), NULL) < 0) goto done;
    }
    b.n_slots = PyDict_GET_SIZE(b.slots);
    b.refs = PyMem_Calloc((size_t)b.n_slots + 1, sizeof(PyObject*));
    b.last = PyMem_Malloc(((size_t)b.n_slots + 1) * sizeof(Py_ssize_t));
    b.seen = PyMem_Malloc(((size_t)b.n_slots + 1) * sizeof(Py_ssize_t));
    b.kept = PyMem_Calloc((size_t)b.n_slots + 1, 1);
    if (b.refs == NULL || b.last == NULL || b.seen == NULL || b.kept == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < b.n_slots; ++s) b.last[s] = -1;
    b.step = -1;
    Py_SETREF(output, ref(&b, output));
    if (output == NULL) goto done;
    for (Py_ssize_t k = 0; k < n_calls; ++k)
        if (map_call(&b, &calls[k], k) < 0) goto done;
    free = frees(&b, n_calls, n_inputs, n_fixed);
    steps = free ? PyList_New(n_calls) : NULL;
    no_outs = steps ? PyTuple_New(0) : NULL;
    minus = no_outs ? PyLong_FromLong(-1) : NULL;
    for (Py_ssize_t k = 0; minus != NULL && k < n_calls; ++k) {
        PyObject* step = make_step(&calls[k], PyList_GET_ITEM(free, k), no_outs, minus);
        if (step == NULL) goto done;
        PyList_SET_ITEM(steps, k, step);
    }
    if (minus != NULL) {
        fields[0] = PyLong_FromSsize_t(n_inputs);
        fields[1] = fields[0] ? PyLong_FromSsize_t(b.n_slots) : NULL;
        if (fields[1] == NULL) Py_XDECREF(fields[0]);
        else {
            fields[2] = Py_NewRef(constants);
            fields[3] = Py_NewRef(steps);
            fields[4] = Py_NewRef(output);
            result = 0;
        }
    }
done:
    for (Py_ssize_t k = 0; calls != NULL && k < n_calls; ++k) {
        Py_XDECREF(calls[k].fn);
        Py_XDECREF(calls[k].args);
        Py_XDECREF(calls[k].kwargs);
        Py_XDECREF(calls[k].outs);
    }
    for (Py_ssize_t s = 0; b.refs != NULL && s < b.n_slots; ++s) Py_XDECREF(b.refs[s]);
    PyMem_Free(calls);
    PyMem_Free(b.refs);
    PyMem_Free(b.last);
    PyMem_Free(b.seen);
    PyMem_Free(b.kept);
    Py_XDECREF(b.slots);
    Py_XDECREF(constants);
    Py_XDECREF(output);
    Py_XDECREF(steps);
    Py_XDECREF(free);
    Py_XDECREF(no_outs);
    Py_XDECREF(minus);
    Py_DECREF(units);
    return result;
}

// build(gm, units): (n_inputs, n_slots, constants, steps, output) of Executor(gm, units).
static PyObject* build(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 2)
        return PyErr_Format(PyExc_TypeError, "build(gm, units) takes 2 arguments, got %zd", argc);
    if (g.node == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._executor.setup() was not called");
        return NULL;
    }
    if (!PySequence_Check(argv[1]) || PyDict_Check(argv[1]))
        return PyErr_Format(PyExc_TypeError, "build(gm, units): units must be a sequence");
    PyObject* units = PySequence_Tuple(argv[1]);  // held: a callback could change a list
    PyObject* fields[N_EXECUTOR];
    if (units == NULL || built(argv[0], units, fields) < 0) return NULL;
    PyObject* out = PyTuple_New(N_EXECUTOR);
    for (int i = 0; i < N_EXECUTOR; ++i)
        if (out != NULL) PyTuple_SET_ITEM(out, i, fields[i]);
        else Py_DECREF(fields[i]);
    return out;
}

// schedule(gm, nodes, runners): Executor(gm, in_place(nodes, runners)), made here without
// its __init__ (which sets the fields build gives: here at their __slots__ offsets), or None
// where in_place gives None.
static PyObject* schedule(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 3 || !PyList_Check(argv[1]) || !PyList_Check(argv[2]))
        return PyErr_Format(PyExc_TypeError, "schedule(gm, nodes, runners): two lists after gm");
    if (g.node == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._executor.setup() was not called");
        return NULL;
    }
    PyObject* order = placed(argv[1], argv[2]);
    if (order == NULL || order == Py_None) return order;
    PyObject* units = PyList_AsTuple(order);
    Py_DECREF(order);
    PyObject* fields[N_EXECUTOR];
    if (units == NULL || built(argv[0], units, fields) < 0) return NULL;
    PyObject* empty = PyTuple_New(0);
    PyObject* run = empty ? g.executor->tp_new(g.executor, empty, NULL) : NULL;
    Py_XDECREF(empty);
    if (run != NULL && !PyObject_TypeCheck(run, g.executor)) {  // its slots are not there
        PyErr_Format(PyExc_TypeError, "schedule: %.100s.__new__ made a %.100s",
                     g.executor->tp_name, Py_TYPE(run)->tp_name);
        Py_CLEAR(run);
    }
    for (int i = 0; i < N_EXECUTOR; ++i) {
        if (run != NULL && g.executor_at[i] != 0)  // a new object's empty slot: fields[i] moves in
            *(PyObject**)((char*)run + g.executor_at[i]) = Py_NewRef(fields[i]);
        else if (run != NULL && PyObject_SetAttr(run, g.s_fields[i], fields[i]) < 0)
            Py_CLEAR(run);
        Py_DECREF(fields[i]);
    }
    return run;
}

// setup(Node, _Slot, Step, RegionCall, Executor, _method, _attr, fields): torch.fx.Node (whose
// fields are read at their offsets where they are C members); dvm.executor's NamedTuples,
// Executor and helpers; the names of a node's args and kwargs fields.
static PyObject* setup(PyObject* module, PyObject* args) {
    PyObject *node, *slot, *step, *call, *executor, *method, *attr, *s_args, *s_kwargs;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OO(UU)", &PyType_Type, &node, &PyType_Type, &slot,
                          &PyType_Type, &step, &PyType_Type, &call, &PyType_Type, &executor,
                          &method, &attr, &s_args, &s_kwargs))
        return NULL;
    PyObject* tuples[] = {slot, step, call};
    for (int i = 0; i < 3; ++i)
        if (!PyType_IsSubtype((PyTypeObject*)tuples[i], &PyTuple_Type))
            return PyErr_Format(PyExc_TypeError, "setup: %R is not a NamedTuple", tuples[i]);
    PyObject* given[] = {node, slot, step, call, executor, method, attr, s_args, s_kwargs};
    PyObject** held[] = {(PyObject**)&g.node,        (PyObject**)&g.slot,
                         (PyObject**)&g.step,        (PyObject**)&g.region_call,
                         (PyObject**)&g.executor,    &g.method,
                         &g.attr,                    &g.s_args,
                         &g.s_kwargs};
    for (int i = 0; i < 9; ++i) Py_XSETREF(*held[i], Py_NewRef(given[i]));
    PyObject* names[N_FIELDS] = {g.s_op, g.s_target, g.s_input_nodes, g.s_args, g.s_kwargs};
    for (int f = 0; f < N_FIELDS; ++f) g.node_at[f] = member_at(g.node, names[f]);
    for (int i = 0; i < N_EXECUTOR; ++i)
        g.executor_at[i] = member_at(g.executor, g.s_fields[i]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "Hand the module dvm.executor's types and helpers."},
    {"in_place", (PyCFunction)(void (*)(void))in_place, METH_FASTCALL,
     "in_place(nodes, runners): the graph order with each region called where its last node\n"
     "was, or None when a node outside a region, placed between its nodes, reads one of them\n"
     "(then the region must move before that node). Regions span no side effect, so moving a\n"
     "region's nodes down to its last one changes nothing else."},
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "build(gm, units): (n_inputs, n_slots, constants, steps, output) of an Executor."},
    {"schedule", (PyCFunction)(void (*)(void))schedule, METH_FASTCALL,
     "schedule(gm, nodes, runners): Executor(gm, in_place(nodes, runners)) in one call, or\n"
     "None where in_place gives None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dvm._executor",
    "The schedule's common case and the steps of dvm's Executor.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__executor(void) {
    Name names[] = {
        {&g.s_op, "op"},
        {&g.s_target, "target"},
        {&g.s_input_nodes, "_input_nodes"},
        {&g.s_region, "region"},
        {&g.s_nodes, "nodes"},
        {&g.s_outputs, "outputs"},
        {&g.s_inputs, "_inputs"},
        {&g.s_get_submodule, "get_submodule"},
        {&g.s_placeholder, "placeholder"},
        {&g.s_call_function, "call_function"},
        {&g.s_get_attr, "get_attr"},
        {&g.s_output, "output"},
        {&g.s_call_module, "call_module"},
        {&g.s_fields[0], "n_inputs"},
        {&g.s_fields[1], "n_slots"},
        {&g.s_fields[2], "_constants"},
        {&g.s_fields[3], "steps"},
        {&g.s_fields[4], "_output"},
    };
    if (INTERN_NAMES(names) < 0) return NULL;
    return PyModule_Create(&module_def);
}
