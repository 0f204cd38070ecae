// dvm._analysis.compile: dvm.compile.compile_graph's common case in one C call, part of the
// dvm._analysis module (csrc/analysis.c).
//
// The graph's nodes, their analysis and merging (analysis.c), each group's region built
// (dvm._emitter's build_region), each region's runner prepared (dvm._launcher's prepare) and
// the graph scheduled (dvm._executor's schedule), the result objects made without their Python
// __init__: what compile_graph, dvm.cluster._cluster and RegionRunner.__init__ do in Python,
// without their frames (a compile right after tracing reaches each of them through cold
// caches). What is rare stays in Python, handed over by setup_compile: a group that does not
// build as one region is split by dvm.cluster._split_parts, a graph dvm._executor cannot
// schedule in place is ordered by dvm.compile's reorder; a graph with a node lacking its fake
// value gives None, for compile_graph's Python path to fill and analyse again.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>

#include "analysis.h"
#include "clock.h"
#include "errors.h"
#include "names.h"

enum { N_ANALYSIS_TABLES = 9 };

static struct {
    // build_region and schedule are looked up where they live (dvm.cluster, dvm._executor) at
    // each call, as the Python path does: whatever replaced them there is called
    PyObject *analysis, *cluster, *prepare, *executor_module, *runner, *clustering, *compiled;
    PyObject *work_ids, *dead, *alone, *no_work, *names, *split, *reorder, *unprepared;
    PyObject* executor;  // the compiled graph's executor name
    PyObject *s_build_region, *s_schedule, *s_nodes, *s_missing_meta, *s_region, *s___name__,
        *s___qualname__, *s__guarded, *s__inputs, *s__results, *s_prepare_us, *s_regions,
        *s_fallbacks, *s_cluster_us, *s_notes, *s_run, *s_runners, *s_clustering, *s_total_us,
        *s_schedule_us, *s_executor, *s_eager_runs;
    PyObject* tables[N_ANALYSIS_TABLES];  // the names of _Analysis's tables
    int tables_list[N_ANALYSIS_TABLES];   // which are lists (the others dicts)
} c;

// An object of `type` made without calling it, its attributes set in order (names[i] to
// values[i], borrowed): a new reference, or NULL with an exception.
static PyObject* bare(PyObject* type, PyObject* const* names, PyObject* const* values, int n) {
    PyObject* empty = PyTuple_New(0);
    PyTypeObject* t = (PyTypeObject*)type;
    PyObject* made = empty != NULL ? t->tp_new(t, empty, NULL) : NULL;
    Py_XDECREF(empty);
    for (int i = 0; made != NULL && i < n; ++i)
        if (PyObject_SetAttr(made, names[i], values[i]) < 0) Py_CLEAR(made);
    return made;
}

// A float in µs of the seconds between `from` and `to`, a new reference.
static PyObject* micros(double from, double to) { return PyFloat_FromDouble((to - from) * 1e6); }

// (node, why) appended to list out for each node of seq; 0, or -1 with an exception.
static int left(PyObject* out, PyObject* seq, PyObject* why) {
    PyObject* fast = PySequence_Fast(seq, "dvm compile: a group's nodes must be a sequence");
    if (fast == NULL) return -1;
    int failed = 0;
    for (Py_ssize_t i = 0; !failed && i < PySequence_Fast_GET_SIZE(fast); ++i) {
        PyObject* pair = PyTuple_Pack(2, PySequence_Fast_GET_ITEM(fast, i), why);
        failed = pair == NULL || PyList_Append(out, pair) < 0;
        Py_XDECREF(pair);
    }
    Py_DECREF(fast);
    return failed ? -1 : 0;
}

// Region `region`, standing for `work` eager kernels (an int), appended to regions when that
// is at least min_ops, else its nodes to fallbacks, each with why it stays eager; 0, or -1
// with an exception.
static int take(PyObject* region, PyObject* work, long min_ops, PyObject* regions,
                PyObject* fallbacks) {
    long count = PyLong_AsLong(work);
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count >= min_ops) return PyList_Append(regions, region);
    PyObject* ops = PyObject_GetAttr(region, c.s_nodes);
    int failed = ops == NULL || left(fallbacks, ops, count ? c.alone : c.no_work) < 0;
    Py_XDECREF(ops);
    return failed ? -1 : 0;
}

