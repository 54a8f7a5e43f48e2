// CPU kernels. Plain loops over ops.h; -O3 vectorizes the memcpy-based loads.
#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "ops.h"

namespace pycoll {

void check_same_length(size_t a, size_t b, const char* what) {
    if (a != b)
        throw std::invalid_argument(std::string(what) + ": the pointer and nbytes lists differ in length (" +
                                    std::to_string(a) + " vs " + std::to_string(b) + ")");
}

void check_float(DType dt, const char* what) {
    if (!is_float(dt))
        throw std::invalid_argument(std::string(what) + " needs a float dtype (float16, bfloat16, float32, float64), got " +
                                    name(dt));
}

void check_op(DType dt, Op op, const char* what) {
    if (is_bitwise(op) && is_float(dt))
        throw std::invalid_argument(std::string(what) + ": " + name(op) + " needs an integer or bool dtype, got " +
                                    name(dt));
}

void check_scaled_sizes(const std::vector<size_t>& nbytes, DType dt, double scale, const char* what) {
    if (scale != 1.0) check_float(dt, (std::string(what) + " with scale != 1").c_str());
    const size_t size = itemsize(dt);
    for (size_t i = 0; i < nbytes.size(); ++i)
        if (nbytes[i] % size)
            throw std::invalid_argument(std::string(what) + ": nbytes[" + std::to_string(i) + "] = " + std::to_string(nbytes[i]) +
                                        " is not a multiple of the " + name(dt) + " itemsize " + std::to_string(size));
}

void check_cast(DType src, DType dst) {
    const bool ok = (src == DType::Float32 && (dst == DType::Float16 || dst == DType::BFloat16)) ||
                    (dst == DType::Float32 && (src == DType::Float16 || src == DType::BFloat16));
    if (!ok)
        throw std::invalid_argument(std::string("cast ") + name(src) + " -> " + name(dst) +
                                    " is not supported; supported: float32 <-> float16, float32 <-> bfloat16");
}

namespace cpu {

// The tensors' bytes form one stream (pack's layout); [begin, end) is the window of it
// that dst (pack) or src (unpack) holds, so a fused batch can travel in pieces.
void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<size_t>& nbytes, size_t begin,
          size_t end) {
    check_same_length(srcs.size(), nbytes.size(), "pack");
    char* out = static_cast<char*>(dst);
    size_t pos = 0;
    for (size_t i = 0; i < srcs.size() && pos < end; pos += nbytes[i++]) {
        const size_t lo = std::max(pos, begin), hi = std::min(pos + nbytes[i], end);
        if (lo < hi) std::memcpy(out + (lo - begin), static_cast<const char*>(srcs[i]) + (lo - pos), hi - lo);
    }
}

void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<size_t>& nbytes, DType dt,
            double scale, size_t begin, size_t end) {
    check_same_length(dsts.size(), nbytes.size(), "unpack");
    check_scaled_sizes(nbytes, dt, scale, "unpack");
    if (begin % itemsize(dt) || (end != SIZE_MAX && end % itemsize(dt)))
        throw std::invalid_argument("unpack: the window [" + std::to_string(begin) + ", " + std::to_string(end) +
                                    ") does not fall on " + name(dt) + " element boundaries");
    const char* in = static_cast<const char*>(src);
    size_t pos = 0;
    for (size_t i = 0; i < dsts.size() && pos < end; pos += nbytes[i++]) {
        const size_t lo = std::max(pos, begin), hi = std::min(pos + nbytes[i], end);
        if (lo >= hi) continue;
        char* out = static_cast<char*>(dsts[i]) + (lo - pos);
        if (scale == 1.0) {
            std::memcpy(out, in + (lo - begin), hi - lo);
        } else {
            dispatch_float(dt, [&](auto tag) {
                using T = typename decltype(tag)::type;
                const arith_t<T> f = arith_t<T>(scale);
                for (size_t j = 0, n = (hi - lo) / sizeof(T); j < n; ++j) scale_at<T, false>(out, in + (lo - begin), j, f);
            });
        }
    }
}

void reduce(void* inout, const void* src, size_t count, DType dt, Op op) {
    check_op(dt, op, "reduce");
    if (!count) return;
    dispatch_dtype(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        dispatch_op(op, [&](auto op_tag) {
            for (size_t i = 0; i < count; ++i) reduce_at<T, decltype(op_tag)::value, false>(inout, src, i);
        });
    });
}

void scale(void* ptr, size_t count, DType dt, double factor) {
    check_float(dt, "scale");
    if (!count) return;
    dispatch_float(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        const arith_t<T> f = arith_t<T>(factor);
        for (size_t i = 0; i < count; ++i) scale_at<T, false>(ptr, ptr, i, f);
    });
}

void cast(void* dst, const void* src, size_t count, DType src_dt, DType dst_dt) {
    check_cast(src_dt, dst_dt);
    if (!count) return;
    dispatch_float(src_dt, [&](auto s) {
        dispatch_float(dst_dt, [&](auto d) {
            using S = typename decltype(s)::type;
            using D = typename decltype(d)::type;
            if constexpr (std::is_same<arith_t<S>, float>::value && std::is_same<arith_t<D>, float>::value)
                for (size_t i = 0; i < count; ++i) cast_at<S, D, false>(dst, src, i);
        });
    });
}

}  // namespace cpu
}  // namespace pycoll
