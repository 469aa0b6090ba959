// msl_shim.h: the C++ side of the MSL emulator (see emulator/__init__.py for the supported subset).
//
// A .metal file compiles as C++ against this header (reached through the file `metal_stdlib`).
// Part 1 is the MSL surface (types, math, atomics, barriers, simdgroup ops) in namespace metal.
// Part 2 (namespace msl_emu) is the scheduler: every threadgroup runs on one OS thread, each of its
// threads on a user-space fiber, so that barriers and simdgroup ops are real rendezvous points.
// Part 3 defines the address-space keywords as macros; it must come last because words like
// `thread` and `device` are ordinary identifiers inside the standard library headers.
#pragma once
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS only exposes the (deprecated) ucontext API with it
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#define MSL_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSL_EMU_ASAN 1
#endif
#endif
#ifdef MSL_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

// The MSL version the emulator compiles as (Apple's compiler predefines __METAL_VERSION__): 3.2, the first
// with `#pragma METAL fp math_mode(safe)` and `fp contract(off)` (common.h). That is the math the emulator
// runs (no fast math; -ffp-contract=off), and msl_subset.py refuses any other math pragma. The fp-contraction
// build (library.py, SPLAT_METAL_EMU_FP_CONTRACT=1) compiles as 3.1 with -ffp-contract=fast: what Apple's
// compiler may do below 3.2, where the pragma does not exist.
#ifndef MSL_EMU_METAL_VERSION
#define MSL_EMU_METAL_VERSION 320
#endif
#define __METAL_VERSION__ MSL_EMU_METAL_VERSION

// ================================================================================================
// Part 1: MSL surface
// ================================================================================================
namespace metal {

template <class T> struct nd_ { using type = T; };
template <class T> using nd = typename nd_<T>::type;  // blocks template deduction on a parameter

// ---- vectors: Metal sizes and alignments (float3 is 16 bytes, aligned 16) ----
template <class T, int N> struct vec;

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  vec() = default;
  explicit vec(T s) : x(s), y(s) {}
  vec(T x_, T y_) : x(x_), y(y_) {}
  template <class U> explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) { return i == 0 ? x : y; }
  const T& operator[](int i) const { return i == 0 ? x : y; }
};

template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s) {}
  vec(T x_, T y_, T z_) : x(x_), y(y_), z(z_) {}
  vec(const vec<T, 2>& a, T z_) : x(a.x), y(a.y), z(z_) {}
  vec(T x_, const vec<T, 2>& b) : x(x_), y(b.x), z(b.y) {}
  template <class U> explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return i == 0 ? x : (i == 1 ? y : z); }
  const T& operator[](int i) const { return i == 0 ? x : (i == 1 ? y : z); }
};

template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}
  vec(const vec<T, 3>& a, T w_) : x(a.x), y(a.y), z(a.z), w(w_) {}
  vec(T x_, const vec<T, 3>& b) : x(x_), y(b.x), z(b.y), w(b.z) {}
  vec(const vec<T, 2>& a, const vec<T, 2>& b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  vec(const vec<T, 2>& a, T z_, T w_) : x(a.x), y(a.y), z(z_), w(w_) {}
  template <class U> explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return i == 0 ? x : (i == 1 ? y : (i == 2 ? z : w)); }
  const T& operator[](int i) const { return i == 0 ? x : (i == 1 ? y : (i == 2 ? z : w)); }
};

// packed_float3 etc.: no padding, alignment of the scalar. Convert to float3 before doing math.
template <class T, int N> struct packed_vec {
  T v[N];
  packed_vec() = default;
  template <class... A, class = std::enable_if_t<sizeof...(A) == N>> packed_vec(A... a) : v{T(a)...} {}
  packed_vec(const vec<T, N>& o) { for (int i = 0; i < N; ++i) v[i] = o[i]; }
  operator vec<T, N>() const { vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = v[i]; return r; }
  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }
};

#define MSL_VEC_TYPES(T, name)                                                                     \
  typedef vec<T, 2> name##2; typedef vec<T, 3> name##3; typedef vec<T, 4> name##4;                \
  typedef packed_vec<T, 2> packed_##name##2; typedef packed_vec<T, 3> packed_##name##3;             \
  typedef packed_vec<T, 4> packed_##name##4;
MSL_VEC_TYPES(float, float)
MSL_VEC_TYPES(int, int)
MSL_VEC_TYPES(unsigned int, uint)
MSL_VEC_TYPES(short, short)
MSL_VEC_TYPES(unsigned short, ushort)
MSL_VEC_TYPES(char, char)
MSL_VEC_TYPES(unsigned char, uchar)
MSL_VEC_TYPES(bool, bool)
#undef MSL_VEC_TYPES

static_assert(sizeof(float3) == 16 && alignof(float3) == 16, "float3 must be 16 bytes like Metal");
static_assert(sizeof(float2) == 8 && alignof(float2) == 8, "float2 must be 8 bytes like Metal");
static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 must be 16 bytes like Metal");
static_assert(sizeof(packed_float3) == 12 && alignof(packed_float3) == 4, "packed_float3 is 12 bytes");

template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};
template <class S> constexpr bool is_scalar_v = std::is_arithmetic_v<S>;

// element-wise operators: vec op vec, vec op scalar, scalar op vec (the scalar converts to T)
#define MSL_VEC_BINOP(op)                                                                           \
  template <class T, int N> inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {   \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] op b[i]; return r; }                        \
  template <class T, int N, class S, class = std::enable_if_t<is_scalar_v<S>>>                     \
  inline vec<T, N> operator op(const vec<T, N>& a, S s) {                                           \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] op T(s); return r; }                        \
  template <class T, int N, class S, class = std::enable_if_t<is_scalar_v<S>>>                     \
  inline vec<T, N> operator op(S s, const vec<T, N>& a) {                                           \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(s) op a[i]; return r; }                        \
  template <class T, int N> inline vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {     \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i]; return a; }                                     \
  template <class T, int N, class S, class = std::enable_if_t<is_scalar_v<S>>>                     \
  inline vec<T, N>& operator op##=(vec<T, N>& a, S s) {                                             \
    for (int i = 0; i < N; ++i) a[i] = a[i] op T(s); return a; }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
MSL_VEC_BINOP(%)
MSL_VEC_BINOP(&)
MSL_VEC_BINOP(|)
MSL_VEC_BINOP(^)
#undef MSL_VEC_BINOP

template <class T, int N> inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = -a[i]; return r;
}
template <int N> inline vec<bool, N> operator!(const vec<bool, N>& a) {
  vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = !a[i]; return r;
}

#define MSL_VEC_CMP(op)                                                                             \
  template <class T, int N> inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {\
    vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] op b[i]; return r; }                     \
  template <class T, int N, class S, class = std::enable_if_t<is_scalar_v<S>>>                     \
  inline vec<bool, N> operator op(const vec<T, N>& a, S s) {                                        \
    vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] op T(s); return r; }
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
MSL_VEC_CMP(<)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>)
MSL_VEC_CMP(>=)
#undef MSL_VEC_CMP

template <int N> inline bool any(const vec<bool, N>& a) { bool r = false; for (int i = 0; i < N; ++i) r = r || a[i]; return r; }
template <int N> inline bool all(const vec<bool, N>& a) { bool r = true; for (int i = 0; i < N; ++i) r = r && a[i]; return r; }
inline bool any(bool a) { return a; }
inline bool all(bool a) { return a; }

