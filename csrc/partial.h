// Partial all-reduce among any members of a communicator, with no communicator of their
// own (pycoll.partial): a chunked ring reduce-scatter + allgather, or for small messages a
// direct exchange (small groups) or recursive doubling, over MPI's non-blocking point to point (mpi_calls). No Python here:
// bindings.cpp passes everything as arguments and releases the GIL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtypes.h"

namespace pycoll::partial {

struct Round {
    intptr_t comm = 0, byte_type = 0, request_null = 0;  // mpi4py's handles
    int undefined = 0;                                   // MPI_UNDEFINED
    std::vector<int> members;  // ranks in comm, sorted; every member passes the same
    std::vector<int> tags;     // tags[j]: of messages between this rank and members[j]
    size_t me = 0;             // this rank's index in members
    void* data = nullptr;      // reduced in place
    size_t count = 0;
    DType dt = DType::Float32;
    Op op = Op::Sum;
    double scale = 1.0;        // applied once reduced (Average: 1 / members)
    size_t chunk_bytes = 1 << 18;  // the ring's message size
    size_t direct_bytes = 0;       // at most this many bytes: the direct exchange, or
    size_t doubling_from = 4;      // from this many members recursive doubling
    double timeout = 0;            // seconds the round may last
};

struct Outcome {
    enum Status { Done, Late, Failed } status = Done;
    int peer = -1;    // Late: the member waited for (its rank in comm)
    int error = 0;    // Failed: MPI's error code
    // After a failure, sends MPI may still read `data` for (MPI cannot cancel a send): the
    // caller keeps the memory until they complete. Receives were cancelled.
    std::vector<intptr_t> sends;
};

// The same result, bit for bit, on every member. Call without the GIL.
Outcome allreduce(const Round& round);

}  // namespace pycoll::partial