// Group `members` (standing for `work` eager kernels) built as one region, or where it does
// not build (a ValueError) the parts dvm.cluster._split_parts makes of it (noting it, its
// dropped nodes in fallbacks), each taken (take()); 0, or -1 with an exception.
static int build(PyObject* members, PyObject* work, PyObject* a, long min_ops,
                 PyObject* regions, PyObject* fallbacks, PyObject* notes) {
    PyObject* build_region = PyObject_GetAttr(c.cluster, c.s_build_region);
    PyObject* built =
        build_region ? PyObject_CallFunctionObjArgs(build_region, members, a, NULL) : NULL;
    Py_XDECREF(build_region);
    if (built != NULL) {
        int failed = take(built, work, min_ops, regions, fallbacks);
        Py_DECREF(built);
        return failed;
    }
    if (!PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
    PyObject* error = take_raised();
    PyObject* parts =
        PyObject_CallFunctionObjArgs(c.split, members, a, error, notes, fallbacks, NULL);
    Py_DECREF(error);
    PyObject* fast = parts != NULL ? PySequence_Fast(parts, "dvm compile: parts") : NULL;
    Py_XDECREF(parts);
    int failed = fast == NULL;
    for (Py_ssize_t k = 0; !failed && k < PySequence_Fast_GET_SIZE(fast); ++k) {
        PyObject *region, *count;
        failed = !PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, k), "OO", &region, &count) ||
                 take(region, count, min_ops, regions, fallbacks) < 0;
    }
    Py_XDECREF(fast);
    return failed ? -1 : 0;
}

// The regions of the analysed graph (nodes) and its fallbacks and notes, appended to the
// lists given: dvm.cluster._cluster's loop over the merged groups. 0, or -1 with an exception.
static int cluster(PyObject* module, PyObject* a, PyObject* nodes, long min_ops,
                   PyObject* regions, PyObject* fallbacks, PyObject* notes) {
    PyObject* argv[] = {a, nodes, c.work_ids};
    PyObject* groups = dvm_merge(module, argv, 3);
    if (groups == NULL) return -1;
    int failed = !PyList_CheckExact(groups);
    if (failed) PyErr_SetString(PyExc_TypeError, "dvm compile: merge gave no list");
    for (Py_ssize_t i = 0; !failed && i < PyList_GET_SIZE(groups); ++i) {
        PyObject* group = PyList_GET_ITEM(groups, i);
        if (!PyTuple_CheckExact(group) || PyTuple_GET_SIZE(group) != 3) {
            PyErr_SetString(PyExc_TypeError, "dvm compile: a group is not (live, dead, work)");
            failed = 1;
            break;
        }
        PyObject *members = PyTuple_GET_ITEM(group, 0), *dead = PyTuple_GET_ITEM(group, 1);
        failed = left(fallbacks, dead, c.dead) < 0;
        Py_ssize_t size = failed ? -1 : PyObject_Length(members);
        if (size > 0)
            failed = build(members, PyTuple_GET_ITEM(group, 2), a, min_ops, regions, fallbacks,
                           notes) < 0;
        else
            failed = size < 0;
    }
    Py_DECREF(groups);
    return failed ? -1 : 0;
}

