// Fused CPU elementwise passes of the pairwise Lorentz distance and exterior angle
// (curvalign.geometry._fused_lorentz). The Gram matrices stay in torch (MKL); everything the
// eager reference (lorentz._PairwiseAcosh, lorentz._PairwiseExteriorAngle) does to the [k, N, M]
// matrix between the forward GEMM and the backward GEMMs is one OpenMP pass here, reading the
// Gram block (and the incoming gradient) and writing one result, with the row, column and total
// sums the small gradients need computed in the same pass.
//
// Distance (per factor f with a = c/2, s = 1/sqrt(c); G = X Y^T, the space Gram matrix):
//   v = t_x t_y - G,  w = a v - 1/2 = (-c<x,y>_L - 1)/2,  u = max(w, 0)
//   forward:  out = s acosh(1 + 2u) = s log1p(2 (u + r)),  r = sqrt(u + u^2)
//   backward: H = s grad [w > 0] / max(r, r_floor)   (written over G: -dL/dG = a H)
//             row_i = sum_j H t_yj,  col_j = sum_i H t_xi,  ga = sum H v,  gs = sum grad acosh
// Exterior angle (operands as in lorentz._PairwiseExteriorAngle; Gs = (c/2) G, G = X Y^T):
//   h = txs ty - Gs,  q = h^2 - 1/4,  den = 1/sqrt(max(q, q_min)),
//   cos = clamp((Gs - a ty) den u, -(1 - e), 1 - e),  forward: out = acos(cos)
//   backward: r = grad / sqrt(1 - cos^2),  p = r den,  rc = r cos,
//             g_h = [q > q_min] rc h den^2,  mG = p u + g_h   (written over G: -dL/dGs)
//             row sums of rc, g_h ty, p ty; column sum of g_h txs + p u a
// The backward recomputes the elementwise values from the saved Gram matrix (a few flops) in
// the same order as the forward, so no [k, N, M] tensor beyond the Gram matrix is kept.
//
// log1p and acos are written out (exponent split + atanh series; fdlibm's rational asin
// kernel) so that gcc vectorises them: libm's are scalar. No -ffast-math: inf and NaN pass
// through as in the reference. Plain C++ behind extern "C" (loaded with ctypes), OpenMP through
// the libgomp torch has loaded. The log1p is _vecmath.h's, shared with _l1_kernel.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "_vecmath.h"

