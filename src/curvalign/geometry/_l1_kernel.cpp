// Fused CPU kernel for PHyCLIP's l1-product distance (curvalign.geometry._fused_l1).
//
// Inputs are the time-augmented operands of curvalign.geometry.lorentz.minkowski_operands,
// re-laid out for the CPU:
//   P  [N, k, D1]         rows:     (c_f / 2) [x, t_x]
//   Q  [Mb, k, D1, 8]     columns interleaved by 8 (zero-padded to Mb * 8 columns): [y, -t_y]
//   s  [k]                1 / sqrt(c_f)
// so that one factor's inner product of a row with 8 columns is D1 vector FMAs on contiguous
// memory (the [k, M, D1] layout put every inner-loop load of a column block in one L1 set).
//
// forward:  out[i, j] = sum_f s_f acosh(1 + 2u),  u = max(w, 0),  w = -P_if . Q_jf - 1/2
//           with acosh(1 + 2u) = log1p(2 (u + r)),  r = sqrt(u + u^2)
// backward: G = grad * [u > 0] / max(r, r_floor);  dP_if = -s_f sum_j G Q_jf,
//           dQ_jf = -s_f sum_i G P_if,  ds_f = sum_ij grad acosh(1 + 2u)
// Exactly the reference's formulas (lorentz._PairwiseAcosh); no [k, N, M] buffer in either
// pass: the backward recomputes w. log1p is written out (exponent split + atanh series)
// because libm's is not vectorised.
//
// Plain C++ with an extern "C" interface (loaded with ctypes): no torch headers, so the
// one-time build takes seconds, not a minute. OpenMP resolves to the libgomp torch loaded.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "_vecmath.h"

namespace {

using curvalign_vecmath::log1p_pos;

constexpr int64_t L = 8;   // columns per interleaved block
constexpr int64_t IB = 4;  // rows per tile

// acosh(1 + 2u) = log1p(v), v = 2 (u + r), for 8 lanes with u >= 0; returns r too.
template <typename T>
static inline void acosh_lanes(const T* __restrict u, T* __restrict out, T* __restrict r) {
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    r[l] = std::sqrt(u[l] + u[l] * u[l]);
    out[l] = log1p_pos<T>(T(2) * (u[l] + r[l]));
  }
}

template <typename T>
void forward_impl(const T* P, const T* Q, const T* s, T* out, int64_t N, int64_t M, int64_t k,
                  int64_t D1, int nthreads) {
  const int64_t Mb = (M + L - 1) / L;
  const int64_t ntiles = (N + IB - 1) / IB;
#pragma omp parallel num_threads(nthreads)
  {
    T w[L], u[L], a[L], r[L], acc[IB][L];
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < ntiles; ++tile) {
      const int64_t i0 = tile * IB, ni = std::min(IB, N - i0);
      for (int64_t jb = 0; jb < Mb; ++jb) {
        for (int64_t ii = 0; ii < IB; ++ii)
          for (int64_t l = 0; l < L; ++l) acc[ii][l] = T(0);
        for (int64_t f = 0; f < k; ++f) {
          const T* q = Q + (jb * k + f) * D1 * L;
          const T sf = s[f];
          for (int64_t ii = 0; ii < ni; ++ii) {
            const T* p = P + ((i0 + ii) * k + f) * D1;
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) w[l] = T(-0.5);
            for (int64_t t = 0; t < D1; ++t) {
              const T pt = p[t];
#pragma omp simd
              for (int64_t l = 0; l < L; ++l) w[l] -= pt * q[t * L + l];
            }
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) u[l] = w[l] > T(0) ? w[l] : T(0);
            acosh_lanes<T>(u, a, r);
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) acc[ii][l] += sf * a[l];
          }
        }
        const int64_t nl = std::min(L, M - jb * L);
        for (int64_t ii = 0; ii < ni; ++ii)
          for (int64_t l = 0; l < nl; ++l) out[(i0 + ii) * M + jb * L + l] = acc[ii][l];
      }
    }
  }
}

