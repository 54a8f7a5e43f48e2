// The blocking collectives' short path, and the engine's Gate that it shares with the
// engine's thread. A collective of contiguous host tensors, called while the engine is
// idle, goes straight to MPI from here: allreduce, broadcast, reduce_scatter, allgather
// and alltoall, each the same MPI calls as its general path in collectives.py (ranks may
// take either path for the same operation). Written in Python their planning cost 5-20 us
// a call, several times the MPI call at small sizes, where each microsecond a rank spends
// outside MPI delays every peer sharing its core; here it costs little more than torch's
// own accessors.
//
// It reads no Python module's state: what it needs arrives as arguments. Functions, once
// (short_path_setup); settings, whenever they change (short_path_settings); the world
// and the engine's Gate, at init and shutdown (short_path_bind). Anything it cannot read
// or route, it leaves (None) to the general path, which says what is wrong.
#include "short_path.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <ctime>
#include <deque>
#include <functional>
#include <string>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "clock.h"
#include "kernels.h"
#include "mpi_calls.h"
#include "pacing.h"
#include "py_ref.h"

namespace pycoll::short_path {
namespace {

PyObject* none() { Py_RETURN_NONE; }

double monotonic() {  // time.monotonic()'s clock: the watchdog compares with it
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // to the tick: the watchdog counts seconds
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

bool as_ptr(PyObject* obj, intptr_t& out) {  // mpi4py handles: negative ints too (MPICH)
    out = reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(obj));
    return !(out == 0 && PyErr_Occurred());
}

// ---------------------------------------------------------------- the Gate

// Who runs the next operation of a group: its engine's thread or a caller. All of its
// state changes with the GIL held, so each method is atomic. What runs is kept as its
// name and start, not as a tuple: a claim allocates nothing (running() makes the tuple,
// for the watchdog once a second).
struct Gate {
    PyObject_HEAD
    PyObject* wake;     // called by release() when work is pending: the engine's thread may sleep
    PyObject* name;     // what runs now, or nullptr
    PyObject* among;    // the world ranks it waits for where not the group's (a partial all-reduce), or nullptr
    double start;       // since when (time.monotonic())
    Py_ssize_t pending; // batches queued or open, as the engine last said
    bool idle;          // the token is here
};

// What the holder of the token runs now, among whom (nullptr or None: the group).
void running_as(Gate* g, PyObject* name, PyObject* among = nullptr) {
    Py_XSETREF(g->name, Py_NewRef(name));
    Py_XSETREF(g->among, among == Py_None ? nullptr : Py_XNewRef(among));
    g->start = monotonic();
}

// The token for a caller, if nothing issued earlier is queued or open (that runs first).
bool claim(Gate* g, PyObject* name, PyObject* among = nullptr) {
    if (!g->idle || g->pending) return false;
    g->idle = false;
    running_as(g, name, among);
    return true;
}

int release(Gate* g) {
    g->idle = true;
    Py_CLEAR(g->name);
    Py_CLEAR(g->among);
    if (!g->pending) return 0;
    Ref done(PyObject_CallNoArgs(g->wake));
    return done ? 0 : -1;
}

int gate_init(PyObject* self, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"wake", nullptr};
    PyObject* wake;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Gate", const_cast<char**>(keywords), &wake)) return -1;
    auto* g = reinterpret_cast<Gate*>(self);
    Py_XSETREF(g->wake, Py_NewRef(wake));
    Py_CLEAR(g->name);
    Py_CLEAR(g->among);
    g->pending = 0;
    g->idle = true;
    return 0;
}

void gate_dealloc(PyObject* self) {
    auto* g = reinterpret_cast<Gate*>(self);
    Py_XDECREF(g->wake);
    Py_XDECREF(g->name);
    Py_XDECREF(g->among);
    Py_TYPE(self)->tp_free(self);
}

// (name, among=None): what runs, and among which world ranks where not the group's.
bool name_and_among(PyObject* const* args, Py_ssize_t nargs, const char* what) {
    if (nargs == 1 || nargs == 2) return true;
    PyErr_Format(PyExc_TypeError, "Gate.%s takes (name, among=None), got %zd arguments", what, nargs);
    return false;
}

PyObject* gate_claim(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (!name_and_among(args, nargs, "claim")) return nullptr;
    return PyBool_FromLong(claim(reinterpret_cast<Gate*>(self), args[0], nargs == 2 ? args[1] : nullptr));
}

PyObject* gate_take(PyObject* self, PyObject*) {
    auto* g = reinterpret_cast<Gate*>(self);
    const bool took = g->idle;
    g->idle = false;
    return PyBool_FromLong(took);
}

PyObject* gate_running_as(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (!name_and_among(args, nargs, "running_as")) return nullptr;
    running_as(reinterpret_cast<Gate*>(self), args[0], nargs == 2 ? args[1] : nullptr);
    Py_RETURN_NONE;
}

PyObject* gate_release(PyObject* self, PyObject*) {
    if (release(reinterpret_cast<Gate*>(self)) < 0) return nullptr;
    Py_RETURN_NONE;
}

PyObject* gate_running(PyObject* self, PyObject*) {
    auto* g = reinterpret_cast<Gate*>(self);
    if (!g->name) Py_RETURN_NONE;
    return Py_BuildValue("(OdO)", g->name, g->start, g->among ? g->among : Py_None);
}

PyObject* gate_get_pending(PyObject* self, void*) { return PyLong_FromSsize_t(reinterpret_cast<Gate*>(self)->pending); }

int gate_set_pending(PyObject* self, PyObject* value, void*) {
    const Py_ssize_t n = value ? PyLong_AsSsize_t(value) : -1;
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Gate.pending takes a count >= 0");
        return -1;
    }
    reinterpret_cast<Gate*>(self)->pending = n;
    return 0;
}

PyObject* gate_get_idle(PyObject* self, void*) { return PyBool_FromLong(reinterpret_cast<Gate*>(self)->idle); }