namespace {

using curvalign_vecmath::log1p_pos;

// fdlibm's rational approximation R(z) of (asin(sqrt z) - sqrt z) / sqrt z^3 on [0, 1/4]
// (musl's acosf coefficients for float, fdlibm's e_acos.c for double).
template <typename T>
struct AsinR;
template <>
struct AsinR<float> {
  static constexpr float PIO2_HI = 1.5707962513e+00f, PIO2_LO = 7.5497894159e-08f;
  static inline float R(float z) {
    const float p = z * (1.6666586697e-01f + z * (-4.2743422091e-02f + z * -8.6563630030e-03f));
    const float q = 1.0f + z * -7.0662963390e-01f;
    return p / q;
  }
};
template <>
struct AsinR<double> {
  static constexpr double PIO2_HI = 1.57079632679489655800e+00,
                          PIO2_LO = 6.12323399573676603587e-17;
  static inline double R(double z) {
    const double p =
        z * (1.66666666666666657415e-01 +
             z * (-3.25565818622400915405e-01 +
                  z * (2.01212532134862925881e-01 +
                       z * (-4.00555345006794114027e-02 +
                            z * (7.91534994289814532176e-04 + z * 3.47933107596021167570e-05)))));
    const double q =
        1.0 + z * (-2.40339491173441421878e+00 +
                   z * (2.02094576023350569471e+00 +
                        z * (-6.88283971605453293030e-01 + z * 7.70381505559019352791e-02)));
    return p / q;
  }
};

// acos(x) for x in [-1, 1] (NaN passes through), branch-free so that it vectorises:
// |x| <= 1/2: pi/2 - (x + x R(x^2));  otherwise with z = (1 - |x|)/2, s = sqrt(z):
// acos(|x|) = 2 (s + s R(z)), acos(-|x|) = pi - 2 (s + s R(z)).
template <typename T>
static inline T acos_vec(T x) {
  const T ax = std::fabs(x);
  const bool big = ax > T(0.5);
  const T z = big ? (T(1) - ax) * T(0.5) : x * x;
  const T s = std::sqrt(z);
  const T R = AsinR<T>::R(z);
  const T small_res = AsinR<T>::PIO2_HI - (x - (AsinR<T>::PIO2_LO - x * R));
  const T pos = T(2) * (s + s * R);
  const T neg = T(2) * (AsinR<T>::PIO2_HI - (s + (s * R - AsinR<T>::PIO2_LO)));
  return big ? (x > T(0) ? pos : neg) : small_res;
}

// Rows [k * N] in nchunks contiguous chunks (a fixed split per thread count).
struct Split {
  int64_t rows, nchunks;
  int64_t begin(int64_t c) const { return rows * c / nchunks; }
  int64_t end(int64_t c) const { return rows * (c + 1) / nchunks; }
};

static inline int64_t chunks_for(int64_t rows, int nthreads) {
  return std::max<int64_t>(1, std::min<int64_t>(nthreads, rows));
}

// The incoming gradient as a strided [k, N, M] view (element strides). A symmetric InfoNCE
// hands the backward a transposed matrix (the sum of the gradients through S and S^T takes
// the layout of the latter): it is read here tile by tile instead of being copied first.
template <typename T>
struct GradView {
  const T* p;
  int64_t sK, sN, sM, N;
  int64_t offset(int64_t row) const { return (row / N) * sK + (row % N) * sN; }
};

constexpr int64_t TILE_ROWS = 16;   // a transposed tile column of floats is one cache line
constexpr int64_t TILE_COLS = 256;
// Tile rows TILE_COLS + 16 elements apart: with a power-of-two stride of 4 KiB or more they
// share L1 sets with each other and with the source lines (1024-column tiles measured 2x
// slower at N = M = 1024 that way).
constexpr int64_t TILE_STRIDE = TILE_COLS + 16;

// Calls fn(row, g, j0, n) for rows [rb, re) over column segments [j0, j0 + n), with g the
// gradient of that segment, contiguous (g[0] is column j0): whole rows when the gradient's
// rows are contiguous, otherwise TILE_ROWS x TILE_COLS tiles gathered into `tile`.
template <typename T, typename F>
static inline void for_segments(int64_t rb, int64_t re, int64_t M, const GradView<T>& gv,
                                std::vector<T>& tile, F&& fn) {
  if (gv.sM == 1) {
    for (int64_t row = rb; row < re; ++row) fn(row, gv.p + gv.offset(row), int64_t(0), M);
    return;
  }
  tile.resize(TILE_ROWS * TILE_STRIDE);
  int64_t base[TILE_ROWS];
  for (int64_t r0 = rb; r0 < re; r0 += TILE_ROWS) {
    const int64_t nr = std::min(TILE_ROWS, re - r0);
    for (int64_t r = 0; r < nr; ++r) base[r] = gv.offset(r0 + r);
    for (int64_t j0 = 0; j0 < M; j0 += TILE_COLS) {
      const int64_t nc = std::min(TILE_COLS, M - j0);
      for (int64_t j = 0; j < nc; ++j) {
        const T* src = gv.p + (j0 + j) * gv.sM;
        for (int64_t r = 0; r < nr; ++r) tile[r * TILE_STRIDE + j] = src[base[r]];
      }
      for (int64_t r = 0; r < nr; ++r) fn(r0 + r, tile.data() + r * TILE_STRIDE, j0, nc);
    }
  }
}

// ----------------------------------------------------------------------------------------
// Distance
// ----------------------------------------------------------------------------------------

template <typename T>
void dist_forward(const T* G, T* out, const T* tx, const T* ty, const T* a, const T* s,
                  int64_t k, int64_t N, int64_t M, int nthreads) {
  const int64_t rows = k * N;
#pragma omp parallel for num_threads(int(chunks_for(rows, nthreads))) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t f = row / N;
    const T af = a[f], sf = s[f], txi = tx[row];
    const T* __restrict g = G + row * M;
    const T* __restrict tyf = ty + f * M;
    T* __restrict o = out + row * M;
#pragma omp simd
    for (int64_t j = 0; j < M; ++j) {
      const T w = af * (txi * tyf[j] - g[j]) - T(0.5);
      const T u = w < T(0) ? T(0) : w;  // NaN passes
      const T r = std::sqrt(u + u * u);
      o[j] = sf * log1p_pos<T>(T(2) * (u + r));
    }
  }
}

