// pycoll._C: with short_path.cpp, partial_now.cpp and pacing.cpp, the only files that see Python
// objects. Pointers arrive as Python ints; names are parsed here (ValueError on unknown ones); every kernel
// runs without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "clock.h"
#include "kernels.h"
#include "link.h"
#include "mpi_calls.h"
#include "pacing.h"
#include "partition.h"
#include "partial.h"
#include "partial_now.h"
#include "py_ref.h"
#include "short_path.h"

namespace py = pybind11;
using namespace pycoll;

namespace {

using Ptrs = std::vector<uintptr_t>;
using Sizes = std::vector<size_t>;
using Release = py::call_guard<py::gil_scoped_release>;

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

Rows rows_of(const Ptrs& bases, const Sizes& row_bytes, const Sizes& strides, const Sizes& lo, const Sizes& hi) {
    return Rows{bases, row_bytes, strides, lo, hi};
}

std::vector<const void*> const_ptrs(const Ptrs& ps) {
    std::vector<const void*> out(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) out[i] = ptr(ps[i]);
    return out;
}

std::vector<void*> mut_ptrs(const Ptrs& ps) {
    std::vector<void*> out(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) out[i] = ptr(ps[i]);
    return out;
}

PyObject* address(PyObject*, PyObject* obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject* found = Py_BuildValue("(KO)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(view.buf)),
                                    view.readonly ? Py_True : Py_False);
    PyBuffer_Release(&view);
    return found;
}

// partial_allreduce's arguments as partial::Round; false with a Python error set.
bool ints_of(PyObject* seq, std::vector<int>& out, const char* what) {
    PyObject* fast = PySequence_Fast(seq, what);
    if (!fast) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        const long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) break;
        out[static_cast<size_t>(i)] = static_cast<int>(v);
    }
    Py_DECREF(fast);
    return !PyErr_Occurred();
}

template <class T> bool size_of(PyObject* obj, T& out) {
    const size_t v = PyLong_AsSize_t(obj);
    out = static_cast<T>(v);
    return !(v == static_cast<size_t>(-1) && PyErr_Occurred());
}

bool handle_of(PyObject* obj, intptr_t& out) {  // mpi4py handles: negative ints too (MPICH)
    out = reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(obj));
    return !(out == 0 && PyErr_Occurred());
}

// MPI_Test on the request at `address` (mpi4py's MPI._addressof), without the GIL, until it
// completes or `timeout` s pass (clock::Patience: spinning 50 us, then yielding, then
// asleep): 0 done, -1 still pending, -2 not tested (no MPI bound: mpi_bind found none),
// else MPI's error code. Polled from Python instead (mpi4py's Test, a closure, a yield),
// a barrier took 2-3x MPI_Barrier's time at 4 ranks.
PyObject* wait_request(PyObject*, PyObject* args) {
    Py_ssize_t address;
    double timeout;
    if (!PyArg_ParseTuple(args, "nd:wait_request", &address, &timeout)) return nullptr;
    if (!mpi::bound()) return PyLong_FromLong(-2);
    int flag = 0, error = 0;
    Py_BEGIN_ALLOW_THREADS
    clock::Patience patience(timeout);
    while ((error = mpi::test(reinterpret_cast<void*>(address), &flag)) == 0 && !flag && patience.idle()) {
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(error ? error : flag ? 0 : -1);
}

// A plain CPython function: it sits on every partial all-reduce's path, where pybind11's
// dispatch of its sixteen arguments cost 0.7 us a call (this, 0.25 us).
PyObject* partial_allreduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "partial_allreduce takes 16 arguments (see its docstring)");
        return nullptr;
    }
    if (!mpi::bound()) {
        PyErr_SetString(PyExc_RuntimeError, "partial_allreduce: MPI is not bound (mpi_bind)");
        return nullptr;
    }
    partial::Round r;
    long undefined = PyLong_AsLong(args[3]);
    uintptr_t data = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(args[7]));
    const char *dtype = PyUnicode_AsUTF8(args[9]), *op = dtype ? PyUnicode_AsUTF8(args[10]) : nullptr;
    r.scale = PyFloat_AsDouble(args[11]);
    r.timeout = PyFloat_AsDouble(args[15]);
    if (!handle_of(args[0], r.comm) || !handle_of(args[1], r.byte_type) || !handle_of(args[2], r.request_null) ||
        !ints_of(args[4], r.members, "members must be a sequence of ranks") ||
        !ints_of(args[5], r.tags, "tags must be a sequence of ints") || !size_of(args[6], r.me) ||
        !size_of(args[8], r.count) || !size_of(args[12], r.chunk_bytes) || !size_of(args[13], r.direct_bytes) ||
        !size_of(args[14], r.doubling_from) ||
        PyErr_Occurred())
        return nullptr;
    r.undefined = static_cast<int>(undefined);
    r.data = ptr(data);
    partial::Outcome out;
    if (!partial_now::kinds_of(dtype, op, r.dt, r.op) || !partial_now::exchange(r, out)) return nullptr;
    PyObject* sends = partial_now::sends_of(out);
    if (!sends) return nullptr;
    return Py_BuildValue("(iiiN)", static_cast<int>(out.status), out.peer, out.error, sends);
}

