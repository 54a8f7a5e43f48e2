// The blocking allreduce's short path (collectives.allreduce and allreduce_), and the
// engine's Gate that it shares with the engine's thread. A contiguous host tensor of one
// piece, while the engine is idle, goes straight to MPI_Allreduce. Written in Python its
// steps cost 1.1 us, twice the MPI call at 4 ranks on 2 cores, where each microsecond a
// rank spends outside MPI delays every peer sharing its core; here they cost little more
// than torch's own accessors.
//
// It reads no Python module's state: what it needs arrives as arguments. Functions, once
// (short_path_setup); settings, whenever they change (short_path_settings); the world
// and the engine's Gate, at init and shutdown (short_path_bind). Anything it cannot read
// or route, it leaves (None) to the general path, which says what is wrong.
#include "short_path.h"

#include <climits>
#include <ctime>
#include <memory>
#include <stdexcept>

#include "kernels.h"
#include "mpi_calls.h"

namespace pycoll::short_path {
namespace {

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

// Who runs the next operation of a process: the engine's thread or a caller. All of its
// state changes with the GIL held, so each method is atomic.
struct Gate {
    PyObject_HEAD
    PyObject* wake;     // called by release() when work is pending: the engine's thread may sleep
    PyObject* running;  // (name, start) of what runs now, or None
    Py_ssize_t pending; // batches queued or open, as the engine last said
    bool idle;          // the token is here
};

// The token for a caller, if nothing issued earlier is queued or open (that runs first).
bool claim(Gate* g, PyObject* name) {
    if (!g->idle || g->pending) return false;
    PyObject* running = Py_BuildValue("(Od)", name, monotonic());
    if (!running) return false;
    g->idle = false;
    Py_SETREF(g->running, running);
    return true;
}

int release(Gate* g) {
    g->idle = true;
    Py_SETREF(g->running, Py_NewRef(Py_None));
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
    Py_XSETREF(g->running, Py_NewRef(Py_None));
    g->pending = 0;
    g->idle = true;
    return 0;
}

void gate_dealloc(PyObject* self) {
    auto* g = reinterpret_cast<Gate*>(self);
    Py_XDECREF(g->wake);
    Py_XDECREF(g->running);
    Py_TYPE(self)->tp_free(self);
}

PyObject* gate_claim(PyObject* self, PyObject* name) {
    bool claimed = claim(reinterpret_cast<Gate*>(self), name);
    if (PyErr_Occurred()) return nullptr;
    return PyBool_FromLong(claimed);
}

PyObject* gate_take(PyObject* self, PyObject*) {
    auto* g = reinterpret_cast<Gate*>(self);
    const bool took = g->idle;
    g->idle = false;
    return PyBool_FromLong(took);
}

PyObject* gate_running_as(PyObject* self, PyObject* name) {
    auto* g = reinterpret_cast<Gate*>(self);
    PyObject* running = Py_BuildValue("(Od)", name, monotonic());
    if (!running) return nullptr;
    Py_SETREF(g->running, running);
    Py_RETURN_NONE;
}

PyObject* gate_release(PyObject* self, PyObject*) {
    if (release(reinterpret_cast<Gate*>(self)) < 0) return nullptr;
    Py_RETURN_NONE;
}

PyObject* gate_running(PyObject* self, PyObject*) { return Py_NewRef(reinterpret_cast<Gate*>(self)->running); }

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
    {"claim", gate_claim, METH_O,
     "claim(name) -> bool: the token for the caller, if idle and nothing is pending; records name as running."},
    {"take", gate_take, METH_NOARGS, "take() -> bool: the token, if idle, to run pending work (the engine's thread)."},
    {"running_as", gate_running_as, METH_O, "running_as(name): record what the holder of the token runs now."},
    {"release", gate_release, METH_NOARGS, "release(): the token back; wake() if work is pending."},
    {"running", gate_running, METH_NOARGS, "running() -> (name, start) or None: what runs now (time.monotonic())."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef gate_getset[] = {
    {"pending", gate_get_pending, gate_set_pending, "batches queued or open (the engine sets it)", nullptr},
    {"idle", gate_get_idle, nullptr, "whether the token is here", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject gate_type = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "pycoll._C.Gate";
    t.tp_basicsize = sizeof(Gate);
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc =
        "Gate(wake): the engine's token. The engine's thread takes it to run queued work; a caller claims it to run "
        "one operation in its own thread when nothing is pending. wake() is called when it is released with work "
        "pending.";
    t.tp_new = PyType_GenericNew;
    t.tp_init = gate_init;
    t.tp_dealloc = gate_dealloc;
    t.tp_methods = gate_methods;
    t.tp_getset = gate_getset;
    return t;
}();

// ---------------------------------------------------------------- what it was given

struct Functions {
    PyObject* ndarray = nullptr;     // numpy.ndarray: read through the buffer protocol
    PyObject* is_torch = nullptr;    // is_torch(x) -> bool: read with torch's accessors
    PyObject* find_route = nullptr;  // find_route(op, x) -> (datatype, op, itemsize, average, dtype)
    PyObject* resolve = nullptr;     // resolve(group) -> an object with .handle and .ranks
    PyObject* empty_like = nullptr;  // empty_like(x, shape): the out-of-place result
    PyObject* mpi_error = nullptr;   // mpi4py.MPI.Exception
    intptr_t in_place = 0;           // MPI_IN_PLACE
    PyObject* kinds = nullptr;       // type -> is_torch's answer, ours
    PyObject* routes = nullptr;      // (op, dtype) -> capsule of a Route, ours
    bool ready = false;
} fn;

struct Settings {
    bool enabled = false;    // PYCOLL_CHECK and the like turn it off
    Py_ssize_t max_bytes = 0;  // larger allreduces go in pieces (PYCOLL_CHUNK_BYTES)
} settings;

struct World {
    Gate* gate = nullptr;  // the engine's; nullptr while pycoll is not initialized
    intptr_t comm = 0;
    Py_ssize_t size = 0;
} world;

unsigned long long runs = 0;

struct Names {
    PyObject *is_cpu, *is_contiguous, *data_ptr, *nbytes, *dtype, *shape, *handle, *ranks, *allreduce;
} s;

// How an (op, dtype) allreduce goes to MPI_Allreduce.
struct Route {
    intptr_t datatype, op;
    Py_ssize_t itemsize;
    bool average;
    DType dt;
};

void free_route(PyObject* capsule) { delete static_cast<Route*>(PyCapsule_GetPointer(capsule, "pycoll.Route")); }

// ---------------------------------------------------------------- reading a tensor

// Where a host tensor's bytes are: its address, size and dtype object. 0: read; 1: not a
// tensor this path reads (the general path then does); -1: error.
struct Host {
    void* ptr = nullptr;
    Py_ssize_t nbytes = 0;
    Ref dtype;
};

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
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(x));
    PyObject* torch = PyDict_GetItemWithError(fn.kinds, type);
    Ref found;
    if (!torch) {
        if (PyErr_Occurred()) return -1;
        found.reset(PyObject_CallOneArg(fn.is_torch, x));  // raises for what pycoll cannot read
        if (!found || PyDict_SetItem(fn.kinds, type, found.get()) < 0) return -1;
        torch = found.get();
    }
    if (torch != Py_True) return 1;
    Ref cpu(PyObject_GetAttr(x, s.is_cpu));
    if (!cpu) return -1;
    if (cpu.get() != Py_True) return 1;
    Ref contiguous(PyObject_CallMethodNoArgs(x, s.is_contiguous));
    if (!contiguous) return -1;
    if (contiguous.get() != Py_True) return 1;
    Ref ptr(PyObject_CallMethodNoArgs(x, s.data_ptr)), nbytes(PyObject_GetAttr(x, s.nbytes));
    if (!ptr || !nbytes) return -1;
    out.ptr = PyLong_AsVoidPtr(ptr.get());
    out.nbytes = PyLong_AsSsize_t(nbytes.get());
    if (PyErr_Occurred()) return -1;
    out.dtype.reset(PyObject_GetAttr(x, s.dtype));
    return out.dtype ? 0 : -1;
}

// The route of (op, dtype), borrowed from our table; nullptr with no error: an op that is not
// even hashable (the general path names what is wrong with it).
const Route* route_of(PyObject* op, PyObject* x, PyObject* dtype) {
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
    const char* name;
    if (!PyArg_ParseTuple(found.get(), "OOnpz:find_route's result", &datatype, &mpi_op, &itemsize, &average, &name))
        return nullptr;
    auto route = std::make_unique<Route>();
    if (!as_ptr(datatype, route->datatype) || !as_ptr(mpi_op, route->op)) return nullptr;
    if (itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "find_route: itemsize must be positive");
        return nullptr;
    }
    route->itemsize = itemsize;
    route->average = average;
    try {
        route->dt = parse_dtype(name);
    } catch (const std::invalid_argument& error) {
        PyErr_SetString(PyExc_ValueError, error.what());
        return nullptr;
    }
    Ref held(PyCapsule_New(route.get(), "pycoll.Route", free_route));
    if (!held) return nullptr;
    const Route* kept = route.release();
    return PyDict_SetItem(fn.routes, key.get(), held.get()) < 0 ? nullptr : kept;
}

// The communicator handle and size of the group last resolved (a group's are fixed: the
// resolver refuses one that shutdown released). The reference keeps that group alive, so
// another cannot take its address.
struct GroupParts {
    PyObject* group = nullptr;
    intptr_t comm = 0;
    Py_ssize_t size = 0;
};
GroupParts last_group;

const GroupParts* parts_of_group(PyObject* group) {
    if (group == last_group.group) return &last_group;
    Ref handle(PyObject_GetAttr(group, s.handle)), ranks(PyObject_GetAttr(group, s.ranks));
    intptr_t comm;
    if (!handle || !ranks || !as_ptr(handle.get(), comm)) return nullptr;
    Py_ssize_t size = PyObject_Length(ranks.get());
    if (size < 0) return nullptr;
    Py_XSETREF(last_group.group, Py_NewRef(group));
    last_group.comm = comm;
    last_group.size = size;
    return &last_group;
}

}  // namespace