PyMethodDef gate_methods[] = {
    {"claim", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gate_claim)), METH_FASTCALL,
     "claim(name, among=None) -> bool: the token for the caller, if idle and nothing is pending; records name as "
     "running (among: the world ranks it waits for, where not the group's)."},
    {"take", gate_take, METH_NOARGS, "take() -> bool: the token, if idle, to run pending work (the engine's thread)."},
    {"running_as", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gate_running_as)), METH_FASTCALL,
     "running_as(name, among=None): record what the holder of the token runs now (among: as claim's)."},
    {"release", gate_release, METH_NOARGS, "release(): the token back; wake() if work is pending."},
    {"running", gate_running, METH_NOARGS,
     "running() -> (name, start, among) or None: what runs now, since when (time.monotonic()), among which world "
     "ranks (None: the group's)."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef gate_getset[] = {
    {"pending", gate_get_pending, gate_set_pending, "batches queued or open (the engine sets it)", nullptr},
    {"idle", gate_get_idle, nullptr, "whether the token is here", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject gate_type = [] {
    PyTypeObject t = type_of(
        "pycoll._C.Gate", sizeof(Gate),
        "Gate(wake): the engine's token. The engine's thread takes it to run queued work; a caller claims it to run "
        "one operation in its own thread when nothing is pending. wake() is called when it is released with work "
        "pending.",
        gate_dealloc);
    t.tp_new = PyType_GenericNew;
    t.tp_init = gate_init;
    t.tp_methods = gate_methods;
    t.tp_getset = gate_getset;
    return t;
}();

// ---------------------------------------------------------------- what it was given

struct Functions {
    PyObject* ndarray = nullptr;      // numpy.ndarray: read through the buffer protocol
    PyObject* is_torch = nullptr;     // is_torch(x) -> bool: read with torch's accessors
    PyObject* find_route = nullptr;   // find_route(op or None, x) -> (datatype, op, itemsize, average, dtype)
    PyObject* resolve = nullptr;      // resolve(group) -> an object with .handle and .ranks
    PyObject* empty_like = nullptr;   // empty_like(x, shape): an out-of-place result
    Py_ssize_t huge_paged = 0;        // torch results this large come from empty_like too (numpy's pages)
    PyObject* empty = nullptr;        // numpy.empty: empty(n, counts_dtype) makes n int64s (new_counts)
    PyObject* counts_dtype = nullptr; // numpy's int64 dtype
    PyObject* failed = nullptr;       // failed(kind, x, out, group, name, headers): raises what exchange() found wrong
    PyObject* views = nullptr;        // views(x, nbytes, runs) -> (views, address): a new buffer cut into runs of views
    PyObject* staging = nullptr;      // staging(group, nbytes): the group's engine's fusion buffer, for its token's holder
    Py_ssize_t alone_bytes = 0;       // a grouped tensor this large goes by itself (the general path then)
    Py_ssize_t cached_piece = 0;      // pieces packed and unpacked are at most this long per peer (in cache)
    PyObject* mpi_error = nullptr;    // mpi4py.MPI.Exception
    intptr_t in_place = 0;            // MPI_IN_PLACE
    intptr_t byte = 0, int64 = 0;     // MPI_BYTE, MPI_INT64_T
    PyObject* kinds = nullptr;        // type -> is_torch's answer, ours
    PyObject* routes = nullptr;       // (op, dtype) -> capsule of a Route, ours
    bool ready = false;
} fn;

struct Settings {
    bool enabled = false;    // PYCOLL_CHECK and the like turn it off
    Py_ssize_t max_bytes = 0;  // larger allreduces go in pieces (PYCOLL_CHUNK_BYTES)
    Py_ssize_t fusion_threshold = 0;  // a grouped allreduce this large is split in groups (PYCOLL_FUSION_THRESHOLD)
} settings;

Link link;  // this path's pacing under --link (short_path_settings)

struct World {
    Gate* gate = nullptr;  // the engine's; nullptr while pycoll is not initialized
    intptr_t comm = 0;
    Py_ssize_t size = 0;
    int64_t* carry = nullptr;  // the world group's (which the runtime keeps while it is bound)
} world;

unsigned long long runs = 0;

struct Names {
    PyObject *is_cpu, *is_contiguous, *data_ptr, *nbytes, *dtype, *shape, *ndim, *handle, *ranks, *carry, *gate, *new_empty;
    PyObject *allreduce, *broadcast, *reduce_scatter, *allgather, *alltoall, *grouped_allreduce;
    PyObject *cpu, *zero;  // Buffer's "cpu" and 0
} s;

void free_route(PyObject* capsule) { delete static_cast<Route*>(PyCapsule_GetPointer(capsule, "pycoll.Route")); }

// ---------------------------------------------------------------- reading a tensor

// A torch tensor class's six accessors, as its class holds them (torch's C functions,
// or whatever a subclass put there), found once per class: calling them directly skips
// the attribute lookup each call would make (reading 1,000 small tensors for
// grouped_allreduce: 0.25 -> 0.21 ms). An attribute set on one tensor object is not seen.
struct TorchClass {
    PyObject* type;  // owned, with the accessors: a class that dies could give its address to another
    PyObject *is_cpu, *is_contiguous, *data_ptr, *nbytes, *dtype, *ndim;

    // An attribute's value on x, through its descriptor when it has one.
    static PyObject* get(PyObject* attr, PyObject* x) {
        descrgetfunc descr_get = Py_TYPE(attr)->tp_descr_get;
        return descr_get ? descr_get(attr, x, reinterpret_cast<PyObject*>(Py_TYPE(x))) : Py_NewRef(attr);
    }
    // x.method(): the class's function called with x (no bound method made).
    static PyObject* call(PyObject* method, PyObject* x) { return PyObject_Vectorcall(method, &x, 1, nullptr); }
};
std::deque<TorchClass> torch_classes;  // a deque: what torch_class returned stays where it is

// The accessors of x's class (a torch tensor class); nullptr with an error.
const TorchClass* torch_class(PyObject* x) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(x));
    for (const TorchClass& c : torch_classes)
        if (c.type == type) return &c;
    TorchClass c{Py_NewRef(type), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    PyObject** slots[] = {&c.is_cpu, &c.is_contiguous, &c.data_ptr, &c.nbytes, &c.dtype, &c.ndim};
    PyObject* names[] = {s.is_cpu, s.is_contiguous, s.data_ptr, s.nbytes, s.dtype, s.ndim};
    for (size_t i = 0; i < 6; ++i) {
        if (!(*slots[i] = PyObject_GetAttr(type, names[i]))) {  // the descriptor itself, as the class holds it
            for (size_t j = 0; j <= i; ++j) Py_XDECREF(*slots[j]);
            Py_DECREF(type);
            return nullptr;
        }
    }
    torch_classes.push_back(c);
    return &torch_classes.back();
}

// The accessors of x's class if it is a torch tensor class; nullptr: not one, or an error.
const TorchClass* torch_class_of(PyObject* x) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(x));
    PyObject* torch = PyDict_GetItemWithError(fn.kinds, type);
    Ref found;
    if (!torch) {
        if (PyErr_Occurred()) return nullptr;
        found.reset(PyObject_CallOneArg(fn.is_torch, x));  // raises for what pycoll cannot read
        if (!found || PyDict_SetItem(fn.kinds, type, found.get()) < 0) return nullptr;
        torch = found.get();
    }
    return torch == Py_True ? torch_class(x) : nullptr;
}

// Reads a tensor of torch class c as read_host does.
int read_torch(const TorchClass& c, PyObject* x, Host& out) {
    Ref cpu(TorchClass::get(c.is_cpu, x));
    if (!cpu) return -1;
    if (cpu.get() != Py_True) return 1;
    Ref contiguous(TorchClass::call(c.is_contiguous, x));
    if (!contiguous) return -1;
    if (contiguous.get() != Py_True) return 1;
    Ref ptr(TorchClass::call(c.data_ptr, x)), nbytes(TorchClass::get(c.nbytes, x));
    if (!ptr || !nbytes) return -1;
    out.ptr = PyLong_AsVoidPtr(ptr.get());
    out.nbytes = PyLong_AsSsize_t(nbytes.get());
    if (PyErr_Occurred()) return -1;
    out.dtype.reset(TorchClass::get(c.dtype, x));
    return out.dtype ? 0 : -1;
}

// Reads a host tensor (Host): 0: read; 1: not a tensor this path reads (the general path
// then does); -1: error.
int read_host(PyObject* x, bool writable, Host& out) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == fn.ndarray) {
        Py_buffer view;
        if (PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
            PyErr_Clear();  // read-only, strided, or a dtype PEP 3118 cannot name
            return 1;
        }
        out.ptr = view.buf;  // x, which the caller holds, keeps the memory
        out.nbytes = view.len;
        PyBuffer_Release(&view);
        out.dtype.reset(PyObject_GetAttr(x, s.dtype));
        return out.dtype ? 0 : -1;
    }
    const TorchClass* c = torch_class_of(x);
    return c ? read_torch(*c, x, out) : PyErr_Occurred() ? -1 : 1;
}

// An out= tensor: a writable host tensor of x's dtype (else 1: the general path says what is wrong).
int read_out(PyObject* out, PyObject* dtype, Host& found) {
    if (int read = read_host(out, true, found)) return read;
    const int same = PyObject_RichCompareBool(found.dtype.get(), dtype, Py_EQ);
    return same < 0 ? -1 : !same;
}

// x.shape as integers; false with an error.
bool dims_of(PyObject* x, std::vector<int64_t>& dims) {
    Ref shape(PyObject_GetAttr(x, s.shape));
    Ref seq(shape ? PySequence_Fast(shape.get(), "shape") : nullptr);
    if (!seq) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
    dims.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        dims[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.get(), i));
        if (dims[i] == -1 && PyErr_Occurred()) return false;
    }
    return true;
}

// A new result of x's kind and dtype, of `nbytes`, shaped `shape`, read for writing: torch's
// own new_empty where empty_like would call it (empty_like's checks cost as much again).
PyObject* new_like(PyObject* x, PyObject* shape, Py_ssize_t nbytes, Host& out) {
    PyObject* torch = PyDict_GetItemWithError(fn.kinds, reinterpret_cast<PyObject*>(Py_TYPE(x)));
    Ref result(torch == Py_True && nbytes < fn.huge_paged
                   ? PyObject_CallMethodOneArg(x, s.new_empty, shape)
                   : PyObject_CallFunctionObjArgs(fn.empty_like, x, shape, nullptr));
    if (!result) return nullptr;
    const int read = read_host(result.get(), true, out);
    if (read > 0) PyErr_SetString(PyExc_TypeError, "empty_like made a result the short path cannot read");
    return read ? nullptr : result.release();
}

// n new int64s (numpy.empty(n, int64): a numpy array, as the general path returns), read
// into `out`; nullptr with an error.
PyObject* new_counts(Py_ssize_t n, Host& out) {
    Ref count(PyLong_FromSsize_t(n));
    PyObject* args[] = {count.get(), fn.counts_dtype};
    Ref made(count ? PyObject_Vectorcall(fn.empty, args, 2, nullptr) : nullptr);
    if (!made) return nullptr;
    if (read_host(made.get(), true, out) != 0 || out.nbytes != 8 * n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "empty(n, counts_dtype) must make n writable int64s");
        return nullptr;
    }
    return made.release();
}

