// MPI calls made from C on mpi4py's handles, for the few paths where mpi4py's argument
// handling costs more than the communication (a blocking allreduce of a few bytes).
// pycoll is not built against an MPI: it finds the functions in the library that
// mpi4py has already loaded, so one build serves every MPI that mpi4py supports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycoll::mpi {

// Find MPI_Allreduce through mpi4py's extension module at `module_path` (its libmpi is
// among that module's dependencies). `handle_size`: sizeof an MPI handle in that MPI's
// ABI, 8 where handles are pointers (Open MPI, the MPI 5 ABI), 4 where they are ints
// (MPICH and its derivatives). Returns "" once bound, else why not.
std::string bind(const char* module_path, size_t handle_size);
bool bound();

// MPI_Allreduce with handles as mpi4py's `.handle` gives them; returns MPI's error code.
// Call without the GIL.
int allreduce(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm);

}  // namespace pycoll::mpi
