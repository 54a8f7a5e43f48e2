// partial_allreduce's blocking call in one compiled entry. A call on a contiguous host
// tensor, with the engine idle and checks and the timeline off, goes from here straight
// into the exchange (partial.cpp) or the group's cached communicator, without the GIL
// (under --link paced as the short path's collectives are);
// in Python the same call cost about 5 us of planning, several times a small exchange.
// Anything else returns None before a count changes, and the general path in
// pycoll/partial.py runs it (and says what is wrong with bad arguments).
//
// One state: the counts that pycoll.partial keeps for every group (rounds begun with each
// peer, which make the tags; uses of each group, which switch it to a cached communicator)
// are its own Python dicts, bound once and counted here by the same rules.
#include "partial_now.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtypes.h"
#include "kernels.h"
#include "mpi_calls.h"
#include "py_ref.h"
#include "partial.h"
#include "short_path.h"

namespace pycoll::partial_now {
namespace {

struct Bound {
    PyObject *shared = nullptr, *uses = nullptr, *comms = nullptr, *broken = nullptr, *abandoned = nullptr;
    PyObject *clone = nullptr, *failed = nullptr;
    intptr_t comm = 0, byte_type = 0, request_null = 0, in_place = 0;
    int undefined = 0, me = 0, size = 0;
    long long tag_ub = 0;
} b;

struct Settings {
    bool enabled = false;  // off under PYCOLL_CHECK and the timeline
    long cache_after = 0;
    size_t direct_bytes = 0, doubling_from = 4, chunk_bytes = 1;
    double timeout = 0;
} settings;
short_path::Link link;  // the emulation's hook under --link (partial_settings)

PyObject *s_handle, *s_name, *s_direct, *s_allreduce;

// ranks as sorted members; false (no error) for anything the general path should judge.
bool members_of(PyObject* ranks, std::vector<int>& members, size_t& me) {
    if (!PyList_CheckExact(ranks) && !PyTuple_CheckExact(ranks)) return false;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(ranks);
    if (k < 2) return false;
    members.resize(static_cast<size_t>(k));
    for (Py_ssize_t i = 0; i < k; ++i) {
        PyObject* r = PySequence_Fast_GET_ITEM(ranks, i);
        if (!PyLong_CheckExact(r)) return false;
        const long v = PyLong_AsLong(r);
        if (v < 0 || v >= b.size) return (PyErr_Clear(), false);
        members[static_cast<size_t>(i)] = static_cast<int>(v);
    }
    std::sort(members.begin(), members.end());
    if (std::adjacent_find(members.begin(), members.end()) != members.end()) return false;
    const auto mine = std::find(members.begin(), members.end(), b.me);
    me = static_cast<size_t>(mine - members.begin());
    return mine != members.end();
}

PyObject* tuple_of(const std::vector<int>& members) {
    PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(members.size()));
    for (size_t i = 0; t && i < members.size(); ++i) {
        PyObject* r = PyLong_FromLong(members[i]);
        if (!r) {
            Py_DECREF(t);
            return nullptr;
        }
        PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), r);
    }
    return t;
}

// dict[key] as a count (0 when absent); -1 with an error.
long long count_in(PyObject* dict, PyObject* key) {
    PyObject* v = PyDict_GetItemWithError(dict, key);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    return PyLong_AsLongLong(v);
}

bool set_count(PyObject* dict, PyObject* key, long long n) {
    Ref v(PyLong_FromLongLong(n));
    return v && PyDict_SetItem(dict, key, v.get()) == 0;
}


PyObject* none() { Py_RETURN_NONE; }

void unbind() {
    for (PyObject** held : {&b.shared, &b.uses, &b.comms, &b.broken, &b.abandoned, &b.clone, &b.failed})
        Py_CLEAR(*held);
}

}  // namespace

