// An owned reference to a Python object, and a static type's common fields, for the C API
// code of the short paths, pacing and bindings.
#pragma once

#include <Python.h>

namespace pycoll {

// An owned reference, released when it goes out of scope.
class Ref {
   public:
    explicit Ref(PyObject* p = nullptr) : p_(p) {}
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    ~Ref() { Py_XDECREF(p_); }
    PyObject* get() const { return p_; }
    PyObject* release() { PyObject* p = p_; p_ = nullptr; return p; }
    void reset(PyObject* p) { Py_XDECREF(p_); p_ = p; }
    explicit operator bool() const { return p_ != nullptr; }

   private:
    PyObject* p_;
};

// A static type's fields every one of ours sets; the caller adds its constructor, methods
// and members, then PyType_Ready.
inline PyTypeObject type_of(const char* name, Py_ssize_t basicsize, const char* doc, destructor dealloc) {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = name;
    t.tp_basicsize = basicsize;
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = doc;
    t.tp_dealloc = dealloc;
    return t;
}

}  // namespace pycoll
