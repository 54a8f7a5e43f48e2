// Per-element kernels shared by the CPU loops (kernels.cpp) and the CUDA kernels
// (cuda/kernels.cu): loads/stores that tolerate unaligned pointers, the reduction ops,
// scaling and casting. Each works on element i so both sides only write the loop.
#pragma once

#include "dtypes.h"

namespace pycoll {

// Aligned=false goes through memcpy: correct at any byte offset (on x86 it compiles to
// plain unaligned moves; on the GPU it is the slow path, taken only for odd offsets).
template <class T, bool Aligned> PYCOLL_HD T load(const void* p, size_t i) {
    if constexpr (Aligned) {
        return static_cast<const T*>(p)[i];
    } else {
        T v;
        memcpy(&v, static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
        return v;
    }
}

template <class T, bool Aligned> PYCOLL_HD void store(void* p, size_t i, T v) {
    if constexpr (Aligned) {
        static_cast<T*>(p)[i] = v;
    } else {
        memcpy(static_cast<char*>(p) + i * sizeof(T), &v, sizeof(T));
    }
}

template <class C> PYCOLL_HD bool is_nan(C v) {
    if constexpr (std::is_floating_point<C>::value) return v != v;
    else return false;
}

// Integer sum/prod wrap like numpy: compute in an unsigned type at least as wide as
// int, so nothing overflows a signed type (UB) and small types don't promote to int.
template <class C>
using wrap_t = std::conditional_t<(sizeof(C) <= 4), uint32_t, uint64_t>;

template <Op op, class C> PYCOLL_HD C combine(C a, C b) {  // sum, prod, bitwise
    if constexpr (op == Op::BAnd || op == Op::BOr || op == Op::BXor) {
        if constexpr (std::is_integral<C>::value)  // bool too: a byte of 0 or 1
            return C(op == Op::BAnd ? a & b : op == Op::BOr ? a | b : a ^ b);
        else
            return a;  // never run: reduce() refuses floats for bitwise ops (check_op)
    } else if constexpr (std::is_integral<C>::value) {
        using W = wrap_t<C>;
        return C(op == Op::Sum ? W(W(a) + W(b)) : W(W(a) * W(b)));
    } else {
        return op == Op::Sum ? a + b : a * b;
    }
}

// min/max: whether a (not b) is the result. NaN propagates like np.minimum/np.maximum.
template <Op op, class C> PYCOLL_HD bool first_wins(C a, C b) {
    if (is_nan(a)) return true;
    if (is_nan(b)) return false;
    return op == Op::Min ? !(b < a) : !(a < b);
}

template <class T, Op op, bool A> PYCOLL_HD void reduce_at(void* inout, const void* src, size_t i) {
    const T x = load<T, A>(inout, i), y = load<T, A>(src, i);
    const arith_t<T> a = to_arith(x), b = to_arith(y);
    if constexpr (op == Op::Min || op == Op::Max)
        store<T, A>(inout, i, first_wins<op>(a, b) ? x : y);  // picks an input: no rounding, NaN bits kept
    else
        store<T, A>(inout, i, from_arith<T>(combine<op>(a, b)));
}

// dst may equal src (in-place scale). fp16/bf16/fp32 scale in float32, fp64 in float64.
template <class T, bool A> PYCOLL_HD void scale_at(void* dst, const void* src, size_t i, arith_t<T> factor) {
    store<T, A>(dst, i, from_arith<T>(to_arith(load<T, A>(src, i)) * factor));
}

// Casts go through float32: S and D are float32, half_t or bf16_t.
template <class S, class D, bool A> PYCOLL_HD void cast_at(void* dst, const void* src, size_t i) {
    store<D, A>(dst, i, from_arith<D>(to_arith(load<S, A>(src, i))));
}

}  // namespace pycoll
