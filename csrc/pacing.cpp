// Collectives under --link (pacing.h; the model and its use: pycoll/emulation.py).
//
// Each world rank's entries into its latest collectives lie in a file in shared memory that
// every rank maps (pace_bind): SLOTS per rank, each (key, entry time, latency, 1/bandwidth,
// bytes), written in turn. A rank writes only its own, the key last (a seqlock: readers check
// the key again after the values); the others find an entry by its key, not by a slot of its
// group's: a rank that has left one group's collective may enter another's before a slow
// member of the first has read it. Every member computes the same start (the latest entry)
// and cost at the slowest member's link, so they leave together.
//
// Compiled because it runs on every paced collective, mostly right after the ranks woke: in
// Python, entering and leaving took 20-30 us each on a cold call (2-core VM), as much as the
// 4 KiB transfers' whole model (docs/benchmarks.md).
#include "pacing.h"

#include <fcntl.h>
#include <structmember.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "clock.h"
#include "py_ref.h"

namespace pycoll::pacing {
namespace {

enum class Kind { Allreduce, Allgather, ReduceScatter, Alltoall, Broadcast, Barrier, Direct, Count };
const char* const kKindNames[] = {"allreduce", "allgather", "reduce_scatter", "alltoall",
                                  "broadcast", "barrier",   "direct"};

bool kind_of(PyObject* name, Kind& out) {
    if (PyUnicode_Check(name))
        for (int i = 0; i < static_cast<int>(Kind::Count); ++i)
            if (PyUnicode_CompareWithASCIIString(name, kKindNames[i]) == 0) return out = static_cast<Kind>(i), true;
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "no cost model for collective %R", name);
    return false;
}

// The alpha-beta cost of `kind` over n ranks (pycoll.emulation.collective_time).
double model(Kind kind, Py_ssize_t n, double nbytes, double latency, double inverse_bandwidth) {
    if (n <= 1) return 0.0;
    const double k = static_cast<double>(n), rounds = std::ceil(std::log2(k));
    switch (kind) {
        case Kind::Allreduce:
            return 2 * (k - 1) * (latency + nbytes * inverse_bandwidth / k);
        case Kind::Allgather:
        case Kind::ReduceScatter:
        case Kind::Alltoall:
            return (k - 1) * (latency + nbytes * inverse_bandwidth / k);
        case Kind::Broadcast:
            return rounds * (latency + nbytes * inverse_bandwidth);
        case Kind::Barrier:
            return rounds * latency;
        default:  // Direct
            return latency + (k - 1) * nbytes * inverse_bandwidth;
    }
}

constexpr Py_ssize_t SLOTS = 256;

// An entry: when its rank entered (not before its previous collective ended), its link, bytes.
struct Values {
    double time, latency, inverse_bandwidth, nbytes;
};
struct Slot {
    int64_t key;  // 0: being written
    Values values;
};

// This process's side of the slots, and its link (pace_settings).
struct Shared {
    std::mutex lock;  // the slots' hints and counters; the GIL is not held while leaving
    Slot* slots = nullptr;  // the file, mapped
    size_t mapped = 0;
    Py_ssize_t ranks = 0, me = -1;
    std::vector<Py_ssize_t> hints;  // per rank: the slot where its latest entry found was
    uint64_t written = 0;           // this rank's entries so far (its next slot)
    double latency = 0.0, inverse_bandwidth = 0.0, timeout = 300.0;
    double last_end = 0.0;  // when this rank's latest paced collective ended
} shared;

void write(int64_t key, const Values& values) {
    Slot& s = shared.slots[shared.me * SLOTS + static_cast<Py_ssize_t>(shared.written++ % SLOTS)];
    __atomic_store_n(&s.key, 0, __ATOMIC_RELAXED);  // no reader takes it half-written
    __atomic_thread_fence(__ATOMIC_RELEASE);
    std::memcpy(&s.values, &values, sizeof values);
    __atomic_store_n(&s.key, key, __ATOMIC_RELEASE);  // last: the entry is complete
}

// `rank`'s entry of `key`; false while it is not there. A rank writes its slots in turn, so
// the one sought is usually the slot after its entry found last.
bool find(Py_ssize_t rank, int64_t key, Values& out) {
    Slot* first = shared.slots + rank * SLOTS;
    const Py_ssize_t hint = shared.hints[rank];
    Py_ssize_t at = (hint + 1) % SLOTS;
    for (Py_ssize_t tried = 0; __atomic_load_n(&first[at].key, __ATOMIC_ACQUIRE) != key; at = (at + 1) % SLOTS)
        if (++tried == SLOTS) return false;
    std::memcpy(&out, &first[at].values, sizeof out);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&first[at].key, __ATOMIC_RELAXED) != key) return false;  // overwritten as we read
    shared.hints[rank] = at;
    return true;
}

