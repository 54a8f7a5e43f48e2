// partial_allreduce's blocking call in one compiled entry (partial_now.cpp): CPython
// functions that bindings.cpp registers in pycoll._C.
#pragma once

#include <Python.h>

#include "dtypes.h"
#include "partial.h"

namespace pycoll::partial_now {

// partial_bind(shared, uses, comms, broken, abandoned, (comm, byte, request_null,
// undefined, in_place), me, size, tag_ub, clone, failed): the per-world state that
// pycoll.partial keeps (read and counted here too) and the functions the entry calls;
// given when pycoll.partial first runs on a world. The engine's token, the tensor reader
// and the (op, dtype) routes are the short path's.
// partial_bind(None): none (pycoll.shutdown).
PyObject* bind(PyObject*, PyObject* args);
// partial_settings(enabled, cache_after, direct_bytes, doubling_from, chunk_bytes, timeout,
// group_of=None): given again whenever the settings change; group_of(members) paces each
// round under --link (short_path::Paced).
PyObject* configure(PyObject*, PyObject* args);
// partial_now(x, inplace, ranks, op, name): the result (x itself in place), or None where
// the general path must run it.
PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// For both Python callers of the exchange (run and _C.partial_allreduce):
// dtype and op names parsed; false with a ValueError naming the unknown one.
bool kinds_of(const char* dtype, const char* op, DType& dt, Op& reduce);
// partial::allreduce(r) without the GIL; false with a Python error (ValueError for
// settings out of range).
bool exchange(const partial::Round& r, partial::Outcome& out);
// The sends a failed round left reading, as a list of request handles; nullptr with an error.
PyObject* sends_of(const partial::Outcome& out);

}  // namespace pycoll::partial_now