// new_like shaped (rows, *dims[1:]), of `itemsize` elements.
PyObject* new_result(PyObject* x, int64_t rows, const std::vector<int64_t>& dims, Py_ssize_t itemsize, Host& out) {
    int64_t nbytes = rows * itemsize;
    for (size_t i = 1; i < dims.size(); ++i) nbytes *= dims[i];
    Ref shape(PyTuple_New(static_cast<Py_ssize_t>(std::max<size_t>(dims.size(), 1))));
    if (!shape) return nullptr;
    for (size_t i = 0; i < std::max<size_t>(dims.size(), 1); ++i) {
        PyObject* extent = PyLong_FromLongLong(i == 0 ? rows : dims[i]);
        if (!extent) return nullptr;
        PyTuple_SET_ITEM(shape.get(), static_cast<Py_ssize_t>(i), extent);
    }
    return new_like(x, shape.get(), static_cast<Py_ssize_t>(nbytes), out);
}

// The route of (op, dtype), borrowed from our table; nullptr with no error: an op that is not
// even hashable (the general path names what is wrong with it).
const Route* route_in_table(PyObject* op, PyObject* x, PyObject* dtype) {
    Ref key(PyTuple_Pack(2, op, dtype));
    if (!key) return nullptr;
    PyObject* capsule = PyDict_GetItemWithError(fn.routes, key.get());
    if (capsule) return static_cast<const Route*>(PyCapsule_GetPointer(capsule, "pycoll.Route"));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return nullptr;
    }
    PyObject* args[] = {op, x};
    Ref found(PyObject_Vectorcall(fn.find_route, args, 2, nullptr));  // raises as the general path
    if (!found) return nullptr;
    PyObject *datatype, *mpi_op;
    Py_ssize_t itemsize;
    int average;
    const char *name, *reduce;
    if (!PyArg_ParseTuple(found.get(), "OOnpsz:find_route's result", &datatype, &mpi_op, &itemsize, &average, &name,
                          &reduce))
        return nullptr;
    auto route = std::make_unique<Route>();
    if (!as_ptr(datatype, route->datatype) || !as_ptr(mpi_op, route->op)) return nullptr;
    if (itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "find_route: itemsize must be positive");
        return nullptr;
    }
    route->itemsize = itemsize;
    route->average = average;
    route->name = name;
    try {
        route->dt = parse_dtype(name);
        if (reduce) route->reduce = parse_op(reduce);
    } catch (const std::invalid_argument& error) {
        PyErr_SetString(PyExc_ValueError, error.what());
        return nullptr;
    }
    Ref held(PyCapsule_New(route.get(), "pycoll.Route", free_route));
    if (!held) return nullptr;
    const Route* kept = route.release();
    return PyDict_SetItem(fn.routes, key.get(), held.get()) < 0 ? nullptr : kept;
}

// The route found last: a collective called again with the same op and dtype (the usual
// case) skips route_in_table's key tuple and lookup. It holds op and dtype, so that no other
// object takes their addresses; short_path_setup forgets it.
struct LastRoute {
    PyObject *op = nullptr, *dtype = nullptr;
    const Route* route = nullptr;
} last_route;

void forget_route() {
    Py_CLEAR(last_route.op);
    Py_CLEAR(last_route.dtype);
    last_route.route = nullptr;
}

// route_in_table, through last_route.
const Route* route_of(PyObject* op, PyObject* x, PyObject* dtype) {
    if (op == last_route.op && dtype == last_route.dtype) return last_route.route;
    const Route* route = route_in_table(op, x, dtype);
    if (route) {
        forget_route();
        last_route = {Py_NewRef(op), Py_NewRef(dtype), route};
    }
    return route;
}

// The communicator a collective runs on, its size, and the group's carried capacities (its
// `carry`, one int64 per Kind: see exchange()).
struct Target {
    intptr_t comm = 0;
    Py_ssize_t size = 0;
    int64_t* carry = nullptr;
    PyObject* gate = nullptr;  // the group's engine's Gate (the group keeps it)
};

// The collectives that agree on sizes with their data (exchange()), indexing a group's `carry`.
enum Kind { kAllgather, kAlltoall, kReduceScatter, kKinds };
// The largest part each carries; a larger one moves in a second round. At 4 ranks and 64 KiB
// (16 KiB a part) copying allgather's and alltoall's parts through staging cost more than
// that round; reduce_scatter's second round is MPI's reduce-scatter after the headers, which
// cost more than its carried alltoall and local reduction.
constexpr int64_t kCarriedMax[kKinds] = {4 * 1024, 4 * 1024, 16 * 1024};

// A group's `carry` array: its int64 capacities (owned by the group); false with an error.
bool carry_of(PyObject* group, int64_t*& out);

// The parts of the group last resolved (a group's are fixed: the resolver refuses one that
// shutdown released). The reference keeps that group alive, so another cannot take its
// address.
struct GroupParts {
    PyObject* group = nullptr;
    Target target;
};
GroupParts last_group;

// group= as the caller passed it; false with an error.
bool target_of(PyObject* group, Target& out) {
    if (group == Py_None) {
        out = {world.comm, world.size, world.carry, reinterpret_cast<PyObject*>(world.gate)};
        return true;
    }
    Ref grp(PyObject_CallOneArg(fn.resolve, group));  // raises for what cannot be used
    if (!grp) return false;
    if (grp.get() != last_group.group) {
        Ref handle(PyObject_GetAttr(grp.get(), s.handle)), ranks(PyObject_GetAttr(grp.get(), s.ranks)),
            gate(PyObject_GetAttr(grp.get(), s.gate));
        intptr_t comm;
        if (!handle || !ranks || !gate || !as_ptr(handle.get(), comm)) return false;
        if (!PyObject_TypeCheck(gate.get(), &gate_type)) {
            PyErr_SetString(PyExc_TypeError, "a group's gate must be its engine's Gate");
            return false;
        }
        const Py_ssize_t size = PyObject_Length(ranks.get());
        int64_t* carry;
        if (size < 0 || !carry_of(grp.get(), carry)) return false;
        Py_XSETREF(last_group.group, Py_NewRef(grp.get()));
        last_group.target = {comm, size, carry, gate.get()};  // the group keeps its gate
    }
    out = last_group.target;  // copied: another thread may change the cache meanwhile
    return true;
}

int rank_in(const Target& t) {
    int rank = -1;
    mpi::comm_rank(t.comm, &rank);
    return rank;
}

// ---------------------------------------------------------------- running one

// Whether the short path may run at all now.
bool active() { return fn.ready && settings.enabled && world.gate && mpi::bound(); }

// MPI's error code as mpi4py's exception; nullptr.
PyObject* mpi_failed(int code) {
    Ref error(PyObject_CallFunction(fn.mpi_error, "i", code));
    if (error) PyErr_SetObject(fn.mpi_error, error.get());
    return nullptr;
}

// Runs `call` (MPI, returning its error code) without the GIL; true if it succeeded,
// else false with mpi4py's exception set.
template <class F> bool without_gil(F&& call) {
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = call();
    Py_END_ALLOW_THREADS
    if (code) mpi_failed(code);
    return code == 0;
}

void scale(void* data, Py_ssize_t count, const Route& route, Py_ssize_t size) {
    if (!route.average) return;
    const double factor = 1.0 / static_cast<double>(size);
    const DType dt = route.dt;
    Py_BEGIN_ALLOW_THREADS
    cpu::scale(data, static_cast<size_t>(count), dt, factor);
    Py_END_ALLOW_THREADS
}

bool fits(int64_t n) { return n >= 0 && n <= INT_MAX; }

// What every entry starts with: the arguments' count, then whether the short path runs.
bool takes(Py_ssize_t nargs, Py_ssize_t wanted, const char* usage) {
    if (nargs != wanted) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", usage, wanted);
        return false;
    }
    return true;
}

PyObject* left(int read) { return read < 0 ? nullptr : none(); }

// A tensor that reduce_scatter, allgather and alltoall cut into rows along dim 0, and the
// group they run on.
struct Rows {
    Host in;
    const Route* route = nullptr;
    std::vector<int64_t> dims;
    int64_t rows = 1;       // dim 0; a 0-d tensor is one row (allgather)
    int64_t row_bytes = 0;  // from the shape, so that a tensor of 0 rows has it too
    Target t;
};