template <typename T>
void backward_impl(const T* P, const T* Q, const T* s, const T* grad, T* gP, T* gQ, T* gs,
                   int64_t N, int64_t M, int64_t k, int64_t D1, T r_floor, int nthreads) {
  const int64_t Mb = (M + L - 1) / L;
  const int64_t qsize = Mb * k * D1 * L;
  const int64_t ntiles = (N + IB - 1) / IB;
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles));
  // One column-gradient buffer per chunk of rows (summed at the end): O(M k D1) each.
  std::vector<std::vector<T>> gQ_parts(nchunks);
  std::vector<std::vector<double>> gs_parts(nchunks, std::vector<double>(k, 0.0));
#pragma omp parallel num_threads(int(nchunks))
  {
    std::vector<T> gPacc(IB * k * D1 * L);
    T w[L], u[L], a[L], r[L], G[L], g[IB][L], gq[64 * L];
#pragma omp for schedule(static, 1)
    for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
      std::vector<T>& gQl = gQ_parts[chunk];
      gQl.assign(qsize, T(0));
      std::vector<double>& gsl = gs_parts[chunk];
      const int64_t tb = ntiles * chunk / nchunks, te = ntiles * (chunk + 1) / nchunks;
      for (int64_t tile = tb; tile < te; ++tile) {
        const int64_t i0 = tile * IB, ni = std::min(IB, N - i0);
        std::fill(gPacc.begin(), gPacc.end(), T(0));
        for (int64_t jb = 0; jb < Mb; ++jb) {
          const int64_t nl = std::min(L, M - jb * L);
          for (int64_t ii = 0; ii < IB; ++ii)
            for (int64_t l = 0; l < L; ++l)
              g[ii][l] = (ii < ni && l < nl) ? grad[(i0 + ii) * M + jb * L + l] : T(0);
          for (int64_t f = 0; f < k; ++f) {
            const T* q = Q + (jb * k + f) * D1 * L;
            T gsf = T(0);
            for (int64_t x = 0; x < D1 * L; ++x) gq[x] = T(0);
            for (int64_t ii = 0; ii < ni; ++ii) {
              const T* p = P + ((i0 + ii) * k + f) * D1;
#pragma omp simd
              for (int64_t l = 0; l < L; ++l) w[l] = T(-0.5);
              for (int64_t t = 0; t < D1; ++t) {
                const T pt = p[t];
#pragma omp simd
                for (int64_t l = 0; l < L; ++l) w[l] -= pt * q[t * L + l];
              }
#pragma omp simd
              for (int64_t l = 0; l < L; ++l) u[l] = w[l] > T(0) ? w[l] : T(0);
              acosh_lanes<T>(u, a, r);
#pragma omp simd reduction(+ : gsf)
              for (int64_t l = 0; l < L; ++l) {
                gsf += g[ii][l] * a[l];
                T rr = r[l] > r_floor ? r[l] : r_floor;
                G[l] = u[l] > T(0) ? g[ii][l] / rr : T(0);
              }
              T* acc = gPacc.data() + (ii * k + f) * D1 * L;
              for (int64_t t = 0; t < D1; ++t) {
                const T pt = p[t];
#pragma omp simd
                for (int64_t l = 0; l < L; ++l) {
                  acc[t * L + l] += G[l] * q[t * L + l];
                  gq[t * L + l] += G[l] * pt;
                }
              }
            }
            gsl[f] += double(gsf);
            T* dst = gQl.data() + (jb * k + f) * D1 * L;
#pragma omp simd
            for (int64_t x = 0; x < D1 * L; ++x) dst[x] += gq[x];
          }
        }
        for (int64_t ii = 0; ii < ni; ++ii)
          for (int64_t f = 0; f < k; ++f) {
            const T msf = -s[f];
            for (int64_t t = 0; t < D1; ++t) {
              const T* acc = gPacc.data() + ((ii * k + f) * D1 + t) * L;
              T sum = T(0);
              for (int64_t l = 0; l < L; ++l) sum += acc[l];
              gP[((i0 + ii) * k + f) * D1 + t] = msf * sum;
            }
          }
      }
    }
  }
  // Sum the chunks' column gradients and scale by -s_f.
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t jb = 0; jb < Mb; ++jb)
      for (int64_t f = 0; f < k; ++f) {
        const int64_t off = (jb * k + f) * D1 * L;
        const T msf = -s[f];
        for (int64_t x = 0; x < D1 * L; ++x) {
          T sum = T(0);
          for (int64_t ch = 0; ch < nchunks; ++ch) sum += gQ_parts[ch][off + x];
          gQ[off + x] = msf * sum;
        }
      }
  for (int64_t f = 0; f < k; ++f) {
    double sum = 0.0;
    for (int64_t ch = 0; ch < nchunks; ++ch) sum += gs_parts[ch][f];
    gs[f] = T(sum);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ---- float32 with AVX2 + FMA: register-tiled loops and a division-free map ---------------------
// Same formulas as forward_impl / backward_impl, restructured for what the generic loops lost to:
// - the inner products of R rows with one 8-column block share each load of the block (t outer,
//   rows inner), so the FMAs, not the loads, bound them;
// - columns are walked in chunks of CB blocks (Q and its gradient for a chunk stay in L2 while
//   a thread's rows pass over it) instead of streaming all of Q for every row tile;
// - the map avoids the divisions: log1p is log1p_pos8, and the backward's 1 / max(r, r_floor)
//   comes from the reciprocal estimate and one Newton step;
// - the backward writes G = grad [u > 0] / max(r, r_floor) of an R x CB tile to an L1 buffer,
//   then forms dP (lanes summed per row) and dQ (rows summed per lane) from it as two small
//   register-blocked products, instead of read-modify-writing [R, k, D1, 8] accumulators.
namespace avx2 {

using curvalign_vecmath::log1p_pos8;

constexpr int64_t CB = 16;  // 8-column blocks per chunk

// acosh(1 + 2u) = log1p(2 (u + r)), r = sqrt(u + u^2), u = max(w, 0) on NV vectors of 8 lanes,
// in place over w. With `inv` (the backward) also 1 / max(r, r_floor) where u > 0, else 0, to
// inv[i], from the reciprocal estimate and one Newton step (relative error about 2^-22; 0 where
// r = inf, as 1 / inf).
template <int NV>
static inline void acosh8(__m256* w, __m256* inv = nullptr, float r_floor = 0.0f) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 u[NV], q[NV];
  for (int i = 0; i < NV; ++i) {
    u[i] = _mm256_max_ps(w[i], zero);  // NaN w gives 0, as forward_impl's select
    q[i] = _mm256_fmadd_ps(u[i], u[i], u[i]);
  }
  if (inv == nullptr) {
    for (int i = 0; i < NV; ++i) {
      const __m256 ur = _mm256_add_ps(u[i], _mm256_sqrt_ps(q[i]));
      w[i] = _mm256_add_ps(ur, ur);
    }
  } else {
    const __m256 rf = _mm256_set1_ps(r_floor);
    const __m256 rmax = _mm256_set1_ps(std::numeric_limits<float>::max());
    for (int i = 0; i < NV; ++i) {
      const __m256 r = _mm256_sqrt_ps(q[i]);
      const __m256 ur = _mm256_add_ps(u[i], r);
      w[i] = _mm256_add_ps(ur, ur);
      // 1 / max(r, r_floor): the reciprocal estimate and one Newton step (0 where r = inf)
      const __m256 rc = _mm256_min_ps(_mm256_max_ps(r, rf), rmax);
      const __m256 y0 = _mm256_rcp_ps(rc);
      const __m256 y = _mm256_mul_ps(y0, _mm256_fnmadd_ps(rc, y0, _mm256_set1_ps(2.0f)));
      inv[i] = _mm256_and_ps(y, _mm256_cmp_ps(u[i], zero, _CMP_GT_OQ));
    }
  }
  log1p_pos8<NV>(w);
}

static inline __m256 load_or_zero(const float* src, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(src);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t l = 0; l < n; ++l) tmp[l] = src[l];
  return _mm256_load_ps(tmp);
}

