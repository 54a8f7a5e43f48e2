// dtypes and reduction ops: names, parsing, sizes, fp16/bf16 conversions and the
// dtype/op dispatch. Shared by the CPU and the CUDA kernels (the conversions are
// __host__ __device__ when nvcc compiles this header).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#define PYCOLL_HD __host__ __device__ __forceinline__
#else
#define PYCOLL_HD inline
#endif

namespace pycoll {

// In the order of Python's tensors.DTYPES. float8 is moved, never computed on: no
// reduction is defined for it (MPI has none, gloo moves none; cast to reduce).
enum class DType : int {
    Float16, BFloat16, Float32, Float64, Int8, Int16, Int32, Int64, UInt8, Bool,
    UInt16, UInt32, UInt64, Float8E4M3FN, Float8E5M2
};
enum class Op : int { Sum, Min, Max, Prod, BAnd, BOr, BXor };

constexpr const char* kDTypeNames[] = {"float16", "bfloat16", "float32", "float64",       "int8",
                                       "int16",   "int32",    "int64",   "uint8",         "bool",
                                       "uint16",  "uint32",   "uint64",  "float8_e4m3fn", "float8_e5m2"};
constexpr size_t kDTypeSizes[] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 1, 2, 4, 8, 1, 1};
static_assert(std::size(kDTypeNames) == std::size(kDTypeSizes) &&
                  std::size(kDTypeNames) == int(DType::Float8E5M2) + 1,
              "one name and one size for each DType");
constexpr const char* kOpNames[] = {"sum", "min", "max", "prod", "band", "bor", "bxor"};
static_assert(std::size(kOpNames) == int(Op::BXor) + 1, "one name for each Op");

inline const char* name(DType dt) { return kDTypeNames[static_cast<int>(dt)]; }
inline const char* name(Op op) { return kOpNames[static_cast<int>(op)]; }
inline size_t itemsize(DType dt) { return kDTypeSizes[static_cast<int>(dt)]; }
inline bool is_float(DType dt) { return static_cast<int>(dt) <= static_cast<int>(DType::Float64); }
inline bool is_bitwise(Op op) { return op == Op::BAnd || op == Op::BOr || op == Op::BXor; }

namespace detail {
// std::invalid_argument becomes ValueError in Python.
template <size_t N>
int parse_name(const std::string& text, const char* const (&names)[N], const char* what) {
    for (size_t i = 0; i < N; ++i)
        if (text == names[i]) return static_cast<int>(i);
    std::string msg = std::string("unknown ") + what + " '" + text + "'; valid " + what + "s: ";
    for (size_t i = 0; i < N; ++i) msg += (i ? ", " : "") + std::string(names[i]);
    throw std::invalid_argument(msg);
}
}  // namespace detail

inline DType parse_dtype(const std::string& s) {
    return static_cast<DType>(detail::parse_name(s, kDTypeNames, "dtype"));
}
inline Op parse_op(const std::string& s) { return static_cast<Op>(detail::parse_name(s, kOpNames, "op")); }

// ---- 16-bit floats: stored as raw bits, arithmetic in float32 -------------------------

struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

PYCOLL_HD uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
PYCOLL_HD float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

