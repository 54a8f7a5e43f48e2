// iPart's partition primitives: row ranges [lo, hi) of many tensors packed back to back
// into one buffer, and unpacked out of it. A tensor is seen as rows of `row_bytes` bytes,
// `stride` bytes apart (stride == row_bytes: contiguous, one copy per tensor). Built on
// the fusion buffers' pack/unpack, so CPU and CUDA share one copy loop each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pycoll {

struct Rows {
    std::vector<uintptr_t> bases;   // each tensor's first row
    std::vector<size_t> row_bytes;  // bytes per row
    std::vector<size_t> strides;    // bytes from one row to the next
    std::vector<size_t> lo, hi;     // the rows [lo, hi) taken from each tensor
};

// Total bytes the row ranges hold (std::invalid_argument on inconsistent lists).
size_t rows_nbytes(const Rows& rows);

namespace cpu {
void pack_rows(void* dst, const Rows& rows);
void unpack_rows(const void* src, const Rows& rows);
}  // namespace cpu

#ifdef PYCOLL_WITH_CUDA
namespace cuda {
void pack_rows(void* dst, const Rows& rows, uintptr_t stream);
void unpack_rows(const void* src, const Rows& rows, uintptr_t stream);
}  // namespace cuda
#endif

}  // namespace pycoll