// Lane sums of 8 vectors: out[r] = sum_l v[r][l].
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 h0 = _mm256_hadd_ps(v[0], v[1]), h1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h2 = _mm256_hadd_ps(v[4], v[5]), h3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 a = _mm256_hadd_ps(h0, h1), b = _mm256_hadd_ps(h2, h3);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

void forward(const float* P, const float* Q, const float* s, float* out, int64_t N, int64_t M,
             int64_t k, int64_t D1, int nthreads) {
  constexpr int64_t R = 4;  // rows per tile
  const int64_t Mb = (M + 7) / 8, nc = (Mb + CB - 1) / CB, ntiles = (N + R - 1) / R;
#pragma omp parallel num_threads(nthreads)
  for (int64_t cc = 0; cc < nc; ++cc) {
    const int64_t jb0 = cc * CB, jb1 = std::min(Mb, jb0 + CB);
#pragma omp for schedule(static) nowait
    for (int64_t tile = 0; tile < ntiles; ++tile) {
      const int64_t i0 = tile * R, ni = std::min(R, N - i0);
      const float* prow[R];
      for (int64_t r = 0; r < R; ++r) prow[r] = P + std::min(i0 + r, N - 1) * k * D1;
      for (int64_t jb = jb0; jb < jb1; ++jb) {
        __m256 acc[R];
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        const float* qb = Q + jb * k * D1 * 8;
        for (int64_t f = 0; f < k; ++f) {
          const float* q = qb + f * D1 * 8;
          __m256 w[R];
          for (int64_t r = 0; r < R; ++r) w[r] = _mm256_set1_ps(-0.5f);
          for (int64_t t = 0; t < D1; ++t) {
            const __m256 qt = _mm256_loadu_ps(q + t * 8);
            for (int64_t r = 0; r < R; ++r)
              w[r] = _mm256_fnmadd_ps(_mm256_broadcast_ss(prow[r] + f * D1 + t), qt, w[r]);
          }
          const __m256 sf = _mm256_broadcast_ss(s + f);
          acosh8<R>(w);
          for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(sf, w[r], acc[r]);
        }
        const int64_t nl = std::min<int64_t>(8, M - jb * 8);
        for (int64_t r = 0; r < ni; ++r) {
          float* dst = out + (i0 + r) * M + jb * 8;
          if (nl == 8) {
            _mm256_storeu_ps(dst, acc[r]);
          } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, acc[r]);
            for (int64_t l = 0; l < nl; ++l) dst[l] = tmp[l];
          }
        }
      }
    }
  }
}