// x read as Rows (op None: not reduced); 0 read, 1 the general path's (a 0-d x where
// `need_dim0`), -1 error.
int read_rows(PyObject* x, PyObject* op, PyObject* group, bool need_dim0, Rows& r) {
    if (int read = read_routed(x, false, op, r.in, r.route)) return read;
    if (!dims_of(x, r.dims)) return -1;
    if (r.dims.empty() && need_dim0) return 1;  // the general path refuses it
    const auto rest = r.dims.begin() + (r.dims.empty() ? 0 : 1);
    r.rows = r.dims.empty() ? 1 : r.dims[0];
    r.row_bytes = r.route->itemsize * std::accumulate(rest, r.dims.end(), int64_t{1}, std::multiplies<int64_t>());
    return target_of(group, r.t) ? 0 : -1;
}

// Rows split as evenly as possible, the first ranks taking one more (collectives._split_rows).
int64_t rows_of_rank(int64_t rows, Py_ssize_t parts, Py_ssize_t r) { return rows / parts + (r < rows % parts); }

bool carry_of(PyObject* group, int64_t*& out) {
    Ref carry(PyObject_GetAttr(group, s.carry));
    Py_buffer view;
    if (!carry || PyObject_GetBuffer(carry.get(), &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return false;
    out = static_cast<int64_t*>(view.buf);  // the group, which its caller holds, keeps the array
    const bool right = view.len == 8 * kKinds;
    PyBuffer_Release(&view);
    if (!right) PyErr_SetString(PyExc_TypeError, "a group's carry must be a writable int64 array of 3");
    return right;
}

// ---------------------------------------------------------------- sizes agreed with the data

// Each rank's block of one exchange: its header, then as many bytes of its part for that
// receiver as the group's capacity holds.
struct Carried {
    size_t words = 0;          // header words
    size_t block = 0;          // bytes per rank, a multiple of 8
    bool complete = false;     // every rank's parts came with the headers: no second round
    const int64_t* got = nullptr;  // the blocks received, one per rank (this thread's, until its next exchange)
    const int64_t* header(size_t r) const { return got + r * block / 8; }
    const char* part(size_t r) const { return reinterpret_cast<const char*>(header(r) + words); }
};

// The one agreement of allgather, alltoall and reduce_scatter (both paths): a receiver of
// an allgather or alltoall cannot know its sizes by itself, and a wrong out= on any rank
// must raise on every rank, not leave the others waiting. So each rank sends, in the
// collective's one MPI call (Allgather, or Alltoall of per-receiver parts), its header
// [largest part in bytes, signature, out='s bytes or -1, sizes...] and its parts, up to
// the group's capacity for that kind. Every rank then sees every header: a mismatch
// raises everywhere; parts that did not fit move in a second round whose sizes all now
// know. The capacity is the largest part of the group's last such call (0 beyond
// kCarriedMax: large parts are not copied through staging), so a repeated call takes one
// round; every member computes it from the same headers, so it is the same on all.
// `send` holds the parts back to back (allgather: the one part every rank receives).
// Without the GIL; MPI's error code.
int exchange(Kind kind, const Target& t, const std::vector<int64_t>& header, const char* send,
             const std::vector<int64_t>& parts, Carried& c) {
    const size_t n = static_cast<size_t>(t.size);
    int64_t& capacity = t.carry[kind];
    c.words = header.size();
    c.block = 8 * c.words + static_cast<size_t>(capacity);
    const bool fits = header[0] <= capacity;
    thread_local std::vector<int64_t> sent, received;  // grown, never cleared: not zeroed on every call
    const size_t blocks = kind == kAllgather ? 1 : n;
    sent.resize(std::max(sent.size(), blocks * c.block / 8));
    received.resize(std::max(received.size(), n * c.block / 8));
    c.got = received.data();
    char* at = reinterpret_cast<char*>(sent.data());
    for (size_t d = 0; d < blocks; ++d, at += c.block) {
        std::memcpy(at, header.data(), 8 * c.words);
        if (fits) std::memcpy(at + 8 * c.words, send, static_cast<size_t>(parts[d]));
        send += parts[d];
    }
    const int count = static_cast<int>(c.block);
    if (int code = kind == kAllgather
                       ? mpi::allgather(sent.data(), count, fn.byte, received.data(), count, fn.byte, t.comm)
                       : mpi::alltoall(sent.data(), count, fn.byte, received.data(), count, fn.byte, t.comm))
        return code;
    int64_t largest = 0;
    for (size_t r = 0; r < n; ++r) largest = std::max(largest, c.header(r)[0]);
    c.complete = largest <= capacity;
    capacity = largest <= kCarriedMax[kind] ? (largest + 7) / 8 * 8 : 0;
    return 0;
}

// The carried parts, back to back at `dst`: `bytes[r]` from rank r.
void unpack(const Carried& c, char* dst, const std::vector<int>& bytes) {
    for (size_t r = 0; r < bytes.size(); dst += bytes[r], ++r) std::memcpy(dst, c.part(r), static_cast<size_t>(bytes[r]));
}

// reduce_scatter's carried parts, `count` elements from each rank, reduced at `dst`.
void reduce(const Carried& c, size_t n, char* dst, size_t count, const Route& route) {
    std::memcpy(dst, c.part(0), count * static_cast<size_t>(route.itemsize));
    for (size_t r = 1; r < n; ++r) cpu::reduce(dst, c.part(r), count, route.dt, route.reduce);
}

// The headers of every rank as a list of lists, handed to `fn.failed(kind, x, out, group,
// name, headers)`, the general path's check, which raises what is wrong (every rank sees
// the same); nullptr.
PyObject* disagreed(const Carried& c, Py_ssize_t n, PyObject* kind, PyObject* x, PyObject* given, PyObject* group,
                    PyObject* name) {
    Ref headers(PyList_New(n));
    for (Py_ssize_t r = 0; headers && r < n; ++r) {
        PyObject* row = PyList_New(static_cast<Py_ssize_t>(c.words));
        PyList_SET_ITEM(headers.get(), r, row);
        for (size_t i = 0; row && i < c.words; ++i) {
            PyObject* item = PyLong_FromLongLong(c.header(static_cast<size_t>(r))[i]);
            if (!item) row = nullptr;
            else PyList_SET_ITEM(row, static_cast<Py_ssize_t>(i), item);
        }
        if (!row) headers.reset(nullptr);
    }
    if (!headers) return nullptr;
    PyObject* args[] = {kind, x, given, group, name, headers.get()};
    Ref raised(PyObject_Vectorcall(fn.failed, args, 6, nullptr));
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%U: the ranks' tensors disagree", kind);
    return nullptr;
}

}  // namespace

int read_routed(PyObject* x, bool writable, PyObject* op, Host& in, const Route*& route) {
    if (int read = read_host(x, writable, in)) return read;
    route = route_of(op, x, in.dtype.get());
    if (!route) return PyErr_Occurred() ? -1 : 1;
    return 0;
}

Paced::Paced(const Link& hooks) : group_of_(Py_XNewRef(hooks.group_of)) {
    if (group_of_) issued_ = clock::now();  // no link: nothing more
}

bool Paced::begin(PyObject* kind, PyObject* group, Py_ssize_t nbytes) {
    if (!group_of_) return true;
    Ref paced(PyObject_CallOneArg(group_of_.get(), group));
    if (!paced || paced.get() == Py_None) return static_cast<bool>(paced);
    entry_.reset(pacing::enter(paced.get(), kind, nbytes, issued_));
    return static_cast<bool>(entry_);
}

bool Paced::end() { return !entry_ || pacing::leave(entry_.get()); }

PyObject* world_gate() { return reinterpret_cast<PyObject*>(world.gate); }

Token::Token(PyObject* name, PyObject* kind, PyObject* gate, PyObject* among) : gate_(gate) {
    Py_XINCREF(gate_);
    held_ = gate_ && claim(reinterpret_cast<Gate*>(gate_), name == Py_None ? kind : name, among);
}

Token::~Token() {
    if (held_) {
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        if (release(reinterpret_cast<Gate*>(gate_)) < 0) PyErr_WriteUnraisable(gate_);
        PyErr_Restore(type, value, trace);
    }
    Py_XDECREF(gate_);
}

bool init(PyObject* module) {
    struct { PyObject** slot; const char* text; } all[] = {
        {&s.is_cpu, "is_cpu"}, {&s.is_contiguous, "is_contiguous"}, {&s.data_ptr, "data_ptr"},
        {&s.nbytes, "nbytes"}, {&s.dtype, "dtype"}, {&s.shape, "shape"}, {&s.handle, "handle"},
        {&s.ranks, "ranks"}, {&s.carry, "carry"}, {&s.gate, "gate"}, {&s.new_empty, "new_empty"}, {&s.allreduce, "allreduce"}, {&s.broadcast, "broadcast"},
        {&s.reduce_scatter, "reduce_scatter"}, {&s.allgather, "allgather"}, {&s.alltoall, "alltoall"},
        {&s.grouped_allreduce, "grouped_allreduce"}, {&s.cpu, "cpu"}, {&s.ndim, "ndim"},
    };
    for (auto& name : all)
        if (!(*name.slot = PyUnicode_InternFromString(name.text))) return false;
    if (!(s.zero = PyLong_FromLong(0))) return false;
    if (PyType_Ready(&gate_type) < 0) return false;
    return PyModule_AddObjectRef(module, "Gate", reinterpret_cast<PyObject*>(&gate_type)) == 0;
}

PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"ndarray", "is_torch", "find_route", "resolve", "empty_like", "huge_paged",
                                     "empty", "counts_dtype", "failed", "views", "staging", "alone_bytes",
                                     "cached_piece", "mpi_error", "in_place", "byte", "int64", nullptr};
    Functions f;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOOnOOOOOnnOnnn:short_path_setup", const_cast<char**>(keywords),
                                     &PyType_Type, &f.ndarray, &f.is_torch, &f.find_route, &f.resolve, &f.empty_like,
                                     &f.huge_paged, &f.empty, &f.counts_dtype, &f.failed, &f.views, &f.staging,
                                     &f.alone_bytes, &f.cached_piece, &f.mpi_error, &f.in_place, &f.byte, &f.int64))
        return nullptr;
    f.kinds = PyDict_New();
    f.routes = PyDict_New();
    if (!f.kinds || !f.routes) return nullptr;
    for (PyObject* held : {f.ndarray, f.is_torch, f.find_route, f.resolve, f.empty_like, f.empty, f.counts_dtype,
                           f.failed, f.views, f.staging, f.mpi_error})
        Py_INCREF(held);  // for the life of the process, as the module that passed them
    f.ready = true;
    forget_route();  // of the table fn.routes replaced
    fn = f;
    Py_RETURN_NONE;
}

