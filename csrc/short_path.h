// The blocking collectives' short path and the engine's Gate (short_path.cpp): CPython
// functions and a type that bindings.cpp registers in pycoll._C.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>

#include "dtypes.h"
#include "py_ref.h"

namespace pycoll::short_path {

bool init(PyObject* module);  // at import: adds Gate; false with a Python error

// short_path_setup(ndarray, is_torch, find_route, resolve, empty_like, huge_paged, empty, counts_dtype,
// failed, views, staging, alone_bytes, mpi_error, in_place, byte, int64): the functions
// and handles the short path uses, given once.
PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs);
// short_path_settings(enabled, max_bytes, fusion_threshold, group_of=None): given again whenever the
// settings change; group_of paces each collective under --link (Link).
PyObject* configure(PyObject*, PyObject* args);
// short_path_bind(gate, world_handle, world_size, world_group) at init (the world Group: its
// `carry`); short_path_bind(None) at shutdown.
PyObject* bind(PyObject*, PyObject* args);
// Each collective's short path: its result (as the public function returns it), or None
// where the short path does not apply and the general path must run it.
// allreduce_now(x, inplace, op, group, name)
PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// broadcast_now(x, inplace, root, group, name)
PyObject* broadcast_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// reduce_scatter_now(x, op, out, group, name)
PyObject* reduce_scatter_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// allgather_now(x, out, group, name)
PyObject* allgather_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// alltoall_now(x, splits, out, group, name) -> (result, received splits)
PyObject* alltoall_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// carried_exchange(kind, group, header, send, parts) -> (blocks, complete): the agreement
// allgather (kind 0), alltoall (1) and reduce_scatter (2) make with their data, for the
// general path (short_path.cpp: exchange()).
PyObject* carried_exchange(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// grouped_allreduce_now(xs, inplace, op, group, name) -> the list of results
PyObject* grouped_allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// row_signature(dtype, row_shape) -> int: what allgather's ranks compare (both paths).
PyObject* row_signature(PyObject*, PyObject* args);
// host_pointers(xs) -> (addresses, byte sizes, dtype name) of a list of writable,
// contiguous host tensors of one class and dtype, read as the short path reads one; None
// for any other list.
PyObject* host_pointers(PyObject*, PyObject* xs);
// host_buffer(x, names, buffer_type) -> buffer_type(address, nbytes, names[x.dtype], shape, "cpu", 0,
// False, x, None) for a writable, contiguous host tensor read as the short path reads one (a
// numpy array or torch tensor) whose dtype `names` holds; None for any other x.
PyObject* host_buffer(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// short_path_runs() -> how many collectives the short path has run in this process.
PyObject* count(PyObject*, PyObject*);
// mpi_calls() -> how many MPI collective calls pycoll._C has made in this process.
PyObject* mpi_calls(PyObject*, PyObject*);

// How a dtype goes to MPI, and an op's reduction of it (op None: no reduction), as
// find_route said; kept per (op, dtype) for this path and partial_now.
struct Route {
    intptr_t datatype, op;
    Py_ssize_t itemsize;
    bool average;
    DType dt;
    Op reduce = Op::Sum;  // the CPU kernels' reduction (Average: Sum, then scaled)
    std::string name;
};

// Where a host tensor's bytes are: its address, size and dtype object.
struct Host {
    void* ptr = nullptr;
    Py_ssize_t nbytes = 0;
    Ref dtype;
};

// x read as this path reads it (writable: for writing too) and its route by op (borrowed:
// kept until short_path_setup runs again): 0 read; 1 not one this path takes (a GPU,
// strided or read-only tensor, an op it cannot hash: the general path says what is wrong);
// -1 with a Python error.
int read_routed(PyObject* x, bool writable, PyObject* op, Host& in, const Route*& route);

// Under --link (pycoll.emulation): group_of(group) -> the group's PaceGroup (pacing.h), or
// None for a group of one; null without a link. This path's is given by short_path_settings,
// partial_now's by partial_settings.
struct Link {
    PyObject* group_of = nullptr;
};

// One collective paced under `hooks`' link, nothing without: made where the collective is
// called, begin() before its MPI calls, end() after them; each false with an error. The model
// runs from the construction, as the general path's from its call (emulation.called): the
// path's own work before its MPI calls is real work, overlapped by the modelled time as the
// real transfer is, not added to it.
class Paced {
   public:
    // The hook is held from here: the settings may change meanwhile.
    explicit Paced(const Link& hooks);
    bool begin(PyObject* kind, PyObject* group, Py_ssize_t nbytes);
    bool end();

   private:
    Ref group_of_, entry_;
    double issued_ = 0.0;
};

// An engine's token for one compiled call (this path's and partial_now's), given back when
// it goes out of scope (an error already raised stays raised). Not held while work issued
// earlier is queued or running (that runs first), nor with no Gate bound.
PyObject* world_gate();  // the world's engine's Gate (borrowed), nullptr while pycoll is not initialized

class Token {
   public:
    // On ``gate``, a group's engine's Gate (borrowed); name, or kind where name is None, shows as
    // running, waiting for the group, or for the world ranks ``among`` (a tuple, borrowed).
    Token(PyObject* name, PyObject* kind, PyObject* gate, PyObject* among = nullptr);
    Token(const Token&) = delete;
    Token& operator=(const Token&) = delete;
    ~Token();
    bool held() const { return held_; }

   private:
    PyObject* gate_;  // ours: short_path_bind(None) may run meanwhile
    bool held_;
};

}  // namespace pycoll::short_path