PYCOLL_HD float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN (payload kept)
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
        const float m = float(mant) * 5.9604644775390625e-8f;
        return sign ? -m : m;
    }
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even; overflow -> inf; NaN -> quiet NaN with its sign.
// (F. Giesen's float_to_half_fast3_rtne; the subnormal case lets the FPU do the rounding.)
PYCOLL_HD uint16_t float_to_half(float f) {
    uint32_t u = float_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t o;
    if (u >= 0x47800000u) {  // >= 65536 (or inf/NaN): no finite half is nearer
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {  // < 2^-14: half subnormal or zero
        const float magic = bits_float(126u << 23);  // 0.5: aligns the 10 mantissa bits at the bottom
        o = float_bits(bits_float(u) + magic) - (126u << 23);
    } else {
        const uint32_t mant_odd = (u >> 13) & 1u;
        u += (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd;  // rebias + round half to even
        o = u >> 13;                                           // a carry into exp 31 gives inf
    }
    return uint16_t(o | sign);
}

PYCOLL_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

PYCOLL_HD uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // keep NaN a (quiet) NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round half to even; carries into inf
}

// Arith<T>: the type arithmetic on a T is done in.
template <class T> struct Arith { using type = T; };
template <> struct Arith<half_t> { using type = float; };
template <> struct Arith<bf16_t> { using type = float; };
template <class T> using arith_t = typename Arith<T>::type;

template <class T> PYCOLL_HD arith_t<T> to_arith(T v) { return v; }
PYCOLL_HD float to_arith(half_t v) { return half_to_float(v.bits); }
PYCOLL_HD float to_arith(bf16_t v) { return bf16_to_float(v.bits); }

template <class T> struct FromArith { static PYCOLL_HD T conv(arith_t<T> v) { return v; } };
template <> struct FromArith<half_t> { static PYCOLL_HD half_t conv(float v) { return half_t{float_to_half(v)}; } };
template <> struct FromArith<bf16_t> { static PYCOLL_HD bf16_t conv(float v) { return bf16_t{float_to_bf16(v)}; } };
template <class T> PYCOLL_HD T from_arith(arith_t<T> v) { return FromArith<T>::conv(v); }

// ---- dispatch: runtime dtype/op -> compile-time type/value ----------------------------

template <class T> struct Tag { using type = T; };
template <Op op> using OpTag = std::integral_constant<Op, op>;

template <class F> void dispatch_dtype(DType dt, F&& f) {
    switch (dt) {
        case DType::Float16: return f(Tag<half_t>{});
        case DType::BFloat16: return f(Tag<bf16_t>{});
        case DType::Float32: return f(Tag<float>{});
        case DType::Float64: return f(Tag<double>{});
        case DType::Int8: return f(Tag<int8_t>{});
        case DType::Int16: return f(Tag<int16_t>{});
        case DType::Int32: return f(Tag<int32_t>{});
        case DType::Int64: return f(Tag<int64_t>{});
        case DType::UInt8: return f(Tag<uint8_t>{});
        case DType::Bool: return f(Tag<bool>{});  // sums saturate: or; products: and
        case DType::UInt16: return f(Tag<uint16_t>{});
        case DType::UInt32: return f(Tag<uint32_t>{});
        case DType::UInt64: return f(Tag<uint64_t>{});
        case DType::Float8E4M3FN:
        case DType::Float8E5M2:
            throw std::invalid_argument(std::string(name(dt)) + " is moved, not reduced: cast to bfloat16 or float32 first");
    }
    throw std::invalid_argument("bad dtype");
}

// Float dtypes only: callers validate first (check_float), so integer code is never instantiated.
template <class F> void dispatch_float(DType dt, F&& f) {
    switch (dt) {
        case DType::Float16: return f(Tag<half_t>{});
        case DType::BFloat16: return f(Tag<bf16_t>{});
        case DType::Float32: return f(Tag<float>{});
        case DType::Float64: return f(Tag<double>{});
        default: throw std::invalid_argument(std::string("expected a float dtype, got ") + name(dt));
    }
}

template <class F> void dispatch_op(Op op, F&& f) {
    switch (op) {
        case Op::Sum: return f(OpTag<Op::Sum>{});
        case Op::Min: return f(OpTag<Op::Min>{});
        case Op::Max: return f(OpTag<Op::Max>{});
        case Op::Prod: return f(OpTag<Op::Prod>{});
        case Op::BAnd: return f(OpTag<Op::BAnd>{});
        case Op::BOr: return f(OpTag<Op::BOr>{});
        case Op::BXor: return f(OpTag<Op::BXor>{});
    }
    throw std::invalid_argument("bad op");
}

}  // namespace pycoll