// ---------------------------------------------------------------- PaceGroup, PaceEntry

struct Group {
    PyObject_HEAD
    int64_t cid, count;     // count: its collectives so far, the same on every member
    double latest;          // when this rank's latest one started in the model
    Py_ssize_t n;           // members
    Py_ssize_t* others;     // the other members' world ranks (rows of the slots)
    PyObject* owner;        // what the emulation made it for (a communicator)
};

struct Entry {
    PyObject_HEAD
    Group* group;
    Kind kind;
    int64_t key;
    Values mine;
};

// When a collective with these entries ends in the model: the latest entry plus the cost at
// the slowest member's link.
double end_of(const Entry* e, const Values* rows, size_t count) {
    Values top{-INFINITY, 0.0, 0.0, 0.0};
    double total = 0.0;
    for (size_t i = 0; i < count; ++i) {
        const Values& r = rows[i];
        top = {std::max(top.time, r.time), std::max(top.latency, r.latency),
               std::max(top.inverse_bandwidth, r.inverse_bandwidth), std::max(top.nbytes, r.nbytes)};
        total += r.nbytes;
    }
    return top.time + model(e->kind, e->group->n, e->kind == Kind::Allgather ? total : top.nbytes, top.latency,
                            top.inverse_bandwidth);
}

// The members' entries of e's collective into rows (this rank's first); false while one is
// not there.
bool entries(const Entry* e, std::vector<Values>& rows) {
    std::lock_guard<std::mutex> hold(shared.lock);
    rows.assign(1, e->mine);
    for (Py_ssize_t i = 0; i < e->group->n - 1; ++i) {
        rows.emplace_back();
        if (!find(e->group->others[i], e->key, rows.back())) return false;
    }
    return true;
}

// The same on every member: the group's id and count, mixed (splitmix64), never 0.
int64_t key_of(int64_t cid, int64_t count) {
    uint64_t z = static_cast<uint64_t>(cid) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(count);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = (z ^ (z >> 31)) & ((1ull << 62) - 1);
    return static_cast<int64_t>(z ? z : 1);
}

PyObject* entry_kind(PyObject* self, void*) {
    return PyUnicode_FromString(kKindNames[static_cast<int>(reinterpret_cast<Entry*>(self)->kind)]);
}

PyGetSetDef entry_getset[] = {
    {"kind", entry_kind, nullptr, "the collective's model (allreduce, allgather, ...)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

void entry_dealloc(PyObject* self) {
    Py_XDECREF(reinterpret_cast<Entry*>(self)->group);
    Py_TYPE(self)->tp_free(self);
}

PyTypeObject entry_type = [] {
    PyTypeObject t = type_of("pycoll._C.PaceEntry", sizeof(Entry),
                             "A rank's entry into one paced collective (PaceGroup.enter); pace_leave(entry) after it.",
                             entry_dealloc);
    t.tp_getset = entry_getset;
    return t;
}();

int group_init(PyObject* self, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"cid", "world", "me", "owner", nullptr};
    long long cid;
    Py_ssize_t me;
    PyObject *world, *owner;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LOnO:PaceGroup", const_cast<char**>(keywords), &cid, &world, &me,
                                     &owner))
        return -1;
    Ref ranks(PySequence_Fast(world, "PaceGroup: world must be a sequence of world ranks"));
    if (!ranks) return -1;
    auto* g = reinterpret_cast<Group*>(self);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(ranks.get());
    PyMem_Free(g->others);
    g->others = static_cast<Py_ssize_t*>(PyMem_Malloc(sizeof(Py_ssize_t) * static_cast<size_t>(n ? n : 1)));
    if (!g->others) return PyErr_NoMemory(), -1;
    Py_ssize_t others = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        const Py_ssize_t rank = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ranks.get(), i));
        if (rank == -1 && PyErr_Occurred()) return -1;
        if (rank != me) g->others[others++] = rank;
    }
    if (others != n - 1) {
        PyErr_Format(PyExc_ValueError, "PaceGroup: world rank %zd must be among the members once", me);
        return -1;
    }
    g->cid = cid, g->count = 0, g->latest = -INFINITY, g->n = n;
    Py_XSETREF(g->owner, Py_NewRef(owner));
    return 0;
}

void group_dealloc(PyObject* self) {
    auto* g = reinterpret_cast<Group*>(self);
    PyMem_Free(g->others);
    Py_XDECREF(g->owner);
    Py_TYPE(self)->tp_free(self);
}