// ---- large host results, kept for reuse
// A fresh result of many MiB is zeroed and mapped by the kernel page by page as MPI first
// writes it (a 64 MiB alltoall result, each call, where mpi4py reuses its buffer). A
// HostBlock's memory goes back to a small pool when the block dies, that is when the last
// array or tensor on it does (they keep it as their base, through any views), and the next
// result of about that size takes it: pages already mapped, nothing to zero.
constexpr size_t kHuge = size_t{2} << 20;  // transparent huge page size: fewer faults
constexpr size_t kKept = 2;                // blocks the pool keeps (a result and the next)

struct Kept {
    void* ptr;
    size_t capacity;
};
std::vector<Kept> pool;  // changed with the GIL held only

struct HostBlock {
    PyObject_HEAD
    void* ptr;
    size_t capacity;  // what ptr holds
    Py_ssize_t nbytes;  // what the block exports
};

void block_dealloc(PyObject* self) {
    auto* b = reinterpret_cast<HostBlock*>(self);
    if (b->ptr) {
        if (pool.size() == kKept) {  // keep the newest: the loop that freed it runs again
            std::free(pool.front().ptr);
            pool.erase(pool.begin());
        }
        pool.push_back({b->ptr, b->capacity});
    }
    Py_TYPE(self)->tp_free(self);
}

int block_getbuffer(PyObject* self, Py_buffer* view, int flags) {
    auto* b = reinterpret_cast<HostBlock*>(self);
    return PyBuffer_FillInfo(view, self, b->ptr, b->nbytes, 0, flags);
}

PyBufferProcs block_buffer = {block_getbuffer, nullptr};

PyTypeObject block_type = [] {
    PyTypeObject t = type_of(
        "pycoll._C.HostBlock", sizeof(HostBlock),
        "host_block(nbytes)'s memory, writable through the buffer protocol; back to the pool when it dies.",
        block_dealloc);
    t.tp_as_buffer = &block_buffer;
    return t;
}();

PyObject* host_block(PyObject*, PyObject* arg) {
    const Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "host_block(nbytes) takes nbytes >= 0");
        return nullptr;
    }
    const size_t want = static_cast<size_t>(nbytes);
    void* ptr = nullptr;
    size_t capacity = 0;
    for (size_t i = 0; i < pool.size(); ++i)
        if (pool[i].capacity >= want && pool[i].capacity / 2 <= want) {  // no more than twice the size
            ptr = pool[i].ptr;
            capacity = pool[i].capacity;
            pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
            break;
        }
    if (!ptr) {
        capacity = std::max(kHuge, (want + kHuge - 1) / kHuge * kHuge);
        ptr = std::aligned_alloc(kHuge, capacity);
        if (!ptr) return PyErr_NoMemory();
        madvise(ptr, capacity, MADV_HUGEPAGE);  // a hint: ignored where huge pages are off
    }
    auto* b = PyObject_New(HostBlock, &block_type);
    if (!b) {
        std::free(ptr);
        return nullptr;
    }
    b->ptr = ptr;
    b->capacity = capacity;
    b->nbytes = nbytes;
    return reinterpret_cast<PyObject*>(b);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "pycoll compiled core: pack/unpack/reduce/scale/cast on raw pointers (ints)";