PyObject* configure(PyObject*, PyObject* args) {
    int enabled;
    Py_ssize_t max_bytes, fusion_threshold;
    PyObject* group_of = Py_None;
    if (!PyArg_ParseTuple(args, "pnn|O:short_path_settings", &enabled, &max_bytes, &fusion_threshold, &group_of))
        return nullptr;
    settings = {enabled != 0, max_bytes, fusion_threshold};
    Py_XSETREF(link.group_of, group_of == Py_None ? nullptr : Py_NewRef(group_of));
    Py_RETURN_NONE;
}

PyObject* bind(PyObject*, PyObject* args) {
    PyObject *gate, *handle = nullptr, *world_group = nullptr;
    Py_ssize_t size = 0;
    if (!PyArg_ParseTuple(args, "O|OnO:short_path_bind", &gate, &handle, &size, &world_group)) return nullptr;
    if (gate == Py_None) {
        Py_CLEAR(world.gate);
        Py_CLEAR(last_group.group);  // its handle is being freed
        Py_RETURN_NONE;
    }
    intptr_t comm;
    int64_t* carry = nullptr;
    if (!PyObject_TypeCheck(gate, &gate_type) || !handle || !as_ptr(handle, comm) || size <= 0 || !world_group ||
        !carry_of(world_group, carry)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "short_path_bind(gate, world_handle, world_size, world_group) or short_path_bind(None)");
        return nullptr;
    }
    world.carry = carry;
    Py_XSETREF(world.gate, reinterpret_cast<Gate*>(Py_NewRef(gate)));
    world.comm = comm;
    world.size = size;
    Py_RETURN_NONE;
}

uint64_t signature(const std::string& dtype, const int64_t* dims, size_t ndims) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    auto mix = [&h](const void* p, size_t n) {
        for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
    };
    mix(dtype.data(), dtype.size() + 1);
    mix(dims, ndims * sizeof(int64_t));
    return h >> 2;  // an int64 > 0 either side
}

PyObject* row_signature(PyObject*, PyObject* args) {
    const char* dtype;
    PyObject* row_shape;
    if (!PyArg_ParseTuple(args, "sO:row_signature", &dtype, &row_shape)) return nullptr;
    Ref seq(PySequence_Fast(row_shape, "row_signature: row_shape must be a sequence of ints"));
    if (!seq) return nullptr;
    std::vector<int64_t> dims(static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.get())));
    for (size_t i = 0; i < dims.size(); ++i) {
        dims[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.get(), static_cast<Py_ssize_t>(i)));
        if (dims[i] == -1 && PyErr_Occurred()) return nullptr;
    }
    return PyLong_FromUnsignedLongLong(signature(dtype, dims.data(), dims.size()));
}

PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "allreduce_now(x, inplace, op, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *op = args[2], *group = args[3], *name = args[4];
    const bool inplace = args[1] == Py_True;
    if (!active()) Py_RETURN_NONE;
    Host in;
    const Route* route = nullptr;
    if (int read = read_routed(x, inplace, op, in, route)) return left(read);
    if (in.nbytes > settings.max_bytes) Py_RETURN_NONE;  // in pieces, that stay in cache
    const Py_ssize_t count = in.nbytes / route->itemsize;
    if (!fits(count)) Py_RETURN_NONE;
    Target t;
    if (!target_of(group, t)) return nullptr;
    Ref out;
    Host result;
    if (inplace) {
        out.reset(Py_NewRef(x));
    } else {
        Ref shape(PyObject_GetAttr(x, s.shape));
        out.reset(shape ? new_like(x, shape.get(), in.nbytes, result) : nullptr);
        if (!out) return nullptr;
    }
    Token token(name, s.allreduce, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();  // earlier work: the engine runs it first
    if (!paced.begin(s.allreduce, group, in.nbytes)) return nullptr;
    const void* send = inplace ? reinterpret_cast<const void*>(fn.in_place) : in.ptr;
    void* recv = inplace ? in.ptr : result.ptr;
    if (!without_gil([&] { return mpi::allreduce(send, recv, static_cast<int>(count), route->datatype, route->op, t.comm); }))
        return nullptr;
    ++runs;
    scale(recv, count, *route, t.size);
    return paced.end() ? out.release() : nullptr;
}

PyObject* broadcast_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "broadcast_now(x, inplace, root, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *root_arg = args[2], *group = args[3], *name = args[4];
    const bool inplace = args[1] == Py_True;
    if (!active() || !PyLong_CheckExact(root_arg)) Py_RETURN_NONE;
    Target t;
    if (!target_of(group, t)) return nullptr;
    const long root = PyLong_AsLong(root_arg);
    if (root < 0 || root >= t.size) {
        PyErr_Clear();
        Py_RETURN_NONE;  // the general path says what is wrong
    }
    const bool root_here = rank_in(t) == root;
    Host in;
    const Route* route = nullptr;
    // The root only sends: its tensor may be read-only, in place too, as mpi4py's Bcast allows.
    if (int read = read_routed(x, inplace && !root_here, Py_None, in, route)) return left(read);
    const Py_ssize_t count = in.nbytes / route->itemsize;
    if (count > (Py_ssize_t{1} << 30)) Py_RETURN_NONE;  // the general path goes in pieces
    Ref out;
    Host result;
    if (inplace) {
        out.reset(Py_NewRef(x));
        result.ptr = in.ptr;
    } else {
        std::vector<int64_t> dims;
        if (!dims_of(x, dims)) return nullptr;
        out.reset(dims.empty() ? nullptr : new_result(x, dims[0], dims, route->itemsize, result));
        if (!out) return PyErr_Occurred() ? nullptr : none();  // 0-d: the general path
        if (root_here) std::memcpy(result.ptr, in.ptr, static_cast<size_t>(in.nbytes));
    }
    Token token(name, s.broadcast, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();
    if (!paced.begin(s.broadcast, group, in.nbytes)) return nullptr;
    void* data = result.ptr;
    const int n = static_cast<int>(count), r = static_cast<int>(root);
    const intptr_t datatype = route->datatype;  // typed, as the general path and mpi4py send it
    if (!without_gil([&] { return mpi::bcast(data, n, datatype, r, t.comm); })) return nullptr;
    ++runs;
    return paced.end() ? out.release() : nullptr;
}