PyObject* group_enter(PyObject* self, PyObject* args) {
    PyObject* kind;
    Py_ssize_t nbytes;
    double issued;
    if (!PyArg_ParseTuple(args, "Ond:enter", &kind, &nbytes, &issued)) return nullptr;
    return enter(self, kind, nbytes, issued);
}

PyMethodDef group_methods[] = {
    {"enter", group_enter, METH_VARARGS,
     "enter(kind, nbytes, issued) -> PaceEntry: this rank's entry into collective `kind` of nbytes (issued: when "
     "it was called, time.monotonic()), where the other members read it."},
    {nullptr, nullptr, 0, nullptr},
};

PyMemberDef group_members[] = {
    {"owner", T_OBJECT, offsetof(Group, owner), READONLY, "what it was made for (a communicator)"},
    {"count", T_LONGLONG, offsetof(Group, count), READONLY, "its collectives so far"},
    {"size", T_PYSSIZET, offsetof(Group, n), READONLY, "its members"},
    {"latest", T_DOUBLE, offsetof(Group, latest), READONLY,
     "when this rank's latest collective on it started in the model (time.monotonic())"},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject group_type = [] {
    PyTypeObject t = type_of(
        "pycoll._C.PaceGroup", sizeof(Group),
        "PaceGroup(cid, world, me, owner): a group's paced collectives: cid, the same on every member; world, its "
        "members' ranks in MPI.COMM_WORLD (me among them). After pace_bind.",
        group_dealloc);
    t.tp_new = PyType_GenericNew;
    t.tp_init = group_init;
    t.tp_methods = group_methods;
    t.tp_members = group_members;
    return t;
}();

void unbind() {
    if (shared.slots) munmap(shared.slots, shared.mapped);
    shared.slots = nullptr;
    shared.ranks = 0, shared.me = -1;
}

}  // namespace

bool init(PyObject* module) {
    if (PyType_Ready(&group_type) < 0 || PyType_Ready(&entry_type) < 0) return false;
    return PyModule_AddObjectRef(module, "PaceGroup", reinterpret_cast<PyObject*>(&group_type)) == 0 &&
           PyModule_AddObjectRef(module, "PaceEntry", reinterpret_cast<PyObject*>(&entry_type)) == 0;
}

PyObject* enter(PyObject* group, PyObject* kind, Py_ssize_t nbytes, double issued) {
    if (!PyObject_TypeCheck(group, &group_type)) {
        PyErr_Format(PyExc_TypeError, "pacing: %R is not a PaceGroup", group);
        return nullptr;
    }
    auto* g = reinterpret_cast<Group*>(group);
    Kind k;
    if (!kind_of(kind, k)) return nullptr;
    if (!shared.slots) {
        PyErr_SetString(PyExc_RuntimeError, "pacing: no slots bound (pace_bind)");
        return nullptr;
    }
    auto* e = PyObject_New(Entry, &entry_type);
    if (!e) return nullptr;
    e->group = reinterpret_cast<Group*>(Py_NewRef(group));
    e->kind = k;
    const double now = clock::now();
    std::lock_guard<std::mutex> hold(shared.lock);
    e->key = key_of(g->cid, ++g->count);
    e->mine = {std::max(std::min(issued, now), shared.last_end), shared.latency, shared.inverse_bandwidth,
               static_cast<double>(nbytes)};
    write(e->key, e->mine);
    g->latest = e->mine.time;
    return reinterpret_cast<PyObject*>(e);
}

bool leave(PyObject* entry) {
    if (!PyObject_TypeCheck(entry, &entry_type)) {
        PyErr_Format(PyExc_TypeError, "pacing: %R is not a PaceEntry", entry);
        return false;
    }
    const auto* e = reinterpret_cast<Entry*>(entry);
    Py_BEGIN_ALLOW_THREADS
    std::vector<Values> rows;
    bool found = entries(e, rows);
    if (!found) {  // a broadcast's root can finish before the others come
        // Not before the end this rank's entry alone gives (the others' can only make it
        // later); by then the others are usually there. A member that never comes: the real
        // call says so, not this.
        clock::sleep_until(end_of(e, &e->mine, 1));
        clock::Patience patience(shared.timeout);
        while (!(found = entries(e, rows)) && patience.idle()) {
        }
    }
    if (found) {
        clock::sleep_until(end_of(e, rows.data(), rows.size()));
        std::lock_guard<std::mutex> hold(shared.lock);
        shared.last_end = clock::now();
    }
    Py_END_ALLOW_THREADS
    return true;
}