// ---- math (float only; MSL has no double) ----
#define MSL_UNARY(name, expr)                                                                       \
  inline float name(float x) { return expr; }                                                       \
  template <int N> inline vec<float, N> name(const vec<float, N>& v) {                              \
    vec<float, N> r; for (int i = 0; i < N; ++i) r[i] = name(v[i]); return r; }
MSL_UNARY(fabs, std::fabs(x))
MSL_UNARY(exp, std::exp(x))
MSL_UNARY(exp2, std::exp2(x))
MSL_UNARY(log, std::log(x))
MSL_UNARY(log2, std::log2(x))
MSL_UNARY(sqrt, std::sqrt(x))
MSL_UNARY(rsqrt, 1.0f / std::sqrt(x))
MSL_UNARY(floor, std::floor(x))
MSL_UNARY(ceil, std::ceil(x))
MSL_UNARY(round, std::round(x))
MSL_UNARY(rint, std::rint(x))
MSL_UNARY(trunc, std::trunc(x))
MSL_UNARY(sin, std::sin(x))
MSL_UNARY(cos, std::cos(x))
MSL_UNARY(tan, std::tan(x))
MSL_UNARY(asin, std::asin(x))
MSL_UNARY(acos, std::acos(x))
MSL_UNARY(atan, std::atan(x))
MSL_UNARY(tanh, std::tanh(x))
MSL_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSL_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f)))
MSL_UNARY(fract, x - std::floor(x))
#undef MSL_UNARY

#define MSL_BINARY(name, expr)                                                                      \
  inline float name(float x, float y) { return expr; }                                              \
  template <int N> inline vec<float, N> name(const vec<float, N>& a, const vec<float, N>& b) {       \
    vec<float, N> r; for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]); return r; }
MSL_BINARY(pow, std::pow(x, y))
MSL_BINARY(powr, std::pow(x, y))
MSL_BINARY(atan2, std::atan2(x, y))
MSL_BINARY(fmod, std::fmod(x, y))
MSL_BINARY(fmin, std::fmin(x, y))
MSL_BINARY(fmax, std::fmax(x, y))
MSL_BINARY(copysign, std::copysign(x, y))
MSL_BINARY(step, (y < x ? 0.0f : 1.0f))
#undef MSL_BINARY

inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
template <class T, int N> inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = abs(v[i]); return r;
}
// float min/max follow fmin/fmax (a NaN operand yields the other operand), as Metal documents.
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline ulong min(ulong a, ulong b) { return a < b ? a : b; }
inline ulong max(ulong a, ulong b) { return a > b ? a : b; }
template <class T, int N> inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]); return r;
}
template <class T, int N> inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]); return r;
}
template <class T> inline T clamp(T x, nd<T> lo, nd<T> hi) { return min(max(x, lo), hi); }
template <class T, int N> inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <class T, int N> inline vec<T, N> clamp(const vec<T, N>& x, nd<T> lo, nd<T> hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <int N> inline vec<float, N> fma(const vec<float, N>& a, const vec<float, N>& b, const vec<float, N>& c) {
  vec<float, N> r; for (int i = 0; i < N; ++i) r[i] = std::fma(a[i], b[i], c[i]); return r;
}
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
template <int N> inline vec<float, N> mix(const vec<float, N>& x, const vec<float, N>& y, const vec<float, N>& a) {
  return x + (y - x) * a;
}
template <int N> inline vec<float, N> mix(const vec<float, N>& x, const vec<float, N>& y, float a) {
  return x + (y - x) * a;
}
template <class T> inline std::enable_if_t<is_scalar_v<T>, T> select(T a, nd<T> b, bool c) { return c ? b : a; }
template <class T, int N> inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i]; return r;
}
template <class T, int N> inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

inline bool isfinite(float x) { return std::isfinite(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <int N> inline vec<bool, N> isfinite(const vec<float, N>& v) {
  vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = std::isfinite(v[i]); return r;
}
template <int N> inline vec<bool, N> isnan(const vec<float, N>& v) {
  vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = std::isnan(v[i]); return r;
}

template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T r = a[0] * b[0]; for (int i = 1; i < N; ++i) r += a[i] * b[i]; return r;
}
template <int N> inline float length_squared(const vec<float, N>& a) { return dot(a, a); }
template <int N> inline float length(const vec<float, N>& a) { return std::sqrt(dot(a, a)); }
template <int N> inline float distance(const vec<float, N>& a, const vec<float, N>& b) { return length(a - b); }
template <int N> inline vec<float, N> normalize(const vec<float, N>& a) { return a * (1.0f / std::sqrt(dot(a, a))); }
template <class T> inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// aliases: Metal's fast:: and precise:: variants compute the same functions here
namespace precise { using namespace ::metal; }
namespace fast { using namespace ::metal; }

// ---- matrices: floatCxR = C columns of floatR, column-major (float3x3 is 48 bytes) ----
template <int C, int R> struct mat {
  vec<float, R> cols[C];
  mat() = default;
  explicit mat(float d) {  // MSL: a scalar constructs a diagonal matrix
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) cols[c][r] = (c == r) ? d : 0.0f;
  }
  template <class... V, class = std::enable_if_t<sizeof...(V) == C && C != 1 &&
                                                 (std::is_same_v<V, vec<float, R>> && ...)>>
  mat(const V&... v) : cols{v...} {}
  template <class... S, class = std::enable_if_t<sizeof...(S) == C * R && (is_scalar_v<S> && ...)>, class = void>
  mat(S... s) {  // scalars in column-major order
    float a[C * R] = {float(s)...};
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) cols[c][r] = a[c * R + r];
  }
  vec<float, R>& operator[](int c) { return cols[c]; }
  const vec<float, R>& operator[](int c) const { return cols[c]; }
};
typedef mat<2, 2> float2x2; typedef mat<2, 3> float2x3; typedef mat<2, 4> float2x4;
typedef mat<3, 2> float3x2; typedef mat<3, 3> float3x3; typedef mat<3, 4> float3x4;
typedef mat<4, 2> float4x2; typedef mat<4, 3> float4x3; typedef mat<4, 4> float4x4;
static_assert(sizeof(float3x3) == 48, "float3x3 is three 16-byte columns like Metal");

template <int C, int R> inline vec<float, R> operator*(const mat<C, R>& m, const vec<float, C>& v) {
  vec<float, R> r = m[0] * v[0]; for (int c = 1; c < C; ++c) r += m[c] * v[c]; return r;
}
template <int C, int R> inline vec<float, C> operator*(const vec<float, R>& v, const mat<C, R>& m) {
  vec<float, C> r; for (int c = 0; c < C; ++c) r[c] = dot(v, m[c]); return r;
}
template <int K, int R, int C> inline mat<C, R> operator*(const mat<K, R>& a, const mat<C, K>& b) {
  mat<C, R> r; for (int c = 0; c < C; ++c) r[c] = a * b[c]; return r;
}
template <int C, int R> inline mat<C, R> operator+(const mat<C, R>& a, const mat<C, R>& b) {
  mat<C, R> r; for (int c = 0; c < C; ++c) r[c] = a[c] + b[c]; return r;
}
template <int C, int R> inline mat<C, R> operator-(const mat<C, R>& a, const mat<C, R>& b) {
  mat<C, R> r; for (int c = 0; c < C; ++c) r[c] = a[c] - b[c]; return r;
}
template <int C, int R> inline mat<C, R> operator-(const mat<C, R>& a) {
  mat<C, R> r; for (int c = 0; c < C; ++c) r[c] = -a[c]; return r;
}
template <int C, int R> inline mat<C, R> operator*(const mat<C, R>& a, float s) {
  mat<C, R> r; for (int c = 0; c < C; ++c) r[c] = a[c] * s; return r;
}
template <int C, int R> inline mat<C, R> operator*(float s, const mat<C, R>& a) { return a * s; }
template <int C, int R> inline mat<C, R>& operator+=(mat<C, R>& a, const mat<C, R>& b) { return a = a + b; }
template <int C, int R> inline mat<C, R>& operator-=(mat<C, R>& a, const mat<C, R>& b) { return a = a - b; }
template <int C, int R> inline mat<C, R>& operator*=(mat<C, R>& a, float s) { return a = a * s; }
template <int C, int R> inline mat<R, C> transpose(const mat<C, R>& m) {
  mat<R, C> t; for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) t[r][c] = m[c][r]; return t;
}
inline float determinant(const float2x2& m) { return m[0][0] * m[1][1] - m[1][0] * m[0][1]; }
inline float determinant(const float3x3& m) { return dot(m[0], cross(m[1], m[2])); }