PyObject* bind(PyObject*, PyObject* args) {
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None) {
        unbind();
        Py_RETURN_NONE;
    }
    Bound n;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!(nnnin)iiLOO:partial_bind", &PyDict_Type, &n.shared, &PyDict_Type,
                          &n.uses, &PyDict_Type, &n.comms, &PyDict_Type, &n.broken, &PyList_Type, &n.abandoned,
                          &n.comm, &n.byte_type, &n.request_null, &n.undefined, &n.in_place, &n.me, &n.size,
                          &n.tag_ub, &n.clone, &n.failed))
        return nullptr;
    if (!s_handle) {
        s_handle = PyUnicode_InternFromString("handle");
        s_name = PyUnicode_InternFromString("partial_allreduce");
        s_direct = PyUnicode_InternFromString("direct");
        s_allreduce = PyUnicode_InternFromString("allreduce");
        if (!s_handle || !s_name || !s_direct || !s_allreduce) return nullptr;
    }
    for (PyObject* held : {n.shared, n.uses, n.comms, n.broken, n.abandoned, n.clone, n.failed})
        Py_INCREF(held);
    unbind();  // what was bound before
    b = n;
    Py_RETURN_NONE;
}

PyObject* configure(PyObject*, PyObject* args) {
    int enabled;
    Settings n;
    PyObject* group_of = Py_None;
    if (!PyArg_ParseTuple(args, "plnnnd|O:partial_settings", &enabled, &n.cache_after, &n.direct_bytes,
                          &n.doubling_from, &n.chunk_bytes, &n.timeout, &group_of))
        return nullptr;
    n.enabled = enabled != 0;
    settings = n;
    Py_XSETREF(link.group_of, group_of == Py_None ? nullptr : Py_NewRef(group_of));
    Py_RETURN_NONE;
}

PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "partial_now(x, inplace, ranks, op, name) takes 5 arguments");
        return nullptr;
    }
    short_path::Paced paced(link);  // the model runs from here: the call
    PyObject *x = args[0], *ranks = args[2], *op = args[3], *name = args[4] == Py_None ? s_name : args[4];
    const bool inplace = args[1] == Py_True;
    // Failed rounds leave state (sends still reading, broken groups) the general path
    // handles; so does op None, which it refuses.
    if (!settings.enabled || !b.shared || !mpi::bound() || PyList_GET_SIZE(b.abandoned) || PyDict_GET_SIZE(b.broken) ||
        op == Py_None)
        Py_RETURN_NONE;
    std::vector<int> members;
    size_t me;
    if (!members_of(ranks, members, me)) Py_RETURN_NONE;
    // Out of place the result is read, not x (which may be read-only): a GPU tensor is
    // cloned here and again by the general path, a copy that path's staging dwarfs.
    Ref out(inplace ? Py_NewRef(x) : PyObject_CallOneArg(b.clone, x));
    if (!out) return nullptr;
    short_path::Host host;
    const short_path::Route* found = nullptr;  // the short path's, asked once per op and dtype
    if (int read = short_path::read_routed(out.get(), true, op, host, found))
        return read < 0 ? nullptr : none();  // GPU, strided, read-only, unhashable op: the general path's
    const short_path::Route& route = *found;  // kept by the short path until it is set up again
    void* data = host.ptr;
    const size_t count = static_cast<size_t>(host.nbytes / route.itemsize);

    Ref key(tuple_of(members));
    if (!key) return nullptr;
    const long long uses = count_in(b.uses, key.get()) + 1;
    if (uses == 0) return nullptr;
    intptr_t cached = 0;  // the group's communicator from its cache_after-th use
    if (settings.cache_after && uses >= settings.cache_after) {
        PyObject* comm = PyDict_GetItemWithError(b.comms, key.get());
        if (!comm) return PyErr_Occurred() ? nullptr : none();  // the general path makes it
        Ref handle(PyObject_GetAttr(comm, s_handle));
        if (!handle) return nullptr;
        cached = reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(handle.get()));
        if (PyErr_Occurred()) return nullptr;
        if (count > INT32_MAX) Py_RETURN_NONE;
    }
    short_path::Token token(name, s_name, short_path::world_gate(), key.get());
    if (!token.held()) return PyErr_Occurred() ? nullptr : none();  // earlier work: the engine runs it first
    // Paced as the general path paces it: the direct exchange's model up to direct_bytes,
    // the ring's beyond (a cached communicator's Allreduce included).
    if (!paced.begin(host.nbytes <= static_cast<Py_ssize_t>(settings.direct_bytes) ? s_direct : s_allreduce,
                     key.get(), host.nbytes))
        return nullptr;

    // Counted before anything can fail: every member counts every round issued to it.
    if (!set_count(b.uses, key.get(), uses)) return nullptr;
    partial::Round r;
    r.tags.resize(members.size());
    for (size_t j = 0; j < members.size(); ++j) {
        PyObject* peer = PyTuple_GET_ITEM(key.get(), static_cast<Py_ssize_t>(j));
        const long long begun = count_in(b.shared, peer);
        if (begun < 0) return nullptr;
        r.tags[j] = static_cast<int>(begun % (b.tag_ub + 1));
        if (j != me && !set_count(b.shared, peer, begun + 1)) return nullptr;
    }
    partial::Outcome outcome;
    const double scale = route.average ? 1.0 / static_cast<double>(members.size()) : 1.0;
    if (cached) {
        int code;
        Py_BEGIN_ALLOW_THREADS
        code = mpi::allreduce(reinterpret_cast<const void*>(b.in_place), data, static_cast<int>(count),
                              route.datatype, route.op, cached);
        if (!code && scale != 1.0) cpu::scale(data, count, route.dt, scale);
        Py_END_ALLOW_THREADS
        if (code) outcome.status = partial::Outcome::Failed, outcome.error = code;
    } else {
        r.comm = b.comm, r.byte_type = b.byte_type, r.request_null = b.request_null, r.undefined = b.undefined;
        r.members = std::move(members);
        r.me = me, r.data = data, r.count = count, r.dt = route.dt, r.op = route.reduce, r.scale = scale;
        r.chunk_bytes = settings.chunk_bytes, r.direct_bytes = settings.direct_bytes;
        r.doubling_from = settings.doubling_from, r.timeout = settings.timeout;
        if (!exchange(r, outcome)) return nullptr;
    }
    if (outcome.status == partial::Outcome::Done) return paced.end() ? out.release() : nullptr;
    Ref sends(sends_of(outcome));
    if (!sends) return nullptr;
    Ref raised(PyObject_CallFunction(b.failed, "OOOiiiO", key.get(), name, out.get(), static_cast<int>(outcome.status),
                                     outcome.peer, outcome.error, sends.get()));
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "partial_allreduce failed");
    return nullptr;
}

bool kinds_of(const char* dtype, const char* op, DType& dt, Op& reduce) {
    try {
        dt = parse_dtype(dtype);
        reduce = parse_op(op);
    } catch (const std::invalid_argument& error) {
        PyErr_SetString(PyExc_ValueError, error.what());
        return false;
    }
    return true;
}

bool exchange(const partial::Round& r, partial::Outcome& out) {
    std::string refused;
    bool invalid = false;
    Py_BEGIN_ALLOW_THREADS
    try {
        out = partial::allreduce(r);
    } catch (const std::exception& error) {
        refused = error.what();
        invalid = dynamic_cast<const std::invalid_argument*>(&error) != nullptr;  // settings out of range
    }
    Py_END_ALLOW_THREADS
    if (refused.empty()) return true;
    PyErr_SetString(invalid ? PyExc_ValueError : PyExc_RuntimeError, refused.c_str());
    return false;
}

PyObject* sends_of(const partial::Outcome& out) {
    Ref sends(PyList_New(static_cast<Py_ssize_t>(out.sends.size())));
    for (size_t i = 0; sends && i < out.sends.size(); ++i) {
        PyObject* h = PyLong_FromVoidPtr(reinterpret_cast<void*>(out.sends[i]));
        if (!h) return nullptr;
        PyList_SET_ITEM(sends.get(), static_cast<Py_ssize_t>(i), h);
    }
    return sends.release();
}

}  // namespace pycoll::partial_now
