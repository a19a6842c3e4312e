// Vectorisable log1p shared by the fused CPU kernels (_l1_kernel.cpp, _lorentz_kernel.cpp).
// libm's log1p is scalar; this one is an exponent split plus an atanh series, written so that
// gcc vectorises it inside `#pragma omp simd` loops. No -ffast-math: +inf and NaN pass through.
// With AVX2 + FMA, an 8-lane float32 log1p_pos8 without divisions as well (see below).
// curvalign._native.NativeKernel hashes this header with each source that includes it, so an
// edit here rebuilds both kernels.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

#if defined(__AVX2__) && defined(__FMA__)
// log1p(v) on NV vectors of 8 float32 lanes each, in place, v >= 0 (+inf and NaN pass through),
// without a division: the exponent split of log1p_pos, then cephes' logf polynomial for log(m),
// m in [sqrt(1/2), sqrt(2)) (about 1 ulp), and the rounding of 1 + v corrected to first order
// with the approximate reciprocal (relative error 2^-12 on a term below 2^-24: the absolute
// error stays under 2^-35, below float resolution wherever log1p(v) > 2^-11). The divisions of
// log1p_pos cost more than the rest of it where the 256-bit divider is slow. Each step runs
// over all NV vectors, so that their chains of dependent FMAs interleave.
template <int NV>
static inline void log1p_pos8(__m256* v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 a[NV], f[NV], kf[NV], p[NV];
  for (int i = 0; i < NV; ++i) {
    a[i] = _mm256_add_ps(one, v[i]);
    const __m256i bits = _mm256_castps_si256(a[i]);
    const __m256i k =
        _mm256_srai_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x3f3504f3)), 23);
    f[i] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32(k, 23))),
                         one);
    kf[i] = _mm256_cvtepi32_ps(k);
    p[i] = _mm256_set1_ps(7.0376836292e-2f);
  }
  static constexpr float C[8] = {-1.1514610310e-1f, 1.1676998740e-1f,  -1.2420140846e-1f,
                                 1.4249322787e-1f,  -1.6668057665e-1f, 2.0000714765e-1f,
                                 -2.4999993993e-1f, 3.3333331174e-1f};
  for (int n = 0; n < 8; ++n)
    for (int i = 0; i < NV; ++i) p[i] = _mm256_fmadd_ps(p[i], f[i], _mm256_set1_ps(C[n]));
  for (int i = 0; i < NV; ++i) {
    // log(m) = f - f^2/2 + f^3 P(f) = f + f^2 (f P(f) - 1/2)
    const __m256 t = _mm256_fmsub_ps(p[i], f[i], _mm256_set1_ps(0.5f));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(f[i], f[i]), t);
    const __m256 corr =
        _mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_sub_ps(a[i], one)), _mm256_rcp_ps(a[i]));
    const __m256 res = _mm256_fmadd_ps(kf[i], _mm256_set1_ps(0.693147180559945309f),
                                       _mm256_add_ps(f[i], _mm256_add_ps(y, corr)));
    const __m256 finite =
        _mm256_cmp_ps(a[i], _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ);
    v[i] = _mm256_blendv_ps(a[i], res, finite);
  }
}
#endif

}  // namespace curvalign_vecmath
