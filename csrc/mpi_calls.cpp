#include "mpi_calls.h"

#include <dlfcn.h>

#include <cstring>
#include <iterator>
#include <type_traits>

namespace pycoll::mpi {
namespace {

// Each function in the two handle ABIs: P where handles are pointers, I where they are ints.
template <class H> struct Abi {
    using Allreduce = int (*)(const void*, void*, int, H, H, H);
    using Isend = int (*)(const void*, int, H, int, int, H, H*);
    using Irecv = int (*)(void*, int, H, int, int, H, H*);
    using Test = int (*)(H*, int*, void*);
    using Testany = int (*)(int, H*, int*, int*, void*);
    using Cancel = int (*)(H*);
    using Wait = int (*)(H*, void*);
};
using P = Abi<void*>;
using I = Abi<int>;

struct Functions {
    void *allreduce, *isend, *irecv, *test, *testany, *cancel, *wait;
} fn{};
size_t handle_bytes = 0;

// Statuses are never read: a buffer larger than any MPI_Status, where MPI may write one
// (MPI_STATUS_IGNORE's value differs between MPIs and mpi4py does not expose it).
thread_local unsigned char status[256];

template <class H> H handle(intptr_t h) {
    if constexpr (std::is_pointer_v<H>) return reinterpret_cast<H>(h);
    else return static_cast<H>(h);
}

bool ints() { return handle_bytes == sizeof(int); }

}  // namespace

std::string bind(const char* module_path, size_t handle_size) {
    if (handle_size != sizeof(void*) && handle_size != sizeof(int))
        return "MPI handles of " + std::to_string(handle_size) + " bytes";
    // RTLD_NOLOAD: only the module mpi4py has already imported; its dependency tree holds libmpi.
    void* module = dlopen(module_path, RTLD_NOW | RTLD_NOLOAD);
    const char* names[] = {"MPI_Allreduce", "MPI_Isend", "MPI_Irecv", "MPI_Test", "MPI_Testany", "MPI_Cancel", "MPI_Wait"};
    void* p[std::size(names)];
    std::string missing;
    for (size_t i = 0; i < std::size(names); ++i) {
        p[i] = module ? dlsym(module, names[i]) : nullptr;
        if (!p[i]) p[i] = dlsym(RTLD_DEFAULT, names[i]);  // an MPI loaded globally instead
        if (!p[i]) missing += std::string(missing.empty() ? "" : ", ") + names[i];
    }
    if (module) dlclose(module);  // drops our reference only
    if (!missing.empty()) return missing + " not found beside " + module_path;
    const Functions found{p[0], p[1], p[2], p[3], p[4], p[5], p[6]};
    fn = found;
    handle_bytes = handle_size;
    return "";
}

bool bound() { return fn.allreduce != nullptr; }

int allreduce(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm) {
    if (ints())
        return reinterpret_cast<I::Allreduce>(fn.allreduce)(send, recv, count, handle<int>(datatype), handle<int>(op),
                                                            handle<int>(comm));
    return reinterpret_cast<P::Allreduce>(fn.allreduce)(send, recv, count, handle<void*>(datatype),
                                                        handle<void*>(op), handle<void*>(comm));
}

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
    if (ints())
        return reinterpret_cast<I::Isend>(fn.isend)(buf, nbytes, handle<int>(byte_type), dest, tag, handle<int>(comm),
                                                    static_cast<int*>(request));
    return reinterpret_cast<P::Isend>(fn.isend)(buf, nbytes, handle<void*>(byte_type), dest, tag,
                                                handle<void*>(comm), static_cast<void**>(request));
}

int irecv(void* buf, int nbytes, intptr_t byte_type, int source, int tag, intptr_t comm, void* request) {
    if (ints())
        return reinterpret_cast<I::Irecv>(fn.irecv)(buf, nbytes, handle<int>(byte_type), source, tag,
                                                    handle<int>(comm), static_cast<int*>(request));
    return reinterpret_cast<P::Irecv>(fn.irecv)(buf, nbytes, handle<void*>(byte_type), source, tag,
                                                handle<void*>(comm), static_cast<void**>(request));
}

int test(void* request, int* flag) {
    if (ints()) return reinterpret_cast<I::Test>(fn.test)(static_cast<int*>(request), flag, status);
    return reinterpret_cast<P::Test>(fn.test)(static_cast<void**>(request), flag, status);
}

int testany(int count, void* requests, int* index, int* flag) {
    if (ints()) return reinterpret_cast<I::Testany>(fn.testany)(count, static_cast<int*>(requests), index, flag, status);
    return reinterpret_cast<P::Testany>(fn.testany)(count, static_cast<void**>(requests), index, flag, status);
}

int cancel(void* request) {
    if (ints()) return reinterpret_cast<I::Cancel>(fn.cancel)(static_cast<int*>(request));
    return reinterpret_cast<P::Cancel>(fn.cancel)(static_cast<void**>(request));
}

int wait(void* request) {
    if (ints()) return reinterpret_cast<I::Wait>(fn.wait)(static_cast<int*>(request), status);
    return reinterpret_cast<P::Wait>(fn.wait)(static_cast<void**>(request), status);
}

}  // namespace pycoll::mpi
