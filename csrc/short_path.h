// The blocking allreduce's short path and the engine's Gate (short_path.cpp): CPython
// functions and a type that bindings.cpp registers in pycoll._C.
#pragma once

#include <Python.h>

namespace pycoll::short_path {

bool init(PyObject* module);  // at import: adds Gate; false with a Python error

// short_path_setup(ndarray, is_torch, find_route, resolve, empty_like, mpi_error, in_place):
// the functions the short path calls, given once.
PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs);
// short_path_settings(enabled, max_bytes): given again whenever the settings change.
PyObject* configure(PyObject*, PyObject* args);
// short_path_bind(gate, world_handle, world_size) at init; short_path_bind(None) at shutdown.
PyObject* bind(PyObject*, PyObject* args);
// allreduce_now(x, inplace, op, group, name): the result (x itself in place), or None
// where the short path does not apply.
PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// short_path_runs() -> how many allreduces the short path has run in this process.
PyObject* count(PyObject*, PyObject*);

}  // namespace pycoll::short_path