// reduce_scatter's signature: what its ranks compare (dtype, op, the shape of a row).
int64_t reduce_signature(const Rows& a) {
    const std::string what = a.route->name + "/" + (a.route->average ? "average" : kOpNames[int(a.route->reduce)]);
    return static_cast<int64_t>(signature(what, a.dims.data() + 1, a.dims.size() - 1));
}

PyObject* reduce_scatter_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "reduce_scatter_now(x, op, out, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *op = args[1], *given = args[2], *group = args[3], *name = args[4];
    if (!active()) Py_RETURN_NONE;
    Rows a;
    if (int read = read_rows(x, op, group, true, a)) return left(read);
    const Target& t = a.t;
    const Route& route = *a.route;
    const size_t n = static_cast<size_t>(t.size);
    const int rank = rank_in(t);
    if (rank < 0 || rank >= t.size) Py_RETURN_NONE;
    std::vector<int64_t> parts(n);
    for (size_t r = 0; r < n; ++r) {
        parts[r] = rows_of_rank(a.rows, t.size, static_cast<Py_ssize_t>(r)) * a.row_bytes;
        if (!fits(parts[r] / route.itemsize)) Py_RETURN_NONE;  // the general path refuses it
    }
    Host result;
    if (given != Py_None)
        if (int read = read_out(given, a.in.dtype.get(), result)) return left(read);
    // What the general path sends too: its largest part, signature, out='s size, rows.
    const std::vector<int64_t> header = {parts[0], reduce_signature(a), given == Py_None ? -1 : result.nbytes, a.rows};
    Token token(name, s.reduce_scatter, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();
    if (!paced.begin(s.reduce_scatter, group, a.in.nbytes)) return nullptr;
    Carried c;
    if (!without_gil([&] { return exchange(kReduceScatter, t, header, static_cast<const char*>(a.in.ptr), parts, c); }))
        return nullptr;
    bool agreed = true;
    for (size_t r = 0; r < n; ++r) {
        const int64_t* h = c.header(r);
        const int64_t wanted = rows_of_rank(a.rows, t.size, static_cast<Py_ssize_t>(r)) * a.row_bytes;
        agreed &= h[1] == header[1] && h[3] == a.rows && (h[2] == -1 || h[2] == wanted);  // -2: a bad out=
    }
    if (!agreed) return disagreed(c, t.size, s.reduce_scatter, x, given, group, name);
    Ref out;
    if (given == Py_None) {
        out.reset(new_result(x, rows_of_rank(a.rows, t.size, rank), a.dims, route.itemsize, result));
        if (!out) return nullptr;
    } else {
        out.reset(Py_NewRef(given));
    }
    std::vector<int> counts(n);
    for (size_t r = 0; r < n; ++r) counts[r] = static_cast<int>(parts[r] / route.itemsize);
    // MPI's own even call where every rank's part is the same (the rule of the general path)
    const bool even = std::all_of(counts.begin(), counts.end(), [&](int k) { return k == counts[0]; });
    char* mine = static_cast<char*>(result.ptr);
    if (!without_gil([&] {
            if (c.complete) {
                reduce(c, n, mine, static_cast<size_t>(counts[rank]), route);
                return 0;
            }
            return even ? mpi::reduce_scatter_block(a.in.ptr, mine, counts[0], route.datatype, route.op, t.comm)
                        : mpi::reduce_scatter(a.in.ptr, mine, counts.data(), route.datatype, route.op, t.comm);
        }))
        return nullptr;
    ++runs;
    scale(mine, counts[rank], route, t.size);
    return paced.end() ? out.release() : nullptr;
}

PyObject* allgather_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 4, "allgather_now(x, out, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *given = args[1], *group = args[2], *name = args[3];
    if (!active()) Py_RETURN_NONE;
    Rows a;
    if (int read = read_rows(x, Py_None, group, false, a)) return left(read);
    const Target& t = a.t;
    Host result;
    if (given != Py_None)
        if (int read = read_out(given, a.in.dtype.get(), result)) return left(read);
    if (!fits(a.in.nbytes)) Py_RETURN_NONE;
    const size_t rest = a.dims.empty() ? 0 : 1;
    // What the general path sends too: its part, what a row is, out='s size, rows.
    const std::vector<int64_t> header = {
        a.in.nbytes, static_cast<int64_t>(signature(a.route->name, a.dims.data() + rest, a.dims.size() - rest)),
        given == Py_None ? -1 : result.nbytes, a.rows};
    Token token(name, s.allgather, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();
    if (!paced.begin(s.allgather, group, a.in.nbytes)) return nullptr;
    Carried c;
    if (!without_gil([&] {
            return exchange(kAllgather, t, header, static_cast<const char*>(a.in.ptr), {a.in.nbytes}, c);
        }))
        return nullptr;
    std::vector<int> counts(static_cast<size_t>(t.size)), displs(counts.size());
    int64_t total = 0, total_rows = 0;
    bool agreed = true;
    for (size_t r = 0; r < counts.size(); ++r) {
        const int64_t nbytes = c.header(r)[3] * a.row_bytes;
        agreed &= c.header(r)[1] == header[1] && fits(nbytes) && fits(total);
        counts[r] = static_cast<int>(nbytes);
        displs[r] = static_cast<int>(total);
        total += nbytes;
        total_rows += c.header(r)[3];
    }
    for (size_t r = 0; r < counts.size(); ++r) agreed &= c.header(r)[2] == -1 || c.header(r)[2] == total;
    if (!agreed) return disagreed(c, t.size, s.allgather, x, given, group, name);
    Ref out;
    if (given == Py_None) {
        out.reset(new_result(x, total_rows, a.dims.empty() ? std::vector<int64_t>{1} : a.dims, a.route->itemsize,
                             result));
        if (!out) return nullptr;
    } else {
        out.reset(Py_NewRef(given));
    }
    const int nbytes = static_cast<int>(a.in.nbytes);
    const bool even = std::all_of(counts.begin(), counts.end(), [&](int k) { return k == counts[0]; });
    char* into = static_cast<char*>(result.ptr);
    if (!without_gil([&] {
            if (c.complete) {
                unpack(c, into, counts);
                return 0;
            }
            if (even)  // MPI's own even call where every rank's part is the same (the general path's rule)
                return mpi::allgather(a.in.ptr, nbytes, fn.byte, into, nbytes, fn.byte, t.comm);
            return mpi::allgatherv(a.in.ptr, nbytes, fn.byte, into, counts.data(), displs.data(), fn.byte, t.comm);
        }))
        return nullptr;
    ++runs;
    return paced.end() ? out.release() : nullptr;
}

// splits as row counts: false if it is not a list or tuple of n ints >= 0 summing to rows.
bool parse_splits(PyObject* splits, Py_ssize_t n, int64_t rows, std::vector<int64_t>& out) {
    out.assign(static_cast<size_t>(n), rows / n);
    if (splits == Py_None) return rows % n == 0;
    if (!PyList_CheckExact(splits) && !PyTuple_CheckExact(splits)) return false;
    if (PySequence_Fast_GET_SIZE(splits) != n) return false;
    int64_t sum = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(splits, i);
        if (!PyLong_CheckExact(item)) return false;
        out[i] = PyLong_AsLongLong(item);
        if (out[i] < 0) {
            PyErr_Clear();
            return false;
        }
        sum += out[i];
    }
    return sum == rows;
}

