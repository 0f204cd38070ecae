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

#endif