// One row segment of the distance's backward: H over the Gram block (in place), the row sum
// of H t_y, the column sums of H t_x; with NEED_C also the sums of H v and grad acosh that the
// curvature's gradient needs (the log1p is skipped when c needs no gradient).
template <typename T, bool NEED_C>
static inline void dist_backward_segment(T* __restrict gh, const T* __restrict gr,
                                         const T* __restrict tyf, T* __restrict cf, int64_t n,
                                         T af, T sf, T txi, T r_floor, T& rsum, T& vsum,
                                         T& asum) {
  T rs = T(0), vs = T(0), as = T(0);
#pragma omp simd reduction(+ : rs, vs, as)
  for (int64_t j = 0; j < n; ++j) {
    const T v = txi * tyf[j] - gh[j];
    const T w = af * v - T(0.5);
    const T u = w < T(0) ? T(0) : w;
    const T r = std::sqrt(u + u * u);
    const T rr = r > r_floor ? r : r_floor;
    const T H = w <= T(0) ? T(0) : sf * gr[j] / rr;
    gh[j] = H;
    rs += H * tyf[j];
    cf[j] += H * txi;
    if constexpr (NEED_C) {
      vs += H * v;
      as += gr[j] * log1p_pos<T>(T(2) * (u + r));
    }
  }
  rsum = rs;
  vsum = vs;
  asum = as;
}

template <typename T>
void dist_backward(T* GH, const GradView<T>& gv, const T* tx, const T* ty, const T* a,
                   const T* s, int64_t k, int64_t N, int64_t M, T r_floor, T* row_out,
                   T* col_out, T* ga, T* gs, bool need_c, int nthreads) {
  const Split sp{k * N, chunks_for(k * N, nthreads)};
  std::vector<std::vector<T>> cols(sp.nchunks);
  std::vector<std::vector<double>> ga_parts(sp.nchunks, std::vector<double>(k, 0.0));
  std::vector<std::vector<double>> gs_parts(sp.nchunks, std::vector<double>(k, 0.0));
  std::fill(row_out, row_out + k * N, T(0));
#pragma omp parallel for num_threads(int(sp.nchunks)) schedule(static, 1)
  for (int64_t ch = 0; ch < sp.nchunks; ++ch) {
    std::vector<T>& col = cols[ch];
    col.assign(k * M, T(0));
    std::vector<T> tile;
    for_segments<T>(sp.begin(ch), sp.end(ch), M, gv, tile,
                    [&](int64_t row, const T* g, int64_t j0, int64_t n) {
      const int64_t f = row / N;
      const T af = a[f], sf = s[f], txi = tx[row];
      T* __restrict gh = GH + row * M + j0;
      const T* __restrict gr = g;
      const T* __restrict tyf = ty + f * M + j0;
      T* __restrict cf = col.data() + f * M + j0;
      T rsum, vsum, asum;
      if (need_c) {
        dist_backward_segment<T, true>(gh, gr, tyf, cf, n, af, sf, txi, r_floor, rsum, vsum, asum);
      } else {
        dist_backward_segment<T, false>(gh, gr, tyf, cf, n, af, sf, txi, r_floor, rsum, vsum,
                                        asum);
      }
      row_out[row] += rsum;
      ga_parts[ch][f] += double(vsum);
      gs_parts[ch][f] += double(asum);
    });
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t j = 0; j < k * M; ++j) {
    T sum = T(0);
    for (int64_t ch = 0; ch < sp.nchunks; ++ch) sum += cols[ch][j];
    col_out[j] = sum;
  }
  for (int64_t f = 0; f < k; ++f) {
    double sa = 0.0, ss = 0.0;
    for (int64_t ch = 0; ch < sp.nchunks; ++ch) {
      sa += ga_parts[ch][f];
      ss += gs_parts[ch][f];
    }
    ga[f] = T(sa);
    gs[f] = T(ss);
  }
}