PyObject* py_leave(PyObject*, PyObject* entry) {
    if (!leave(entry)) return nullptr;
    Py_RETURN_NONE;
}

PyObject* bind(PyObject*, PyObject* args) {
    PyObject* path;
    Py_ssize_t ranks = 0, me = -1;
    if (!PyArg_ParseTuple(args, "O|nn:pace_bind", &path, &ranks, &me)) return nullptr;
    std::lock_guard<std::mutex> hold(shared.lock);
    unbind();
    if (path == Py_None) Py_RETURN_NONE;
    if (ranks <= 0 || me < 0 || me >= ranks) {
        PyErr_Format(PyExc_ValueError, "pace_bind: rank %zd of %zd ranks is not a rank", me, ranks);
        return nullptr;
    }
    PyObject* encoded = nullptr;
    if (!PyUnicode_FSConverter(path, &encoded)) return nullptr;
    Ref name(encoded);
    const char* file = PyBytes_AS_STRING(encoded);
    const size_t nbytes = sizeof(Slot) * SLOTS * static_cast<size_t>(ranks);
    const int fd = open(file, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    struct stat st;
    // Zeros; every rank asks for the same size, so whichever grows the file, it fits all.
    const bool sized = fd >= 0 && fstat(fd, &st) == 0 &&
                       (static_cast<size_t>(st.st_size) >= nbytes || ftruncate(fd, static_cast<off_t>(nbytes)) == 0);
    void* map = sized ? mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    const int error = errno;
    if (fd >= 0) close(fd);
    if (map == MAP_FAILED) {
        errno = error;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, file);
    }
    shared.slots = static_cast<Slot*>(map);
    shared.mapped = nbytes;
    shared.ranks = ranks, shared.me = me;
    shared.hints.assign(static_cast<size_t>(ranks), SLOTS - 1);
    Py_RETURN_NONE;
}

PyObject* settings(PyObject*, PyObject* args) {
    double latency, inverse_bandwidth, timeout;
    if (!PyArg_ParseTuple(args, "ddd:pace_settings", &latency, &inverse_bandwidth, &timeout)) return nullptr;
    std::lock_guard<std::mutex> hold(shared.lock);
    shared.latency = latency, shared.inverse_bandwidth = inverse_bandwidth, shared.timeout = timeout;
    Py_RETURN_NONE;
}

PyObject* collective_time(PyObject*, PyObject* args) {
    PyObject* name;
    Py_ssize_t n;
    double nbytes, latency, bandwidth;
    if (!PyArg_ParseTuple(args, "Onddd:collective_time", &name, &n, &nbytes, &latency, &bandwidth)) return nullptr;
    Kind kind;
    if (!kind_of(name, kind)) return nullptr;
    return PyFloat_FromDouble(model(kind, n, nbytes, latency, 1.0 / bandwidth));
}

PyObject* sleep_until(PyObject*, PyObject* deadline) {
    const double d = PyFloat_AsDouble(deadline);
    if (d == -1.0 && PyErr_Occurred()) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    clock::sleep_until(d);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* run_delay(PyObject*, PyObject*) { return PyFloat_FromDouble(clock::run_delay()); }

PyObject* count_core_waits(PyObject*, PyObject* on) {
    const int flag = PyObject_IsTrue(on);
    if (flag < 0) return nullptr;
    clock::count_core_waits(flag != 0);
    Py_RETURN_NONE;
}

PyObject* counting_core_waits(PyObject*, PyObject*) { return PyBool_FromLong(clock::counting_core_waits()); }

PyObject* core_wait_woke(PyObject*, PyObject* args) {
    double deadline, before, awake = -1.0, at = -1.0, delay = -1.0;
    if (!PyArg_ParseTuple(args, "dd|ddd:core_wait_woke", &deadline, &before, &awake, &at, &delay)) return nullptr;
    if (at < 0) {
        clock::woke(deadline, before, awake, delay, at);
    } else {
        clock::count_wait(deadline, before, awake, at, delay);
    }
    return Py_BuildValue("(dd)", delay, at);
}

PyObject* core_wait_after(PyObject*, PyObject* args) {
    double since, at = -1.0, delay = -1.0;
    if (!PyArg_ParseTuple(args, "d|dd:core_wait_after", &since, &at, &delay)) return nullptr;
    return PyFloat_FromDouble(clock::wait_after(since, at < 0 ? clock::now() : at, delay));
}

PyObject* precise_timers(PyObject*, PyObject*) {
    clock::precise_timers();
    Py_RETURN_NONE;
}

}  // namespace pycoll::pacing
