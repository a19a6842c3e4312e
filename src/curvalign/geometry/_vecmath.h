// Vectorisable log1p shared by the fused CPU kernels (_l1_kernel.cpp, _lorentz_kernel.cpp).
// libm's log1p is scalar; this one is an exponent split plus an atanh series, written so that
// gcc vectorises it inside `#pragma omp simd` loops. No -ffast-math: +inf and NaN pass through.
// curvalign._native.NativeKernel hashes this header with each source that includes it, so an
// edit here rebuilds both kernels.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

namespace curvalign_vecmath {

template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using I = int32_t;
  static constexpr int MANT = 23;
  static constexpr I SQRT_HALF = 0x3f3504f3;  // bits of sqrt(1/2)
  static constexpr int TERMS = 5;             // atanh series to s^9: error < 1e-9
};
template <>
struct Bits<double> {
  using I = int64_t;
  static constexpr int MANT = 52;
  static constexpr I SQRT_HALF = 0x3fe6a09e667f3bcdLL;
  static constexpr int TERMS = 11;  // to s^21: error < 1e-18
};

// sum_{n < TERMS} z^n / (2n + 1), straight-line (Horner) so that the loops vectorise.
template <typename T, int n, int TERMS>
static inline T atanh_series(T z) {
  if constexpr (n == TERMS - 1) {
    return T(1) / T(2 * n + 1);
  } else {
    return T(1) / T(2 * n + 1) + z * atanh_series<T, n + 1, TERMS>(z);
  }
}

template <typename T, typename I>
static inline I to_bits(T x) {
  I i;
  std::memcpy(&i, &x, sizeof(T));
  return i;
}
template <typename T, typename I>
static inline T from_bits(I i) {
  T x;
  std::memcpy(&x, &i, sizeof(T));
  return x;
}

// log1p(v) for v >= 0 (or +inf / NaN, passed through).
template <typename T>
static inline T log1p_pos(T v) {
  using I = typename Bits<T>::I;
  constexpr T LN2 = T(0.693147180559945309417232121458176568);
  const T a = T(1) + v;
  // a = 2^e * m with m in [sqrt(1/2), sqrt(2))
  const I bits = to_bits<T, I>(a);
  const I k = (bits - Bits<T>::SQRT_HALF) >> Bits<T>::MANT;
  const T m = from_bits<T, I>(bits - (k << Bits<T>::MANT));
  const T f = m - T(1);
  const T s = f / (T(2) + f);
  const T z = s * s;
  const T loga = T(k) * LN2 + T(2) * s * atanh_series<T, 0, Bits<T>::TERMS>(z);
  // the rounding of 1 + v corrected to first order
  const T res = loga + (v - (a - T(1))) / a;
  return a <= std::numeric_limits<T>::max() ? res : a;  // +inf and NaN pass through
}

}  // namespace curvalign_vecmath