#ifdef PYCOLL_WITH_CUDA
    constexpr bool with_cuda = true;
#else
    constexpr bool with_cuda = false;
#endif
    m.def("has_cuda", [] { return with_cuda; }, "Whether the CUDA kernels were compiled in.");
    m.def("itemsize", [](const std::string& dt) { return itemsize(parse_dtype(dt)); }, py::arg("dtype"));

    // Plain CPython functions, not pybind11 ones: they sit on every small allreduce's path,
    // where pybind11's argument dispatch costs as much as the MPI call itself.
#define FAST(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))
    static PyMethodDef fast[] = {
        {"address", address, METH_O,
         "(address, readonly) of a C-contiguous buffer-protocol object (numpy's __array_interface__ costs ten "
         "times more); None if it is not one."},
        {"allreduce_now", FAST(short_path::allreduce_now), METH_FASTCALL,
         "allreduce_now(x, inplace, op, group, name): a blocking allreduce of a contiguous host tensor straight to "
         "MPI_Allreduce, without the GIL, while the engine is idle; the result (x itself in place), or None where "
         "the general path must run it. After short_path_setup."},
        {"broadcast_now", FAST(short_path::broadcast_now), METH_FASTCALL,
         "broadcast_now(x, inplace, root, group, name): broadcast's short path (as allreduce_now's)."},
        {"reduce_scatter_now", FAST(short_path::reduce_scatter_now), METH_FASTCALL,
         "reduce_scatter_now(x, op, out, group, name): reduce_scatter's short path (as allreduce_now's)."},
        {"allgather_now", FAST(short_path::allgather_now), METH_FASTCALL,
         "allgather_now(x, out, group, name): allgather's short path (as allreduce_now's)."},
        {"alltoall_now", FAST(short_path::alltoall_now), METH_FASTCALL,
         "alltoall_now(x, splits, out, group, name) -> (result, received splits): alltoall's short path (as "
         "allreduce_now's)."},
        {"carried_exchange", FAST(short_path::carried_exchange), METH_FASTCALL,
         "carried_exchange(kind, group, header, send, parts) -> (blocks, complete): the one exchange of headers "
         "(and parts that fit the group's capacity) that allgather (kind 0), alltoall (1) and reduce_scatter (2) "
         "make, on host memory at address send; for the general path."},
        {"grouped_allreduce_now", FAST(short_path::grouped_allreduce_now), METH_FASTCALL,
         "grouped_allreduce_now(xs, inplace, op, group, name): a blocking grouped allreduce of a list of host tensors "
         "that fuse into one group, in one compiled pass (read, pack, MPI_Allreduce, unpack; views of one new buffer "
         "out of place); the list of results, or None where the general path must run it."},
        {"host_block", host_block, METH_O,
         "host_block(nbytes) -> a HostBlock: uninitialized host memory on huge pages, exported through the buffer "
         "protocol; its memory is reused by a later block once it dies (large results, tensors.empty_like)."},
        {"row_signature", short_path::row_signature, METH_VARARGS,
         "row_signature(dtype, row_shape) -> int: what allgather's and alltoall's ranks compare (reduce_scatter's: "
         "dtype 'float32/sum', and so on)."},
        {"host_buffer", FAST(short_path::host_buffer), METH_FASTCALL,
         "host_buffer(x, numpy_names, torch_names, buffer_type) -> tensors.Buffer of a writable, contiguous "
         "host tensor (numpy array or torch tensor) read as the short path reads one, whose dtype the names of "
         "its kind hold; None for any other x."},
        {"host_pointers", short_path::host_pointers, METH_O,
         "host_pointers(xs) -> (addresses, byte sizes, dtype) of a list of writable contiguous host tensors of one "
         "class and dtype; None for any other (after short_path_setup)."},
        {"wait_request", wait_request, METH_VARARGS,
         "wait_request(address, timeout) -> 0 once the MPI request at address (MPI._addressof) completes, -1 if it "
         "is still pending after timeout s, -2 if no MPI is bound (mpi_bind), else MPI's error code; MPI_Test "
         "without the GIL, spinning, then yielding, then asleep."},
        {"partial_allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(partial_allreduce)),
         METH_FASTCALL,
         "partial_allreduce(comm, byte_type, request_null, undefined, members, tags, me, data, count, dtype, op, "
         "scale, chunk_bytes, direct_bytes, doubling_from, timeout): reduce data in place among members (ranks of comm; this "
         "rank is members[me]) over MPI's point to point (csrc/partial.h), without the GIL; handles as mpi4py's. "
         "(status, peer, error, sends): status 0 done, 1 late waiting for rank peer, 2 MPI error `error`; sends: "
         "requests (handles) that may still read data after a failure."},
        {"partial_now", FAST(partial_now::run), METH_FASTCALL,
         "partial_now(x, inplace, ranks, op, name): a blocking partial all-reduce of a contiguous host tensor in one "
         "compiled call (csrc/partial_now.cpp); the result (x itself in place), or None where the general path must "
         "run it. After partial_bind."},
        {"partial_bind", partial_now::bind, METH_VARARGS,
         "partial_bind(shared, uses, comms, broken, abandoned, (comm, byte, request_null, undefined, in_place), "
         "me, size, tag_ub, clone, failed): pycoll.partial's per-world state and callbacks; "
         "partial_bind(None) at shutdown."},
        {"partial_settings", partial_now::configure, METH_VARARGS,
         "partial_settings(enabled, cache_after, direct_bytes, doubling_from, chunk_bytes, timeout, group_of=None): "
         "whenever the settings change; under --link group_of(members) -> the PaceGroup that paces each round."},
        {"short_path_runs", short_path::count, METH_NOARGS,
         "How many collectives the *_now functions have run in this process."},
        {"mpi_calls", short_path::mpi_calls, METH_NOARGS,
         "How many MPI collective calls pycoll._C has made in this process (the rounds a collective took)."},
        {"short_path_setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(short_path::setup)),
         METH_VARARGS | METH_KEYWORDS,
         "short_path_setup(ndarray, is_torch, find_route, resolve, empty_like, huge_paged, empty, counts_dtype, failed, "
         "views, staging, alone_bytes, cached_piece, mpi_error, in_place, byte, int64): what the *_now functions call and use "
         "(collectives.py passes them once)."},
        {"short_path_settings", short_path::configure, METH_VARARGS,
         "short_path_settings(enabled, max_bytes, fusion_threshold, group_of=None): whether the *_now "
         "functions run, the largest tensor allreduce_now takes (and grouped_allreduce_now's piece), the largest list "
         "grouped_allreduce_now takes; under --link, group_of(group) -> the PaceGroup (or None) that paces each "
         "one."},
        {"pace_leave", pacing::py_leave, METH_O,
         "pace_leave(entry): after a paced collective's real transfer, sleep (without the GIL) until its modelled end, "
         "the same on every member."},
        {"pace_bind", pacing::bind, METH_VARARGS,
         "pace_bind(path, ranks, rank): map the file (made and sized if need be) where the ranks of MPI.COMM_WORLD "
         "write their entries into paced collectives, this rank being rank; pace_bind(None): none."},
        {"pace_settings", pacing::settings, METH_VARARGS,
         "pace_settings(latency, inverse_bandwidth, timeout): this rank's link (seconds, seconds per byte) and how "
         "long leaving waits for a member's entry."},
        {"collective_time", pacing::collective_time, METH_VARARGS,
         "collective_time(kind, n, nbytes, latency, bandwidth) -> seconds: the alpha-beta model (pycoll.emulation)."},
        {"sleep_until", pacing::sleep_until, METH_O,
         "sleep_until(deadline): return at deadline (time.monotonic()), asleep until its last 120 us, then yielding; "
         "without the GIL. Counts the wait for a core after it while count_core_waits is on."},
        {"run_delay", pacing::run_delay, METH_NOARGS,
         "run_delay() -> seconds this thread has been runnable without a core (Linux's schedstat; 0 without)."},
        {"count_core_waits", pacing::count_core_waits, METH_O, "count_core_waits(on): count waits for a core after "
         "modelled deadlines from now on (or not)."},
        {"counting_core_waits", pacing::counting_core_waits, METH_NOARGS, "Whether core waits are counted."},
        {"core_wait_woke", pacing::core_wait_woke, METH_VARARGS,
         "core_wait_woke(deadline, before, awake=-1, at=-1, delay=-1) -> (run delay, time): this thread, whose run "
         "delay was before when it went to sleep (or when it was on a core at awake), is back on a core (at time at "
         "with run delay delay; now and its run delay if not given): count its wait after deadline."},
        {"core_wait_after", pacing::core_wait_after, METH_VARARGS,
         "core_wait_after(since, at=-1, delay=-1) -> seconds the threads waited for a core after the latest deadline "
         "since since, up to at (now if not given; this thread's run delay then: delay); forgets it."},
        {"precise_timers", pacing::precise_timers, METH_NOARGS,
         "A 1 ns timer slack for this thread (Linux's default 50 us makes every sleep that much late)."},
        {"short_path_bind", short_path::bind, METH_VARARGS,
         "short_path_bind(gate, world_handle, world_size, world_group): the engine's Gate and the world (pycoll.init); "
         "short_path_bind(None): none (pycoll.shutdown)."},
    };
    if (!short_path::init(m.ptr()) || !pacing::init(m.ptr()) || PyType_Ready(&block_type) < 0) throw py::error_already_set();
    for (auto& def : fast) m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_New(&def, nullptr)));
    m.def(
        "mpi_bind", [](const std::string& module_path, size_t handle_size) { return mpi::bind(module_path.c_str(), handle_size); },
        py::arg("module_path"), py::arg("handle_size"),
        "Find MPI's functions beside mpi4py's extension module (MPI.__file__); MPI._sizeof(MPI.Comm) is "
        "handle_size. Returns '' once bound, else why not.");
    m.def("mpi_bound", &mpi::bound, "Whether mpi_bind found MPI: the short path and partial_allreduce can run.");

    // ---- --link: the emulation thread's releases of held point-to-point requests (link.h) ----
    m.def(
        "link_wait",
        [](const std::vector<std::pair<double, intptr_t>>& releases, const std::vector<int>& fds, double until) {
            std::vector<link::Release> due;
            due.reserve(releases.size());
            for (const auto& [when, request] : releases) due.push_back({when, request});
            std::vector<int> ready;
            int error = 0;
            size_t done;
            {
                py::gil_scoped_release nogil;
                done = link::wait(due, fds, until, ready, error);
            }
            return py::make_tuple(done, ready, error);
        },
        py::arg("releases"), py::arg("fds"), py::arg("until"),
        "link_wait(releases, fds, until) -> (completed, ready, error): without the GIL, complete each generalized "
        "request of releases ((due, handle) pairs sorted by due, time.monotonic()'s clock) at its due, waking "
        "link_nap's nappers, until `until` or until one of fds is readable (ready: their indices). completed: how "
        "many of releases (a prefix); error: MPI's code if completing the next one failed, else 0.");
    m.def("link_nap", &link::nap, py::arg("seconds"), Release(),
          "link_nap(seconds) -> whether a release by link_wait (or link_released) ended the sleep before seconds "
          "(at once after one that this thread's naps have not seen yet); counts its wait for a core after that "
          "release while count_core_waits is on.");
    m.def("link_released", &link::released, "Wake link_nap's nappers: requests were completed elsewhere.");

    // ---- CPU ----
    m.def(
        "pack",
        [](uintptr_t dst, const Ptrs& srcs, const Sizes& nbytes, size_t begin, size_t end) {
            cpu::pack(ptr(dst), const_ptrs(srcs), nbytes, begin, end);
        },
        py::arg("dst"), py::arg("srcs"), py::arg("nbytes"), py::arg("begin") = 0, py::arg("end") = SIZE_MAX, Release(),
        "Copy srcs[i] (nbytes[i] bytes) back to back into dst; only bytes [begin, end) of that stream.");
    m.def(
        "unpack",
        [](uintptr_t src, const Ptrs& dsts, const Sizes& nbytes, const std::string& dtype, double scale, size_t begin,
           size_t end) { cpu::unpack(ptr(src), mut_ptrs(dsts), nbytes, parse_dtype(dtype), scale, begin, end); },
        py::arg("src"), py::arg("dsts"), py::arg("nbytes"), py::arg("dtype") = "uint8", py::arg("scale") = 1.0,
        py::arg("begin") = 0, py::arg("end") = SIZE_MAX, Release(),
        "Inverse of pack (src holds bytes [begin, end) of the stream); multiplies each element by scale (float "
        "dtypes) when scale != 1.");
    m.def(
        "reduce",
        [](uintptr_t inout, uintptr_t src, size_t count, const std::string& dtype, const std::string& op) {
            cpu::reduce(ptr(inout), ptr(src), count, parse_dtype(dtype), parse_op(op));
        },
        py::arg("inout"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"), Release(),
        "inout[i] = op(inout[i], src[i]) for count elements.");
    m.def(
        "scale",
        [](uintptr_t p, size_t count, const std::string& dtype, double factor) {
            cpu::scale(ptr(p), count, parse_dtype(dtype), factor);
        },
        py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("factor"), Release(),
        "In-place ptr[i] *= factor (float dtypes).");
    m.def(
        "cast",
        [](uintptr_t dst, uintptr_t src, size_t count, const std::string& s, const std::string& d) {
            cpu::cast(ptr(dst), ptr(src), count, parse_dtype(s), parse_dtype(d));
        },
        py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("src_dtype"), py::arg("dst_dtype"), Release(),
        "float32 <-> float16/bfloat16, round to nearest even.");

    // ---- iPart's partitions: row ranges of many tensors <-> one buffer (partition.h) ----
    m.def("rows_nbytes", [](const Ptrs& b, const Sizes& w, const Sizes& s, const Sizes& lo, const Sizes& hi) {
            return rows_nbytes(rows_of(b, w, s, lo, hi)); },
        py::arg("bases"), py::arg("row_bytes"), py::arg("strides"), py::arg("lo"), py::arg("hi"),
        "Bytes that rows [lo[i], hi[i]) of the tensors hold together.");
    m.def(
        "pack_rows",
        [](uintptr_t dst, const Ptrs& b, const Sizes& w, const Sizes& s, const Sizes& lo, const Sizes& hi) {
            cpu::pack_rows(ptr(dst), rows_of(b, w, s, lo, hi));
        },
        py::arg("dst"), py::arg("bases"), py::arg("row_bytes"), py::arg("strides"), py::arg("lo"), py::arg("hi"),
        Release(),
        "Copy rows [lo[i], hi[i]) of each tensor (rows of row_bytes[i] bytes, strides[i] apart, from bases[i]) back "
        "to back into dst.");
    m.def(
        "unpack_rows",
        [](uintptr_t src, const Ptrs& b, const Sizes& w, const Sizes& s, const Sizes& lo, const Sizes& hi) {
            cpu::unpack_rows(ptr(src), rows_of(b, w, s, lo, hi));
        },
        py::arg("src"), py::arg("bases"), py::arg("row_bytes"), py::arg("strides"), py::arg("lo"), py::arg("hi"),
        Release(), "Inverse of pack_rows.");

#ifdef PYCOLL_WITH_CUDA
    // ---- CUDA: same kernels on device pointers, asynchronous on `stream` ----
    m.def(
        "cuda_pack",
        [](uintptr_t dst, const Ptrs& srcs, const Sizes& nbytes, uintptr_t stream) {
            cuda::pack(ptr(dst), const_ptrs(srcs), nbytes, stream);
        },
        py::arg("dst"), py::arg("srcs"), py::arg("nbytes"), py::arg("stream") = 0, Release());
    m.def(
        "cuda_unpack",
        [](uintptr_t src, const Ptrs& dsts, const Sizes& nbytes, const std::string& dtype, double scale,
           uintptr_t stream) { cuda::unpack(ptr(src), mut_ptrs(dsts), nbytes, parse_dtype(dtype), scale, stream); },
        py::arg("src"), py::arg("dsts"), py::arg("nbytes"), py::arg("dtype") = "uint8", py::arg("scale") = 1.0,
        py::arg("stream") = 0, Release());
    m.def(
        "cuda_reduce",
        [](uintptr_t inout, uintptr_t src, size_t count, const std::string& dtype, const std::string& op,
           uintptr_t stream) { cuda::reduce(ptr(inout), ptr(src), count, parse_dtype(dtype), parse_op(op), stream); },
        py::arg("inout"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream") = 0,
        Release());
    m.def(
        "cuda_scale",
        [](uintptr_t p, size_t count, const std::string& dtype, double factor, uintptr_t stream) {
            cuda::scale(ptr(p), count, parse_dtype(dtype), factor, stream);
        },
        py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("factor"), py::arg("stream") = 0, Release());
    m.def(
        "cuda_cast",
        [](uintptr_t dst, uintptr_t src, size_t count, const std::string& s, const std::string& d, uintptr_t stream) {
            cuda::cast(ptr(dst), ptr(src), count, parse_dtype(s), parse_dtype(d), stream);
        },
        py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("src_dtype"), py::arg("dst_dtype"),
        py::arg("stream") = 0, Release());
    m.def(
        "cuda_memcpy",
        [](uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
            cuda::memcpy_async(ptr(dst), ptr(src), nbytes, stream);
        },
        py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream") = 0, Release(),
        "cudaMemcpyAsync(..., cudaMemcpyDefault, stream).");
    m.def("cuda_synchronize", [](uintptr_t stream) { cuda::synchronize(stream); }, py::arg("stream") = 0, Release());
    m.def("cuda_device_count", [] { return cuda::device_count(); }, Release(), "0 when no driver or device.");
    m.def(
        "cuda_host_alloc",
        [](size_t nbytes, int device) { return reinterpret_cast<uintptr_t>(cuda::host_alloc(nbytes, device)); },
        py::arg("nbytes"), py::arg("device"), Release(), "Pinned host memory (for staging); free with cuda_host_free.");
    m.def("cuda_host_free", [](uintptr_t p) { cuda::host_free(ptr(p)); }, py::arg("ptr"), Release());

    m.def("cuda_copy_stream", &cuda::copy_stream, py::arg("device"), Release(),
          "pycoll's own non-blocking stream for staging copies on `device` (a cudaStream_t as an int).");
    py::class_<cuda::Event>(m, "CudaEvent", "An event recorded on `stream` of `device` when created.")
        .def(py::init<uintptr_t, int>(), py::arg("stream"), py::arg("device"), Release())
        .def_readonly("device", &cuda::Event::device)
        .def("synchronize", &cuda::Event::synchronize, Release())
        .def("query", &cuda::Event::query, Release());
    m.def(
        "cuda_copy",
        [](uintptr_t dst, uintptr_t src, size_t nbytes, int device, const cuda::Event* after) {
            cuda::copy_async(ptr(dst), ptr(src), nbytes, device, after);
        },
        py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("after") = nullptr, Release(),
        "cudaMemcpyAsync on cuda_copy_stream(device), once `after` (a CudaEvent or None) has happened.");
    m.def(
        "cuda_scale_async",
        [](const Ptrs& ptrs, const Sizes& nbytes, const std::string& dtype, double factor, int device) {
            cuda::scale_async(mut_ptrs(ptrs), nbytes, parse_dtype(dtype), factor, device);
        },
        py::arg("ptrs"), py::arg("nbytes"), py::arg("dtype"), py::arg("factor"), py::arg("device"), Release(),
        "In place ptrs[i] *= factor (nbytes[i] bytes each, float dtypes) on cuda_copy_stream(device), after the "
        "copies started there.");
    m.def(
        "cuda_pack_rows",
        [](uintptr_t dst, const Ptrs& b, const Sizes& w, const Sizes& s, const Sizes& lo, const Sizes& hi,
           uintptr_t stream) { cuda::pack_rows(ptr(dst), rows_of(b, w, s, lo, hi), stream); },
        py::arg("dst"), py::arg("bases"), py::arg("row_bytes"), py::arg("strides"), py::arg("lo"), py::arg("hi"),
        py::arg("stream") = 0, Release(), "pack_rows on device pointers, asynchronous on stream.");
    m.def(
        "cuda_unpack_rows",
        [](uintptr_t src, const Ptrs& b, const Sizes& w, const Sizes& s, const Sizes& lo, const Sizes& hi,
           uintptr_t stream) { cuda::unpack_rows(ptr(src), rows_of(b, w, s, lo, hi), stream); },
        py::arg("src"), py::arg("bases"), py::arg("row_bytes"), py::arg("strides"), py::arg("lo"), py::arg("hi"),
        py::arg("stream") = 0, Release(), "unpack_rows on device pointers, asynchronous on stream.");
#endif
}
