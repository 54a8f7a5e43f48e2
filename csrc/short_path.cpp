// The blocking allreduce's short path (collectives.allreduce and allreduce_), and the
// engine's claim and release that it shares with Engine.run. A contiguous host tensor of
// one piece, while the engine is idle, goes straight to MPI_Allreduce. Written in Python
// its steps cost 1.1 us, twice the MPI call at 4 ranks on 2 cores, where each
// microsecond a rank spends outside MPI delays every peer sharing its core; here they cost
// little more than torch's own accessors. It reads the Python objects that short_path_setup
// was given once (collectives.py): anything it cannot read or route, it leaves (None) to
// the general path, which says what is wrong.
#include "short_path.h"

#include <climits>
#include <ctime>

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

struct Context {
    PyObject* ndarray = nullptr;        // numpy.ndarray, read through the buffer protocol
    PyObject* readers = nullptr;        // tensors._READERS: class -> reader
    PyObject* find_reader = nullptr;    // tensors._reader(x): a class met first, added to readers
    PyObject* torch_reader = nullptr;   // tensors._from_torch: classes read with torch's accessors
    PyObject* routes = nullptr;         // (op, x.dtype) -> collectives._Route
    PyObject* find_route = nullptr;     // collectives._short_route(op, x): the route, added to routes
    PyObject* overrides = nullptr;      // config._overrides, then
    PyObject* environment = nullptr;    // config._from_environment, else
    PyObject* get_knob = nullptr;       // config.get, which fills it
    PyObject* state = nullptr;          // runtime._state: .world, .engine
    PyObject* resolve = nullptr;        // runtime.resolve(group)
    PyObject* empty_like = nullptr;     // tensors.empty_like(x, shape)
    PyObject* mpi_error = nullptr;      // mpi4py.MPI.Exception
    intptr_t in_place = 0;              // MPI_IN_PLACE
    bool ready = false;
};

Context ctx;
unsigned long long runs = 0;

struct Names {
    PyObject *is_cpu, *is_contiguous, *data_ptr, *nbytes, *dtype, *shape, *world, *engine, *handle, *ranks,
        *idle, *queued, *open, *running, *notify, *pop, *append, *check, *link, *chunk_bytes, *allreduce;
} s;

}  // namespace

bool init() {
    struct { PyObject** slot; const char* text; } all[] = {
        {&s.is_cpu, "is_cpu"}, {&s.is_contiguous, "is_contiguous"}, {&s.data_ptr, "data_ptr"},
        {&s.nbytes, "nbytes"}, {&s.dtype, "dtype"}, {&s.shape, "shape"}, {&s.world, "world"},
        {&s.engine, "engine"}, {&s.handle, "handle"}, {&s.ranks, "ranks"}, {&s.idle, "_idle"},
        {&s.queued, "_ready"}, {&s.open, "_open"}, {&s.running, "_running"}, {&s.notify, "_notify"},
        {&s.pop, "pop"}, {&s.append, "append"}, {&s.check, "check"}, {&s.link, "link"}, {&s.chunk_bytes, "chunk_bytes"},
        {&s.allreduce, "allreduce"},
    };
    for (auto& name : all)
        if (!(*name.slot = PyUnicode_InternFromString(name.text))) return false;
    return true;
}