PyObject* alltoall_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "alltoall_now(x, splits, out, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *splits = args[1], *given = args[2], *group = args[3], *name = args[4];
    if (!active()) Py_RETURN_NONE;
    Rows a;
    if (int read = read_rows(x, Py_None, group, true, a)) return left(read);
    if (!fits(a.in.nbytes)) Py_RETURN_NONE;  // the general path refuses it
    const Target& t = a.t;
    const int64_t row_bytes = a.row_bytes;
    const size_t n = static_cast<size_t>(t.size);
    std::vector<int64_t> sent;
    if (!parse_splits(splits, t.size, a.rows, sent)) Py_RETURN_NONE;
    Host result;
    if (given != Py_None)
        if (int read = read_out(given, a.in.dtype.get(), result)) return left(read);
    const int rank = rank_in(t);
    if (rank < 0 || static_cast<size_t>(rank) >= n) Py_RETURN_NONE;
    // What the general path sends too: its largest part, what a row is, out='s size, splits.
    std::vector<int64_t> parts(n), header = {0, static_cast<int64_t>(signature(a.route->name, a.dims.data() + 1,
                                                                                a.dims.size() - 1)),
                                             given == Py_None ? -1 : result.nbytes};
    for (size_t d = 0; d < n; ++d) {
        parts[d] = sent[d] * row_bytes;
        header[0] = std::max(header[0], parts[d]);
        header.push_back(sent[d]);
    }
    Host got;
    Ref received(new_counts(t.size, got));
    if (!received) return nullptr;
    auto* recv_splits = static_cast<int64_t*>(got.ptr);
    Token token(name, s.alltoall, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();
    if (!paced.begin(s.alltoall, group, a.in.nbytes)) return nullptr;
    Carried c;
    if (!without_gil([&] { return exchange(kAlltoall, t, header, static_cast<const char*>(a.in.ptr), parts, c); }))
        return nullptr;
    bool agreed = true, even = true;
    for (size_t d = 0; d < n; ++d) {  // every rank's receipt, and its out='s size
        int64_t rows = 0;
        for (size_t r = 0; r < n; ++r) {
            const int64_t part = c.header(r)[3 + d];
            agreed &= fits(part * row_bytes);
            even &= part == c.header(0)[3];  // rows, as the general path compares
            rows += part;
        }
        const int64_t wanted = c.header(d)[2];
        agreed &= c.header(d)[1] == header[1] && fits(rows * row_bytes) && (wanted == -1 || wanted == rows * row_bytes);
    }
    if (!agreed) return disagreed(c, t.size, s.alltoall, x, given, group, name);
    std::vector<int> scounts(n), sdispls(n), rcounts(n), rdispls(n);
    int64_t sent_total = 0, recv_total = 0, recv_rows = 0;
    for (size_t r = 0; r < n; ++r) {
        recv_splits[r] = c.header(r)[3 + rank];
        scounts[r] = static_cast<int>(parts[r]);
        sdispls[r] = static_cast<int>(sent_total);
        rcounts[r] = static_cast<int>(recv_splits[r] * row_bytes);
        rdispls[r] = static_cast<int>(recv_total);
        sent_total += parts[r];
        recv_total += rcounts[r];
        recv_rows += recv_splits[r];
    }
    Ref out;
    if (given == Py_None) {
        out.reset(new_result(x, recv_rows, a.dims, a.route->itemsize, result));
        if (!out) return nullptr;
    } else {
        out.reset(Py_NewRef(given));
    }
    char* into = static_cast<char*>(result.ptr);
    if (!without_gil([&] {
            if (c.complete) {
                unpack(c, into, rcounts);
                return 0;
            }
            if (even)  // MPI's own even call where every part is the same (the general path's rule)
                return mpi::alltoall(a.in.ptr, scounts[0], fn.byte, into, rcounts[0], fn.byte, t.comm);
            return mpi::alltoallv(a.in.ptr, scounts.data(), sdispls.data(), fn.byte, into, rcounts.data(),
                                  rdispls.data(), fn.byte, t.comm);
        }))
        return nullptr;
    ++runs;
    return paced.end() ? PyTuple_Pack(2, out.get(), received.get()) : nullptr;
}

// carried_exchange(kind, group, header, send, parts) -> (blocks, complete): exchange() for
// the general path, on host memory at address `send`; blocks: every rank's block as int64s
// (reshape to (ranks, -1): the first len(header) of each are its header, its part follows).
PyObject* carried_exchange(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "carried_exchange(kind, group, header, send, parts)")) return nullptr;
    const long kind = PyLong_AsLong(args[0]);
    if (kind < 0 || kind >= kKinds) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "carried_exchange: kind is 0, 1 or 2");
        return nullptr;
    }
    Target t;
    if (!fn.ready || !mpi::bound()) {
        PyErr_SetString(PyExc_RuntimeError, "carried_exchange needs short_path_setup and MPI found (mpi_bind)");
        return nullptr;
    }
    if (!target_of(args[1], t)) return nullptr;
    std::vector<int64_t> header, parts;
    for (auto [list, into] : {std::pair{args[2], &header}, std::pair{args[4], &parts}}) {
        Ref seq(PySequence_Fast(list, "carried_exchange: header and parts are lists of ints"));
        if (!seq) return nullptr;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.get()); ++i) {
            into->push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.get(), i)));
            if (PyErr_Occurred()) return nullptr;
        }
    }
    const auto* send = static_cast<const char*>(PyLong_AsVoidPtr(args[3]));
    if (PyErr_Occurred()) return nullptr;
    Carried c;
    if (!without_gil([&] { return exchange(static_cast<Kind>(kind), t, header, send, parts, c); })) return nullptr;
    const size_t words = static_cast<size_t>(t.size) * c.block / 8;
    Host h;
    Ref blocks(new_counts(static_cast<Py_ssize_t>(words), h));
    if (!blocks) return nullptr;
    std::memcpy(h.ptr, c.got, 8 * words);
    return Py_BuildValue("(OO)", blocks.get(), c.complete ? Py_True : Py_False);
}

// A list of writable, contiguous host tensors of one class and dtype, read as one is.
struct Many {
    std::vector<void*> ptrs;
    std::vector<size_t> sizes;
    size_t total = 0;
    const Route* route = nullptr;  // the route of (op, dtype)
    const TorchClass* torch = nullptr;  // their torch class, if they are torch tensors
};

// xs read as Many; 0 read, 1 not such a list (the general path reads each and says what is
// wrong), -1 error.
int read_list(PyObject* xs, PyObject* op, Many& m) {
    if (!fn.ready || !PyList_CheckExact(xs) || PyList_GET_SIZE(xs) == 0) return 1;
    const Py_ssize_t n = PyList_GET_SIZE(xs);
    PyObject* first = PyList_GET_ITEM(xs, 0);
    // All are of first's class: a torch class's accessors are looked up once.
    if (reinterpret_cast<PyObject*>(Py_TYPE(first)) != fn.ndarray && !(m.torch = torch_class_of(first)) &&
        PyErr_Occurred())
        return -1;
    Ref dtype;
    m.ptrs.resize(static_cast<size_t>(n));
    m.sizes.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* x = PyList_GET_ITEM(xs, i);
        Host h;
        if (Py_TYPE(x) != Py_TYPE(first)) return 1;
        if (int read = m.torch ? read_torch(*m.torch, x, h) : read_host(x, true, h)) return read;
        if (!dtype) {
            dtype.reset(Py_NewRef(h.dtype.get()));
        } else if (h.dtype.get() != dtype.get()) {  // dtype objects are singletons in numpy and torch
            const int same = PyObject_RichCompareBool(h.dtype.get(), dtype.get(), Py_EQ);
            if (same <= 0) return same < 0 ? -1 : 1;
        }
        m.ptrs[i] = h.ptr;
        m.sizes[i] = static_cast<size_t>(h.nbytes);
        m.total += m.sizes[i];
    }
    m.route = route_of(op, first, dtype.get());
    return m.route ? 0 : PyErr_Occurred() ? -1 : 1;
}

// The (count, shape) runs of consecutive tensors of one shape in xs, read as m, as a list
// for fn.views; nullptr with an error. A 1-d tensor's shape is its byte size over the
// itemsize, so only its ndim is read: a torch shape (a new torch.Size) costs twice that.
PyObject* shape_runs(PyObject* xs, const Many& m) {
    Ref runs(PyList_New(0));
    std::vector<int64_t> dims, last;
    Py_ssize_t count = 0;
    auto flush = [&]() -> bool {
        if (!count) return true;
        Ref shape(PyTuple_New(static_cast<Py_ssize_t>(last.size())));
        for (size_t d = 0; shape && d < last.size(); ++d) {
            PyObject* extent = PyLong_FromLongLong(last[d]);
            if (!extent) return false;
            PyTuple_SET_ITEM(shape.get(), static_cast<Py_ssize_t>(d), extent);
        }
        Ref run(shape ? Py_BuildValue("(nO)", count, shape.get()) : nullptr);
        return run && PyList_Append(runs.get(), run.get()) == 0;
    };
    for (Py_ssize_t i = 0; runs && i < PyList_GET_SIZE(xs); ++i) {
        PyObject* x = PyList_GET_ITEM(xs, i);
        Ref ndim(m.torch ? TorchClass::get(m.torch->ndim, x) : PyObject_GetAttr(x, s.ndim));
        const long n = ndim ? PyLong_AsLong(ndim.get()) : -1;
        if (n == 1)
            dims.assign(1, static_cast<int64_t>(m.sizes[i]) / m.route->itemsize);
        else if (PyErr_Occurred() || !dims_of(x, dims))
            return nullptr;
        if (count && dims == last) {
            ++count;
            continue;
        }
        if (!flush()) return nullptr;
        last.swap(dims);
        count = 1;
    }
    return runs && flush() ? runs.release() : nullptr;
}