void backward(const float* P, const float* Q, const float* s, const float* grad, float* gP,
              float* gQ, float* gs, int64_t N, int64_t M, int64_t k, int64_t D1, float r_floor,
              int nthreads) {
  constexpr int64_t R = 8;   // rows per tile: the lanes of one hsum8x8
  constexpr int64_t RM = 4;  // rows mapped together
  const int64_t Mb = (M + 7) / 8, nc = (Mb + CB - 1) / CB, ntiles = (N + R - 1) / R;
  const int64_t Npad = ntiles * R, qsize = Mb * k * D1 * 8;
  const int64_t nparts = std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles));
  // dP transposed, [k, D1, Npad]: a tile's 8 row sums are one vector (rows are disjoint
  // between threads); dQ per thread (summed at the end), [Mb, k, D1, 8] as Q.
  std::vector<float> gPt(k * D1 * Npad, 0.0f);
  std::vector<std::vector<float>> gQ_parts(nparts);
  std::vector<std::vector<double>> gs_parts(nparts, std::vector<double>(k, 0.0));
#pragma omp parallel for num_threads(int(nparts)) schedule(static, 1)
  for (int64_t part = 0; part < nparts; ++part) {
    std::vector<float>& gQl = gQ_parts[part];
    gQl.assign(qsize, 0.0f);
    std::vector<double>& gsl = gs_parts[part];
    alignas(32) float Gbuf[R][CB][8];
    alignas(32) float gbuf[R][CB][8];
    const int64_t tb = ntiles * part / nparts, te = ntiles * (part + 1) / nparts;
    for (int64_t cc = 0; cc < nc; ++cc) {
      const int64_t jb0 = cc * CB, nb = std::min(Mb, jb0 + CB) - jb0;
      for (int64_t tile = tb; tile < te; ++tile) {
        const int64_t i0 = tile * R, ni = std::min(R, N - i0);
        const float* prow[R];
        for (int64_t r = 0; r < R; ++r) prow[r] = P + std::min(i0 + r, N - 1) * k * D1;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t b = 0; b < nb; ++b) {
            const int64_t col = (jb0 + b) * 8;
            const __m256 g = r < ni ? load_or_zero(grad + (i0 + r) * M + col, M - col)
                                    : _mm256_setzero_ps();
            _mm256_store_ps(gbuf[r][b], g);
          }
        for (int64_t f = 0; f < k; ++f) {
          const float* qf = Q + (jb0 * k + f) * D1 * 8;  // block b at qf + b * k * D1 * 8
          // w, acosh, G for the tile; grad . acosh for ds_f
          __m256 gsacc = _mm256_setzero_ps();
          for (int64_t b = 0; b < nb; ++b) {
            const float* q = qf + b * k * D1 * 8;
            __m256 w[R];
            for (int64_t r = 0; r < R; ++r) w[r] = _mm256_set1_ps(-0.5f);
            for (int64_t t = 0; t < D1; ++t) {
              const __m256 qt = _mm256_loadu_ps(q + t * 8);
              for (int64_t r = 0; r < R; ++r)
                w[r] = _mm256_fnmadd_ps(_mm256_broadcast_ss(prow[r] + f * D1 + t), qt, w[r]);
            }
            for (int64_t h = 0; h < R; h += RM) {
              __m256 ir[RM];
              acosh8<RM>(w + h, ir, r_floor);
              for (int64_t r = h; r < h + RM; ++r) {
                const __m256 g = _mm256_load_ps(gbuf[r][b]);
                gsacc = _mm256_fmadd_ps(g, w[r], gsacc);
                _mm256_store_ps(Gbuf[r][b], _mm256_mul_ps(g, ir[r - h]));
              }
            }
          }
          gsl[f] += double(hsum(gsacc));
          // dP (before -s_f): row r, column t: sum over the chunk of G[r] * q[t]
          for (int64_t t = 0; t < D1; ++t) {
            __m256 acc[R];
            for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
              const __m256 qt = _mm256_loadu_ps(qf + b * k * D1 * 8 + t * 8);
              for (int64_t r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_load_ps(Gbuf[r][b]), qt, acc[r]);
            }
            float* dst = gPt.data() + (f * D1 + t) * Npad + i0;
            _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), hsum8x8(acc)));
          }
          // dQ (before -s_f): block b, column t: sum over the tile's rows of G[r] * p_r[t]
          for (int64_t t = 0; t < D1; ++t) {
            __m256 pb[R];
            for (int64_t r = 0; r < R; ++r) pb[r] = _mm256_broadcast_ss(prow[r] + f * D1 + t);
            for (int64_t b = 0; b < nb; ++b) {
              __m256 a0 = _mm256_mul_ps(_mm256_load_ps(Gbuf[0][b]), pb[0]);
              __m256 a1 = _mm256_mul_ps(_mm256_load_ps(Gbuf[1][b]), pb[1]);
              for (int64_t r = 2; r < R; r += 2) {
                a0 = _mm256_fmadd_ps(_mm256_load_ps(Gbuf[r][b]), pb[r], a0);
                a1 = _mm256_fmadd_ps(_mm256_load_ps(Gbuf[r + 1][b]), pb[r + 1], a1);
              }
              float* dst = gQl.data() + ((jb0 + b) * k + f) * D1 * 8 + t * 8;
              _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_add_ps(a0, a1)));
            }
          }
        }
      }
    }
  }