namespace {

// config.get(name), with its precedence (override, then environment), without a Python call.
PyObject* knob(PyObject* name) {  // borrowed from config's dicts
    PyObject* value = PyDict_GetItemWithError(ctx.overrides, name);
    if (!value && !PyErr_Occurred()) value = PyDict_GetItemWithError(ctx.environment, name);
    if (value || PyErr_Occurred()) return value;
    Ref parsed(PyObject_CallOneArg(ctx.get_knob, name));  // first use: parses the variable
    return parsed ? PyDict_GetItemWithError(ctx.environment, name) : nullptr;
}

double monotonic() {  // time.monotonic()'s clock: the watchdog compares with it
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // to the tick: the watchdog counts seconds
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Where a host tensor's bytes are: its address, size and dtype object. 0: read; 1: not a
// tensor this path reads (the general path then does); -1: error.
struct Host {
    void* ptr = nullptr;
    Py_ssize_t nbytes = 0;
    Ref dtype;
};

int read_host(PyObject* x, bool writable, Host& out) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == ctx.ndarray) {
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
    PyObject* reader = PyDict_GetItemWithError(ctx.readers, reinterpret_cast<PyObject*>(Py_TYPE(x)));
    Ref found;
    if (!reader) {
        if (PyErr_Occurred()) return -1;
        found.reset(PyObject_CallOneArg(ctx.find_reader, x));  // raises for what pycoll cannot read
        if (!(reader = found.get())) return -1;
    }
    if (reader != ctx.torch_reader) return 1;
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

// The route of (op, dtype); nullptr with no error: an op that is not even hashable.
PyObject* route_of(PyObject* op, PyObject* x, PyObject* dtype) {
    Ref key(PyTuple_Pack(2, op, dtype));
    if (!key) return nullptr;
    PyObject* route = PyDict_GetItemWithError(ctx.routes, key.get());
    if (route) return Py_INCREF(route), route;
    if (PyErr_Occurred()) {  // an unhashable op: the general path names what is wrong with it
        PyErr_Clear();
        return nullptr;
    }
    PyObject* args[] = {op, x};
    Ref found(PyObject_Vectorcall(ctx.find_route, args, 2, nullptr));
    if (found && !(PyTuple_Check(found.get()) && PyTuple_GET_SIZE(found.get()) == 5)) {
        PyErr_SetString(PyExc_TypeError, "short path: find_route must return a collectives._Route");
        return nullptr;
    }
    return found.release();
}

PyObject* none() { Py_RETURN_NONE; }

bool as_ptr(PyObject* obj, intptr_t& out) {  // mpi4py handles: negative ints too (MPICH)
    out = reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(obj));
    return !(out == 0 && PyErr_Occurred());
}

// What claim and release use of the engine they last saw, looked up once: Engine binds
// _idle and _ready in __init__ and never again. The references keep that engine alive,
// so a new one cannot take its address.
struct EngineParts {
    PyObject* engine = nullptr;
    PyObject* pop = nullptr;     // engine._idle.pop
    PyObject* append = nullptr;  // engine._idle.append
    PyObject* queued = nullptr;  // engine._ready
};
EngineParts last_engine;

const EngineParts* parts_of(PyObject* engine) {
    if (engine == last_engine.engine) return &last_engine;
    Ref idle(PyObject_GetAttr(engine, s.idle));
    Ref queued(idle ? PyObject_GetAttr(engine, s.queued) : nullptr);
    Ref pop(queued ? PyObject_GetAttr(idle.get(), s.pop) : nullptr);
    Ref append(pop ? PyObject_GetAttr(idle.get(), s.append) : nullptr);
    if (!append) return nullptr;
    Py_INCREF(engine);
    EngineParts old = last_engine;
    last_engine = {engine, pop.release(), append.release(), queued.release()};
    for (PyObject* held : {old.engine, old.pop, old.append, old.queued}) Py_XDECREF(held);
    return &last_engine;
}

// The communicator handle and size of the group last used, likewise (a Group's are fixed).
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
    Py_INCREF(group);
    PyObject* old = last_group.group;
    last_group = {group, comm, size};
    Py_XDECREF(old);
    return &last_group;
}

// claim and release, shared by allreduce_now and the engine_* functions: 1 claimed, 0 not,
// -1 error.
int release(PyObject* engine);