PyObject* host_pointers(PyObject*, PyObject* xs) {
    Many m;
    if (int read = read_list(xs, Py_None, m)) return left(read);
    const Py_ssize_t n = static_cast<Py_ssize_t>(m.ptrs.size());
    Ref ptrs(PyList_New(n)), sizes(PyList_New(n));
    if (!ptrs || !sizes) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* ptr = PyLong_FromVoidPtr(m.ptrs[i]);
        if (!ptr) return nullptr;
        PyList_SET_ITEM(ptrs.get(), i, ptr);
        PyObject* size = PyLong_FromSize_t(m.sizes[i]);
        if (!size) return nullptr;
        PyList_SET_ITEM(sizes.get(), i, size);
    }
    return Py_BuildValue("(OOs)", ptrs.get(), sizes.get(), m.route->name.c_str());
}

PyObject* host_buffer(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 4, "host_buffer(x, numpy_names, torch_names, buffer_type)")) return nullptr;
    PyObject *x = args[0], *type = args[3];
    Host h;
    if (!fn.ready || !PyType_Check(type) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &PyTuple_Type) ||
        !PyDict_Check(args[1]) || !PyDict_Check(args[2]))
        return left(1);
    if (int read = read_host(x, true, h)) return left(read);
    PyObject* names = reinterpret_cast<PyObject*>(Py_TYPE(x)) == fn.ndarray ? args[1] : args[2];
    PyObject* name = PyDict_GetItemWithError(names, h.dtype.get());
    if (!name) return left(PyErr_Occurred() ? -1 : 1);
    Ref shape(PyObject_GetAttr(x, s.shape));
    if (shape && !PyTuple_CheckExact(shape.get())) shape.reset(PySequence_Tuple(shape.get()));  // torch.Size
    // Ints only: nothing for the cyclic GC to visit (what it would find out itself, a pass later);
    // a step's every gradient leaves one of these alive until its batch runs.
    if (shape && PyObject_GC_IsTracked(shape.get())) {
        bool atoms = true;
        for (Py_ssize_t i = 0; atoms && i < PyTuple_GET_SIZE(shape.get()); ++i)
            atoms = PyLong_CheckExact(PyTuple_GET_ITEM(shape.get(), i));
        if (atoms) PyObject_GC_UnTrack(shape.get());
    }
    Ref ptr(shape ? PyLong_FromVoidPtr(h.ptr) : nullptr), nbytes(ptr ? PyLong_FromSsize_t(h.nbytes) : nullptr);
    if (!nbytes) return nullptr;
    // Buffer(ptr, nbytes, dtype, shape, "cpu", 0, readonly False, owner x, ready None), filled
    // in place as tuple.__new__(Buffer, fields) would copy it, without NamedTuple's Python __new__.
    PyTypeObject* buffer_type = reinterpret_cast<PyTypeObject*>(type);
    PyObject* buffer = buffer_type->tp_alloc(buffer_type, 9);
    if (!buffer) return nullptr;
    PyObject* fields[] = {ptr.release(), nbytes.release(), Py_NewRef(name), shape.release(), Py_NewRef(s.cpu),
                          Py_NewRef(s.zero), Py_NewRef(Py_False), Py_NewRef(x), Py_NewRef(Py_None)};
    for (Py_ssize_t i = 0; i < 9; ++i) PyTuple_SET_ITEM(buffer, i, fields[i]);
    // Untracked as well: it holds x and atoms, and x does not hold it, so no cycle passes
    // through it. A step's every async gradient keeps one alive until its batch runs, and
    // the cyclic GC's passes over them cost allreduce_async_ 0.1 us a call.
    if (PyObject_GC_IsTracked(buffer)) PyObject_GC_UnTrack(buffer);
    return buffer;
}

PyObject* grouped_allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!takes(nargs, 5, "grouped_allreduce_now(xs, inplace, op, group, name)")) return nullptr;
    Paced paced(link);  // the model runs from here: the call
    PyObject *xs = args[0], *op = args[2], *group = args[3], *name = args[4];
    const bool inplace = args[1] == Py_True;
    if (!active()) Py_RETURN_NONE;
    Many m;
    if (int read = read_list(xs, op, m)) return left(read);
    // One group, as collectives._allreduce_many would make it; other lists it splits.
    if (*std::max_element(m.sizes.begin(), m.sizes.end()) >= static_cast<size_t>(fn.alone_bytes) ||
        m.total > static_cast<size_t>(settings.fusion_threshold))
        Py_RETURN_NONE;
    const Route& route = *m.route;
    Target t;
    if (!target_of(group, t)) return nullptr;
    std::vector<void*> dsts = m.ptrs;
    Ref outs;
    if (inplace) {
        outs.reset(PyList_GetSlice(xs, 0, PyList_GET_SIZE(xs)));
    } else {  // the results: views of one new buffer, reduced where they lie
        Ref runs(shape_runs(xs, m));
        Ref made(runs ? PyObject_CallFunction(fn.views, "OnO", PyList_GET_ITEM(xs, 0), static_cast<Py_ssize_t>(m.total),
                                              runs.get())
                      : nullptr);
        PyObject *views, *address;
        if (!made || !PyArg_ParseTuple(made.get(), "O!O:views' result", &PyList_Type, &views, &address)) return nullptr;
        char* flat = static_cast<char*>(PyLong_AsVoidPtr(address));
        if (PyErr_Occurred()) return nullptr;
        for (size_t i = 0, at = 0; i < dsts.size(); at += m.sizes[i++])
            dsts[i] = flat + at;
        outs.reset(Py_NewRef(views));
    }
    if (!outs) return nullptr;
    Token token(name, s.grouped_allreduce, t.gate);
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();
    if (!paced.begin(s.allreduce, group, static_cast<Py_ssize_t>(m.total))) return nullptr;
    // collectives._reduce_staged's pieces, packed into the staging buffer unless the
    // destinations lie back to back (they are then their own, and need no unpack); pieces
    // that are unpacked are at most cached_piece long per peer.
    bool contiguous = true;
    for (size_t i = 1; i < dsts.size(); ++i)
        contiguous &= static_cast<char*>(dsts[i - 1]) + m.sizes[i - 1] == dsts[i];
    const bool packed = contiguous && dsts == m.ptrs;
    const size_t itemsize = static_cast<size_t>(route.itemsize), total = m.total;
    const size_t chunk = static_cast<size_t>(
        contiguous ? settings.max_bytes
                   : std::min(settings.max_bytes, fn.cached_piece * std::max<Py_ssize_t>(1, t.size - 1)));
    const size_t limit = std::min(chunk, (size_t{1} << 30) * itemsize);
    const size_t step = std::max(itemsize, limit / itemsize * itemsize);
    char* staging = nullptr;
    Ref buffer;
    if (!contiguous) {
        Host h;
        buffer.reset(PyObject_CallFunction(fn.staging, "On", group, static_cast<Py_ssize_t>(std::min(step, total))));
        if (!buffer || read_host(buffer.get(), true, h) != 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "staging(group, n) must give a writable host buffer");
            return nullptr;
        }
        staging = static_cast<char*>(h.ptr);
    }
    std::vector<const void*> srcs(m.ptrs.begin(), m.ptrs.end());
    const double factor = route.average ? 1.0 / static_cast<double>(t.size) : 1.0;
    if (!without_gil([&] {
            size_t begin = 0;
            do {  // one empty piece for nothing, as tensors.pieces
                const size_t end = std::min(total, begin + step);
                char* piece = contiguous ? static_cast<char*>(dsts[0]) + begin : staging;
                if (!packed) cpu::pack(piece, srcs, m.sizes, begin, end);
                const int count = static_cast<int>((end - begin) / itemsize);
                if (int code = mpi::allreduce(reinterpret_cast<const void*>(fn.in_place), piece, count,
                                              route.datatype, route.op, t.comm))
                    return code;
                if (!contiguous)
                    cpu::unpack(piece, dsts, m.sizes, route.dt, factor, begin, end);
                else if (factor != 1.0)
                    cpu::scale(piece, (end - begin) / itemsize, route.dt, factor);
                begin = end;
            } while (begin < total);
            return 0;
        }))
        return nullptr;
    ++runs;
    return paced.end() ? outs.release() : nullptr;
}

PyObject* count(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(runs); }

PyObject* mpi_calls(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(mpi::collective_calls()); }

}  // namespace pycoll::short_path
