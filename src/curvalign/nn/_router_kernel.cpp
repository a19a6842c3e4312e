// Fused CPU kernel for AGR's pairwise router MLP (curvalign.nn._fused_router).
//
// Per pair (row t, column i) of an [Nt, Ni] score matrix, with the LayerNorm folded into the
// first layer (curvalign.nn.router, module docstring):
//   mean = (se + sh + st_t + si_i) / D,  var = (se^2 + sh^2 + qt_t + qi_i) / D - mean^2   (double)
//   rstd = (max(var, 0) + eps)^-1/2
//   u_k  = se wE_k + sh wH_k - mean k_k + TP_tk + IP_ik,   h1_k = u_k rstd + c_k       (k < H1)
//   d1_k = m1_k gelu(h1_k);  h2_j = b2_j + sum_k W2_jk d1_k;  d2_j = m2_j gelu(h2_j)   (j < H2)
//   out  = b3 + sum_j w3_j d2_j
// gelu is the exact erf form (nn.GELU()); m are inverted-dropout masks in {0, scale}.
//
// Nothing per pair is stored between the passes: the backward recomputes the hidden units of a
// tile of 8 pairs (one row, 8 consecutive columns: the SIMD lanes) in L1, then back-propagates
// through them, accumulating the parameter gradients per thread (per row in T, then in double).
// The dropout masks are a hash of (seed, row, column, unit), so the backward replays exactly
// the forward's masks, whatever the threads or the order of the tiles. Each 32-bit hash gives
// two 16-bit words; a unit is dropped where its word is below thr (p rounded to 2^-16, the
// scale 1 / (1 - thr / 2^16) exact: the distribution of curvalign.nn.router.BitDropout).
//
// float: a division-free GELU (gelu_block: Phi from exp(-x^2 / 2) times a polynomial, its
// exponential shared with gelu'; the forward's value alone from one power of two of a
// polynomial; within 2e-7 of the exact GELU), applied to a whole layer of the tile at once,
// several vectors interleaved, so that independent units' dependency chains overlap.
// double: libm's erf and exp (the float64 path is for tests; it is exact, not fast).
// Tiles go two at a time through the layer-2 products (one broadcast weight serves both), and
// under AVX2 + FMA the GELU loops, those products and the dW2 update are written in intrinsics
// that do the portable loops' operations in the same order (the same results).
//
// Layouts (C-contiguous): se, sh, out, gout [Nt, Ni]; st, qt [Nt], si, qi [Nip] (double);
// TP [Nt, H1]; IP [Nip / 8, H1, 8] (image rows interleaved by 8: one tile's rows are 2 KB of
// contiguous memory); SM [4, H1] = (wE, wH, k, c); W2 [H2, H1], W2T [H1, H2]; b2, w3 [H2].
// H1 and H2 are multiples of 8 (zero-padded by the caller), Nip = Ni rounded up to 8.
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#define CURVALIGN_AVX2_FMA 1
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t L = 8;   // pairs per tile: SIMD lanes
constexpr int64_t JB = 8;  // units per register block of the layer-2 products
constexpr int GELU_U = 4;  // vectors a GELU loop iteration interleaves (AVX2)
constexpr int64_t S = 8;   // tiles whose d1 and gh2 are buffered for one dW2 update (backward)

// a * b + c as one fused multiply-add where the build targets FMA (the kernels are compiled
// with -std=c++17, under which gcc does not contract a * b + c on its own)
template <typename T>
inline T fmadd(T a, T b, T c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// ---- hash-based dropout masks ------------------------------------------------------------
inline uint32_t mix32(uint32_t x) {  // a bijective 32-bit mixer ("lowbias32")
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
inline uint32_t row_key(int64_t t, uint32_t seed_lo) {
  return mix32(uint32_t(t) * 0x9E3779B9U ^ seed_lo);
}
inline uint32_t pair_key(uint32_t rk, int64_t i, uint32_t seed_hi) {
  return mix32(rk ^ mix32(uint32_t(i) * 0x85EBCA6BU ^ seed_hi));
}
// group g holds units 2g and 2g + 1 (layer 1: k; layer 2: H1 + j)
inline uint32_t group_key(int64_t g) { return mix32(uint32_t(g) * 0xC2B2AE35U + 0x165667B1U); }

// The inverted-dropout multipliers of units 2g, 2g + 1 for the tile's 8 pairs: 0 or scale.
template <typename T>
inline void group_masks(const uint32_t* __restrict pk, int64_t g, int32_t thr, T scale,
                        T* __restrict m0, T* __restrict m1) {
  const uint32_t gk = group_key(g);
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    const uint32_t w = mix32(pk[l] ^ gk);
    m0[l] = int32_t(w & 0xFFFFU) >= thr ? scale : T(0);
    m1[l] = int32_t(w >> 16) >= thr ? scale : T(0);
  }
}

// ---- GELU (value and derivative) over L lanes --------------------------------------------
inline void exp_lanes(const float* __restrict x, float* __restrict out) {
  constexpr float LOG2E = 1.44269504088896341f, C1 = 0.693359375f, C2 = -2.12194440e-4f;
  float n[L], p[L], s[L];
  uint32_t b[L];
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    float v = x[l] < -87.3f ? -87.3f : x[l];  // NaN passes through both selects
    v = v > 88.3f ? 88.3f : v;
    const float k = (v * LOG2E + 12582912.0f) - 12582912.0f;  // round to nearest
    float r = fmadd(-k, C1, v);
    r = fmadd(-k, C2, r);
    float q = 1.9875691500e-4f;
    q = fmadd(q, r, 1.3981999507e-3f);
    q = fmadd(q, r, 8.3334519073e-3f);
    q = fmadd(q, r, 4.1665795894e-2f);
    q = fmadd(q, r, 1.6666665459e-1f);
    q = fmadd(q, r, 5.0000001201e-1f);
    p[l] = fmadd(q * r, r, r + 1.0f);
    n[l] = k;
  }
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) b[l] = uint32_t(int32_t(n[l]) + 127) << 23;
  std::memcpy(s, b, sizeof(s));
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) out[l] = p[l] * s[l];
}

// GELU and its derivative over a block of n values (n a multiple of L), without division
// or branch (the loop vectorises; a whole layer at once keeps several units in flight):
//   Phi(x) = 1 - Q(|x|) for x >= 0 and Q(|x|) for x < 0,   Q(a) = exp(-a^2 / 2) M(a),
// M(a) = Q(a) e^(a^2 / 2) (half the scaled complementary error function erfcx(a / sqrt 2)) by a
// degree-11 polynomial fitted on [0, 6] to minimise the error of Phi weighted by max(1, a);
// beyond |x| = 5 (where the fit, weighted by exp(-a^2 / 2), leaves M's shape) M is held at its
// value at 5 (within 1% of M(5); Q(5) = 3e-7, so Q's error stays below 1e-8). The error of
// Phi is below 2e-7 and that of gelu = x Phi below 2e-7 max(1, |x|) (torch's vectorised float
// GELU uses A&S 7.1.26, whose erf is within 1.5e-7); tests/test_router_fused.py bounds both
// against the exact GELU. The exponential is shared with the density: gelu' = Phi + x phi,
// phi = exp(-x^2 / 2) / sqrt(2 pi). exp(-x^2 / 2) = 2^t: k the nearest integer to t, a degree-5
// polynomial of 2^(t - k) (relative error 2.3e-7 in float), k added to the exponent bits. Both
// polynomials by Estrin's scheme: independent products, short dependency chains (the latency
// of a long Horner chain, not the count of multiply-adds, bounded this loop).
inline float bits_to_float(uint32_t b) { return __builtin_bit_cast(float, b); }
inline uint32_t float_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