// ---- bit cast ----
template <class T, class U> inline T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of equal size");
  T t; std::memcpy(&t, &u, sizeof(T)); return t;
}

// ---- atomics: 4-byte objects laid over device buffers, real CPU atomics underneath ----
}  // namespace metal
namespace msl_emu { inline void count_atomic(const volatile void* p); }  // work counters (part 2)
namespace metal {
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED };
template <class T> struct atomic { T v_; };
typedef atomic<int> atomic_int;
typedef atomic<unsigned int> atomic_uint;
typedef atomic<float> atomic_float;
static_assert(sizeof(atomic_float) == 4, "atomic_float must overlay a float buffer");

template <class T> inline T atomic_load_explicit(const volatile atomic<T>* p, memory_order) {
  T r; __atomic_load(const_cast<T*>(&p->v_), &r, __ATOMIC_RELAXED); return r;
}
template <class T> inline void atomic_store_explicit(volatile atomic<T>* p, nd<T> v, memory_order) {
  __atomic_store(const_cast<T*>(&p->v_), &v, __ATOMIC_RELAXED);
}
template <class T> inline T atomic_exchange_explicit(volatile atomic<T>* p, nd<T> v, memory_order) {
  msl_emu::count_atomic(p);
  T r; __atomic_exchange(const_cast<T*>(&p->v_), &v, &r, __ATOMIC_RELAXED); return r;
}
template <class T> inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* p, nd<T>* expected,
                                                                     nd<T> desired, memory_order, memory_order) {
  return __atomic_compare_exchange(const_cast<T*>(&p->v_), expected, &desired, true, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED);
}
template <class T, class F> inline T atomic_rmw_(volatile atomic<T>* p, F f) {  // CAS loop
  msl_emu::count_atomic(p);
  T* a = const_cast<T*>(&p->v_);
  T old; __atomic_load(a, &old, __ATOMIC_RELAXED);
  T want = f(old);
  while (!__atomic_compare_exchange(a, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) want = f(old);
  return old;
}
template <class T> inline T atomic_fetch_add_explicit(volatile atomic<T>* p, nd<T> v, memory_order) {
  if constexpr (std::is_integral_v<T>) msl_emu::count_atomic(p);
  if constexpr (std::is_integral_v<T>) return __atomic_fetch_add(const_cast<T*>(&p->v_), v, __ATOMIC_RELAXED);
  else return atomic_rmw_(p, [v](T o) { return o + v; });
}
template <class T> inline T atomic_fetch_sub_explicit(volatile atomic<T>* p, nd<T> v, memory_order) {
  if constexpr (std::is_integral_v<T>) msl_emu::count_atomic(p);
  if constexpr (std::is_integral_v<T>) return __atomic_fetch_sub(const_cast<T*>(&p->v_), v, __ATOMIC_RELAXED);
  else return atomic_rmw_(p, [v](T o) { return o - v; });
}
#define MSL_INT_ATOMIC(name, expr)                                                                  \
  template <class T> inline T name(volatile atomic<T>* p, nd<T> v, memory_order) {                 \
    static_assert(std::is_integral_v<T>, #name " is for atomic_int / atomic_uint only (as in Metal)");\
    return atomic_rmw_(p, [v](T o) { return T(expr); }); }
MSL_INT_ATOMIC(atomic_fetch_max_explicit, o > v ? o : v)
MSL_INT_ATOMIC(atomic_fetch_min_explicit, o < v ? o : v)
MSL_INT_ATOMIC(atomic_fetch_and_explicit, o & v)
MSL_INT_ATOMIC(atomic_fetch_or_explicit, o | v)
MSL_INT_ATOMIC(atomic_fetch_xor_explicit, o ^ v)
#undef MSL_INT_ATOMIC

// ---- barriers and simdgroup ops (implemented in part 2) ----
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal
namespace msl_emu {
// Where a barrier or simdgroup op is called: a default argument of each, so it is the CALLER's .metal
// file and line (the assembled source's #line directives), and column where the compiler has
// __builtin_COLUMN (clang; g++ 12 tells two calls on one line apart only by the op). Every thread of a group
// (lane of a simdgroup) must reach the same call site: two sites are two different barriers on a GPU.
struct Site {
  const char* file;
  unsigned line, column;
#if defined(__has_builtin)
#if __has_builtin(__builtin_COLUMN)
#define MSL_EMU_COLUMN __builtin_COLUMN()
#endif
#endif
#ifndef MSL_EMU_COLUMN
#define MSL_EMU_COLUMN 0u
#endif
  static constexpr Site here(const char* f = __builtin_FILE(), unsigned l = __builtin_LINE(),
                             unsigned c = MSL_EMU_COLUMN) {
    return Site{f, l, c};
  }
  bool operator==(const Site& o) const { return line == o.line && column == o.column && std::strcmp(file, o.file) == 0; }
  std::string str() const {
    return std::string(file) + ":" + std::to_string(line) + (column ? ":" + std::to_string(column) : "");
  }
};
}  // namespace msl_emu
namespace metal {
void threadgroup_barrier(mem_flags, msl_emu::Site site = msl_emu::Site::here());
void simdgroup_barrier(mem_flags, msl_emu::Site site = msl_emu::Site::here());

}  // namespace metal

// ================================================================================================
// Part 2: scheduler
// ================================================================================================
namespace msl_emu {

constexpr int kSimdWidth = 32;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxTgArrays = 256;  // `threadgroup T a[N];` declarations of one library, at most (library.py)  // per fiber, lazily committed; a guard page below

struct Pos {  // what the position attributes read, filled per thread as Metal defines them
  uint32_t tpig[3];    // thread_position_in_grid = tgp * dispatch size + tpt
  uint32_t tpt[3];     // thread_position_in_threadgroup
  uint32_t tgp[3];     // threadgroup_position_in_grid
  uint32_t tptg[3];    // threads_per_threadgroup: actual size of THIS group (edge groups are smaller)
  uint32_t dtptg[3];   // dispatch_threads_per_threadgroup: the requested group size
  uint32_t tpgrid[3];  // threads_per_grid
  uint32_t tgpg[3];    // threadgroups_per_grid
  uint32_t tidx;       // thread_index_in_threadgroup = x + y*tptg.x + z*tptg.x*tptg.y
  uint32_t lane;       // thread_index_in_simdgroup = tidx % 32
  uint32_t sgidx;      // simdgroup_index_in_threadgroup = tidx / 32
  uint32_t nsg;        // simdgroups_per_threadgroup = ceil(group threads / 32)
};

using Body = void (*)(void** args, const Pos& p);
enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };
enum SimdOp { OP_SUM = 1, OP_MAX, OP_MIN, OP_PREFIX_EX, OP_PREFIX_IN, OP_SHUFFLE, OP_SHUFFLE_DOWN,
              OP_SHUFFLE_UP, OP_SHUFFLE_XOR, OP_BROADCAST, OP_BROADCAST_FIRST, OP_BALLOT, OP_ANY,
              OP_ALL, OP_BARRIER };

struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  char* stack = nullptr;
  bool fresh = true;  // true: must be (re)started with makecontext (new, or abandoned after an error)
  State state = DONE;
  int simd_op = 0;
  int barrier_flags = 0;   // the mem_flags of the threadgroup_barrier it waits at
  Site site{"", 0, 0};     // the barrier or simdgroup op this thread waits at
  bool switching = false;  // inside a threadgroup-switch yield (MSL_EMU_TG_SWITCH)
  uint32_t simd_seq = 0;   // simdgroup ops done by this thread (double-buffers the lane slots)
  Pos pos;
  void* asan_fake_stack = nullptr;  // AddressSanitizer's bookkeeping while this fiber is switched out
};

// The order threads run in between two synchronisation points is a seeded shuffle (Metal promises
// no order at all): splitmix64 keyed by (seed, group, round), so it does not depend on which OS
// thread runs the group.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline void shuffle_order(std::vector<uint32_t>& order, uint32_t n, uint64_t key) {
  order.resize(n);
  for (uint32_t i = 0; i < n; ++i) order[i] = i;
  for (uint32_t i = n; i > 1; --i) {
    key = mix64(key);
    std::swap(order[i - 1], order[key % i]);
  }
}

