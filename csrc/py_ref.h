// An owned reference to a Python object, for the C API code of the short paths.
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

}  // namespace pycoll
