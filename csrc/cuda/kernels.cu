// CUDA kernels: the per-element code of ops.h in grid-stride loops, plus one-launch
// pack/unpack driven by a segment table passed as a kernel parameter.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels.h"
#include "../ops.h"

namespace pycoll {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 65535;
constexpr size_t kChunk = 64 * 1024;  // bytes per block-iteration of pack/unpack; a multiple of every itemsize

void check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        cudaGetLastError();  // reset the (non-sticky) error so the next call starts clean
        throw std::runtime_error(std::string("pycoll CUDA ") + what + ": " + cudaGetErrorString(err));
    }
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

unsigned blocks_for(size_t n) { return unsigned(std::min(std::max<size_t>((n + kThreads - 1) / kThreads, 1), kMaxBlocks)); }

__host__ __device__ inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ---- elementwise kernels --------------------------------------------------------------

#define PYCOLL_GRID_LOOP(i, n) \
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (n); i += size_t(gridDim.x) * blockDim.x)

template <class T, Op op, bool A> __global__ void reduce_kernel(void* inout, const void* src, size_t n) {
    PYCOLL_GRID_LOOP(i, n) reduce_at<T, op, A>(inout, src, i);
}

template <class T, bool A> __global__ void scale_kernel(void* p, size_t n, arith_t<T> factor) {
    PYCOLL_GRID_LOOP(i, n) scale_at<T, A>(p, p, i, factor);
}

template <class S, class D, bool A> __global__ void cast_kernel(void* dst, const void* src, size_t n) {
    PYCOLL_GRID_LOOP(i, n) cast_at<S, D, A>(dst, src, i);
}

// Launch the aligned instantiation when every pointer is aligned to the element size,
// the memcpy-based one otherwise (odd byte offsets).
template <class F> void with_alignment(bool is_aligned, F&& f) {
    if (is_aligned) f(std::true_type{});
    else f(std::false_type{});
}

// ---- pack / unpack: one launch, blocks walk 64 KiB chunks of a segment table ----------

struct Segment {
    const char* src;
    char* dst;
    size_t nbytes;
    size_t first_chunk;  // index of this segment's first chunk in the launch
};

// Kernel parameters may be up to 32 KiB on Volta+ with CUDA >= 12.1; 512 segments = 16 KiB.
// More buffers than that take one launch per 512. __grid_constant__ on the kernel
// parameter lets threads index it in place instead of copying it to local memory.
constexpr int kMaxSegments = 512;
struct SegmentTable {
    int count;
    size_t chunks;
    Segment seg[kMaxSegments];
};

// Which segment holds chunk c (segments are non-empty, first_chunk ascending).
__device__ const Segment& find_segment(const SegmentTable& t, size_t c) {
    int lo = 0, hi = t.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (t.seg[mid].first_chunk <= c) lo = mid;
        else hi = mid - 1;
    }
    return t.seg[lo];
}

// Widest copy both pointers allow; the tail goes byte by byte.
__device__ void copy_bytes(char* dst, const char* src, size_t n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
    size_t done = 0;
    if (a % 16 == 0) {
        const size_t nv = n / 16;
        for (size_t i = threadIdx.x; i < nv; i += blockDim.x)
            reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
        done = nv * 16;
    } else if (a % 4 == 0) {
        const size_t nv = n / 4;
        for (size_t i = threadIdx.x; i < nv; i += blockDim.x)
            reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
        done = nv * 4;
    }
    for (size_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void copy_segments_kernel(const __grid_constant__ SegmentTable t) {
    for (size_t c = blockIdx.x; c < t.chunks; c += gridDim.x) {
        const Segment& s = find_segment(t, c);
        const size_t off = (c - s.first_chunk) * kChunk;
        copy_bytes(s.dst + off, s.src + off, min_size(kChunk, s.nbytes - off));
    }
}

template <class T, bool A>
__global__ void scale_segments_kernel(const __grid_constant__ SegmentTable t, arith_t<T> factor) {
    for (size_t c = blockIdx.x; c < t.chunks; c += gridDim.x) {
        const Segment& s = find_segment(t, c);
        const size_t off = (c - s.first_chunk) * kChunk;
        const size_t n = min_size(kChunk, s.nbytes - off) / sizeof(T);
        for (size_t i = threadIdx.x; i < n; i += blockDim.x) scale_at<T, A>(s.dst + off, s.src + off, i, factor);
    }
}

// Split (src, dst, nbytes) triples into tables of at most kMaxSegments non-empty
// segments and call launch(table, all_aligned_to_elem) for each.
template <class F>
void for_each_table(const std::vector<const char*>& srcs, const std::vector<char*>& dsts,
                    const std::vector<size_t>& nbytes, size_t elem, F&& launch) {
    SegmentTable t;
    t.count = 0;
    t.chunks = 0;
    bool all_aligned = true;
    auto flush = [&] {
        if (t.count) launch(t, all_aligned);
        t.count = 0;
        t.chunks = 0;
        all_aligned = true;
    };
    for (size_t i = 0; i < nbytes.size(); ++i) {
        if (!nbytes[i]) continue;
        t.seg[t.count++] = Segment{srcs[i], dsts[i], nbytes[i], t.chunks};
        t.chunks += (nbytes[i] + kChunk - 1) / kChunk;
        all_aligned = all_aligned && aligned(srcs[i], elem) && aligned(dsts[i], elem);
        if (t.count == kMaxSegments) flush();
    }
    flush();
}

// One table's segments, dst = src * factor, on stream st.
void launch_scale(const SegmentTable& t, bool is_aligned, DType dt, double factor, cudaStream_t st) {
    const unsigned grid = unsigned(std::min(t.chunks, kMaxBlocks));
    dispatch_float(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        with_alignment(is_aligned, [&](auto a) {
            scale_segments_kernel<T, decltype(a)::value><<<grid, kThreads, 0, st>>>(t, arith_t<T>(factor));
        });
    });
}

}  // namespace