template <bool GRAD>
inline void gelu_block_portable(const float* __restrict x, float* __restrict y,
                                float* __restrict dy, int64_t n0, int64_t n) {
  constexpr float NEG_HALF_LOG2E = -0.72134752044448170368f, BETA = 0.39894228040143267794f;
#pragma omp simd
  for (int64_t l = n0; l < n; ++l) {
    const float v = x[l];
    const float a = std::fabs(v);
    const float ac = a < 5.0f ? a : 5.0f;  // NaN: 5 here, and v carries it into y and dy
    // e = exp(-v^2 / 2) = 2^t, t in [-125, 0]
    float t = (v * v) * NEG_HALF_LOG2E;
    t = t > -125.0f ? t : -125.0f;
    const float k = (t + 12582912.0f) - 12582912.0f;  // round to nearest
    const float f = t - k;                            // [-0.5, 0.5]
    const float f2 = f * f;
    const float p01 = fmadd(6.931469673e-01f, f, 1.000000071e+00f);
    const float p23 = fmadd(5.550713317e-02f, f, 2.402212059e-01f);
    const float p45 = fmadd(1.327632099e-03f, f, 9.675496566e-03f);
    const float p = fmadd(fmadd(p45, f2, p23), f2, p01);
    const float e = bits_to_float(float_to_bits(p) + (uint32_t(int32_t(k)) << 23));
    // M(ac)
    const float a2 = ac * ac, a4 = a2 * a2;
    const float m01 = fmadd(-3.989393346e-01f, ac, 4.999999676e-01f);
    const float m23 = fmadd(-1.327188551e-01f, ac, 2.499555720e-01f);
    const float m45 = fmadd(-2.514752086e-02f, ac, 6.170143967e-02f);
    const float m67 = fmadd(-2.429460693e-03f, ac, 8.715895730e-03f);
    const float m89 = fmadd(-7.273314113e-05f, ac, 5.072860895e-04f);
    const float mab = fmadd(-2.440394372e-07f, ac, 6.283735582e-06f);
    const float m03 = fmadd(m23, a2, m01);
    const float m47 = fmadd(m67, a2, m45);
    const float m8b = fmadd(mab, a2, m89);
    const float m = fmadd(fmadd(m8b, a4, m47), a4, m03);
    const float q = e * m;
    const float cdf = v < 0.0f ? q : 1.0f - q;
    y[l] = v * cdf;
    if (GRAD) dy[l] = fmadd(v, BETA * e, cdf);
  }
}

#ifdef CURVALIGN_AVX2_FMA
// The same arithmetic in AVX2 intrinsics, operation for operation (the results are identical to
// the portable loop's), U vectors at a time, step by step across them: one vector's chain is
// about 60 cycles of latency, more than the FP scheduler's window overlaps by itself on the
// development machine (one vector at a time ran about 40% slower), and gcc's vectorisation of
// the portable loop also reloads its ~20 constants with a broadcast each iteration.
template <int U>
inline int64_t gelu_block_avx2(const float* __restrict x, float* __restrict y,
                               float* __restrict dy, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), five = _mm256_set1_ps(5.0f);
  const __m256 lo = _mm256_set1_ps(-125.0f), magic = _mm256_set1_ps(12582912.0f);
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  auto c = [](float v) { return _mm256_set1_ps(v); };
  int64_t l = 0;
  for (; l + 8 * U <= n; l += 8 * U) {
    __m256 v[U], ac[U], k[U], f[U], e[U], m[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      v[u] = _mm256_loadu_ps(x + l + 8 * u);
      ac[u] = _mm256_min_ps(_mm256_andnot_ps(sign, v[u]), five);  // NaN: 5 (minps: operand 2)
      __m256 t = _mm256_mul_ps(_mm256_mul_ps(v[u], v[u]), c(-0.72134752044448170368f));
      t = _mm256_max_ps(t, lo);  // t > -125 ? t : -125, NaN to -125 as in the portable loop
      k[u] = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
      f[u] = _mm256_sub_ps(t, k[u]);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256 f2 = _mm256_mul_ps(f[u], f[u]);
      const __m256 p01 = _mm256_fmadd_ps(c(6.931469673e-01f), f[u], c(1.000000071e+00f));
      const __m256 p23 = _mm256_fmadd_ps(c(5.550713317e-02f), f[u], c(2.402212059e-01f));
      const __m256 p45 = _mm256_fmadd_ps(c(1.327632099e-03f), f[u], c(9.675496566e-03f));
      const __m256 p = _mm256_fmadd_ps(_mm256_fmadd_ps(p45, f2, p23), f2, p01);
      const __m256i ki = _mm256_slli_epi32(_mm256_cvttps_epi32(k[u]), 23);
      e[u] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), ki));
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256 a2 = _mm256_mul_ps(ac[u], ac[u]), a4 = _mm256_mul_ps(a2, a2);
      const __m256 m01 = _mm256_fmadd_ps(c(-3.989393346e-01f), ac[u], c(4.999999676e-01f));
      const __m256 m23 = _mm256_fmadd_ps(c(-1.327188551e-01f), ac[u], c(2.499555720e-01f));
      const __m256 m45 = _mm256_fmadd_ps(c(-2.514752086e-02f), ac[u], c(6.170143967e-02f));
      const __m256 m67 = _mm256_fmadd_ps(c(-2.429460693e-03f), ac[u], c(8.715895730e-03f));
      const __m256 m89 = _mm256_fmadd_ps(c(-7.273314113e-05f), ac[u], c(5.072860895e-04f));
      const __m256 mab = _mm256_fmadd_ps(c(-2.440394372e-07f), ac[u], c(6.283735582e-06f));
      const __m256 m03 = _mm256_fmadd_ps(m23, a2, m01);
      const __m256 m47 = _mm256_fmadd_ps(m67, a2, m45);
      const __m256 m8b = _mm256_fmadd_ps(mab, a2, m89);
      m[u] = _mm256_fmadd_ps(_mm256_fmadd_ps(m8b, a4, m47), a4, m03);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256 q = _mm256_mul_ps(e[u], m[u]);
      const __m256 cdf =
          _mm256_blendv_ps(_mm256_sub_ps(one, q), q, _mm256_cmp_ps(v[u], zero, _CMP_LT_OQ));
      _mm256_storeu_ps(y + l + 8 * u, _mm256_mul_ps(v[u], cdf));
      const __m256 density = _mm256_mul_ps(c(0.39894228040143267794f), e[u]);
      _mm256_storeu_ps(dy + l + 8 * u, _mm256_fmadd_ps(v[u], density, cdf));
    }
  }
  return l;
}
#endif

// GELU's value alone (the forward), with fewer multiply-adds: Q(a) = 2^P(a), P = log2 Q (a
// smooth function: -1 at 0, about -a^2 / (2 ln 2) far out) a degree-8 polynomial fitted on
// [0, 6] with Q's error weighted by max(1, a), held at 6 beyond (Q(6) = 1e-9); one power of two
// instead of an exponential times a degree-11 polynomial. Within 2e-7 max(1, |x|) of the exact
// GELU as gelu_block's value is (the two differ by at most about 3e-7 max(1, |x|): the backward
// recomputes the hidden layers with gelu_block, so it differentiates the forward to that
// rounding; the float64 path computes both exactly).
inline float gelu_value_at(float v) {
  const float a = std::fabs(v);
  const float ac = a < 6.0f ? a : 6.0f;  // NaN: 6 here, and v carries it into the value
  const float a2 = ac * ac, a4 = a2 * a2;
  const float p01 = fmadd(-1.151106947e+00f, ac, -9.999999588e-01f);
  const float p23 = fmadd(-5.254654862e-02f, ac, -4.591930154e-01f);
  const float p45 = fmadd(-2.025847305e-04f, ac, 7.142930818e-03f);
  const float p67 = fmadd(3.295997149e-05f, ac, -1.572379291e-04f);
  const float p03 = fmadd(p23, a2, p01);
  const float p48 = fmadd(-2.275242282e-06f, a4, fmadd(p67, a2, p45));
  const float t = fmadd(p48, a4, p03);  // [-30.1, -1]
  const float k = (t + 12582912.0f) - 12582912.0f;
  const float f = t - k;
  const float f2 = f * f;
  const float e01 = fmadd(6.931469673e-01f, f, 1.000000071e+00f);
  const float e23 = fmadd(5.550713317e-02f, f, 2.402212059e-01f);
  const float e45 = fmadd(1.327632099e-03f, f, 9.675496566e-03f);
  const float e = fmadd(fmadd(e45, f2, e23), f2, e01);
  const float q = bits_to_float(float_to_bits(e) + (uint32_t(int32_t(k)) << 23));
  const float cdf = v < 0.0f ? q : 1.0f - q;
  return v * cdf;
}

inline void gelu_value_portable(const float* __restrict x, float* __restrict y, int64_t n0,
                                int64_t n) {
#pragma omp simd
  for (int64_t l = n0; l < n; ++l) y[l] = gelu_value_at(x[l]);
}