struct TgWrite {  // the threadgroup-switch build's record of the last plain store to a 4-byte word
  int32_t writer;  // thread_index_in_threadgroup, -1: none since the group started
  uint32_t barrier;  // barriers the group had passed when it was written
};

struct TgBlock {  // one `threadgroup T a[N];` array of a kernel, owned by one OS thread
  void* ptr = nullptr;
  size_t bytes = 0;
  uint64_t gen = ~0ull;  // the group it was last poisoned for
  TgWrite* writes = nullptr;  // [ceil(bytes / 4)], threadgroup-switch build only
};

#ifdef MSL_EMU_TG_SWITCH
#define MSL_EMU_NO_TSAN __attribute__((no_sanitize_thread))
#else
#define MSL_EMU_NO_TSAN
#endif

struct SimdSlots {  // lane values of one simdgroup's current op; [seq parity][lane]
  alignas(16) unsigned char val[2][kSimdWidth][16];
  int32_t arg[2][kSimdWidth];
  uint32_t active[2];  // bitmask of lanes taking part (lanes that returned are inactive)
};

struct Worker;
struct Dispatch {
  Body body;
  void** args;
  uint32_t grid[3], group[3], ngroups[3];
  uint64_t total_groups;
  bool fibers;
  uint64_t seed;            // schedule seed (SPLAT_METAL_EMU_SEED)
  unsigned char poison;     // byte threadgroup memory is filled with at group start
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string err;
  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> g(err_mu);
    if (err.empty()) err = msg;
    failed = true;
  }
};

struct Worker {
  Dispatch* d = nullptr;
  std::vector<Fiber*> fibers;
  std::vector<SimdSlots> simd;
  jmp_buf sched;
  Fiber* cur = nullptr;
  bool in_fiber = false;
  uint64_t group_linear = 0;     // index of the group being run (its threadgroup memory generation)
  std::vector<uint32_t> order;   // this round's thread order
  std::vector<TgBlock> tg;       // threadgroup arrays, by declaration slot
  const TgBlock* tg_begin = nullptr;  // tg's blocks as plain pointers, for the threadgroup-switch hooks
  const TgBlock* tg_end = nullptr;
  int64_t count[6] = {0, 0, 0, 0, 0, 0};  // work counters of this OS thread (see Count)
  // threadgroup-switch build: barriers this group passed, the count right after the last one with
  // mem_threadgroup, the last one without it, and the first too-weak-barrier report of the group
  uint32_t barriers = 0, fenced = 0;
  Site weak_barrier{"", 0, 0};
  std::string tg_error;
  void* asan_fake_stack = nullptr;
  const void* sched_stack_bottom = nullptr;  // the OS thread's own stack, for AddressSanitizer
  size_t sched_stack_size = 0;
  Worker() { tg.reserve(kMaxTgArrays); }  // tg never moves: the threadgroup-switch hooks read it any time
  ~Worker() {
    for (Fiber* f : fibers) { munmap(f->stack, kStackBytes + 4096); delete f; }
    for (TgBlock& b : tg) { std::free(b.ptr); std::free(b.writes); }
  }
};

inline thread_local Worker* tls_worker = nullptr;

// Work counters, always on (a plain increment in the worker; summed into the library's totals when a
// worker finishes its share of a dispatch), read by the Python side with msl_emu_counters: what the
// step ledger (splat_metal_method/step_ledger.py) reports per kernel. Simdgroup ops and barriers are
// counted once per simdgroup / threadgroup (by its first live lane / thread 0), weighted by scalar
// components for reductions (a float4 simd_sum counts 4; SIMD_REDUCTION_OPS counts the calls); atomics once
// per calling thread.
enum Count {
  SIMD_REDUCTIONS = 0, SIMD_SHUFFLES = 1, DEVICE_ATOMICS = 2, THREADGROUP_ATOMICS = 3, BARRIERS = 4,
  SIMD_REDUCTION_OPS = 5, N_COUNTS = 6
};
inline std::atomic<int64_t> g_count[N_COUNTS];
inline void count(Count what, int64_t n = 1) { if (tls_worker) tls_worker->count[what] += n; }
inline void read_counters(int64_t* out) { for (int k = 0; k < N_COUNTS; ++k) out[k] = g_count[k].load(); }

struct KernelError { std::string msg; };  // thrown only on the plain (non-fiber) path

[[noreturn]] inline void no_fiber_error(const char* what) {
  throw KernelError{std::string(what) + " was called, but the emulator chose the fast path without fibers "
                    "for this library (its source never mentions barriers or simd_ functions). "
                    "Call it directly in the .metal source."};
}

// AddressSanitizer must be told about every stack switch (fibers run on their own mmap'd stacks),
// or it reports false errors on the first longjmp. No-ops in the normal build.
inline void asan_to_fiber(Worker* w, Fiber* f) {
#ifdef MSL_EMU_ASAN
  __sanitizer_start_switch_fiber(&w->asan_fake_stack, f->stack + 4096, kStackBytes);
#else
  (void)w; (void)f;
#endif
}
inline void asan_in_fiber(Worker* w, Fiber* f) {
#ifdef MSL_EMU_ASAN
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, &w->sched_stack_bottom, &w->sched_stack_size);
#else
  (void)w; (void)f;
#endif
}
inline void asan_to_sched(Worker* w, Fiber* f) {
#ifdef MSL_EMU_ASAN
  __sanitizer_start_switch_fiber(&f->asan_fake_stack, w->sched_stack_bottom, w->sched_stack_size);
#else
  (void)w; (void)f;
#endif
}
inline void asan_in_sched(Worker* w) {
#ifdef MSL_EMU_ASAN
  __sanitizer_finish_switch_fiber(w->asan_fake_stack, nullptr, nullptr);
#else
  (void)w;
#endif
}

// Give control back to the group scheduler until it resumes this thread.
inline void block(State s, int op = 0, const Site& site = Site{"", 0, 0}) {
  Worker* w = tls_worker;
  Fiber* f = w->cur;
  f->state = s;
  f->simd_op = op;
  f->site = site;
  if (!_setjmp(f->jb)) { asan_to_sched(w, f); _longjmp(w->sched, 1); }
  asan_in_fiber(w, f);
}

