// Attributes read without the generic lookup: the descriptors a type's objects are read through,
// resolved once at setup (torch.fx.Node's fields, FakeTensor's getters and stride method), for
// every C module of the compile. A module reads an object directly only where its type is
// exactly the one resolved, and by name otherwise.
#ifndef DVM_FIELDS_H
#define DVM_FIELDS_H

#include <Python.h>
#include <structmember.h>

// The offset of type's C member `name` where the generic lookup reads an object's attribute
// there (a member descriptor of an object field); 0 when it is not one.
static inline Py_ssize_t member_at(PyTypeObject* type, PyObject* name) {
    PyObject* d = type->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(type, name) : NULL;
    // a member of type or a base: a descriptor of another type's (set into a class dict)
    // refuses type's objects, and its offset is not theirs
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
        !PyType_IsSubtype(type, PyDescr_TYPE(d)))
        return 0;
    PyMemberDef* m = ((PyMemberDescrObject*)d)->d_member;
    int plain = (m->type == T_OBJECT || m->type == T_OBJECT_EX) && !(m->flags & READ_RESTRICTED);
    return plain ? m->offset : 0;
}

// type's getter of `name` where the generic lookup reads an object's attribute through it (a
// getset descriptor); NULL when it is not one.
static inline PyGetSetDef* getter_of(PyTypeObject* type, PyObject* name) {
    PyObject* d = type->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(type, name) : NULL;
    if (d == NULL || !Py_IS_TYPE(d, &PyGetSetDescr_Type) ||
        !PyType_IsSubtype(type, PyDescr_TYPE(d)))  // another type's getter: as member_at
        return NULL;
    PyGetSetDef* def = ((PyGetSetDescrObject*)d)->d_getset;
    return def->get != NULL ? def : NULL;
}

// type's C method `name` where the generic lookup finds it (a method descriptor, which an
// object's own __dict__ could only shadow by an assignment to that name), borrowed; NULL when
// it is not one.
static inline PyObject* method_of(PyTypeObject* type, PyObject* name) {
    PyObject* d = type->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(type, name) : NULL;
    return d != NULL && Py_IS_TYPE(d, &PyMethodDescr_Type) ? d : NULL;
}

// torch's check for __torch_function__ overrides, which each of a tensor subclass's getters and
// methods runs (it makes the str "__torch_function__" and looks it up on the tensor: ~1,000
// instructions a read), switched off around reads of an exact FakeTensor, whose override is
// torch's disabled one, so the reads give what they give with it on. Off means the state
// torch._C.DisableTorchFunctionSubclass sets, through its own __enter__ and __exit__ (the C
// functions, on one object); only while no torch function mode is active
// (torch._C._is_torch_function_mode_enabled), so no Python code runs while it is off.
typedef struct {
    PyObject* off;  // a torch._C.DisableTorchFunctionSubclass; NULL: never switched off
    PyCFunction enter, leave, modes;
    PyObject* modes_self;
    int leave_takes_args;  // __exit__ is METH_VARARGS (called with an empty tuple)
} Quiet;

// q resolved from torch._C where it has these functions as expected; left unresolved (reads
// keep the check) otherwise. 0, or -1 with an exception.
static inline int quiet_setup(Quiet* q) {
    Py_CLEAR(q->off);
    PyObject* torch_c = PyImport_ImportModule("torch._C");
    if (torch_c == NULL) return -1;
    PyObject* type = PyObject_GetAttrString(torch_c, "DisableTorchFunctionSubclass");
    PyObject* modes = type == NULL ? NULL
                                   : PyObject_GetAttrString(torch_c, "_is_torch_function_mode_enabled");
    Py_DECREF(torch_c);
    if (modes == NULL) {
        Py_XDECREF(type);
        PyErr_Clear();  // a torch without them: reads keep the check
        return 0;
    }
    PyObject *enter = NULL, *leave = NULL, *off = NULL;
    if (PyType_Check(type) && PyCFunction_Check(modes) &&
        PyCFunction_GET_FLAGS(modes) == METH_NOARGS) {
        PyObject* s_enter = PyUnicode_InternFromString("__enter__");
        PyObject* s_exit = PyUnicode_InternFromString("__exit__");
        if (s_enter != NULL && s_exit != NULL) {
            enter = method_of((PyTypeObject*)type, s_enter);
            leave = method_of((PyTypeObject*)type, s_exit);
        }
        Py_XDECREF(s_enter);
        Py_XDECREF(s_exit);
        if (PyErr_Occurred()) goto done;
    }
    if (enter != NULL && leave != NULL) {
        PyMethodDef* e = ((PyMethodDescrObject*)enter)->d_method;
        PyMethodDef* l = ((PyMethodDescrObject*)leave)->d_method;
        int leave_flags = l->ml_flags & ~METH_COEXIST;
        if ((e->ml_flags & ~METH_COEXIST) == METH_NOARGS &&
            (leave_flags == METH_NOARGS || leave_flags == METH_VARARGS)) {
            if ((off = PyObject_CallNoArgs(type)) == NULL) goto done;
            if (!PyObject_TypeCheck(off, (PyTypeObject*)type)) {
                Py_CLEAR(off);
                goto done;
            }
            q->enter = e->ml_meth;
            q->leave = l->ml_meth;
            q->leave_takes_args = leave_flags == METH_VARARGS;
            q->modes = PyCFunction_GET_FUNCTION(modes);
            q->modes_self = PyCFunction_GET_SELF(modes);
            q->off = off;
        }
    }
done:
    Py_DECREF(type);
    Py_DECREF(modes);
    return PyErr_Occurred() ? -1 : 0;
}

// Switch the check off for reads of v: 1 when it is off (quiet_end after the reads), 0 when
// not (v is not exactly `fake`, a mode is active, or q unresolved), -1 with an exception.
static inline int quiet_begin(Quiet* q, PyObject* v, PyTypeObject* fake) {
    if (q->off == NULL || Py_TYPE(v) != fake) return 0;
    PyObject* on = q->modes(q->modes_self, NULL);
    if (on == NULL) return -1;
    Py_DECREF(on);
    if (on != Py_False) return 0;
    PyObject* done = q->enter(q->off, NULL);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 1;
}

// Switch the check back on after quiet_begin gave 1: 0, or -1 with an exception where that
// failed (an exception already set is kept, and 0 given).
static inline int quiet_end(Quiet* q) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject* none = PyTuple_New(0);
    PyObject* done = none == NULL ? NULL : q->leave(q->off, q->leave_takes_args ? none : NULL);
    Py_XDECREF(none);
    if (done == NULL && type == NULL) return -1;
    Py_XDECREF(done);
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, trace);
    }
    return 0;
}

#endif