#ifdef CURVALIGN_AVX2_FMA
// U vectors at a time, step by step across them, as gelu_block_avx2
template <int U>
inline int64_t gelu_value_avx2(const float* __restrict x, float* __restrict y, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), six = _mm256_set1_ps(6.0f);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  auto c = [](float v) { return _mm256_set1_ps(v); };
  int64_t l = 0;
  for (; l + 8 * U <= n; l += 8 * U) {
    __m256 v[U], ac[U], a2[U], a4[U], t[U], k[U], f[U], e[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      v[u] = _mm256_loadu_ps(x + l + 8 * u);
      ac[u] = _mm256_min_ps(_mm256_andnot_ps(sign, v[u]), six);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a2[u] = _mm256_mul_ps(ac[u], ac[u]);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a4[u] = _mm256_mul_ps(a2[u], a2[u]);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256 p01 = _mm256_fmadd_ps(c(-1.151106947e+00f), ac[u], c(-9.999999588e-01f));
      const __m256 p23 = _mm256_fmadd_ps(c(-5.254654862e-02f), ac[u], c(-4.591930154e-01f));
      const __m256 p45 = _mm256_fmadd_ps(c(-2.025847305e-04f), ac[u], c(7.142930818e-03f));
      const __m256 p67 = _mm256_fmadd_ps(c(3.295997149e-05f), ac[u], c(-1.572379291e-04f));
      const __m256 p03 = _mm256_fmadd_ps(p23, a2[u], p01);
      const __m256 p48 =
          _mm256_fmadd_ps(c(-2.275242282e-06f), a4[u], _mm256_fmadd_ps(p67, a2[u], p45));
      t[u] = _mm256_fmadd_ps(p48, a4[u], p03);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      k[u] = _mm256_sub_ps(_mm256_add_ps(t[u], magic), magic);
      f[u] = _mm256_sub_ps(t[u], k[u]);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256 f2 = _mm256_mul_ps(f[u], f[u]);
      const __m256 e01 = _mm256_fmadd_ps(c(6.931469673e-01f), f[u], c(1.000000071e+00f));
      const __m256 e23 = _mm256_fmadd_ps(c(5.550713317e-02f), f[u], c(2.402212059e-01f));
      const __m256 e45 = _mm256_fmadd_ps(c(1.327632099e-03f), f[u], c(9.675496566e-03f));
      e[u] = _mm256_fmadd_ps(_mm256_fmadd_ps(e45, f2, e23), f2, e01);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256i ki = _mm256_slli_epi32(_mm256_cvttps_epi32(k[u]), 23);
      const __m256 q = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(e[u]), ki));
      const __m256 cdf =
          _mm256_blendv_ps(_mm256_sub_ps(one, q), q, _mm256_cmp_ps(v[u], zero, _CMP_LT_OQ));
      _mm256_storeu_ps(y + l + 8 * u, _mm256_mul_ps(v[u], cdf));
    }
  }
  return l;
}
#endif

template <bool GRAD>
inline void gelu_block(const float* __restrict x, float* __restrict y, float* __restrict dy,
                       int64_t n) {
#ifdef CURVALIGN_AVX2_FMA
  if (GRAD)
    gelu_block_portable<true>(x, y, dy, gelu_block_avx2<GELU_U>(x, y, dy, n), n);
  else
    gelu_value_portable(x, y, gelu_value_avx2<GELU_U>(x, y, n), n);
#else
  if (GRAD)
    gelu_block_portable<true>(x, y, dy, 0, n);
  else
    gelu_value_portable(x, y, 0, n);
#endif
}

// double: libm's erf and exp (the float64 path is for tests; it is exact, not fast)
template <bool GRAD>
inline void gelu_block(const double* __restrict x, double* __restrict y, double* __restrict dy,
                       int64_t n) {
  constexpr double SQRT1_2 = 0.70710678118654752440, BETA = 0.39894228040143267794;
  for (int64_t l = 0; l < n; ++l) {
    const double cdf = 0.5 * (1.0 + std::erf(x[l] * SQRT1_2));
    y[l] = x[l] * cdf;
    if (GRAD) dy[l] = cdf + x[l] * (BETA * std::exp(-0.5 * x[l] * x[l]));
  }
}

// ---- the problem ----------------------------------------------------------------------------
template <typename T>
struct Router {
  const T *se, *sh;
  const double *st, *qt, *si, *qi;
  const T *TP, *IP, *SM, *W2, *W2T, *b2, *w3;
  T b3;
  int64_t Nt, Ni, Nip, H1, H2;
  double D, eps;
  int32_t thr1, thr2;
  uint32_t seed_lo, seed_hi;
  T scale1, scale2;
};

// Per-tile state: the lanes' inputs, statistics and the hidden layers.
template <typename T>
struct Tile {
  T se[L], sh[L], mean[L], rstd[L];
  double mean_d[L], rstd_d[L];
  bool var_ok[L];
  uint32_t pk[L];
  std::vector<T> u, d1s, g1, h2;  // [H1, L] each (d1s: d1's own slot), [H1, L], [H2, L]
  std::vector<T> h, a, da, m;     // a layer's GELU input, value, derivative; masks [H1 + H2, L]
  T* d1;                          // d1s, or the backward's slot of its buffer of S tiles
  Tile(int64_t H1, int64_t H2)
      : u(H1 * L),
        d1s(H1 * L),
        g1(H1 * L),
        h2(H2 * L),
        h(H1 * L),
        a(std::max(H1, H2) * L),
        da(std::max(H1, H2) * L),
        m((H1 + H2) * L) {
    d1 = d1s.data();
  }
};

template <typename T>
inline void load_tile(const Router<T>& R, Tile<T>& tl, int64_t t, int64_t i0, int64_t nl,
                      uint32_t rk) {
  for (int64_t l = 0; l < L; ++l) {
    const bool ok = l < nl;
    const T se = ok ? R.se[t * R.Ni + i0 + l] : T(0);
    const T sh = ok ? R.sh[t * R.Ni + i0 + l] : T(0);
    const double se64 = double(se), sh64 = double(sh);
    const double mean = (se64 + sh64 + R.st[t] + R.si[i0 + l]) / R.D;
    const double var = (se64 * se64 + sh64 * sh64 + R.qt[t] + R.qi[i0 + l]) / R.D - mean * mean;
    const double rstd = 1.0 / std::sqrt((var < 0.0 ? 0.0 : var) + R.eps);
    tl.se[l] = se;
    tl.sh[l] = sh;
    tl.mean_d[l] = mean;
    tl.rstd_d[l] = rstd;
    tl.var_ok[l] = var >= 0.0;  // clamp_min's gradient mask
    tl.mean[l] = T(mean);
    tl.rstd[l] = T(rstd);
    tl.pk[l] = pair_key(rk, i0 + l, R.seed_hi);
  }
}

// The tile's dropout multipliers (0 or scale) of every hidden unit: tl.m [H1 + H2, L] (H1 is
// a multiple of 8, so no hash group straddles the two layers).
template <typename T>
inline void tile_masks(const Router<T>& R, Tile<T>& tl) {
  const int64_t G = (R.H1 + R.H2) / 2;
  for (int64_t g = 0; g < G; ++g) {
    const bool first = 2 * g < R.H1;
    group_masks(tl.pk, g, first ? R.thr1 : R.thr2, first ? R.scale1 : R.scale2,
                tl.m.data() + 2 * g * L, tl.m.data() + (2 * g + 1) * L);
  }
}