// RegionRunner(region, number) made without its __init__ (dvm.compile.RegionRunner's fields):
// a new reference, or NULL with an exception.
static PyObject* runner(PyObject* region, Py_ssize_t number) {
    PyObject* key = PyLong_FromSsize_t(number);
    if (key == NULL) return NULL;
    PyObject* name = PyDict_GetItemWithError(c.names, key);  // borrowed
    if (name == NULL && !PyErr_Occurred()) {
        PyObject* made = PyUnicode_FromFormat("dvm_region_%zd", number);
        name = made != NULL ? PyDict_SetDefault(c.names, key, made) : NULL;
        Py_XDECREF(made);
    }
    Py_DECREF(key);
    if (name == NULL) return NULL;
    double t0 = perf_seconds();
    PyObject* prepared = t0 < 0 && PyErr_Occurred() ? NULL : PyObject_CallOneArg(c.prepare, region);
    if (prepared == NULL) return NULL;
    double t1 = perf_seconds();
    PyObject* spent = t1 < 0 && PyErr_Occurred() ? NULL : micros(t0, t1);
    PyObject* out = NULL;
    if (spent != NULL && PyTuple_CheckExact(prepared) && PyTuple_GET_SIZE(prepared) == 3) {
        PyObject* names[] = {c.s_region,   c.s___name__, c.s___qualname__, c.s__guarded,
                             c.s__inputs,  c.s__results, c.s_prepare_us};
        PyObject* values[] = {region,
                              name,
                              name,
                              PyTuple_GET_ITEM(prepared, 0),
                              PyTuple_GET_ITEM(prepared, 1),
                              PyTuple_GET_ITEM(prepared, 2),
                              spent};
        out = bare(c.runner, names, values, 7);
    } else if (spent != NULL) {
        PyErr_SetString(PyExc_TypeError, "dvm compile: prepare gave no (guarded, inputs, results)");
    }
    Py_XDECREF(spent);
    Py_DECREF(prepared);
    return out;
}

// Region k of regions, whose runner raised (the exception set), taken out of regions and handed
// with the exception to dvm.compile's _unprepared (its nodes left to eager with why, a warning)
// where the exception is an Exception; 0, or -1 with an exception.
static int unprepared(PyObject* regions, Py_ssize_t k, PyObject* fallbacks, PyObject* notes) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject* error = take_raised();
    PyObject* region = Py_NewRef(PyList_GET_ITEM(regions, k));
    PyObject* handled = PyList_SetSlice(regions, k, k + 1, NULL) < 0
                            ? NULL
                            : PyObject_CallFunctionObjArgs(c.unprepared, region, error, fallbacks,
                                                           notes, NULL);
    Py_DECREF(region);
    Py_XDECREF(error);
    Py_XDECREF(handled);
    return handled != NULL ? 0 : -1;
}

// A new dvm.cluster._Analysis of nodes, analysed (analysis.c's run), *missing_meta set to
// whether a node lacks its fake value; NULL with an exception.
static PyObject* analysed(PyObject* module, PyObject* nodes, int* missing_meta) {
    PyObject* values[N_ANALYSIS_TABLES + 1];
    PyObject* names[N_ANALYSIS_TABLES + 1];
    int made = 0, failed = 0;
    for (; made < N_ANALYSIS_TABLES && !failed; ++made) {
        names[made] = c.tables[made];
        values[made] = c.tables_list[made] ? PyList_New(0) : PyDict_New();
        failed = values[made] == NULL;
    }
    names[N_ANALYSIS_TABLES] = c.s_nodes;
    values[N_ANALYSIS_TABLES] = nodes;
    PyObject* a = failed ? NULL : bare(c.analysis, names, values, N_ANALYSIS_TABLES + 1);
    for (int i = 0; i < made; ++i) Py_XDECREF(values[i]);
    if (a == NULL) return NULL;
    PyObject* argv[] = {a, nodes};
    PyObject* missing = dvm_run(module, argv, 2);
    if (missing == NULL || PyObject_SetAttr(a, c.s_missing_meta, missing) < 0) Py_CLEAR(a);
    else *missing_meta = missing == Py_True;
    Py_XDECREF(missing);
    return a;
}