// ----------------------------------------------------------------------------------------
// Exterior angle
// ----------------------------------------------------------------------------------------

template <typename T>
void angle_forward(const T* G, T* out, const T* hc, const T* txs, const T* u, const T* a,
                   const T* ty, int64_t k, int64_t N, int64_t M, T e, int nthreads) {
  const int64_t rows = k * N;
  const T q_min = e * (T(1) + e), bound = T(1) - e;
#pragma omp parallel for num_threads(int(chunks_for(rows, nthreads))) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t f = row / N;
    const T hcf = hc[f], txsi = txs[row], ui = u[row], ai = a[row];
    const T* __restrict gr = G + row * M;
    const T* __restrict tyf = ty + f * M;
    T* __restrict o = out + row * M;
#pragma omp simd
    for (int64_t j = 0; j < M; ++j) {
      const T g = hcf * gr[j];
      const T h = txsi * tyf[j] - g;
      const T q = h * h - T(0.25);
      const T den = T(1) / std::sqrt(q > q_min ? q : q_min);
      T cs = (g - ai * tyf[j]) * den * ui;
      cs = cs > bound ? bound : (cs < -bound ? -bound : cs);  // NaN passes
      o[j] = acos_vec<T>(cs);
    }
  }
}

template <typename T>
void angle_backward(T* GM, const GradView<T>& gv, const T* hc, const T* txs, const T* u,
                    const T* a, const T* ty, int64_t k, int64_t N, int64_t M, T e, T* row_rc,
                    T* row_txs, T* row_a, T* col_ty, int nthreads) {
  const Split sp{k * N, chunks_for(k * N, nthreads)};
  const T q_min = e * (T(1) + e), bound = T(1) - e;
  std::vector<std::vector<T>> cols(sp.nchunks);
  std::fill(row_rc, row_rc + k * N, T(0));
  std::fill(row_txs, row_txs + k * N, T(0));
  std::fill(row_a, row_a + k * N, T(0));
#pragma omp parallel for num_threads(int(sp.nchunks)) schedule(static, 1)
  for (int64_t ch = 0; ch < sp.nchunks; ++ch) {
    std::vector<T>& col = cols[ch];
    col.assign(k * M, T(0));
    std::vector<T> tile;
    for_segments<T>(sp.begin(ch), sp.end(ch), M, gv, tile,
                    [&](int64_t row, const T* g_in, int64_t j0, int64_t n) {
      const int64_t f = row / N;
      const T hcf = hc[f], txsi = txs[row], ui = u[row], ai = a[row], uai = ui * ai;
      T* __restrict gm = GM + row * M + j0;
      const T* __restrict gr = g_in;
      const T* __restrict tyf = ty + f * M + j0;
      T* __restrict cf = col.data() + f * M + j0;
      T s_rc = T(0), s_txs = T(0), s_a = T(0);
#pragma omp simd reduction(+ : s_rc, s_txs, s_a)
      for (int64_t j = 0; j < n; ++j) {
        const T g = hcf * gm[j];
        const T h = txsi * tyf[j] - g;
        const T q = h * h - T(0.25);
        const T den = T(1) / std::sqrt(q > q_min ? q : q_min);
        T cs = (g - ai * tyf[j]) * den * ui;
        cs = cs > bound ? bound : (cs < -bound ? -bound : cs);
        const T r = gr[j] / std::sqrt(T(1) - cs * cs);
        const T p = r * den;
        const T rc = r * cs;
        const T g_h = q <= q_min ? T(0) : rc * h * den * den;
        gm[j] = p * ui + g_h;
        s_rc += rc;
        s_txs += g_h * tyf[j];
        s_a += p * tyf[j];
        cf[j] += g_h * txsi + p * uai;
      }
      row_rc[row] += s_rc;
      row_txs[row] += s_txs;
      row_a[row] += s_a;
    });
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t j = 0; j < k * M; ++j) {
    T sum = T(0);
    for (int64_t ch = 0; ch < sp.nchunks; ++ch) sum += cols[ch][j];
    col_ty[j] = sum;
  }
}

}  // namespace

