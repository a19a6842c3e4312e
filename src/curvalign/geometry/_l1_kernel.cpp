// Fused CPU kernel for PHyCLIP's l1-product distance (curvalign.geometry._fused_l1).
//
// Inputs are the time-augmented operands of curvalign.geometry.lorentz._minkowski_operands,
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

}  // namespace

// The ctypes interface: every array C-contiguous, of the suffix's dtype; see the header comment.
#define CURVALIGN_L1_EXPORT(T, SUF)                                                          \
  extern "C" void curvalign_l1_forward_##SUF(const T* P, const T* Q, const T* s, T* out,    \
                                              int64_t N, int64_t M, int64_t k, int64_t D1,  \
                                              int nthreads) {                               \
    forward_impl<T>(P, Q, s, out, N, M, k, D1, nthreads);                                   \
  }                                                                                         \
  extern "C" void curvalign_l1_backward_##SUF(const T* P, const T* Q, const T* s,           \
                                               const T* grad, T* gP, T* gQ, T* gs, int64_t N, \
                                               int64_t M, int64_t k, int64_t D1,            \
                                               double r_floor, int nthreads) {              \
    backward_impl<T>(P, Q, s, grad, gP, gQ, gs, N, M, k, D1, T(r_floor), nthreads);         \
  }

CURVALIGN_L1_EXPORT(float, f32)
CURVALIGN_L1_EXPORT(double, f64)