#ifdef CURVALIGN_AVX2_FMA
// float under AVX2: the same hashes and thresholds, four groups a step, interleaved (one
// group's chain of two multiplications and five shifts alone leaves the core idle)
template <>
inline void tile_masks<float>(const Router<float>& R, Tile<float>& tl) {
  static_assert(L == 8, "one __m256 a tile");
  const int64_t G = (R.H1 + R.H2) / 2;
  const __m256i pk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tl.pk));
  const __m256i c1 = _mm256_set1_epi32(int32_t(0x7feb352dU));
  const __m256i c2 = _mm256_set1_epi32(int32_t(0x846ca68bU));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  constexpr int64_t U = 4;
  auto group = [&](int64_t g, __m256i& w) {
    w = _mm256_xor_si256(pk, _mm256_set1_epi32(int32_t(group_key(g))));
  };
  auto store = [&](int64_t g, __m256i w) {
    const bool first = 2 * g < R.H1;
    const __m256i thr = _mm256_set1_epi32(first ? R.thr1 : R.thr2);
    const __m256 scale = _mm256_set1_ps(first ? R.scale1 : R.scale2);
    // dropped where the 16-bit word is below thr: thr > word
    const __m256i d0 = _mm256_cmpgt_epi32(thr, _mm256_and_si256(w, low));
    const __m256i d1 = _mm256_cmpgt_epi32(thr, _mm256_srli_epi32(w, 16));
    _mm256_storeu_ps(tl.m.data() + 2 * g * L, _mm256_andnot_ps(_mm256_castsi256_ps(d0), scale));
    _mm256_storeu_ps(tl.m.data() + (2 * g + 1) * L,
                     _mm256_andnot_ps(_mm256_castsi256_ps(d1), scale));
  };
  int64_t g0 = 0;
  for (; g0 + U <= G; g0 += U) {
    __m256i w[U];
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) group(g0 + u, w[u]);
    // mix32: x ^= x >> 16; x *= c1; x ^= x >> 15; x *= c2; x ^= x >> 16
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) w[u] = _mm256_xor_si256(w[u], _mm256_srli_epi32(w[u], 16));
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) w[u] = _mm256_mullo_epi32(w[u], c1);
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) w[u] = _mm256_xor_si256(w[u], _mm256_srli_epi32(w[u], 15));
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) w[u] = _mm256_mullo_epi32(w[u], c2);
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) w[u] = _mm256_xor_si256(w[u], _mm256_srli_epi32(w[u], 16));
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) store(g0 + u, w[u]);
  }
  for (int64_t g = g0; g < G; ++g) {
    const bool first = 2 * g < R.H1;
    group_masks(tl.pk, g, first ? R.thr1 : R.thr2, first ? R.scale1 : R.scale2,
                tl.m.data() + 2 * g * L, tl.m.data() + (2 * g + 1) * L);
  }
}
#endif

// Layer 1 (folded LayerNorm + fc1), GELU and dropout: tl.d1 (and tl.u, tl.g1 = m gelu'(h1)).
// The pre-activations of the whole layer first, then one GELU pass over them (independent
// units in flight together), then the masks.
template <typename T, bool GRAD, bool DROP>
inline void layer1(const Router<T>& R, Tile<T>& tl, int64_t t, int64_t ib) {
  const int64_t H1 = R.H1;
  const T* tp = R.TP + t * H1;
  const T* ip = R.IP + ib * H1 * L;
  for (int64_t q = 0; q < H1; ++q) {
    const T wE = R.SM[q], wH = R.SM[H1 + q], kq = R.SM[2 * H1 + q], c = R.SM[3 * H1 + q];
    const T tq = tp[q];
    const T* ipq = ip + q * L;
    T* uq = tl.u.data() + q * L;
    T* hq = tl.h.data() + q * L;
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const T uu = fmadd(tl.se[l], wE, fmadd(tl.sh[l], wH, fmadd(-tl.mean[l], kq, tq + ipq[l])));
      if (GRAD) uq[l] = uu;
      hq[l] = fmadd(uu, tl.rstd[l], c);
    }
  }
  gelu_block<GRAD>(tl.h.data(), tl.a.data(), tl.da.data(), H1 * L);
  const T* a = tl.a.data();
  const T* da = tl.da.data();
  const T* m = tl.m.data();
  T* d1 = tl.d1;
  T* g1 = tl.g1.data();
#pragma omp simd
  for (int64_t x = 0; x < H1 * L; ++x) {
    const T mq = DROP ? m[x] : T(1);
    d1[x] = a[x] * mq;
    if (GRAD) g1[x] = da[x] * mq;
  }
}

// out = init + W^T x on one tile of L lanes: W [In, Out] row-major (row i holds the weights
// from input unit i), x [In, L], out [Out, L]; init [Out] or null for zeros. Register blocks
// of JB output units (Out must be a multiple of JB, as the padded hidden widths are).
template <typename T>
inline void lanes_matvec(const T* W, const T* x, const T* init, T* out, int64_t In, int64_t Out) {
  for (int64_t o0 = 0; o0 < Out; o0 += JB) {
    T acc[JB][L];
    for (int64_t oo = 0; oo < JB; ++oo)
      for (int64_t l = 0; l < L; ++l) acc[oo][l] = init ? init[o0 + oo] : T(0);
    for (int64_t i = 0; i < In; ++i) {
      const T* wr = W + i * Out + o0;
      const T* xi = x + i * L;
#pragma GCC unroll 8
      for (int64_t oo = 0; oo < JB; ++oo) {
        const T wv = wr[oo];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[oo][l] = fmadd(wv, xi[l], acc[oo][l]);
      }
    }
    for (int64_t oo = 0; oo < JB; ++oo)
      for (int64_t l = 0; l < L; ++l) out[(o0 + oo) * L + l] = acc[oo][l];
  }
}

// The same product for two tiles at once (xa, xb -> oa, ob): each weight's broadcast serves
// two vectors, blocks of JB2 output units (16 accumulators would spill: 8 do not). About a
// third faster than two calls of lanes_matvec on the development machine; the same operations
// in the same order, so the same results.
template <typename T>
inline void lanes_matvec2(const T* W, const T* xa, const T* xb, const T* init, T* oa, T* ob,
                          int64_t In, int64_t Out) {
  constexpr int64_t JB2 = 4;
  for (int64_t o0 = 0; o0 < Out; o0 += JB2) {
    T aa[JB2][L], ab[JB2][L];
    for (int64_t oo = 0; oo < JB2; ++oo)
      for (int64_t l = 0; l < L; ++l) aa[oo][l] = ab[oo][l] = init ? init[o0 + oo] : T(0);
    for (int64_t i = 0; i < In; ++i) {
      const T* wr = W + i * Out + o0;
      const T* xai = xa + i * L;
      const T* xbi = xb + i * L;
#pragma GCC unroll 4
      for (int64_t oo = 0; oo < JB2; ++oo) {
        const T wv = wr[oo];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          aa[oo][l] = fmadd(wv, xai[l], aa[oo][l]);
          ab[oo][l] = fmadd(wv, xbi[l], ab[oo][l]);
        }
      }
    }
    for (int64_t oo = 0; oo < JB2; ++oo)
      for (int64_t l = 0; l < L; ++l) {
        oa[(o0 + oo) * L + l] = aa[oo][l];
        ob[(o0 + oo) * L + l] = ab[oo][l];
      }
  }
}

#ifdef CURVALIGN_AVX2_FMA
// float under AVX2: the same loop in intrinsics (gcc keeps the plain loop's accumulators in
// registers but schedules the broadcasts worse: about 10% slower on the development machine)
template <>
inline void lanes_matvec2<float>(const float* W, const float* xa, const float* xb,
                                 const float* init, float* oa, float* ob, int64_t In,
                                 int64_t Out) {
  static_assert(L == 8, "one __m256 a tile");
  constexpr int64_t JB2 = 4;
  for (int64_t o0 = 0; o0 < Out; o0 += JB2) {
    __m256 aa[JB2], ab[JB2];
    for (int64_t oo = 0; oo < JB2; ++oo)
      aa[oo] = ab[oo] = _mm256_set1_ps(init ? init[o0 + oo] : 0.0f);
    for (int64_t i = 0; i < In; ++i) {
      const float* wr = W + i * Out + o0;
      const __m256 xai = _mm256_loadu_ps(xa + i * L), xbi = _mm256_loadu_ps(xb + i * L);
#pragma GCC unroll 4
      for (int64_t oo = 0; oo < JB2; ++oo) {
        const __m256 wv = _mm256_broadcast_ss(wr + oo);
        aa[oo] = _mm256_fmadd_ps(wv, xai, aa[oo]);
        ab[oo] = _mm256_fmadd_ps(wv, xbi, ab[oo]);
      }
    }
    for (int64_t oo = 0; oo < JB2; ++oo) {
      _mm256_storeu_ps(oa + (o0 + oo) * L, aa[oo]);
      _mm256_storeu_ps(ob + (o0 + oo) * L, ab[oo]);
    }
  }
}
#endif

// h2 = b2 + W2 d1 on one tile, or on two (tb may be null): [H2, L] each
template <typename T>
inline void layer2(const Router<T>& R, Tile<T>& ta, Tile<T>* tb) {
  if (tb)
    lanes_matvec2<T>(R.W2T, ta.d1, tb->d1, R.b2, ta.h2.data(), tb->h2.data(), R.H1, R.H2);
  else
    lanes_matvec<T>(R.W2T, ta.d1, R.b2, ta.h2.data(), R.H1, R.H2);
}