bool init(PyObject* module) {
    struct { PyObject** slot; const char* text; } all[] = {
        {&s.is_cpu, "is_cpu"}, {&s.is_contiguous, "is_contiguous"}, {&s.data_ptr, "data_ptr"},
        {&s.nbytes, "nbytes"}, {&s.dtype, "dtype"}, {&s.shape, "shape"}, {&s.handle, "handle"},
        {&s.ranks, "ranks"}, {&s.allreduce, "allreduce"},
    };
    for (auto& name : all)
        if (!(*name.slot = PyUnicode_InternFromString(name.text))) return false;
    if (PyType_Ready(&gate_type) < 0) return false;
    return PyModule_AddObjectRef(module, "Gate", reinterpret_cast<PyObject*>(&gate_type)) == 0;
}

PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"ndarray", "is_torch", "find_route", "resolve", "empty_like", "mpi_error",
                                     "in_place", nullptr};
    Functions f;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOOOn:short_path_setup", const_cast<char**>(keywords),
                                     &PyType_Type, &f.ndarray, &f.is_torch, &f.find_route, &f.resolve, &f.empty_like,
                                     &f.mpi_error, &f.in_place))
        return nullptr;
    f.kinds = PyDict_New();
    f.routes = PyDict_New();
    if (!f.kinds || !f.routes) return nullptr;
    for (PyObject* held : {f.ndarray, f.is_torch, f.find_route, f.resolve, f.empty_like, f.mpi_error})
        Py_INCREF(held);  // for the life of the process, as the module that passed them
    f.ready = true;
    fn = f;
    Py_RETURN_NONE;
}

