// The blocking allreduce's short path and the engine's claim/release (short_path.cpp):
// CPython functions that bindings.cpp registers in pycoll._C.
#pragma once

#include <Python.h>

namespace pycoll::short_path {

bool init();  // at import: interns the attribute names it reads; false with a Python error

// short_path_setup(**objects): the Python objects the short path reads, given once.
PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs);
// allreduce_now(x, inplace, op, group, name): the result (x itself in place), or None
// where the short path does not apply.
PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// engine_claim(engine, name) -> bool and engine_release(engine): Engine.claim/release.
PyObject* engine_claim(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* engine_release(PyObject*, PyObject* engine);
// short_path_runs() -> how many allreduces the short path has run in this process.
PyObject* count(PyObject*, PyObject*);

}  // namespace pycoll::short_path