// compile(gm, graph, min_ops, t0): the CompiledGraph of gm (whose graph is `graph`) timed
// from t0 (perf_counter() at the call), or None where a node lacks its fake value.
static PyObject* compile(PyObject* module, PyObject* const* argv, Py_ssize_t argc) {
    if (argc != 4 || !PyLong_Check(argv[2]) || !PyFloat_Check(argv[3])) {
        PyErr_SetString(PyExc_TypeError, "compile(gm, graph, min_ops, t0): an int and a float");
        return NULL;
    }
    if (c.compiled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dvm._analysis.setup_compile() was not called");
        return NULL;
    }
    PyObject *gm = argv[0], *graph = argv[1];
    int overflow;
    long min_ops = PyLong_AsLongAndOverflow(argv[2], &overflow);
    if (min_ops == -1 && PyErr_Occurred()) return NULL;
    if (overflow) min_ops = overflow > 0 ? LONG_MAX : LONG_MIN;  // more than any group's work
    double t0 = PyFloat_AS_DOUBLE(argv[3]);
    PyObject* nodes = dvm_nodes(module, graph);
    if (nodes == NULL) return NULL;
    int fill = 0;  // a node lacks its fake value: compile_graph's Python path fills them
    PyObject *a = analysed(module, nodes, &fill), *out = NULL, *clustering = NULL, *run = NULL;
    PyObject* lists[3] = {PyList_New(0), PyList_New(0), PyList_New(0)};
    PyObject *regions = lists[0], *notes = lists[1], *runners = lists[2], *fallbacks = NULL;
    if (a == NULL || !regions || !notes || !runners) goto done;
    if (fill) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject* first = PyObject_GetAttr(a, c.s_fallbacks);  // the analysis's, copied
    fallbacks = first != NULL ? PySequence_List(first) : NULL;
    Py_XDECREF(first);
    if (fallbacks == NULL || cluster(module, a, nodes, min_ops, regions, fallbacks, notes) < 0)
        goto done;
    double t = perf_seconds();
    PyObject* spent = t < 0 && PyErr_Occurred() ? NULL : micros(t0, t);
    if (spent == NULL) goto done;
    PyObject* cluster_names[] = {c.s_regions, c.s_fallbacks, c.s_cluster_us, c.s_notes};
    PyObject* cluster_values[] = {regions, fallbacks, spent, notes};
    clustering = bare(c.clustering, cluster_names, cluster_values, 4);
    Py_DECREF(spent);
    if (clustering == NULL) goto done;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(regions);) {  // k: the runners made so far
        PyObject* made = runner(PyList_GET_ITEM(regions, k), k);
        if (made == NULL) {
            if (unprepared(regions, k, fallbacks, notes) < 0) goto done;
            continue;
        }
        int failed = PyList_Append(runners, made) < 0;
        Py_DECREF(made);
        if (failed) goto done;
        ++k;
    }
    double t1 = perf_seconds();
    if (t1 < 0 && PyErr_Occurred()) goto done;
    PyObject* schedule = PyObject_GetAttr(c.executor_module, c.s_schedule);
    run = schedule ? PyObject_CallFunctionObjArgs(schedule, gm, nodes, runners, NULL) : NULL;
    Py_XDECREF(schedule);
    if (run == Py_None) {
        Py_SETREF(run, PyObject_CallFunctionObjArgs(c.reorder, gm, nodes, runners, NULL));
    }
    double t2 = run != NULL ? perf_seconds() : -1.0;
    if (t2 < 0 && PyErr_Occurred()) goto done;
    PyObject* total = micros(t0, t2);
    PyObject* scheduling = micros(t1, t2);
    PyObject* zero = PyLong_FromLong(0);
    if (total != NULL && scheduling != NULL && zero != NULL) {
        PyObject* names[] = {c.s_run,      c.s_runners,     c.s_clustering, c.s_total_us,
                             c.s_schedule_us, c.s_executor, c.s_eager_runs};
        PyObject* values[] = {run, runners, clustering, total, scheduling, c.executor, zero};
        out = bare(c.compiled, names, values, 7);
    }
    Py_XDECREF(total);
    Py_XDECREF(scheduling);
    Py_XDECREF(zero);
done:
    Py_XDECREF(run);
    Py_XDECREF(clustering);
    Py_XDECREF(fallbacks);
    for (int i = 0; i < 3; ++i) Py_XDECREF(lists[i]);
    Py_XDECREF(a);
    Py_DECREF(nodes);
    return out;
}