// acc[j, k, :] += sum_s gh2[s, j, :] d1[s, k, :] for ns buffered tiles: 2 x 4 blocks of
// (j, k) held in registers over the tiles (the accumulator is loaded and stored once per block).
template <typename T>
inline void dW2_update(T* __restrict acc, const T* __restrict gh2, const T* __restrict d1,
                       int64_t ns, int64_t H1, int64_t H2) {
  constexpr int64_t JR = 2, KR = 4;
  for (int64_t j0 = 0; j0 < H2; j0 += JR)
    for (int64_t k0 = 0; k0 < H1; k0 += KR) {
      T a[JR][KR][L];
      for (int64_t jj = 0; jj < JR; ++jj)
        for (int64_t kk = 0; kk < KR; ++kk)
          for (int64_t l = 0; l < L; ++l) a[jj][kk][l] = acc[((j0 + jj) * H1 + k0 + kk) * L + l];
      for (int64_t s = 0; s < ns; ++s) {
        const T* g = gh2 + (s * H2 + j0) * L;
        const T* d = d1 + (s * H1 + k0) * L;
#pragma GCC unroll 2
        for (int64_t jj = 0; jj < JR; ++jj)
#pragma GCC unroll 4
          for (int64_t kk = 0; kk < KR; ++kk)
#pragma omp simd
            for (int64_t l = 0; l < L; ++l)
              a[jj][kk][l] = fmadd(g[jj * L + l], d[kk * L + l], a[jj][kk][l]);
      }
      for (int64_t jj = 0; jj < JR; ++jj)
        for (int64_t kk = 0; kk < KR; ++kk)
          for (int64_t l = 0; l < L; ++l) acc[((j0 + jj) * H1 + k0 + kk) * L + l] = a[jj][kk][l];
    }
}

#ifdef CURVALIGN_AVX2_FMA
// float under AVX2: the same blocks and order in intrinsics (with gcc's code for the plain
// loop the whole backward was about 4% slower on the development machine)
template <>
inline void dW2_update<float>(float* __restrict acc, const float* __restrict gh2,
                              const float* __restrict d1, int64_t ns, int64_t H1, int64_t H2) {
  static_assert(L == 8, "one __m256 a tile");
  constexpr int64_t JR = 2, KR = 4;
  for (int64_t j0 = 0; j0 < H2; j0 += JR)
    for (int64_t k0 = 0; k0 < H1; k0 += KR) {
      __m256 a[JR][KR];
      for (int64_t jj = 0; jj < JR; ++jj)
        for (int64_t kk = 0; kk < KR; ++kk)
          a[jj][kk] = _mm256_loadu_ps(acc + ((j0 + jj) * H1 + k0 + kk) * L);
      for (int64_t s = 0; s < ns; ++s) {
        const float* g = gh2 + (s * H2 + j0) * L;
        const float* d = d1 + (s * H1 + k0) * L;
        const __m256 g0 = _mm256_loadu_ps(g), g1 = _mm256_loadu_ps(g + L);
#pragma GCC unroll 4
        for (int64_t kk = 0; kk < KR; ++kk) {
          const __m256 dk = _mm256_loadu_ps(d + kk * L);
          a[0][kk] = _mm256_fmadd_ps(g0, dk, a[0][kk]);
          a[1][kk] = _mm256_fmadd_ps(g1, dk, a[1][kk]);
        }
      }
      for (int64_t jj = 0; jj < JR; ++jj)
        for (int64_t kk = 0; kk < KR; ++kk)
          _mm256_storeu_ps(acc + ((j0 + jj) * H1 + k0 + kk) * L, a[jj][kk]);
    }
}
#endif

template <typename T, bool DROP>
void forward_rows(const Router<T>& R, T* out, int nthreads) {
  const int64_t Nib = R.Nip / L;
#pragma omp parallel num_threads(nthreads)
  {
    Tile<T> ta(R.H1, R.H2), tb(R.H1, R.H2);
    Tile<T>* tiles[2] = {&ta, &tb};
    T o[L];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R.Nt; ++t) {
      const uint32_t rk = row_key(t, R.seed_lo);
      for (int64_t ib = 0; ib < Nib; ib += 2) {  // two tiles at a time (the last may be alone)
        const int64_t nb = std::min<int64_t>(2, Nib - ib);
        for (int64_t s = 0; s < nb; ++s) {
          Tile<T>& tl = *tiles[s];
          const int64_t i0 = (ib + s) * L, nl = std::min(L, R.Ni - i0);
          load_tile(R, tl, t, i0, nl, rk);
          if (DROP) tile_masks(R, tl);
          layer1<T, false, DROP>(R, tl, t, ib + s);
        }
        layer2(R, ta, nb == 2 ? &tb : nullptr);
        for (int64_t s = 0; s < nb; ++s) {
          Tile<T>& tl = *tiles[s];
          const int64_t i0 = (ib + s) * L, nl = std::min(L, R.Ni - i0);
          gelu_block<false>(tl.h2.data(), tl.a.data(), tl.da.data(), R.H2 * L);
          const T* m2 = tl.m.data() + R.H1 * L;
          for (int64_t l = 0; l < L; ++l) o[l] = R.b3;
          for (int64_t j = 0; j < R.H2; ++j) {
            const T w3 = R.w3[j];
            const T* aj = tl.a.data() + j * L;
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) {
              const T mq = DROP ? m2[j * L + l] : T(1);
              o[l] = fmadd(w3, aj[l] * mq, o[l]);
            }
          }
          for (int64_t l = 0; l < nl; ++l) out[t * R.Ni + i0 + l] = o[l];
        }
      }
    }
  }
}

// Gradients. Per thread: row accumulators in T (lanes kept apart), flushed per row into double
// totals; the image-side gradients in double. Threads own contiguous row ranges; the totals are
// summed in thread order (deterministic for a given thread count).
template <typename T>
struct Grads {
  T *gse, *gsh;  // may be null
  double *gst, *gqt, *gsi, *gqi;
  T *gTP, *gIP, *gSM, *gW2, *gb2, *gw3, *gb3;
};

template <typename T, bool DROP>
void backward_rows(const Router<T>& R, const T* gout, const Grads<T>& G, int nthreads) {
  const int64_t H1 = R.H1, H2 = R.H2, Nib = R.Nip / L;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(nthreads, R.Nt));
  // per-thread double totals: W2 [H2 H1], SM [4 H1], b2 [H2], w3 [H2], b3, IP [Nip H1], si, qi
  const int64_t nW = H2 * H1, nS = 4 * H1, nIP = R.Nip * H1;
  std::vector<std::vector<double>> tot(nth);