#pragma omp parallel num_threads(nthreads)
  {
    // dQ: the parts' sum times -s_f
#pragma omp for schedule(static)
    for (int64_t jb = 0; jb < Mb; ++jb)
      for (int64_t f = 0; f < k; ++f) {
        const int64_t off = (jb * k + f) * D1 * 8;
        const float msf = -s[f];
        for (int64_t x = 0; x < D1 * 8; ++x) {
          float sum = 0.0f;
          for (int64_t ch = 0; ch < nparts; ++ch) sum += gQ_parts[ch][off + x];
          gQ[off + x] = msf * sum;
        }
      }
    // dP: back from [k, D1, Npad] to [N, k, D1], times -s_f
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t f = 0; f < k; ++f)
        for (int64_t t = 0; t < D1; ++t)
          gP[(i * k + f) * D1 + t] = -s[f] * gPt[(f * D1 + t) * Npad + i];
  }
  for (int64_t f = 0; f < k; ++f) {
    double sum = 0.0;
    for (int64_t ch = 0; ch < nparts; ++ch) sum += gs_parts[ch][f];
    gs[f] = float(sum);
  }
}

}  // namespace avx2
#endif

}  // namespace

// The ctypes interface: every array C-contiguous, of the suffix's dtype; see the header comment.
// float32 takes the AVX2 loops where the build has AVX2 + FMA (curvalign._native.isa_flags).
namespace {
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2 = true;
#else
constexpr bool kAvx2 = false;
#endif

template <typename T>
void forward_dispatch(const T* P, const T* Q, const T* s, T* out, int64_t N, int64_t M,
                      int64_t k, int64_t D1, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    avx2::forward(P, Q, s, out, N, M, k, D1, nthreads);
    return;
  }
#endif
  forward_impl<T>(P, Q, s, out, N, M, k, D1, nthreads);
}