// The ctypes interface: every array C-contiguous, of the suffix's dtype, except the incoming
// gradient grad [k, N, M], given with its element strides (gsK, gsN, gsM); shapes G, out
// [k, N, M]; tx, txs, u, a (angle) [k, N]; ty [k, M]; a, s (distance), hc (angle) [k].
#define CURVALIGN_LORENTZ_EXPORT(T, SUF)                                                       \
  extern "C" void curvalign_dist_forward_##SUF(const T* G, T* out, const T* tx, const T* ty,  \
                                               const T* a, const T* s, int64_t k, int64_t N,  \
                                               int64_t M, int nthreads) {                     \
    dist_forward<T>(G, out, tx, ty, a, s, k, N, M, nthreads);                                 \
  }                                                                                           \
  extern "C" void curvalign_dist_backward_##SUF(                                              \
      T* GH, const T* grad, int64_t gsK, int64_t gsN, int64_t gsM, const T* tx, const T* ty,  \
      const T* a, const T* s, int64_t k, int64_t N, int64_t M, double r_floor, T* row,        \
      T* col, T* ga, T* gs, int need_c, int nthreads) {                                       \
    dist_backward<T>(GH, GradView<T>{grad, gsK, gsN, gsM, N}, tx, ty, a, s, k, N, M,          \
                     T(r_floor), row, col, ga, gs, need_c != 0, nthreads);                    \
  }                                                                                           \
  extern "C" void curvalign_angle_forward_##SUF(                                              \
      const T* G, T* out, const T* hc, const T* txs, const T* u, const T* a, const T* ty,     \
      int64_t k, int64_t N, int64_t M, double e, int nthreads) {                              \
    angle_forward<T>(G, out, hc, txs, u, a, ty, k, N, M, T(e), nthreads);                     \
  }                                                                                           \
  extern "C" void curvalign_angle_backward_##SUF(                                             \
      T* GM, const T* grad, int64_t gsK, int64_t gsN, int64_t gsM, const T* hc, const T* txs, \
      const T* u, const T* a, const T* ty, int64_t k, int64_t N, int64_t M, double e,         \
      T* row_rc, T* row_txs, T* row_a, T* col_ty, int nthreads) {                             \
    angle_backward<T>(GM, GradView<T>{grad, gsK, gsN, gsM, N}, hc, txs, u, a, ty, k, N, M,    \
                      T(e), row_rc, row_txs, row_a, col_ty, nthreads);                        \
  }

CURVALIGN_LORENTZ_EXPORT(float, f32)
CURVALIGN_LORENTZ_EXPORT(double, f64)