#pragma omp parallel num_threads(int(nth))
  {
#pragma omp for schedule(static, 1)
    for (int64_t th = 0; th < nth; ++th) {
      std::vector<double>& acc = tot[th];
      acc.assign(nW + nS + 2 * H2 + 1 + nIP + 2 * R.Nip, 0.0);
      double* aW2 = acc.data();
      double* aSM = aW2 + nW;
      double* ab2 = aSM + nS;
      double* aw3 = ab2 + H2;
      double* ab3 = aw3 + H2;
      double* aIP = ab3 + 1;
      double* asi = aIP + nIP;
      double* aqi = asi + R.Nip;
      Tile<T> tA(H1, H2), tB(H1, H2);
      Tile<T>* tiles[2] = {&tA, &tB};
      std::vector<T> rW2(nW * L), rSM(nS * L), rb2(H2 * L), rw3(H2 * L), rTP(H1 * L);
      std::vector<T> d1s(S * H1 * L), gh2s(S * H2 * L), gd1s(2 * H1 * L);
      int64_t ns = 0;  // tiles buffered for the next dW2 update
      T rb3[L], gs[2][L];
      const int64_t tb = R.Nt * th / nth, te = R.Nt * (th + 1) / nth;
      for (int64_t t = tb; t < te; ++t) {
        std::fill(rW2.begin(), rW2.end(), T(0));
        std::fill(rSM.begin(), rSM.end(), T(0));
        std::fill(rb2.begin(), rb2.end(), T(0));
        std::fill(rw3.begin(), rw3.end(), T(0));
        std::fill(rTP.begin(), rTP.end(), T(0));
        for (int64_t l = 0; l < L; ++l) rb3[l] = T(0);
        double gst = 0.0, gqt = 0.0;
        const uint32_t rk = row_key(t, R.seed_lo);
        for (int64_t ib0 = 0; ib0 < Nib; ib0 += 2) {  // two tiles at a time (the last may be alone)
          const int64_t nb = std::min<int64_t>(2, Nib - ib0);
          // the forward again, tile by tile up to the layer-2 product, which serves both
          for (int64_t sb = 0; sb < nb; ++sb) {
            Tile<T>& tl = *tiles[sb];
            const int64_t ib = ib0 + sb, i0 = ib * L, nl = std::min(L, R.Ni - i0);
            T* g = gs[sb];
            for (int64_t l = 0; l < L; ++l) g[l] = l < nl ? gout[t * R.Ni + i0 + l] : T(0);
            tl.d1 = d1s.data() + (ns + sb) * H1 * L;
            load_tile(R, tl, t, i0, nl, rk);
            if (DROP) tile_masks(R, tl);
            layer1<T, true, DROP>(R, tl, t, ib);
          }
          layer2(R, tA, nb == 2 ? &tB : nullptr);
          for (int64_t sb = 0; sb < nb; ++sb) {
            Tile<T>& tl = *tiles[sb];
            const T* g = gs[sb];
            T* gh2 = gh2s.data() + (ns + sb) * H2 * L;
            // layer 2 activation and output layer: gh2 = g w3 m2 gelu'(h2)
            for (int64_t l = 0; l < L; ++l) rb3[l] += g[l];
            gelu_block<true>(tl.h2.data(), tl.a.data(), tl.da.data(), H2 * L);
            const T* m2 = tl.m.data() + H1 * L;
            for (int64_t q = 0; q < H2; ++q) {
              const T w3 = R.w3[q];
              const T* aq = tl.a.data() + q * L;
              const T* daq = tl.da.data() + q * L;
              T* gq = gh2 + q * L;
              T* rw3q = rw3.data() + q * L;
              T* rb2q = rb2.data() + q * L;
#pragma omp simd
              for (int64_t l = 0; l < L; ++l) {
                const T mq = DROP ? m2[q * L + l] : T(1);
                rw3q[l] += g[l] * (aq[l] * mq);
                gq[l] = g[l] * w3 * (daq[l] * mq);
                rb2q[l] += gq[l];
              }
            }
          }
          // gd1 = W2^T gh2, both tiles in one product
          const T* gh2a = gh2s.data() + ns * H2 * L;
          if (nb == 2)
            lanes_matvec2<T>(R.W2, gh2a, gh2a + H2 * L, nullptr, gd1s.data(),
                             gd1s.data() + H1 * L, H2, H1);
          else
            lanes_matvec<T>(R.W2, gh2a, nullptr, gd1s.data(), H2, H1);
          // dW2 += gh2 d1^T (lanes kept apart), every S tiles and at the end of the row
          ns += nb;
          if (ns == S || ib0 + nb == Nib) {
            dW2_update(rW2.data(), gh2s.data(), d1s.data(), ns, H1, H2);
            ns = 0;
          }
          for (int64_t sb = 0; sb < nb; ++sb) {
            Tile<T>& tl = *tiles[sb];
            const int64_t ib = ib0 + sb, i0 = ib * L, nl = std::min(L, R.Ni - i0);
            const T* gd1 = gd1s.data() + sb * H1 * L;
            // layer 1: z = gd1 m1 gelu'(h1); the folded first layer's and the statistics' gradients
            T drstd[L], dmean[L], dse[L], dsh[L];
            for (int64_t l = 0; l < L; ++l) drstd[l] = dmean[l] = dse[l] = dsh[l] = T(0);
            double* aIPb = aIP + ib * H1 * L;
            for (int64_t q = 0; q < H1; ++q) {
              const T wE = R.SM[q], wH = R.SM[H1 + q], kq = R.SM[2 * H1 + q];
              const T* gdq = gd1 + q * L;
              const T* g1q = tl.g1.data() + q * L;
              const T* uq = tl.u.data() + q * L;
              T* sE = rSM.data() + q * L;
              T* sH = rSM.data() + (H1 + q) * L;
              T* sK = rSM.data() + (2 * H1 + q) * L;
              T* sC = rSM.data() + (3 * H1 + q) * L;
              T* tq = rTP.data() + q * L;
              double* iq = aIPb + q * L;
#pragma omp simd
              for (int64_t l = 0; l < L; ++l) {
                const T z = gdq[l] * g1q[l];
                const T zr = z * tl.rstd[l];
                sC[l] += z;
                sE[l] += tl.se[l] * zr;
                sH[l] += tl.sh[l] * zr;
                sK[l] -= tl.mean[l] * zr;
                tq[l] += zr;
                iq[l] += double(zr);
                drstd[l] += z * uq[l];
                dmean[l] += z * kq;
                dse[l] += z * wE;
                dsh[l] += z * wH;
              }
            }
            // the statistics (double), as autograd differentiates the reference
            for (int64_t l = 0; l < nl; ++l) {
              const double r = tl.rstd_d[l];
              const double dvar = tl.var_ok[l] ? double(drstd[l]) * (-0.5) * r * r * r : 0.0;
              const double dmean_w = -double(tl.rstd[l]) * double(dmean[l]);
              const double dm = dmean_w - 2.0 * tl.mean_d[l] * dvar;
              gst += dm / R.D;
              gqt += dvar / R.D;
              asi[i0 + l] += dm / R.D;
              aqi[i0 + l] += dvar / R.D;
              const int64_t at = t * R.Ni + i0 + l;
              if (G.gse)
                G.gse[at] = T(double(tl.rstd[l] * dse[l]) +
                              (dm + 2.0 * double(tl.se[l]) * dvar) / R.D);
              if (G.gsh)
                G.gsh[at] = T(double(tl.rstd[l] * dsh[l]) +
                              (dm + 2.0 * double(tl.sh[l]) * dvar) / R.D);
            }
          }
        }
        // flush the row
        G.gst[t] = gst;
        G.gqt[t] = gqt;
        for (int64_t q = 0; q < H1; ++q) {
          double s = 0.0;
          for (int64_t l = 0; l < L; ++l) s += double(rTP[q * L + l]);
          G.gTP[t * H1 + q] = T(s);
        }
        for (int64_t x = 0; x < nW; ++x) {
          double s = 0.0;
          for (int64_t l = 0; l < L; ++l) s += double(rW2[x * L + l]);
          aW2[x] += s;
        }
        for (int64_t x = 0; x < nS; ++x) {
          double s = 0.0;
          for (int64_t l = 0; l < L; ++l) s += double(rSM[x * L + l]);
          aSM[x] += s;
        }
        for (int64_t x = 0; x < H2; ++x) {
          double s2 = 0.0, s3 = 0.0;
          for (int64_t l = 0; l < L; ++l) {
            s2 += double(rb2[x * L + l]);
            s3 += double(rw3[x * L + l]);
          }
          ab2[x] += s2;
          aw3[x] += s3;
        }
        double s = 0.0;
        for (int64_t l = 0; l < L; ++l) s += double(rb3[l]);
        ab3[0] += s;
      }
    }
  }
  // sum the threads in order
  std::vector<double> sum(tot[0].size(), 0.0);
  for (int64_t th = 0; th < nth; ++th)
    for (size_t x = 0; x < sum.size(); ++x) sum[x] += tot[th][x];
  const double* sW2 = sum.data();
  const double* sSM = sW2 + nW;
  const double* sb2 = sSM + nS;
  const double* sw3 = sb2 + H2;
  const double* sb3 = sw3 + H2;
  const double* sIP = sb3 + 1;
  const double* ssi = sIP + nIP;
  const double* sqi = ssi + R.Nip;
  for (int64_t x = 0; x < nW; ++x) G.gW2[x] = T(sW2[x]);
  for (int64_t x = 0; x < nS; ++x) G.gSM[x] = T(sSM[x]);
  for (int64_t x = 0; x < H2; ++x) {
    G.gb2[x] = T(sb2[x]);
    G.gw3[x] = T(sw3[x]);
  }
  G.gb3[0] = T(sb3[0]);
  for (int64_t x = 0; x < nIP; ++x) G.gIP[x] = T(sIP[x]);
  for (int64_t x = 0; x < R.Nip; ++x) {
    G.gsi[x] = ssi[x];
    G.gqi[x] = sqi[x];
  }
}