// Every fiber runs this forever: one GPU thread per loop iteration, then park until reused.
inline void fiber_main() {
  asan_in_fiber(tls_worker, tls_worker->cur);
  for (;;) {
    Worker* w = tls_worker;
    Fiber* f = w->cur;
    w->d->body(w->d->args, f->pos);
    f->state = DONE;
    if (!_setjmp(f->jb)) { asan_to_sched(w, f); _longjmp(w->sched, 1); }
    asan_in_fiber(w, f);
  }
}

inline void resume(Worker* w, Fiber* f) {
  w->cur = f;
  if (!_setjmp(w->sched)) {
    asan_to_fiber(w, f);
    if (f->fresh) {
      f->fresh = false;
#ifdef MSL_EMU_ASAN
      f->asan_fake_stack = nullptr;
      ASAN_UNPOISON_MEMORY_REGION(f->stack + 4096, kStackBytes);  // frames of an abandoned run are gone
#endif
      getcontext(&f->uc);
      f->uc.uc_stack.ss_sp = f->stack + 4096;
      f->uc.uc_stack.ss_size = kStackBytes;
      f->uc.uc_link = nullptr;
      makecontext(&f->uc, fiber_main, 0);
      setcontext(&f->uc);  // slow (a syscall) but only once per fiber per dispatch
    } else {
      _longjmp(f->jb, 1);  // fast switch: no signal-mask syscall
    }
  }
  asan_in_sched(w);
}

inline Fiber* new_fiber() {
  Fiber* f = new Fiber();
  void* mem = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) { delete f; return nullptr; }
  mprotect(mem, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
  f->stack = static_cast<char*>(mem);
  return f;
}

inline void fill_pos(const Dispatch& d, const uint32_t tg[3], const uint32_t actual[3], uint32_t i, Pos& p) {
  uint32_t ax = actual[0], ay = actual[1];
  uint32_t t[3] = {i % ax, (i / ax) % ay, i / (ax * ay)};
  for (int k = 0; k < 3; ++k) {
    p.tpt[k] = t[k];
    p.tgp[k] = tg[k];
    p.tptg[k] = actual[k];
    p.dtptg[k] = d.group[k];
    p.tpgrid[k] = d.grid[k];
    p.tgpg[k] = d.ngroups[k];
    p.tpig[k] = tg[k] * d.group[k] + t[k];
  }
  uint32_t n = actual[0] * actual[1] * actual[2];
  p.tidx = i;
  p.lane = i % kSimdWidth;
  p.sgidx = i / kSimdWidth;
  p.nsg = (n + kSimdWidth - 1) / kSimdWidth;
}

inline std::string group_str(const uint32_t tg[3]) {
  return "threadgroup (" + std::to_string(tg[0]) + "," + std::to_string(tg[1]) + "," + std::to_string(tg[2]) + ")";
}

// Run one threadgroup to completion on this OS thread. Returns false on error (d->err set).
inline bool run_group_fibers(Worker* w, const uint32_t tg[3], const uint32_t actual[3]) {
  Dispatch& d = *w->d;
  uint32_t n = actual[0] * actual[1] * actual[2];
  while (w->fibers.size() < n) {
    Fiber* f = new_fiber();
    if (!f) { d.fail("could not allocate fiber stacks"); return false; }
    w->fibers.push_back(f);
  }
  uint32_t nsg = (n + kSimdWidth - 1) / kSimdWidth;
  if (w->simd.size() < nsg) w->simd.resize(nsg);
  for (uint32_t i = 0; i < n; ++i) {
    Fiber* f = w->fibers[i];
    f->state = RUNNABLE; f->simd_seq = 0; f->simd_op = 0;
    fill_pos(d, tg, actual, i, f->pos);
  }
  w->barriers = w->fenced = 0;
  w->tg_error.clear();
  auto abandon = [&](const std::string& msg) {
    d.fail(msg);
    for (uint32_t i = 0; i < n; ++i) if (w->fibers[i]->state != DONE) w->fibers[i]->fresh = true;
    return false;
  };
  w->in_fiber = true;
  for (uint64_t round = 0;; ++round) {
    // run every runnable thread, in this round's shuffled order, until it blocks or returns
    shuffle_order(w->order, n, mix64(d.seed ^ mix64(w->group_linear * 0x100000001B3ull + round)));
    for (uint32_t i : w->order)
      if (w->fibers[i]->state == RUNNABLE) resume(w, w->fibers[i]);
    w->in_fiber = false;
    if (!w->tg_error.empty()) return abandon("in " + group_str(tg) + ", " + w->tg_error);
    uint32_t n_done = 0, n_bar = 0;
    for (uint32_t i = 0; i < n; ++i) {
      n_done += w->fibers[i]->state == DONE;
      n_bar += w->fibers[i]->state == AT_BARRIER;
    }
    if (n_done == n) return true;
    bool progress = false;
    for (uint32_t i = 0; i < n && !progress; ++i) progress = w->fibers[i]->state == RUNNABLE;  // yielded
    if (progress) { w->in_fiber = true; continue; }
    for (uint32_t s = 0; s < nsg; ++s) {  // a simdgroup op completes when all its live lanes arrived
      uint32_t lo = s * kSimdWidth, hi = std::min(n, lo + kSimdWidth);
      uint32_t mask = 0, n_simd = 0, n_live = 0;
      int op = 0; uint32_t seq = 0, first = 0, other = 0; bool mismatch = false;
      for (uint32_t i = lo; i < hi; ++i) {
        Fiber* f = w->fibers[i];
        if (f->state == DONE) continue;
        ++n_live;
        if (f->state != AT_SIMD) continue;
        if (n_simd == 0) { op = f->simd_op; seq = f->simd_seq; first = i; }
        else if (!mismatch && (f->simd_op != op || f->simd_seq != seq || !(f->site == w->fibers[first]->site))) {
          mismatch = true;
          other = i;
        }
        ++n_simd;
        mask |= 1u << (i - lo);
      }
      if (n_simd == 0) continue;
      if (mismatch)
        return abandon("lanes of simdgroup " + std::to_string(s) + " in " + group_str(tg) +
                       " reached different simdgroup operations: lane " + std::to_string(first - lo) + " at " +
                       w->fibers[first]->site.str() + ", lane " + std::to_string(other - lo) + " at " +
                       w->fibers[other]->site.str() +
                       " (undefined behaviour in Metal: simd_* calls must be in uniform control flow, every "
                       "live lane at the same call)");
      if (n_simd < n_live)
        return abandon("deadlock in " + group_str(tg) + ": some lanes of simdgroup " + std::to_string(s) +
                       " wait in a simd_* operation while others wait at a threadgroup_barrier");
      w->simd[s].active[(seq - 1) & 1] = mask;
      for (uint32_t i = lo; i < hi; ++i) if (w->fibers[i]->state == AT_SIMD) w->fibers[i]->state = RUNNABLE;
      progress = true;
    }
    if (progress) { w->in_fiber = true; continue; }
    // Everyone alive is at a threadgroup barrier: it opens only if NO thread of the group returned.
    if (n_done > 0) {
      uint32_t first_done = 0;
      while (w->fibers[first_done]->state != DONE) ++first_done;
      return abandon("in " + group_str(tg) + ", thread_index_in_threadgroup " + std::to_string(first_done) +
                     " returned while " + std::to_string(n_bar) +
                     " other threads wait at a threadgroup_barrier (undefined behaviour in Metal: every thread "
                     "must reach every barrier; never return early before a barrier, mask the work instead, "
                     "and keep barriers out of divergent control flow)");
    }
    for (uint32_t i = 1; i < n; ++i)
      if (!(w->fibers[i]->site == w->fibers[0]->site))
        return abandon("in " + group_str(tg) + ", threads reached different threadgroup_barrier calls: "
                       "thread_index_in_threadgroup 0 at " + w->fibers[0]->site.str() + ", " + std::to_string(i) +
                       " at " + w->fibers[i]->site.str() +
                       " (undefined behaviour in Metal: every thread must reach the same barrier; keep barriers "
                       "out of divergent control flow)");
    bool fence = true;  // the barrier orders threadgroup memory only if every thread asked for it
    for (uint32_t i = 0; i < n; ++i) fence = fence && (w->fibers[i]->barrier_flags & 2);  // mem_threadgroup
    ++w->barriers;
    if (fence) w->fenced = w->barriers;
    else w->weak_barrier = w->fibers[0]->site;
    for (uint32_t i = 0; i < n; ++i) w->fibers[i]->state = RUNNABLE;
    w->in_fiber = true;
  }
}

