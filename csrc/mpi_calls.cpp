#include "mpi_calls.h"

#include <dlfcn.h>

namespace pycoll::mpi {
namespace {

// MPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm) in the two handle ABIs.
using AllreducePtr = int (*)(const void*, void*, int, void*, void*, void*);
using AllreduceInt = int (*)(const void*, void*, int, int, int, int);

void* allreduce_fn = nullptr;
size_t handle_bytes = 0;

}  // namespace

std::string bind(const char* module_path, size_t handle_size) {
    if (handle_size != sizeof(void*) && handle_size != sizeof(int))
        return "MPI handles of " + std::to_string(handle_size) + " bytes";
    // RTLD_NOLOAD: only the module mpi4py has already imported; its dependency tree holds libmpi.
    void* module = dlopen(module_path, RTLD_NOW | RTLD_NOLOAD);
    void* fn = module ? dlsym(module, "MPI_Allreduce") : nullptr;
    if (!fn) fn = dlsym(RTLD_DEFAULT, "MPI_Allreduce");  // an MPI loaded globally instead
    if (module) dlclose(module);                          // drops our reference only
    if (!fn) return std::string("MPI_Allreduce not found beside ") + module_path;
    allreduce_fn = fn;
    handle_bytes = handle_size;
    return "";
}

bool bound() { return allreduce_fn != nullptr; }

int allreduce(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm) {
    if (handle_bytes == sizeof(int))
        return reinterpret_cast<AllreduceInt>(allreduce_fn)(send, recv, count, static_cast<int>(datatype),
                                                            static_cast<int>(op), static_cast<int>(comm));
    return reinterpret_cast<AllreducePtr>(allreduce_fn)(send, recv, count, reinterpret_cast<void*>(datatype),
                                                        reinterpret_cast<void*>(op), reinterpret_cast<void*>(comm));
}

}  // namespace pycoll::mpi