PyObject* configure(PyObject*, PyObject* args) {
    int enabled;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTuple(args, "pn:short_path_settings", &enabled, &max_bytes)) return nullptr;
    settings = {enabled != 0, max_bytes};
    Py_RETURN_NONE;
}

PyObject* bind(PyObject*, PyObject* args) {
    PyObject *gate, *handle = nullptr;
    Py_ssize_t size = 0;
    if (!PyArg_ParseTuple(args, "O|On:short_path_bind", &gate, &handle, &size)) return nullptr;
    if (gate == Py_None) {
        Py_CLEAR(world.gate);
        Py_CLEAR(last_group.group);  // its handle is being freed
        Py_RETURN_NONE;
    }
    intptr_t comm;
    if (!PyObject_TypeCheck(gate, &gate_type) || !handle || !as_ptr(handle, comm) || size <= 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "short_path_bind(gate, world_handle, world_size) or short_path_bind(None)");
        return nullptr;
    }
    Py_XSETREF(world.gate, reinterpret_cast<Gate*>(Py_NewRef(gate)));
    world.comm = comm;
    world.size = size;
    Py_RETURN_NONE;
}

PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allreduce_now(x, inplace, op, group, name) takes 5 arguments");
        return nullptr;
    }
    PyObject *x = args[0], *op = args[2], *group = args[3], *name = args[4];
    const bool inplace = args[1] == Py_True;
    Gate* gate = world.gate;
    if (!fn.ready || !settings.enabled || !gate || !mpi::bound()) Py_RETURN_NONE;

    Host in;
    if (int read = read_host(x, inplace, in)) return read < 0 ? nullptr : none();
    const Route* route = route_of(op, x, in.dtype.get());
    if (!route) return PyErr_Occurred() ? nullptr : none();
    if (in.nbytes > settings.max_bytes) Py_RETURN_NONE;  // in pieces, that stay in cache
    const Py_ssize_t count = in.nbytes / route->itemsize;
    if (count > INT_MAX) Py_RETURN_NONE;

    intptr_t comm = world.comm;
    Py_ssize_t size = world.size;
    if (group != Py_None) {
        Ref grp(PyObject_CallOneArg(fn.resolve, group));  // raises for what cannot be used
        if (!grp) return nullptr;
        const GroupParts* g = parts_of_group(grp.get());
        if (!g) return nullptr;
        comm = g->comm;  // copied: another thread may change the cache meanwhile
        size = g->size;
    }

    Ref out;
    Host result;
    if (inplace) {
        out.reset(Py_NewRef(x));
    } else {
        Ref shape(PyObject_GetAttr(x, s.shape));
        out.reset(shape ? PyObject_CallFunctionObjArgs(fn.empty_like, x, shape.get(), nullptr) : nullptr);
        if (!out) return nullptr;
        if (int read = read_host(out.get(), true, result)) return read < 0 ? nullptr : none();
    }
    Py_INCREF(gate);  // bind(None) may run in another thread while MPI runs
    Ref held(reinterpret_cast<PyObject*>(gate));
    if (!claim(gate, name == Py_None ? s.allreduce : name))
        return PyErr_Occurred() ? nullptr : none();  // earlier work: the engine runs it first
    const void* send = inplace ? reinterpret_cast<const void*>(fn.in_place) : in.ptr;
    void* recv = inplace ? in.ptr : result.ptr;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = mpi::allreduce(send, recv, static_cast<int>(count), route->datatype, route->op, comm);
    Py_END_ALLOW_THREADS
    ++runs;
    if (release(gate) < 0) return nullptr;
    if (code) {
        Ref error(PyObject_CallFunction(fn.mpi_error, "i", code));
        if (error) PyErr_SetObject(fn.mpi_error, error.get());
        return nullptr;
    }
    if (route->average) {
        const double factor = 1.0 / static_cast<double>(size);
        const DType dt = route->dt;
        Py_BEGIN_ALLOW_THREADS
        cpu::scale(recv, static_cast<size_t>(count), dt, factor);
        Py_END_ALLOW_THREADS
    }
    return out.release();
}

PyObject* count(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(runs); }

}  // namespace pycoll::short_path