void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<size_t>& nbytes, uintptr_t stream) {
    check_same_length(srcs.size(), nbytes.size(), "cuda_pack");
    std::vector<const char*> s(srcs.size());
    std::vector<char*> d(srcs.size());
    char* out = static_cast<char*>(dst);
    for (size_t i = 0; i < srcs.size(); ++i) {
        s[i] = static_cast<const char*>(srcs[i]);
        d[i] = out;
        out += nbytes[i];
    }
    for_each_table(s, d, nbytes, 1, [&](const SegmentTable& t, bool) {
        copy_segments_kernel<<<unsigned(std::min(t.chunks, kMaxBlocks)), kThreads, 0, as_stream(stream)>>>(t);
        check(cudaGetLastError(), "cuda_pack launch");
    });
}

void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<size_t>& nbytes, DType dt,
            double scale, uintptr_t stream) {
    check_same_length(dsts.size(), nbytes.size(), "cuda_unpack");
    check_scaled_sizes(nbytes, dt, scale, "cuda_unpack");
    std::vector<const char*> s(dsts.size());
    std::vector<char*> d(dsts.size());
    const char* in = static_cast<const char*>(src);
    for (size_t i = 0; i < dsts.size(); ++i) {
        s[i] = in;
        d[i] = static_cast<char*>(dsts[i]);
        in += nbytes[i];
    }
    const cudaStream_t st = as_stream(stream);
    for_each_table(s, d, nbytes, itemsize(dt), [&](const SegmentTable& t, bool is_aligned) {
        if (scale == 1.0)
            copy_segments_kernel<<<unsigned(std::min(t.chunks, kMaxBlocks)), kThreads, 0, st>>>(t);
        else
            launch_scale(t, is_aligned, dt, scale, st);
        check(cudaGetLastError(), "cuda_unpack launch");
    });
}

void reduce(void* inout, const void* src, size_t count, DType dt, Op op, uintptr_t stream) {
    check_op(dt, op, "cuda_reduce");
    if (!count) return;
    const size_t size = itemsize(dt);
    dispatch_dtype(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        dispatch_op(op, [&](auto op_tag) {
            with_alignment(aligned(inout, size) && aligned(src, size), [&](auto a) {
                reduce_kernel<T, decltype(op_tag)::value, decltype(a)::value>
                    <<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(inout, src, count);
            });
        });
    });
    check(cudaGetLastError(), "cuda_reduce launch");
}

void scale(void* ptr, size_t count, DType dt, double factor, uintptr_t stream) {
    check_float(dt, "cuda_scale");
    if (!count) return;
    dispatch_float(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        with_alignment(aligned(ptr, sizeof(T)), [&](auto a) {
            scale_kernel<T, decltype(a)::value>
                <<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(ptr, count, arith_t<T>(factor));
        });
    });
    check(cudaGetLastError(), "cuda_scale launch");
}

void cast(void* dst, const void* src, size_t count, DType src_dt, DType dst_dt, uintptr_t stream) {
    check_cast(src_dt, dst_dt);
    if (!count) return;
    dispatch_float(src_dt, [&](auto s) {
        dispatch_float(dst_dt, [&](auto d) {
            using S = typename decltype(s)::type;
            using D = typename decltype(d)::type;
            if constexpr (std::is_same<arith_t<S>, float>::value && std::is_same<arith_t<D>, float>::value &&
                          !std::is_same<S, D>::value) {
                with_alignment(aligned(dst, sizeof(D)) && aligned(src, sizeof(S)), [&](auto a) {
                    cast_kernel<S, D, decltype(a)::value>
                        <<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(dst, src, count);
                });
            }
        });
    });
    check(cudaGetLastError(), "cuda_cast launch");
}