inline bool run_group_plain(Worker* w, const uint32_t tg[3], const uint32_t actual[3]) {
  Dispatch& d = *w->d;
  uint32_t n = actual[0] * actual[1] * actual[2];
  Pos p;
  shuffle_order(w->order, n, mix64(d.seed ^ mix64(w->group_linear * 0x100000001B3ull)));
  try {
    for (uint32_t i : w->order) { fill_pos(d, tg, actual, i, p); d.body(d.args, p); }
  } catch (const KernelError& e) {
    d.fail(e.msg);
    return false;
  }
  return true;
}

inline void worker_loop(Dispatch* d) {
  Worker w;
  w.d = d;
  Worker* saved = tls_worker;
  tls_worker = &w;
  for (;;) {
    if (d->failed) break;
    uint64_t g = d->next.fetch_add(1);
    if (g >= d->total_groups) break;
    uint32_t tg[3] = {uint32_t(g % d->ngroups[0]), uint32_t((g / d->ngroups[0]) % d->ngroups[1]),
                      uint32_t(g / (uint64_t(d->ngroups[0]) * d->ngroups[1]))};
    uint32_t actual[3];
    for (int k = 0; k < 3; ++k) actual[k] = std::min(d->group[k], d->grid[k] - tg[k] * d->group[k]);
    w.group_linear = g;
    bool ok = d->fibers ? run_group_fibers(&w, tg, actual) : run_group_plain(&w, tg, actual);
    if (!ok) break;
  }
  for (int k = 0; k < N_COUNTS; ++k) if (w.count[k]) g_count[k].fetch_add(w.count[k]);
  tls_worker = saved;
}

inline thread_local std::string last_error;

// The entry point every generated launch_<kernel> calls. Returns 0 on success.
inline int dispatch(Body body, void** args, const int64_t* grid, const int64_t* group, int n_os_threads,
                    int use_fibers, uint64_t seed) {
  Dispatch d;
  d.body = body; d.args = args; d.fibers = use_fibers != 0; d.total_groups = 1;
  d.seed = seed; d.poison = (seed & 1) ? 0x7F : 0xFF;
  for (int k = 0; k < 3; ++k) {
    d.grid[k] = uint32_t(grid[k]);
    d.group[k] = uint32_t(group[k]);
    d.ngroups[k] = (d.grid[k] + d.group[k] - 1) / d.group[k];
    d.total_groups *= d.ngroups[k];
  }
  if (d.total_groups == 0) return 0;
  int nt = int(std::min<uint64_t>(std::max(1, n_os_threads), d.total_groups));
  std::vector<std::thread> threads;
  for (int t = 1; t < nt; ++t) threads.emplace_back(worker_loop, &d);
  worker_loop(&d);  // the calling thread works too
  for (auto& t : threads) t.join();
  if (d.failed) { last_error = d.err; return 1; }
  return 0;
}

// Publishes w->tg's blocks to the threadgroup-switch hooks; not instrumented (a hook between the two stores
// would see half an update).
#ifdef MSL_EMU_TG_SWITCH
__attribute__((no_sanitize_thread))
#endif
inline void set_tg_view(Worker* w) {
  TgBlock* data = w->tg.data();  // the calls are instrumented: before the stores
  size_t n = w->tg.size();
  w->tg_begin = data;
  w->tg_end = data + n;
}

// Storage of the threadgroup array declared at `slot`, for the group this OS thread runs now. The
// first thread of a group to reach the declaration fills it with the poison byte (0xFF: float NaN,
// int -1; 0x7F with an odd seed: float 3.4e38, int 2139062143), so a read before any write shows.
// Each array is its own heap block, so AddressSanitizer also catches threadgroup out-of-bounds.
// Not instrumented in the threadgroup-switch build: a hook between its stores would see half an update.
MSL_EMU_NO_TSAN inline void* tg_array(int slot, size_t bytes) {
  Worker* w = tls_worker;
  if (w->tg.size() <= size_t(slot)) w->tg.resize(slot + 1);
  set_tg_view(w);
  TgBlock& b = w->tg.data()[slot];
  if (b.bytes != bytes) {
    b.bytes = 0;  // out of the hooks' view while it moves
    std::free(b.ptr);
    std::free(b.writes);
    if (posix_memalign(&b.ptr, 64, bytes ? bytes : 1) != 0) b.ptr = nullptr;
#ifdef MSL_EMU_TG_SWITCH
    b.writes = static_cast<TgWrite*>(std::malloc(sizeof(TgWrite) * (bytes / 4 + 1)));
#endif
    b.bytes = bytes;
    b.gen = ~0ull;
  }
  if (b.gen != w->group_linear) {
    std::memset(b.ptr, w->d->poison, bytes);
    if (b.writes) std::memset(b.writes, 0xFF, sizeof(TgWrite) * (bytes / 4 + 1));  // writer -1
    b.gen = w->group_linear;
  }
  return b.ptr;
}

#ifdef MSL_EMU_TG_SWITCH
// The threadgroup-switch build (SPLAT_METAL_EMU_TG_SWITCH=1): g++'s -fsanitize=thread instruments every
// load, store and atomic of the library with a call to a __tsan_* hook; this shim defines the hooks itself
// (no ThreadSanitizer runtime is linked) and yields the thread to the group scheduler before every access to
// the group's threadgroup memory. The next thread of the round's shuffled order runs until its own next
// access: a non-atomic read-modify-write of threadgroup memory between barriers (`tg[0] += 1`) then loses
// updates as it can on a GPU, instead of running whole.
//
// It also checks mem_flags: a plain load of a word another simdgroup's thread stored before a barrier
// without mem_flags::mem_threadgroup, and no barrier with it since, is refused (Metal orders threadgroup
// memory across a barrier only with that flag; atomics are not checked).
__attribute__((no_sanitize_thread)) inline const TgBlock* tg_block_of(const Worker* w, const volatile void* p) {
  const char* c = (const char*)p;  // no std:: calls here: they are instrumented and would call back
  for (const TgBlock* b = w->tg_begin; b != w->tg_end; ++b)
    if (c >= (const char*)b->ptr && c < (const char*)b->ptr + b->bytes) return b;
  return nullptr;
}
enum TgAccess { TG_LOAD, TG_STORE, TG_ATOMIC };
__attribute__((no_sanitize_thread)) inline void tg_access(const volatile void* p, TgAccess how = TG_ATOMIC) {
  Worker* w = tls_worker;
  if (!w || !w->in_fiber || !w->cur || w->cur->switching) return;
  const TgBlock* b = tg_block_of(w, p);
  if (!b) return;
  Fiber* f = w->cur;
  if (b->writes && how != TG_ATOMIC) {
    TgWrite& rec = b->writes[((const char*)p - (const char*)b->ptr) / 4];
    if (how == TG_STORE) {
      rec.writer = int32_t(f->pos.tidx);
      rec.barrier = w->barriers;
    } else if (rec.writer >= 0 && uint32_t(rec.writer) / kSimdWidth != f->pos.sgidx &&
               w->barriers > rec.barrier && w->fenced <= rec.barrier && w->tg_error.empty()) {
      w->tg_error = "thread_index_in_threadgroup " + std::to_string(f->pos.tidx) +
                    " reads threadgroup memory that thread " + std::to_string(rec.writer) +
                    " wrote before the threadgroup_barrier at " + w->weak_barrier.str() +
                    ", whose mem_flags lack mem_flags::mem_threadgroup (Metal does not order threadgroup "
                    "memory across it: pass mem_flags::mem_threadgroup)";
    }
  }
  f->switching = true;  // block()'s own accesses are instrumented too
  block(RUNNABLE);
  f->switching = false;
}
#endif