// The idle token, if nothing issued earlier is queued or open. Here and in release no
// Python code runs between parts_of and the last use of its parts.
int claim(PyObject* engine, PyObject* name) {
    const EngineParts* e = parts_of(engine);
    if (!e) return -1;
    Ref token(PyObject_CallNoArgs(e->pop));  // atomic: the GIL is held throughout
    if (!token) {
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) return -1;
        PyErr_Clear();  // running: someone else has it
        return 0;
    }
    Ref open(PyObject_GetAttr(engine, s.open));
    const Py_ssize_t queued = open ? PyObject_Length(e->queued) : -1;
    if (queued < 0) return -1;
    if (queued || open.get() != Py_None)  // issued earlier: that runs first
        return release(engine) < 0 ? -1 : 0;
    Ref start(PyFloat_FromDouble(monotonic()));
    Ref running(start ? PyTuple_Pack(2, name, start.get()) : nullptr);
    if (!running || PyObject_SetAttr(engine, s.running, running.get()) < 0) {
        release(engine);
        return -1;
    }
    return 1;
}

// The token back; the engine's thread woken if work was queued while it was out (the thread
// may have found it gone and gone to sleep).
int release(PyObject* engine) {
    const EngineParts* e = parts_of(engine);
    if (!e || PyObject_SetAttr(engine, s.running, Py_None) < 0) return -1;
    Ref back(PyObject_CallOneArg(e->append, Py_True));
    if (!back) return -1;
    const Py_ssize_t queued = PyObject_Length(e->queued);  // meanwhile, by another thread
    if (queued <= 0) return queued < 0 ? -1 : 0;
    Ref done(PyObject_CallMethodNoArgs(engine, s.notify));
    return done ? 0 : -1;
}

}  // namespace

PyObject* setup(PyObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"ndarray", "readers", "find_reader", "torch_reader", "routes", "find_route", "overrides",
                                     "environment", "get_knob", "state", "resolve", "empty_like", "mpi_error",
                                     "in_place", nullptr};
    Context c;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOO!OO!O!OOOOOn:short_path_setup",
                                     const_cast<char**>(keywords), &PyType_Type, &c.ndarray, &PyDict_Type,
                                     &c.readers, &c.find_reader, &c.torch_reader, &PyDict_Type, &c.routes, &c.find_route,
                                     &PyDict_Type, &c.overrides, &PyDict_Type, &c.environment, &c.get_knob,
                                     &c.state, &c.resolve, &c.empty_like, &c.mpi_error, &c.in_place))
        return nullptr;
    for (PyObject* held : {c.ndarray, c.readers, c.find_reader, c.torch_reader, c.routes, c.find_route, c.overrides,
                           c.environment, c.get_knob, c.state, c.resolve, c.empty_like, c.mpi_error})
        Py_INCREF(held);  // for the life of the process, as the module that passed them
    c.ready = true;
    ctx = c;
    Py_RETURN_NONE;
}

