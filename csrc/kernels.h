// The kernel API on raw pointers, CPU (kernels.cpp) and CUDA (cuda/kernels.cu).
// No Python here: bindings.cpp parses names, converts ints to pointers and releases the GIL.
// Errors: std::invalid_argument (-> ValueError) for bad arguments, std::runtime_error
// (-> RuntimeError) for CUDA failures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtypes.h"

namespace pycoll {

// ---- argument checks, shared by CPU and CUDA ------------------------------------------
void check_same_length(size_t a, size_t b, const char* what);
void check_float(DType dt, const char* what);
// reduce: bitwise ops need an integer or bool dtype.
void check_op(DType dt, Op op, const char* what);
// unpack and the scaled copies: nbytes multiples of itemsize(dt); scale != 1 needs a
// float dtype. `what` names the caller in the message.
void check_scaled_sizes(const std::vector<size_t>& nbytes, DType dt, double scale, const char* what);
// cast: float32 <-> float16/bfloat16 only.
void check_cast(DType src, DType dst);

namespace cpu {
// [begin, end): the window of the packed stream that dst (pack) / src (unpack) holds.
void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<size_t>& nbytes, size_t begin = 0,
          size_t end = SIZE_MAX);
void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<size_t>& nbytes, DType dt,
            double scale, size_t begin = 0, size_t end = SIZE_MAX);
void reduce(void* inout, const void* src, size_t count, DType dt, Op op);
void scale(void* ptr, size_t count, DType dt, double factor);
void cast(void* dst, const void* src, size_t count, DType src_dt, DType dst_dt);
}  // namespace cpu

#ifdef PYCOLL_WITH_CUDA
// Same semantics on device pointers; `stream` is a cudaStream_t as an integer (0 = default).
// Everything is asynchronous on the stream except the explicitly synchronous calls.
namespace cuda {
void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<size_t>& nbytes, uintptr_t stream);
void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<size_t>& nbytes, DType dt,
            double scale, uintptr_t stream);
void reduce(void* inout, const void* src, size_t count, DType dt, Op op, uintptr_t stream);
void scale(void* ptr, size_t count, DType dt, double factor, uintptr_t stream);
void cast(void* dst, const void* src, size_t count, DType src_dt, DType dst_dt, uintptr_t stream);
void memcpy_async(void* dst, const void* src, size_t nbytes, uintptr_t stream);  // cudaMemcpyDefault
void synchronize(uintptr_t stream);
int device_count();  // 0 when there is no driver or no device; never throws
void* host_alloc(size_t nbytes, int device);
void host_free(void* ptr);

// Staging copies run on pycoll's own stream per device, created non-blocking: they wait
// only for the events they are given, never for the work other threads queue later on
// the legacy default stream (a gradient's copy must not wait for the rest of backward).
uintptr_t copy_stream(int device);
// An event recorded on `stream` of `device` (the producer's work so far); the calling
// thread's current device is left as it was.
class Event {
  public:
    Event(uintptr_t stream, int device);
    ~Event();
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    void synchronize() const;
    bool query() const;  // true once everything before the event has run
    void* handle() const { return event_; }
    const int device;

  private:
    void* event_;  // cudaEvent_t, kept opaque so this header needs no CUDA
};
// cudaMemcpyAsync on copy_stream(device), after `after` (nullptr: no wait).
void copy_async(void* dst, const void* src, size_t nbytes, int device, const Event* after);
// ptrs[i] *= factor over nbytes[i] bytes each, in place, on copy_stream(device) after the
// copies started there: Average's scale on the GPU once a staged result is copied back.
void scale_async(const std::vector<void*>& ptrs, const std::vector<size_t>& nbytes, DType dt, double factor,
                 int device);
}  // namespace cuda
#endif

}  // namespace pycoll