template <typename T>
Router<T> make_router(const T* se, const T* sh, const double* st, const double* qt,
                      const double* si, const double* qi, const T* TP, const T* IP, const T* SM,
                      const T* W2, const T* W2T, const T* b2, const T* w3, double b3, int64_t Nt,
                      int64_t Ni, int64_t H1, int64_t H2, double D, double eps, int64_t thr1,
                      int64_t thr2, double scale1, double scale2, uint64_t seed) {
  Router<T> R;
  R.se = se, R.sh = sh, R.st = st, R.qt = qt, R.si = si, R.qi = qi;
  R.TP = TP, R.IP = IP, R.SM = SM, R.W2 = W2, R.W2T = W2T, R.b2 = b2, R.w3 = w3, R.b3 = T(b3);
  R.Nt = Nt, R.Ni = Ni, R.Nip = (Ni + L - 1) / L * L, R.H1 = H1, R.H2 = H2;
  R.D = D, R.eps = eps;
  R.thr1 = int32_t(thr1), R.thr2 = int32_t(thr2);
  R.seed_lo = uint32_t(seed), R.seed_hi = uint32_t(seed >> 32);
  R.scale1 = T(scale1), R.scale2 = T(scale2);
  return R;
}

}  // namespace

// The ctypes interface; see the header comment for the layouts.
#define CURVALIGN_ROUTER_EXPORT(T, SUF)                                                        \
  extern "C" void curvalign_router_forward_##SUF(                                              \
      const T* se, const T* sh, const double* st, const double* qt, const double* si,          \
      const double* qi, const T* TP, const T* IP, const T* SM, const T* W2T, const T* b2,      \
      const T* w3, double b3, T* out, int64_t Nt, int64_t Ni, int64_t H1, int64_t H2,          \
      double D, double eps, int64_t thr1, int64_t thr2, double scale1, double scale2,          \
      uint64_t seed, int nthreads) {                                                           \
    const auto R = make_router<T>(se, sh, st, qt, si, qi, TP, IP, SM, nullptr, W2T, b2, w3,   \
                                  b3, Nt, Ni, H1, H2, D, eps, thr1, thr2, scale1, scale2,     \
                                  seed);                                                       \
    if (thr1 > 0 || thr2 > 0)                                                                  \
      forward_rows<T, true>(R, out, nthreads);                                                 \
    else                                                                                       \
      forward_rows<T, false>(R, out, nthreads);                                                \
  }                                                                                            \
  extern "C" void curvalign_router_backward_##SUF(                                             \
      const T* se, const T* sh, const double* st, const double* qt, const double* si,          \
      const double* qi, const T* TP, const T* IP, const T* SM, const T* W2, const T* W2T,      \
      const T* b2, const T* w3, double b3, const T* gout, T* gse, T* gsh, double* gst,         \
      double* gqt, double* gsi, double* gqi, T* gTP, T* gIP, T* gSM, T* gW2, T* gb2, T* gw3,   \
      T* gb3, int64_t Nt, int64_t Ni, int64_t H1, int64_t H2, double D, double eps,            \
      int64_t thr1, int64_t thr2, double scale1, double scale2, uint64_t seed, int nthreads) { \
    const auto R = make_router<T>(se, sh, st, qt, si, qi, TP, IP, SM, W2, W2T, b2, w3, b3, Nt, \
                                  Ni, H1, H2, D, eps, thr1, thr2, scale1, scale2, seed);       \
    const Grads<T> G{gse, gsh, gst, gqt, gsi, gqi, gTP, gIP, gSM, gW2, gb2, gw3, gb3};         \
    if (thr1 > 0 || thr2 > 0)                                                                  \
      backward_rows<T, true>(R, gout, G, nthreads);                                            \
    else                                                                                       \
      backward_rows<T, false>(R, gout, G, nthreads);                                           \
  }

CURVALIGN_ROUTER_EXPORT(float, f32)
CURVALIGN_ROUTER_EXPORT(double, f64)

// The float GELU and its derivative over n values as the backward computes them (y, dy), and the
// forward's value alone (value); tests bound their errors. portable: the plain loops even where
// the AVX2 versions are built (tests compare the two).
extern "C" void curvalign_router_gelu_f32(const float* x, float* y, float* dy, float* value,
                                          int64_t n, int portable) {
  if (portable) {
    gelu_block_portable<true>(x, y, dy, 0, n);
    gelu_value_portable(x, value, 0, n);
  } else {
    gelu_block<true>(x, y, dy, n);
    gelu_block<false>(x, value, nullptr, n);
  }
}

// The keep masks themselves (tests): keep[t, i, q] for q < H1 + H2 (layer 1 then layer 2).
extern "C" void curvalign_router_keep_masks(uint8_t* keep, int64_t Nt, int64_t Ni, int64_t H1,
                                            int64_t H2, int64_t thr1, int64_t thr2,
                                            uint64_t seed) {
  const uint32_t seed_lo = uint32_t(seed), seed_hi = uint32_t(seed >> 32);
  const int64_t H = H1 + H2;
  for (int64_t t = 0; t < Nt; ++t) {
    const uint32_t rk = row_key(t, seed_lo);
    for (int64_t i = 0; i < Ni; ++i) {
      const uint32_t pk = pair_key(rk, i, seed_hi);
      for (int64_t q = 0; q < H; ++q) {
        const uint32_t word = mix32(pk ^ group_key(q >> 1));
        const uint32_t half = (word >> (16 * (q & 1))) & 0xFFFFU;
        keep[(t * Ni + i) * H + q] = half >= uint32_t(q < H1 ? thr1 : thr2) ? 1 : 0;
      }
    }
  }
}

// ---- AGR's routed score, both directions of one [Nt, Ni] score matrix ----------------------
// (curvalign.nn.router.routed_scores; Algorithm 1, lines 32-34), with the query side's gate g
// and calibration (wE, sH, sE) per row (text queries, t2i) and per column (image queries, i2t):
//   Delta = D tanh((sE beta s_e - s_h) / D),  S = s_h + alpha g w wE Delta + alpha g (sH - 1) s_h
// One pass forward (both outputs), one pass backward (the gradients of s_h, s_e, w summed over
// both directions; the row vectors' per row, the column vectors' per thread in double).
namespace {

inline void tanh_lanes(const float* __restrict u, float* __restrict out) {
  float e2[L], e[L];
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) e2[l] = 2.0f * std::fabs(u[l]);
  exp_lanes(e2, e);
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    const float x = u[l], a = std::fabs(x), x2 = x * x;
    // |x| < 0.55: the Taylor series to x^17 (relative error < 1e-8); else 1 - 2 / (e^2|x| + 1)
    float p = 6404582.0f / 10854718875.0f;
    p = fmadd(p, x2, -929569.0f / 638512875.0f);
    p = fmadd(p, x2, 21844.0f / 6081075.0f);
    p = fmadd(p, x2, -1382.0f / 155925.0f);
    p = fmadd(p, x2, 62.0f / 2835.0f);
    p = fmadd(p, x2, -17.0f / 315.0f);
    p = fmadd(p, x2, 2.0f / 15.0f);
    p = fmadd(p, x2, -1.0f / 3.0f);
    const float small = fmadd(x * x2, p, x);
    const float big = 1.0f - 2.0f / (e[l] + 1.0f);
    out[l] = a < 0.55f ? small : (x < 0.0f ? -big : big);
  }
}
inline void tanh_lanes(const double* __restrict u, double* __restrict out) {
  for (int64_t l = 0; l < L; ++l) out[l] = std::tanh(u[l]);
}

template <typename T>
struct Routed {
  const T *sh, *se, *w;
  const T *gt, *ct;  // rows: gate [Nt], calibration [Nt, 3] = (wE, sH, sE)
  const T *gi, *ci;  // columns: gate [Ni], calibration [3, Ni] (transposed)
  int64_t Nt, Ni;
  T alpha, beta, D;
};

