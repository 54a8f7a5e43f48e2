// Row ranges -> the (pointer, bytes) spans the pack/unpack kernels take: one span per
// tensor when its rows are contiguous, else one per row.
#include "partition.h"

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace pycoll {

namespace {

struct Spans {
    std::vector<void*> ptrs;
    std::vector<size_t> nbytes;
};

Spans spans_of(const Rows& rows, const char* what) {
    const size_t n = rows.bases.size();
    if (rows.row_bytes.size() != n || rows.strides.size() != n || rows.lo.size() != n || rows.hi.size() != n)
        throw std::invalid_argument(std::string(what) + ": bases, row_bytes, strides, lo and hi differ in length");
    Spans out;
    for (size_t i = 0; i < n; ++i) {
        const size_t lo = rows.lo[i], hi = rows.hi[i], width = rows.row_bytes[i], stride = rows.strides[i];
        if (lo > hi)
            throw std::invalid_argument(std::string(what) + ": tensor " + std::to_string(i) + " has rows [" +
                                        std::to_string(lo) + ", " + std::to_string(hi) + "), lo > hi");
        if (hi - lo > 1 && stride < width)
            throw std::invalid_argument(std::string(what) + ": tensor " + std::to_string(i) + "'s rows overlap (stride " +
                                        std::to_string(stride) + " < row_bytes " + std::to_string(width) + ")");
        if (hi == lo || width == 0) continue;
        char* base = reinterpret_cast<char*>(rows.bases[i]);
        if (stride == width || hi - lo == 1) {
            out.ptrs.push_back(base + lo * stride);
            out.nbytes.push_back((hi - lo) * width);
        } else {
            for (size_t r = lo; r < hi; ++r) {
                out.ptrs.push_back(base + r * stride);
                out.nbytes.push_back(width);
            }
        }
    }
    return out;
}

std::vector<const void*> as_const(const std::vector<void*>& ptrs) { return {ptrs.begin(), ptrs.end()}; }

}  // namespace

size_t rows_nbytes(const Rows& rows) {
    size_t total = 0;
    for (size_t n : spans_of(rows, "rows_nbytes").nbytes) total += n;
    return total;
}

namespace cpu {
void pack_rows(void* dst, const Rows& rows) {
    Spans s = spans_of(rows, "pack_rows");
    pack(dst, as_const(s.ptrs), s.nbytes);
}
void unpack_rows(const void* src, const Rows& rows) {
    Spans s = spans_of(rows, "unpack_rows");
    unpack(src, s.ptrs, s.nbytes, DType::UInt8, 1.0);
}
}  // namespace cpu

#ifdef PYCOLL_WITH_CUDA
namespace cuda {
void pack_rows(void* dst, const Rows& rows, uintptr_t stream) {
    Spans s = spans_of(rows, "cuda_pack_rows");
    pack(dst, as_const(s.ptrs), s.nbytes, stream);
}
void unpack_rows(const void* src, const Rows& rows, uintptr_t stream) {
    Spans s = spans_of(rows, "cuda_unpack_rows");
    unpack(src, s.ptrs, s.nbytes, DType::UInt8, 1.0, stream);
}
}  // namespace cuda
#endif

}  // namespace pycoll