void memcpy_async(void* dst, const void* src, size_t nbytes, uintptr_t stream) {
    if (!nbytes) return;
    check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, as_stream(stream)), "cuda_memcpy");
}

void synchronize(uintptr_t stream) { check(cudaStreamSynchronize(as_stream(stream)), "cuda_synchronize"); }

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

namespace {

// Whether `device` has an active primary context, asked of the driver that the runtime has
// loaded (no link to libcuda); true when that cannot be told.
bool has_context(int device) {
    using DeviceGet = int (*)(int*, int);
    using PrimaryCtxGetState = int (*)(int, unsigned int*, int*);
    static void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    static auto get = driver ? reinterpret_cast<DeviceGet>(dlsym(driver, "cuDeviceGet")) : nullptr;
    static auto state = driver ? reinterpret_cast<PrimaryCtxGetState>(dlsym(driver, "cuDevicePrimaryCtxGetState"))
                               : nullptr;
    int handle = 0, active = 0;
    unsigned int flags = 0;
    if (!get || !state || get(&handle, device) != 0 || state(handle, &flags, &active) != 0) return true;
    return active != 0;
}

// Runs a block with `device` current, then restores the caller's device: these calls
// come from the user's threads, whose current device torch and cupy track themselves. A
// thread that never chose one (pycoll's own) reports device 0 with no context there:
// restoring it would make one (cudaSetDevice does since CUDA 12), a stray context on GPU 0
// for a rank bound to another GPU, so it is left on `device`.
class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        check(cudaGetDevice(&previous_), "cudaGetDevice");
        if (device != previous_) {
            restore_ = has_context(previous_);
            check(cudaSetDevice(device), "cudaSetDevice");
        }
    }
    ~DeviceGuard() {
        if (restore_) cudaSetDevice(previous_);
    }

  private:
    int previous_ = 0;
    bool restore_ = false;
};

}  // namespace

uintptr_t copy_stream(int device) {
    static std::mutex lock;
    static std::vector<cudaStream_t> streams;  // by device; never destroyed (one per device)
    std::lock_guard<std::mutex> hold(lock);
    if (device < 0) throw std::invalid_argument("copy_stream: negative device");
    if (size_t(device) >= streams.size()) streams.resize(device + 1, nullptr);
    if (!streams[device]) {
        DeviceGuard on(device);
        check(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking), "cudaStreamCreate");
    }
    return reinterpret_cast<uintptr_t>(streams[device]);
}

Event::Event(uintptr_t stream, int device_) : device(device_), event_(nullptr) {
    DeviceGuard on(device);
    cudaEvent_t ev;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    event_ = ev;
    const cudaError_t err = cudaEventRecord(ev, as_stream(stream));
    if (err != cudaSuccess) {
        cudaEventDestroy(ev);
        check(err, "cudaEventRecord");
    }
}

Event::~Event() { cudaEventDestroy(static_cast<cudaEvent_t>(event_)); }

void Event::synchronize() const {
    DeviceGuard on(device);  // no runtime call in a thread without a device makes one on GPU 0
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cudaEventSynchronize");
}

bool Event::query() const {
    DeviceGuard on(device);
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event_));
    if (err == cudaErrorNotReady) {
        cudaGetLastError();
        return false;
    }
    check(err, "cudaEventQuery");
    return true;
}

void copy_async(void* dst, const void* src, size_t nbytes, int device, const Event* after) {
    const cudaStream_t stream = as_stream(copy_stream(device));
    DeviceGuard on(device);
    if (after) check(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(after->handle()), 0), "cudaStreamWaitEvent");
    if (nbytes) check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream), "cuda_copy");
}

void scale_async(const std::vector<void*>& ptrs, const std::vector<size_t>& nbytes, DType dt, double factor,
                 int device) {
    check_same_length(ptrs.size(), nbytes.size(), "cuda_scale_async");
    check_scaled_sizes(nbytes, dt, factor, "cuda_scale_async");
    std::vector<char*> d(ptrs.size());
    for (size_t i = 0; i < ptrs.size(); ++i) d[i] = static_cast<char*>(ptrs[i]);
    const std::vector<const char*> s(d.begin(), d.end());
    const cudaStream_t stream = as_stream(copy_stream(device));
    DeviceGuard on(device);
    for_each_table(s, d, nbytes, itemsize(dt), [&](const SegmentTable& t, bool is_aligned) {
        launch_scale(t, is_aligned, dt, factor, stream);
        check(cudaGetLastError(), "cuda_scale_async launch");
    });
}

void* host_alloc(size_t nbytes, int device) {
    DeviceGuard on(device);  // in that device's context: none is made on another GPU
    void* p = nullptr;
    check(cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocPortable), "cuda_host_alloc");
    return p;
}

void host_free(void* ptr) {
    if (ptr) check(cudaFreeHost(ptr), "cuda_host_free");
}

}  // namespace cuda
}  // namespace pycoll