template <typename T>
void backward_dispatch(const T* P, const T* Q, const T* s, const T* grad, T* gP, T* gQ, T* gs,
                       int64_t N, int64_t M, int64_t k, int64_t D1, T r_floor, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    avx2::backward(P, Q, s, grad, gP, gQ, gs, N, M, k, D1, r_floor, nthreads);
    return;
  }
#endif
  backward_impl<T>(P, Q, s, grad, gP, gQ, gs, N, M, k, D1, r_floor, nthreads);
}
}  // namespace

#define CURVALIGN_L1_EXPORT(T, SUF)                                                          \
  extern "C" void curvalign_l1_forward_##SUF(const T* P, const T* Q, const T* s, T* out,    \
                                              int64_t N, int64_t M, int64_t k, int64_t D1,  \
                                              int nthreads) {                               \
    forward_dispatch<T>(P, Q, s, out, N, M, k, D1, nthreads);                               \
  }                                                                                         \
  extern "C" void curvalign_l1_backward_##SUF(const T* P, const T* Q, const T* s,           \
                                               const T* grad, T* gP, T* gQ, T* gs, int64_t N, \
                                               int64_t M, int64_t k, int64_t D1,            \
                                               double r_floor, int nthreads) {              \
    backward_dispatch<T>(P, Q, s, grad, gP, gQ, gs, N, M, k, D1, T(r_floor), nthreads);     \
  }

// Which float32 path this build takes (1: the AVX2 loops), for the tests.
extern "C" int curvalign_l1_avx2() { return kAvx2 ? 1 : 0; }

CURVALIGN_L1_EXPORT(float, f32)
CURVALIGN_L1_EXPORT(double, f64)
