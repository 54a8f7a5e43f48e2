// MPI calls made from C on mpi4py's handles, for the few paths where mpi4py's argument
// handling costs more than the communication (the blocking collectives' short path, the
// partial all-reduce's ring). pycoll is not built against an MPI: it finds the functions
// in the library that mpi4py has already loaded, so one build serves every MPI that
// mpi4py supports. Handles travel as intptr_t; requests live in a Requests array.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pycoll::mpi {

// Find MPI's functions through mpi4py's extension module at `module_path` (its libmpi is
// among that module's dependencies). `handle_size`: sizeof an MPI handle in that MPI's
// ABI, 8 where handles are pointers (Open MPI, the MPI 5 ABI), 4 where they are ints
// (MPICH and its derivatives). Returns "" once bound, else why not.
std::string bind(const char* module_path, size_t handle_size);
bool bound();
// How many collective calls (allreduce ... reduce_scatter_block below) this process has
// made through here: what tests count to see how many rounds a collective took.
uint64_t collective_calls();

// Every call returns MPI's error code. Call without the GIL.
int allreduce(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm);
int bcast(void* buf, int count, intptr_t datatype, int root, intptr_t comm);
int allgather(const void* send, int scount, intptr_t stype, void* recv, int rcount, intptr_t rtype, intptr_t comm);
int allgatherv(const void* send, int scount, intptr_t stype, void* recv, const int* rcounts, const int* rdispls,
               intptr_t rtype, intptr_t comm);
int alltoall(const void* send, int scount, intptr_t stype, void* recv, int rcount, intptr_t rtype, intptr_t comm);
int alltoallv(const void* send, const int* scounts, const int* sdispls, intptr_t stype, void* recv,
              const int* rcounts, const int* rdispls, intptr_t rtype, intptr_t comm);
int reduce_scatter(const void* send, void* recv, const int* rcounts, intptr_t datatype, intptr_t op, intptr_t comm);
int reduce_scatter_block(const void* send, void* recv, int count, intptr_t datatype, intptr_t op, intptr_t comm);
int comm_rank(intptr_t comm, int* rank);

// MPI_Request handles, contiguous in the bound ABI's size (what MPI_Testany reads), each
// MPI_REQUEST_NULL (`null`, mpi4py's handle of it) until started.
class Requests {
  public:
    explicit Requests(intptr_t null) : null_(null) {}
    size_t size() const { return bytes_.size() / width(); }
    size_t add();  // a new null slot; its index
    intptr_t get(size_t i) const;
    bool active(size_t i) const { return get(i) != null_; }
    void* at(size_t i) { return bytes_.data() + i * width(); }
    void* data() { return bytes_.data(); }

  private:
    static size_t width();
    intptr_t null_;
    std::vector<unsigned char> bytes_;
};

int isend(const void* buf, int nbytes, intptr_t byte_type, int dest, int tag, intptr_t comm, void* request);
int irecv(void* buf, int nbytes, intptr_t byte_type, int source, int tag, intptr_t comm, void* request);
int test(void* request, int* flag);
// MPI_Testany over `count` requests from `requests`; `index` is MPI_UNDEFINED when none is active.
int testany(int count, void* requests, int* index, int* flag);
int cancel(void* request);
int wait(void* request);
// MPI_Grequest_complete of the generalized request `request` (its handle's value).
int grequest_complete(intptr_t request);

}  // namespace pycoll::mpi