inline void count_atomic(const volatile void* p) {
  Worker* w = tls_worker;
  if (!w) return;
  const char* c = (const char*)p;
  for (const TgBlock& b : w->tg)
    if (c >= (const char*)b.ptr && c < (const char*)b.ptr + b.bytes) { ++w->count[THREADGROUP_ATOMICS]; return; }
  ++w->count[DEVICE_ATOMICS];
}
// Scalar components a simd reduction of a T performs (a Metal simd_sum reduces each component: a float3 is 3,
// not its 16 bytes / 4); 8-byte scalars count 2.
template <class T> struct reduced_components { static constexpr int64_t n = sizeof(T) / 4 ? sizeof(T) / 4 : 1; };
template <class T, int N> struct reduced_components<metal::vec<T, N>> {
  static constexpr int64_t n = N * reduced_components<T>::n;
};

// Counts a simdgroup op once: by its first live lane.
inline void count_simd(const SimdSlots& s, int par, Count what, int64_t n) {
  if (tls_worker->cur->pos.lane == uint32_t(__builtin_ctz(s.active[par]))) count(what, n);
}
// A simdgroup reduction of a T: its scalar components, and one call.
template <class T> inline void count_reduction(const SimdSlots& s, int par) {
  count_simd(s, par, SIMD_REDUCTIONS, reduced_components<T>::n);
  count_simd(s, par, SIMD_REDUCTION_OPS, 1);
}

// ---- the per-thread side of barriers and simd ops ----
inline Fiber* current_fiber(const char* what) {
  Worker* w = tls_worker;
  if (!w || !w->in_fiber) no_fiber_error(what);
  return w->cur;
}

// Store this lane's value, wait for the whole simdgroup, then read everybody's values.
// Slots are double-buffered by op parity: a fast lane may already write op k+1 while a slow lane
// still reads op k, but it cannot reach op k+2 before the slow lane arrives at k+1.
template <class T> inline SimdSlots& simd_exchange(const char* what, int op, T v, int32_t arg, int& par,
                                                    const Site& site) {
  static_assert(sizeof(T) <= 16, "simd op value too large");
  Fiber* f = current_fiber(what);
  Worker* w = tls_worker;
  SimdSlots& s = w->simd[f->pos.sgidx];
  par = f->simd_seq & 1;
  std::memcpy(s.val[par][f->pos.lane], &v, sizeof(T));
  s.arg[par][f->pos.lane] = arg;
  ++f->simd_seq;
  block(AT_SIMD, op, site);
  return s;
}
template <class T> inline T slot(const SimdSlots& s, int par, uint32_t lane) {
  T v; std::memcpy(&v, s.val[par][lane], sizeof(T)); return v;
}

}  // namespace msl_emu