PyObject* allreduce_now(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allreduce_now(x, inplace, op, group, name) takes 5 arguments");
        return nullptr;
    }
    PyObject *x = args[0], *op = args[2], *group = args[3], *name = args[4];
    const bool inplace = args[1] == Py_True;
    if (!ctx.ready || !mpi::bound()) Py_RETURN_NONE;
    PyObject* check = knob(s.check);
    if (!check) return nullptr;
    int checking = PyObject_IsTrue(check);
    if (checking) return checking < 0 ? nullptr : none();  // the ranks compare first
    PyObject* link = knob(s.link);  // parsed once, like every knob: a dict lookup here
    if (!link) return nullptr;
    if (link != Py_None) Py_RETURN_NONE;  // --link: the general path sleeps the modelled time

    Host in;
    if (int read = read_host(x, inplace, in)) return read < 0 ? nullptr : none();
    Ref held_route(route_of(op, x, in.dtype.get()));
    PyObject* route = held_route.get();
    if (!route) return PyErr_Occurred() ? nullptr : none();
    PyObject* limit = knob(s.chunk_bytes);
    if (!limit) return nullptr;
    Py_ssize_t chunk = PyLong_AsSsize_t(limit);
    if (chunk == -1 && PyErr_Occurred()) return nullptr;
    if (in.nbytes > chunk) Py_RETURN_NONE;  // in pieces, that stay in cache
    intptr_t datatype, mpi_op;
    Py_ssize_t itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(route, 2));
    int average = PyObject_IsTrue(PyTuple_GET_ITEM(route, 3));
    if (!as_ptr(PyTuple_GET_ITEM(route, 0), datatype) || !as_ptr(PyTuple_GET_ITEM(route, 1), mpi_op) ||
        itemsize <= 0 || average < 0)
        return PyErr_Occurred() ? nullptr : none();
    const Py_ssize_t count = in.nbytes / itemsize;
    if (count > INT_MAX) Py_RETURN_NONE;

    Ref grp(group == Py_None ? PyObject_GetAttr(ctx.state, s.world) : PyObject_CallOneArg(ctx.resolve, group));
    Ref engine(PyObject_GetAttr(ctx.state, s.engine));
    if (!grp || !engine) return nullptr;
    if (grp.get() == Py_None || engine.get() == Py_None) Py_RETURN_NONE;  // not initialized: the general path says so
    const GroupParts* g = parts_of_group(grp.get());
    if (!g) return nullptr;
    const intptr_t comm = g->comm;  // copied: another thread may change the cache meanwhile
    const Py_ssize_t size = g->size;

    Ref out;
    Host result;
    if (inplace) {
        Py_INCREF(x);
        out.reset(x);
    } else {
        Ref shape(PyObject_GetAttr(x, s.shape));
        out.reset(shape ? PyObject_CallFunctionObjArgs(ctx.empty_like, x, shape.get(), nullptr) : nullptr);
        if (!out) return nullptr;
        if (int read = read_host(out.get(), true, result)) return read < 0 ? nullptr : none();
    }
    int claimed = claim(engine.get(), name == Py_None ? s.allreduce : name);
    if (claimed <= 0) return claimed < 0 ? nullptr : none();  // earlier work: the engine runs it first
    const void* send = inplace ? reinterpret_cast<const void*>(ctx.in_place) : in.ptr;
    void* recv = inplace ? in.ptr : result.ptr;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = mpi::allreduce(send, recv, static_cast<int>(count), datatype, mpi_op, comm);
    Py_END_ALLOW_THREADS
    ++runs;
    if (release(engine.get()) < 0) return nullptr;
    if (code) {
        Ref error(PyObject_CallFunction(ctx.mpi_error, "i", code));
        if (error) PyErr_SetObject(ctx.mpi_error, error.get());
        return nullptr;
    }
    if (average) {
        Ref dtype_name(PyObject_GetAttr(route, s.dtype));
        const char* text = dtype_name ? PyUnicode_AsUTF8(dtype_name.get()) : nullptr;
        if (!text) return nullptr;
        DType dt;
        try {
            dt = parse_dtype(text);
        } catch (const std::invalid_argument& error) {
            PyErr_SetString(PyExc_ValueError, error.what());
            return nullptr;
        }
        const double factor = 1.0 / static_cast<double>(size);
        Py_BEGIN_ALLOW_THREADS
        cpu::scale(recv, static_cast<size_t>(count), dt, factor);
        Py_END_ALLOW_THREADS
    }
    return out.release();
}

PyObject* engine_claim(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "engine_claim(engine, name) takes 2 arguments");
        return nullptr;
    }
    int claimed = claim(args[0], args[1]);
    return claimed < 0 ? nullptr : PyBool_FromLong(claimed);
}

PyObject* engine_release(PyObject*, PyObject* engine) {
    if (release(engine) < 0) return nullptr;
    Py_RETURN_NONE;
}

PyObject* count(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(runs); }

}  // namespace pycoll::short_path