// setup_compile(analysis, tables, cluster, prepare, executor_module, runner, clustering,
// compiled, work_ids, (dead, alone, no_work), names, split, reorder, unprepared, executor):
// dvm.cluster._Analysis and the names of its tables (each a list when its default is one,
// else a dict), the module dvm.cluster (whose build_region builds a group) and dvm._executor
// (whose schedule schedules the graph), the calls and types compile() uses, the fallback
// reasons, the runners' names by number (a dict it fills) and what takes a region whose runner
// raised.
static PyObject* setup_compile(PyObject* module, PyObject* args) {
    PyObject *analysis, *tables, *cluster_module, *prepare, *executor_module, *runner_type;
    PyObject* clustering;
    PyObject *compiled, *work_ids, *dead, *alone, *no_work, *names, *split;
    PyObject *reorder, *unprepared_call, *executor;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!O!O!O!(UUU)O!OOOU", &PyType_Type, &analysis,
                          &PyDict_Type, &tables, &PyModule_Type, &cluster_module, &prepare,
                          &PyModule_Type, &executor_module, &PyType_Type, &runner_type,
                          &PyType_Type, &clustering, &PyType_Type,
                          &compiled, &PyFrozenSet_Type, &work_ids, &dead, &alone,
                          &no_work, &PyDict_Type, &names, &split, &reorder,
                          &unprepared_call, &executor))
        return NULL;
    if (PyDict_GET_SIZE(tables) != N_ANALYSIS_TABLES) {
        return PyErr_Format(PyExc_ValueError, "setup_compile: %d tables, not %zd",
                            N_ANALYSIS_TABLES, PyDict_GET_SIZE(tables));
    }
    Py_ssize_t pos = 0;
    PyObject *name, *is_list;
    for (int i = 0; PyDict_Next(tables, &pos, &name, &is_list); ++i) {
        if (!PyUnicode_CheckExact(name))
            return PyErr_Format(PyExc_TypeError, "setup_compile: a table's name is not a str");
        Py_XSETREF(c.tables[i], Py_NewRef(name));
        c.tables_list[i] = PyObject_IsTrue(is_list);
        if (c.tables_list[i] < 0) return NULL;
    }
    PyObject* given[] = {analysis,    cluster_module, prepare,  executor_module, runner_type,
                         clustering,  compiled,       work_ids, dead,            alone,
                         no_work,     names,          split,    reorder,         unprepared_call,
                         executor};
    PyObject** held[] = {&c.analysis,   &c.cluster,  &c.prepare,  &c.executor_module, &c.runner,
                         &c.clustering, &c.compiled, &c.work_ids, &c.dead,            &c.alone,
                         &c.no_work,    &c.names,    &c.split,    &c.reorder,         &c.unprepared,
                         &c.executor};
    for (size_t i = 0; i < sizeof given / sizeof given[0]; ++i)
        Py_XSETREF(*held[i], Py_NewRef(given[i]));
    Py_RETURN_NONE;
}

static PyMethodDef compile_methods[] = {
    {"setup_compile", setup_compile, METH_VARARGS,
     "Hand compile() the types, calls and reasons of dvm.cluster and dvm.compile."},
    {"compile", (PyCFunction)(void (*)(void))compile, METH_FASTCALL,
     "compile(gm, graph, min_ops, t0): dvm.compile.compile_graph's common case; None where a "
     "node lacks its fake value."},
    {NULL, NULL, 0, NULL},
};

int dvm_add_compile(PyObject* module) {
    Name strings[] = {
        {&c.s_build_region, "build_region"}, {&c.s_schedule, "schedule"},
        {&c.s_nodes, "nodes"},           {&c.s_missing_meta, "missing_meta"},
        {&c.s_region, "region"},         {&c.s___name__, "__name__"},
        {&c.s___qualname__, "__qualname__"}, {&c.s__guarded, "_guarded"},
        {&c.s__inputs, "_inputs"},       {&c.s__results, "_results"},
        {&c.s_prepare_us, "prepare_us"}, {&c.s_regions, "regions"},
        {&c.s_fallbacks, "fallbacks"},   {&c.s_cluster_us, "cluster_us"},
        {&c.s_notes, "notes"},           {&c.s_run, "run"},
        {&c.s_runners, "runners"},       {&c.s_clustering, "clustering"},
        {&c.s_total_us, "total_us"},     {&c.s_schedule_us, "schedule_us"},
        {&c.s_executor, "executor"},     {&c.s_eager_runs, "eager_runs"},
    };
    if (INTERN_NAMES(strings) < 0) return -1;
    return PyModule_AddFunctions(module, compile_methods);
}