template <typename T>
void routed_forward(const Routed<T>& R, T* S1, T* S2, int nthreads) {
  const T inv_d = T(1) / R.D;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < R.Nt; ++t) {
    const T at = R.alpha * R.gt[t], wEt = R.ct[3 * t], sHt = R.ct[3 * t + 1];
    const T sEt = R.ct[3 * t + 2];
    for (int64_t i0 = 0; i0 < R.Ni; i0 += L) {
      const int64_t nl = std::min(L, R.Ni - i0);
      T sh[L], se[L], w[L], ai[L], wEi[L], sHi[L], sEi[L], u1[L], u2[L], th1[L], th2[L];
      for (int64_t l = 0; l < L; ++l) {
        const bool ok = l < nl;
        const int64_t x = t * R.Ni + i0 + l, i = i0 + l;
        sh[l] = ok ? R.sh[x] : T(0), se[l] = ok ? R.se[x] : T(0), w[l] = ok ? R.w[x] : T(0);
        ai[l] = ok ? R.alpha * R.gi[i] : T(0);
        wEi[l] = ok ? R.ci[i] : T(0), sHi[l] = ok ? R.ci[R.Ni + i] : T(0);
        sEi[l] = ok ? R.ci[2 * R.Ni + i] : T(0);
      }
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) {
        u1[l] = (sEt * (R.beta * se[l]) - sh[l]) * inv_d;
        u2[l] = (sEi[l] * (R.beta * se[l]) - sh[l]) * inv_d;
      }
      tanh_lanes(u1, th1);
      tanh_lanes(u2, th2);
      T o1[L], o2[L];
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) {
        o1[l] = sh[l] + at * w[l] * wEt * (R.D * th1[l]) + at * (sHt - T(1)) * sh[l];
        o2[l] = sh[l] + ai[l] * w[l] * wEi[l] * (R.D * th2[l]) + ai[l] * (sHi[l] - T(1)) * sh[l];
      }
      for (int64_t l = 0; l < nl; ++l) {
        S1[t * R.Ni + i0 + l] = o1[l];
        S2[t * R.Ni + i0 + l] = o2[l];
      }
    }
  }
}

template <typename T>
void routed_backward(const Routed<T>& R, const T* G1, const T* G2, T* gsh, T* gse, T* gw,
                     T* ggt, T* gct, T* ggi, T* gci, int nthreads) {
  const T inv_d = T(1) / R.D;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(nthreads, R.Nt));
  std::vector<std::vector<double>> cols(nth);  // per thread: d gate_i, d wE_i, d sH_i, d sE_i
#pragma omp parallel num_threads(int(nth))
  {
#pragma omp for schedule(static, 1)
    for (int64_t th = 0; th < nth; ++th) {
      std::vector<double>& col = cols[th];
      col.assign(4 * R.Ni, 0.0);
      const int64_t tb = R.Nt * th / nth, te = R.Nt * (th + 1) / nth;
      for (int64_t t = tb; t < te; ++t) {
        const T gt = R.gt[t], at = R.alpha * gt, wEt = R.ct[3 * t], sHt = R.ct[3 * t + 1];
        const T sEt = R.ct[3 * t + 2];
        double rg = 0.0, rwE = 0.0, rsH = 0.0, rsE = 0.0;
        for (int64_t i0 = 0; i0 < R.Ni; i0 += L) {
          const int64_t nl = std::min(L, R.Ni - i0);
          T sh[L], se[L], w[L], g1[L], g2[L], gi[L], wEi[L], sHi[L], sEi[L], u1[L], u2[L];
          T th1[L], th2[L];
          for (int64_t l = 0; l < L; ++l) {
            const bool ok = l < nl;
            const int64_t x = t * R.Ni + i0 + l, i = i0 + l;
            sh[l] = ok ? R.sh[x] : T(0), se[l] = ok ? R.se[x] : T(0), w[l] = ok ? R.w[x] : T(0);
            g1[l] = ok ? G1[x] : T(0), g2[l] = ok ? G2[x] : T(0);
            gi[l] = ok ? R.gi[i] : T(0);
            wEi[l] = ok ? R.ci[i] : T(0), sHi[l] = ok ? R.ci[R.Ni + i] : T(0);
            sEi[l] = ok ? R.ci[2 * R.Ni + i] : T(0);
          }
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            u1[l] = (sEt * (R.beta * se[l]) - sh[l]) * inv_d;
            u2[l] = (sEi[l] * (R.beta * se[l]) - sh[l]) * inv_d;
          }
          tanh_lanes(u1, th1);
          tanh_lanes(u2, th2);
          T dsh[L], dse[L], dw[L], cg[L], cwE[L], csH[L], csE[L], rgl[L], rwEl[L], rsHl[L];
          T rsEl[L];
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            // rows (t2i)
            const T d1 = R.D * th1[l], q1 = T(1) - th1[l] * th1[l];
            const T c1 = g1[l] * at * w[l] * wEt;  // G dS/dDelta
            rgl[l] = g1[l] * R.alpha * (w[l] * wEt * d1 + (sHt - T(1)) * sh[l]);
            rwEl[l] = g1[l] * at * w[l] * d1;
            rsHl[l] = g1[l] * at * sh[l];
            rsEl[l] = c1 * q1 * R.beta * se[l];
            // columns (i2t)
            const T ai = R.alpha * gi[l];
            const T d2 = R.D * th2[l], q2 = T(1) - th2[l] * th2[l];
            const T c2 = g2[l] * ai * w[l] * wEi[l];
            cg[l] = g2[l] * R.alpha * (w[l] * wEi[l] * d2 + (sHi[l] - T(1)) * sh[l]);
            cwE[l] = g2[l] * ai * w[l] * d2;
            csH[l] = g2[l] * ai * sh[l];
            csE[l] = c2 * q2 * R.beta * se[l];
            // the matrices, both directions summed
            dsh[l] = g1[l] * (T(1) + at * (sHt - T(1))) - c1 * q1 +
                     g2[l] * (T(1) + ai * (sHi[l] - T(1))) - c2 * q2;
            dse[l] = c1 * q1 * sEt * R.beta + c2 * q2 * sEi[l] * R.beta;
            dw[l] = g1[l] * at * wEt * d1 + g2[l] * ai * wEi[l] * d2;
          }
          for (int64_t l = 0; l < nl; ++l) {
            const int64_t x = t * R.Ni + i0 + l, i = i0 + l;
            gsh[x] = dsh[l], gse[x] = dse[l], gw[x] = dw[l];
            rg += double(rgl[l]), rwE += double(rwEl[l]), rsH += double(rsHl[l]);
            rsE += double(rsEl[l]);
            col[i] += double(cg[l]), col[R.Ni + i] += double(cwE[l]);
            col[2 * R.Ni + i] += double(csH[l]), col[3 * R.Ni + i] += double(csE[l]);
          }
        }
        ggt[t] = T(rg), gct[3 * t] = T(rwE), gct[3 * t + 1] = T(rsH), gct[3 * t + 2] = T(rsE);
      }
    }
  }
  for (int64_t x = 0; x < R.Ni; ++x) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t th = 0; th < nth; ++th)
      for (int k = 0; k < 4; ++k) s[k] += cols[th][k * R.Ni + x];
    ggi[x] = T(s[0]);
    for (int k = 0; k < 3; ++k) gci[k * R.Ni + x] = T(s[k + 1]);
  }
}

}  // namespace

#define CURVALIGN_ROUTED_EXPORT(T, SUF)                                                         \
  extern "C" void curvalign_routed_forward_##SUF(                                               \
      const T* sh, const T* se, const T* w, const T* gt, const T* ct, const T* gi,              \
      const T* ci, T* S1, T* S2, int64_t Nt, int64_t Ni, double alpha, double beta, double D,   \
      int nthreads) {                                                                           \
    const Routed<T> R{sh, se, w, gt, ct, gi, ci, Nt, Ni, T(alpha), T(beta), T(D)};              \
    routed_forward<T>(R, S1, S2, nthreads);                                                     \
  }                                                                                             \
  extern "C" void curvalign_routed_backward_##SUF(                                              \
      const T* sh, const T* se, const T* w, const T* gt, const T* ct, const T* gi,              \
      const T* ci, const T* G1, const T* G2, T* gsh, T* gse, T* gw, T* ggt, T* gct, T* ggi,     \
      T* gci, int64_t Nt, int64_t Ni, double alpha, double beta, double D, int nthreads) {      \
    const Routed<T> R{sh, se, w, gt, ct, gi, ci, Nt, Ni, T(alpha), T(beta), T(D)};              \
    routed_backward<T>(R, G1, G2, gsh, gse, gw, ggt, gct, ggi, gci, nthreads);                  \
  }

CURVALIGN_ROUTED_EXPORT(float, f32)
CURVALIGN_ROUTED_EXPORT(double, f64)
