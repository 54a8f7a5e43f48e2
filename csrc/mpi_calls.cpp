#include "mpi_calls.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <type_traits>

namespace pycoll::mpi {
namespace {

// The functions, in the order of kNames: the collectives first (counted), up to kCommRank.
enum Fn { kAllreduce, kBcast, kAllgather, kAllgatherv, kAlltoall, kAlltoallv, kReduceScatter, kReduceScatterBlock,
          kCommRank,
          kIsend, kIrecv, kTest, kTestany, kCancel, kWait, kGrequestComplete, kCount };
const char* const kNames[kCount] = {"MPI_Allreduce", "MPI_Bcast", "MPI_Allgather", "MPI_Allgatherv",
                                    "MPI_Alltoall", "MPI_Alltoallv", "MPI_Reduce_scatter",
                                    "MPI_Reduce_scatter_block", "MPI_Comm_rank",
                                    "MPI_Isend", "MPI_Irecv", "MPI_Test", "MPI_Testany", "MPI_Cancel",
                                    "MPI_Wait", "MPI_Grequest_complete"};
void* fn[kCount] = {};
size_t handle_bytes = 0;
std::atomic<uint64_t> collectives{0};

// Statuses are never read: a buffer larger than any MPI_Status, where MPI may write one
// (MPI_STATUS_IGNORE's value differs between MPIs and mpi4py does not expose it).
thread_local unsigned char status[256];

bool ints() { return handle_bytes == sizeof(int); }

// Arguments that are MPI handles (H: void* where handles are pointers, int where they are
// ints) or point to them; everything else passes as it is.
struct Handle { intptr_t value; };
struct Request { void* at; };  // MPI_Request*
template <class H, class T> struct As {
    using type = T;
    static T get(T x) { return x; }
};
template <class H> struct As<H, Handle> {
    using type = H;
    static H get(Handle h) {
        if constexpr (std::is_pointer_v<H>) return reinterpret_cast<H>(h.value);
        else return static_cast<H>(h.value);
    }
};
template <class H> struct As<H, Request> {
    using type = H*;
    static H* get(Request r) { return static_cast<H*>(r.at); }
};

template <class H, class... A> int invoke(Fn f, A... args) {
    using Signature = int (*)(typename As<H, A>::type...);
    return reinterpret_cast<Signature>(fn[f])(As<H, A>::get(args)...);
}

// MPI function `f` in the bound ABI.
template <class... A> int call(Fn f, A... args) {
    if (f < kCommRank) collectives.fetch_add(1, std::memory_order_relaxed);
    return ints() ? invoke<int>(f, args...) : invoke<void*>(f, args...);
}

}  // namespace

std::string bind(const char* module_path, size_t handle_size) {
    if (handle_size != sizeof(void*) && handle_size != sizeof(int))
        return "MPI handles of " + std::to_string(handle_size) + " bytes";
    // RTLD_NOLOAD: only the module mpi4py has already imported; its dependency tree holds libmpi.
    void* module = dlopen(module_path, RTLD_NOW | RTLD_NOLOAD);
    void* found[kCount];
    std::string missing;
    for (size_t i = 0; i < kCount; ++i) {
        found[i] = module ? dlsym(module, kNames[i]) : nullptr;
        if (!found[i]) found[i] = dlsym(RTLD_DEFAULT, kNames[i]);  // an MPI loaded globally instead
        if (!found[i]) missing += std::string(missing.empty() ? "" : ", ") + kNames[i];
    }
    if (module) dlclose(module);  // drops our reference only
    if (!missing.empty()) return missing + " not found beside " + module_path;
    std::copy(std::begin(found), std::end(found), std::begin(fn));
    handle_bytes = handle_size;
    return "";
}

bool bound() { return fn[kAllreduce] != nullptr; }

uint64_t collective_calls() { return collectives.load(std::memory_order_relaxed); }

int allreduce(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm) {
    return call(kAllreduce, send, recv, count, Handle{datatype}, Handle{op}, Handle{comm});
}

int bcast(void* buf, int count, intptr_t datatype, int root, intptr_t comm) {
    return call(kBcast, buf, count, Handle{datatype}, root, Handle{comm});
}

int allgather(const void* send, int scount, intptr_t stype, void* recv, int rcount, intptr_t rtype, intptr_t comm) {
    return call(kAllgather, send, scount, Handle{stype}, recv, rcount, Handle{rtype}, Handle{comm});
}

int allgatherv(const void* send, int scount, intptr_t stype, void* recv, const int* rcounts, const int* rdispls,
               intptr_t rtype, intptr_t comm) {
    return call(kAllgatherv, send, scount, Handle{stype}, recv, rcounts, rdispls, Handle{rtype}, Handle{comm});
}

int alltoall(const void* send, int scount, intptr_t stype, void* recv, int rcount, intptr_t rtype, intptr_t comm) {
    return call(kAlltoall, send, scount, Handle{stype}, recv, rcount, Handle{rtype}, Handle{comm});
}

int alltoallv(const void* send, const int* scounts, const int* sdispls, intptr_t stype, void* recv,
              const int* rcounts, const int* rdispls, intptr_t rtype, intptr_t comm) {
    return call(kAlltoallv, send, scounts, sdispls, Handle{stype}, recv, rcounts, rdispls, Handle{rtype},
                Handle{comm});
}

int reduce_scatter(const void* send, void* recv, const int* rcounts, intptr_t datatype, intptr_t op, intptr_t comm) {
    return call(kReduceScatter, send, recv, rcounts, Handle{datatype}, Handle{op}, Handle{comm});
}

int reduce_scatter_block(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm) {
    return call(kReduceScatterBlock, send, recv, count, Handle{datatype}, Handle{op}, Handle{comm});
}

int comm_rank(intptr_t comm, int* rank) { return call(kCommRank, Handle{comm}, rank); }

size_t Requests::width() { return handle_bytes; }

size_t Requests::add() {
    bytes_.resize(bytes_.size() + width());
    const size_t i = size() - 1;
    if (ints()) {
        const int v = static_cast<int>(null_);
        std::memcpy(at(i), &v, sizeof v);
    } else {
        const void* v = reinterpret_cast<void*>(null_);
        std::memcpy(at(i), &v, sizeof v);
    }
    return i;
}

intptr_t Requests::get(size_t i) const {
    const unsigned char* p = bytes_.data() + i * width();
    if (ints()) {
        int v;
        std::memcpy(&v, p, sizeof v);
        return v;
    }
    void* v;
    std::memcpy(&v, p, sizeof v);
    return reinterpret_cast<intptr_t>(v);
}

int isend(const void* buf, int nbytes, intptr_t byte_type, int dest, int tag, intptr_t comm, void* request) {
    return call(kIsend, buf, nbytes, Handle{byte_type}, dest, tag, Handle{comm}, Request{request});
}

int irecv(void* buf, int nbytes, intptr_t byte_type, int source, int tag, intptr_t comm, void* request) {
    return call(kIrecv, buf, nbytes, Handle{byte_type}, source, tag, Handle{comm}, Request{request});
}

int test(void* request, int* flag) { return call(kTest, Request{request}, flag, static_cast<void*>(status)); }

int testany(int count, void* requests, int* index, int* flag) {
    return call(kTestany, count, Request{requests}, index, flag, static_cast<void*>(status));
}

int cancel(void* request) { return call(kCancel, Request{request}); }

int wait(void* request) { return call(kWait, Request{request}, static_cast<void*>(status)); }

int grequest_complete(intptr_t request) { return call(kGrequestComplete, Handle{request}); }

}  // namespace pycoll::mpi
