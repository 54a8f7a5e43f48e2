// partial_allreduce's blocking call in one compiled entry (partial_now.cpp): CPython
// functions that bindings.cpp registers in pycoll._C.
#pragma once

#include <Python.h>

namespace pycoll::partial_now {

// partial_bind(shared, uses, comms, broken, abandoned, gate, (comm, byte, request_null,
// undefined, in_place), me, size, tag_ub, spin, route, clone, failed): the per-world state
// that pycoll.partial keeps (read and counted here too), the engine's Gate and the
// functions the entry calls; given when pycoll.partial first runs on a world.
// partial_bind(None): none (pycoll.shutdown).
PyObject* bind(PyObject*, PyObject* args);
// partial_settings(enabled, cache_after, direct_bytes, doubling_from, chunk_bytes, timeout, spin):
// given again whenever the settings change.
PyObject* configure(PyObject*, PyObject* args);
// partial_now(x, inplace, ranks, op, name): the result (x itself in place), or None where
// the general path must run it.
PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t nargs);

}  // namespace pycoll::partial_now
