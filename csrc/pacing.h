// Collectives under --link (pycoll.emulation): each member's entry into a collective in a
// shared-memory file, and the sleep to the modelled end that every member computes alike
// (pacing.cpp). CPython types and functions that bindings.cpp registers in pycoll._C; the
// short path and partial_now call enter() and leave() without Python.
#pragma once

#include <Python.h>

namespace pycoll::pacing {

bool init(PyObject* module);  // at import: adds PaceGroup and PaceEntry; false with a Python error

// group.enter(kind, nbytes, issued): this rank's entry into collective `kind` (issued: when it
// was called, time.monotonic()'s clock), written where the other members read it; a new
// reference to a PaceEntry, nullptr with an error. `group` is a PaceGroup.
PyObject* enter(PyObject* group, PyObject* kind, Py_ssize_t nbytes, double issued);
// After the real collective: sleep until the modelled end (the same on every member), without
// the GIL. False with an error.
bool leave(PyObject* entry);

// pace_leave(entry), pace_bind(path, ranks, rank), pace_settings(latency, inverse_bandwidth,
// timeout), collective_time(kind, n, nbytes, latency, bandwidth), sleep_until(deadline),
// run_delay(), count_core_waits(on), counting_core_waits(), core_wait_woke(deadline, before,
// awake=-1, at=-1, delay=-1), core_wait_after(since, at=-1, delay=-1), precise_timers(): see
// bindings.cpp's docstrings.
PyObject* py_leave(PyObject*, PyObject* entry);
PyObject* bind(PyObject*, PyObject* args);
PyObject* settings(PyObject*, PyObject* args);
PyObject* collective_time(PyObject*, PyObject* args);
PyObject* sleep_until(PyObject*, PyObject* deadline);
PyObject* run_delay(PyObject*, PyObject*);
PyObject* count_core_waits(PyObject*, PyObject* on);
PyObject* counting_core_waits(PyObject*, PyObject*);
PyObject* core_wait_woke(PyObject*, PyObject* args);
PyObject* core_wait_after(PyObject*, PyObject* args);
PyObject* precise_timers(PyObject*, PyObject*);

}  // namespace pycoll::pacing