namespace metal {
inline void threadgroup_barrier(mem_flags flags, msl_emu::Site site) {
  msl_emu::Fiber* f = msl_emu::current_fiber("threadgroup_barrier");
  f->barrier_flags = int(flags);
  if (f->pos.tidx == 0) msl_emu::count(msl_emu::BARRIERS);
  msl_emu::block(msl_emu::AT_BARRIER, 0, site);
}
inline void simdgroup_barrier(mem_flags, msl_emu::Site site) {
  int par;
  msl_emu::simd_exchange("simdgroup_barrier", msl_emu::OP_BARRIER, 0, 0, par, site);
}

#define MSL_SIMD_REDUCE(name, OP, init, combine)                                                    \
  template <class T> inline T name(T v, msl_emu::Site site = msl_emu::Site::here()) {               \
    int par; auto& s = msl_emu::simd_exchange(#name, msl_emu::OP, v, 0, par, site);                  \
    msl_emu::count_reduction<T>(s, par);    \
    bool first = true; T r = v;                                                                     \
    for (uint32_t l = 0; l < 32; ++l) if (s.active[par] >> l & 1) {                                 \
      T x = msl_emu::slot<T>(s, par, l);                                                            \
      if (first) { r = x; first = false; } else { r = combine; } }                                  \
    return r; }
MSL_SIMD_REDUCE(simd_sum, OP_SUM, 0, r + x)
MSL_SIMD_REDUCE(simd_max, OP_MAX, 0, max(r, x))
MSL_SIMD_REDUCE(simd_min, OP_MIN, 0, min(r, x))
#undef MSL_SIMD_REDUCE

template <class T> inline T simd_prefix_exclusive_sum(T v, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_prefix_exclusive_sum", msl_emu::OP_PREFIX_EX, v, 0, par, site);
  msl_emu::count_reduction<T>(s, par);
  uint32_t me = msl_emu::tls_worker->cur->pos.lane;
  T r = T(0);
  for (uint32_t l = 0; l < me; ++l) if (s.active[par] >> l & 1) r = r + msl_emu::slot<T>(s, par, l);
  return r;
}
template <class T> inline T simd_prefix_inclusive_sum(T v, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_prefix_inclusive_sum", msl_emu::OP_PREFIX_IN, v, 0, par, site);
  msl_emu::count_reduction<T>(s, par);
  uint32_t me = msl_emu::tls_worker->cur->pos.lane;
  T r = T(0);
  for (uint32_t l = 0; l <= me; ++l) if (s.active[par] >> l & 1) r = r + msl_emu::slot<T>(s, par, l);
  return r;
}
// Reading a lane that does not exist or has returned is undefined in Metal; here it yields the
// caller's own value (also what shuffle_down/up give at the edge of the simdgroup).
#define MSL_SIMD_SHUFFLE(name, OP, src_expr)                                                        \
  template <class T> inline T name(T v, nd<uint> a, msl_emu::Site site = msl_emu::Site::here()) {   \
    int par; auto& s = msl_emu::simd_exchange(#name, msl_emu::OP, v, int32_t(a), par, site);         \
    msl_emu::count_simd(s, par, msl_emu::SIMD_SHUFFLES, 1);                                         \
    int64_t me = msl_emu::tls_worker->cur->pos.lane; int64_t src = (src_expr);                       \
    if (src < 0 || src >= 32 || !(s.active[par] >> src & 1)) return v;                              \
    return msl_emu::slot<T>(s, par, uint32_t(src)); }
MSL_SIMD_SHUFFLE(simd_shuffle, OP_SHUFFLE, int64_t(a))
MSL_SIMD_SHUFFLE(simd_broadcast, OP_BROADCAST, int64_t(a))
MSL_SIMD_SHUFFLE(simd_shuffle_down, OP_SHUFFLE_DOWN, me + int64_t(a))
MSL_SIMD_SHUFFLE(simd_shuffle_up, OP_SHUFFLE_UP, me - int64_t(a))
MSL_SIMD_SHUFFLE(simd_shuffle_xor, OP_SHUFFLE_XOR, me ^ int64_t(a))
#undef MSL_SIMD_SHUFFLE

template <class T> inline T simd_broadcast_first(T v, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_broadcast_first", msl_emu::OP_BROADCAST_FIRST, v, 0, par, site);
  msl_emu::count_simd(s, par, msl_emu::SIMD_SHUFFLES, 1);
  return msl_emu::slot<T>(s, par, uint32_t(__builtin_ctz(s.active[par])));
}

struct simd_vote {
  typedef ulong vote_t;
  vote_t v, active_;
  explicit operator vote_t() const { return v; }
  bool any() const { return v != 0; }
  bool all() const { return (v & active_) == active_; }  // all active lanes voted true
};
inline simd_vote simd_ballot(bool b, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_ballot", msl_emu::OP_BALLOT, b, 0, par, site);
  msl_emu::count_simd(s, par, msl_emu::SIMD_SHUFFLES, 1);
  ulong r = 0;
  for (uint32_t l = 0; l < 32; ++l) if ((s.active[par] >> l & 1) && msl_emu::slot<bool>(s, par, l)) r |= 1ul << l;
  return simd_vote{r, ulong(s.active[par])};
}
inline simd_vote simd_active_threads_mask(msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_active_threads_mask", msl_emu::OP_BALLOT, true, 0, par, site);
  return simd_vote{ulong(s.active[par]), ulong(s.active[par])};
}
inline bool simd_any(bool b, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_any", msl_emu::OP_ANY, b, 0, par, site);
  msl_emu::count_simd(s, par, msl_emu::SIMD_SHUFFLES, 1);
  for (uint32_t l = 0; l < 32; ++l) if ((s.active[par] >> l & 1) && msl_emu::slot<bool>(s, par, l)) return true;
  return false;
}
inline bool simd_all(bool b, msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_all", msl_emu::OP_ALL, b, 0, par, site);
  msl_emu::count_simd(s, par, msl_emu::SIMD_SHUFFLES, 1);
  for (uint32_t l = 0; l < 32; ++l) if ((s.active[par] >> l & 1) && !msl_emu::slot<bool>(s, par, l)) return false;
  return true;
}
inline bool simd_is_first(msl_emu::Site site = msl_emu::Site::here()) {
  int par; auto& s = msl_emu::simd_exchange("simd_is_first", msl_emu::OP_BROADCAST_FIRST, 0, 0, par, site);
  return msl_emu::tls_worker->cur->pos.lane == uint32_t(__builtin_ctz(s.active[par]));
}
}  // namespace metal

#ifdef MSL_EMU_TG_SWITCH
// The hooks -fsanitize=thread calls (see tg_access). Atomics do the operation itself (sequentially
// consistent: stronger than any order Metal offers), after the switch.
#define MSL_EMU_NOTSAN extern "C" __attribute__((no_sanitize_thread, visibility("default")))
MSL_EMU_NOTSAN void __tsan_init() {}
MSL_EMU_NOTSAN void __tsan_func_entry(void*) {}
MSL_EMU_NOTSAN void __tsan_func_exit() {}
MSL_EMU_NOTSAN void __tsan_vptr_update(void**, void*) {}
MSL_EMU_NOTSAN void __tsan_vptr_read(void**) {}
MSL_EMU_NOTSAN void __tsan_read_range(void* p, unsigned long) { msl_emu::tg_access(p, msl_emu::TG_LOAD); }
MSL_EMU_NOTSAN void __tsan_write_range(void* p, unsigned long) { msl_emu::tg_access(p, msl_emu::TG_STORE); }
MSL_EMU_NOTSAN void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
MSL_EMU_NOTSAN void __tsan_atomic_signal_fence(int) {}
#define MSL_EMU_ACCESS(n)                                                                             \
  MSL_EMU_NOTSAN void __tsan_read##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_LOAD); }             \
  MSL_EMU_NOTSAN void __tsan_write##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_STORE); }           \
  MSL_EMU_NOTSAN void __tsan_unaligned_read##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_LOAD); }   \
  MSL_EMU_NOTSAN void __tsan_unaligned_write##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_STORE); } \
  MSL_EMU_NOTSAN void __tsan_volatile_read##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_LOAD); }    \
  MSL_EMU_NOTSAN void __tsan_volatile_write##n(void* p) { msl_emu::tg_access(p, msl_emu::TG_STORE); }
MSL_EMU_ACCESS(1)
MSL_EMU_ACCESS(2)
MSL_EMU_ACCESS(4)
MSL_EMU_ACCESS(8)
MSL_EMU_ACCESS(16)
#undef MSL_EMU_ACCESS
#define MSL_EMU_ATOMICS(bits, T)                                                                      \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_load(const volatile T* a, int) {                             \
    msl_emu::tg_access(a); return __atomic_load_n(a, __ATOMIC_SEQ_CST); }                             \
  MSL_EMU_NOTSAN void __tsan_atomic##bits##_store(volatile T* a, T v, int) {                          \
    msl_emu::tg_access(a); __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }                                \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) {                          \
    msl_emu::tg_access(a); return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }                      \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) {                         \
    msl_emu::tg_access(a); return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }                       \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) {                         \
    msl_emu::tg_access(a); return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }                       \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) {                         \
    msl_emu::tg_access(a); return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }                       \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) {                          \
    msl_emu::tg_access(a); return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                        \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) {                         \
    msl_emu::tg_access(a); return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }                       \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_fetch_nand(volatile T* a, T v, int) {                        \
    msl_emu::tg_access(a); return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); }                      \
  MSL_EMU_NOTSAN int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) { \
    msl_emu::tg_access(a); return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); } \
  MSL_EMU_NOTSAN int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {   \
    msl_emu::tg_access(a); return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); } \
  MSL_EMU_NOTSAN T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {     \
    msl_emu::tg_access(a); __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
    return c; }
MSL_EMU_ATOMICS(8, char)
MSL_EMU_ATOMICS(16, short)
MSL_EMU_ATOMICS(32, int)
MSL_EMU_ATOMICS(64, long)
#undef MSL_EMU_ATOMICS
#endif

// Position attributes: the kernel declares uint, ushort, uint2, uint3 (or ushort2/3); give it that.
namespace msl_emu {
template <class T> struct vec_n { static constexpr int n = 1; };
template <class T, int N> struct vec_n<metal::vec<T, N>> { static constexpr int n = N; };
template <class T> inline T pos_as(const uint32_t v[3]) {
  constexpr int n = vec_n<T>::n;
  static_assert(n <= 3, "position attributes have at most 3 components");
  if constexpr (n == 1) {
    return T(v[0]);
  } else {
    T r;
    for (int k = 0; k < n; ++k) r[k] = decltype(r.x)(v[k]);
    return r;
  }
}
}  // namespace msl_emu

// ================================================================================================
// Part 3: MSL keywords
// ================================================================================================
// The emulator's Python side rewrites each `threadgroup T a[N];` declaration of a kernel body to a
// reference to msl_emu::tg_array(slot, sizeof(T[N])): all fibers of one threadgroup run on the same
// OS thread, one group at a time, so they share it, and other OS threads (other groups) have their
// own. It is poisoned at the start of every group (Metal leaves it undefined). Every other
// `threadgroup` (pointer and reference types, e.g. a helper's `threadgroup float* sh`) expands to
// nothing.
#define kernel
#define device
#define constant const
#define thread
#define threadgroup
