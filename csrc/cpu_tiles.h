// CPU tile kernels: the per-element arithmetic on one tile of <= kTile elements, as plain
// loops over raw pointers (no ATen, no std templates), so one source compiles for several
// instruction sets: cpu_tiles.cpp (baseline x86-64 / any arch) and cpu_tiles_avx2.cpp
// (`#pragma GCC target("avx2")`), chosen at run time (cpu_dispatch.cpp). FMA is deliberately
// not enabled, so every ISA computes bit-identical results (IEEE add/mul/div/sqrt, same order).
//
// Per tile, the composed gradient is built in a small stack buffer (L1-resident) by a few
// simple `#pragma omp simd` loops with no per-element branches (option tests are per tile),
// then the optimizer arithmetic consumes it and writes the outputs. Reads of an element always
// precede the write of that element, so outputs may alias inputs element-wise.
//
// Include cpu_tile_types.h (and <cmath>) before this file, then define SAPIPE_CPU_ISA.
#ifndef SAPIPE_CPU_ISA
#error "define SAPIPE_CPU_ISA (the namespace of this instruction-set variant) first"
#endif

#if defined(_OPENMP)
#define SAPIPE_SIMD _Pragma("omp simd")
#else
#define SAPIPE_SIMD
#endif

namespace sapipe {
namespace cpu {
namespace SAPIPE_CPU_ISA {

// h[0:len] = grad - prev / n  (the part of the gradient before DC), elements [off, off+len).
template <typename T>
inline void base_tile(const TileSrc<T>& s, int64_t off, int64_t len, T* __restrict h) {
  const T* g = s.g + off;
  if (s.prev) {
    const T* p = s.prev + off;
    const T n = s.n;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = g[i] - p[i] / n;
  } else {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = g[i];
  }
}

// h[0:len] = the composed gradient. `coeff` = lam * <g, D> of the tile's tensor (outer form).
template <typename T>
inline void compose_tile(const TileSrc<T>& s, int64_t off, int64_t len, T coeff, T* __restrict h) {
  base_tile(s, off, len, h);
  if (s.form == kDiagonal) {
    // reference: scale = g * D; scale *= g; scale *= lam; out = g + scale
    const T* d = s.delta + off;
    const T lam = s.lam;
    if (s.delta_ref) {
      const T* r = s.delta_ref + off;
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) h[i] = h[i] + ((h[i] * (d[i] - r[i])) * h[i]) * lam;
    } else {
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) h[i] = h[i] + ((h[i] * d[i]) * h[i]) * lam;
    }
  } else if (s.form == kOuter) {
    // reference: addcmul(g, g, coeff) = g + g * coeff
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + h[i] * coeff;
  }
  if (s.local) {
    const T* l = s.local + off;
    const T a = s.inv_n;  // reference: h.add_(local, alpha=1/n)
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + a * l[i];
  }
}

template <typename T>
void compose_store(const TileSrc<T>& s, T* out, int64_t off, int64_t len, T coeff) {
  alignas(64) T h[kTile];
  compose_tile(s, off, len, coeff, h);
  T* dst = out + off;
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) dst[i] = h[i];
}

// torch.optim.SGD's single-tensor step on the tile (sapipe.ops.reference_sgd).
template <typename T>
void sgd_tile(const TileSrc<T>& s, const SgdTile<T>& a, int64_t off, int64_t len, T coeff) {
  alignas(64) T h[kTile];
  alignas(64) T b[kTile];
  compose_tile(s, off, len, coeff, h);
  const T* p = a.param + off;
  if (a.maximize) {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = -h[i];
  }
  if (a.has_wd) {  // d_p = d_p + wd * param
    const T wd = a.wd;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + wd * p[i];
  }
  const T* d = h;
  if (a.has_momentum) {
    const T mom = a.mom;
    if (a.first) {  // buf = clone(d_p)
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) b[i] = h[i];
    } else {  // buf = buf * momentum + (1 - dampening) * d_p
      const T* mb = a.buf + off;
      const T damp1 = a.damp1;
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) b[i] = mb[i] * mom + damp1 * h[i];
    }
    if (!a.peek) {
      T* mb = a.buf + off;
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) mb[i] = b[i];
    }
    if (a.nesterov) {  // d_p = d_p + momentum * buf
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) h[i] = h[i] + mom * b[i];
    } else {
      d = b;
    }
  }
  T* dst = a.dst + off;  // param + (-lr) * d_p
  const T neg_lr = a.neg_lr;
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) dst[i] = p[i] + neg_lr * d[i];
}

// torch.optim.Adam(W)'s single-tensor step on the tile (sapipe.ops.reference_adam).
template <typename T>
void adam_tile(const TileSrc<T>& s, const AdamTile<T>& a, int64_t off, int64_t len, T coeff) {
  alignas(64) T h[kTile];
  alignas(64) T m[kTile];
  alignas(64) T v[kTile];
  compose_tile(s, off, len, coeff, h);
  const T* p = a.param + off;
  if (a.maximize) {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = -h[i];
  }
  if (a.l2) {  // g = g + wd * param
    const T wd = a.wd;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + wd * p[i];
  }
  const T* ea = a.exp_avg + off;
  const T* eas = a.exp_avg_sq + off;
  const T w = a.w;
  if (a.small_w) {  // exp_avg.lerp(g, w), torch's formula for |w| < 0.5
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) m[i] = ea[i] + w * (h[i] - ea[i]);
  } else {
    const T one_minus_w = a.one_minus_w;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) m[i] = h[i] - (h[i] - ea[i]) * one_minus_w;
  }
  const T beta2 = a.beta2, omb2 = a.omb2;  // exp_avg_sq * beta2 + (1 - beta2) * g * g
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) v[i] = eas[i] * beta2 + (omb2 * h[i]) * h[i];
  if (!a.peek) {
    T* ea_w = a.exp_avg + off;
    T* eas_w = a.exp_avg_sq + off;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) {
      ea_w[i] = m[i];
      eas_w[i] = v[i];
    }
  }
  // base + (-step_size) * m / (sqrt(v) / sqrt(bc2) + eps), base = param (* (1 - lr*wd))
  T* dst = a.dst + off;
  const T bc2s = a.bc2s, eps = a.eps, neg_ss = a.neg_ss;
  if (a.decay_on) {
    const T dec = a.decay;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i)
      dst[i] = p[i] * dec + (neg_ss * m[i]) / (std::sqrt(v[i]) / bc2s + eps);
  } else {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i)
      dst[i] = p[i] + (neg_ss * m[i]) / (std::sqrt(v[i]) / bc2s + eps);
  }
}

// <g - prev/n, delta - delta_ref> over [lo, hi): products and sums in double, in kDotLanes
// independent partial sums (lane k takes the elements i = lo + k mod kDotLanes) combined in a
// fixed order at the end. The order is written out, not left to the vectoriser (no
// reassociation), so every ISA gets the same bits; the lanes break the add-latency chain.
template <typename T, bool kPrev, bool kRef>
double dot_impl(const TileSrc<T>& s, int64_t lo, int64_t hi) {
  constexpr int kDotLanes = 16;
  const T* g = s.g;
  const T* d = s.delta;
  const T* r = s.delta_ref;
  const T* p = s.prev;
  const T n = s.n;
  double acc[kDotLanes] = {};
  auto term = [&](int64_t i) {
    T h = g[i];
    if (kPrev) h = g[i] - p[i] / n;
    T dd = d[i];
    if (kRef) dd = d[i] - r[i];
    return static_cast<double>(h) * static_cast<double>(dd);
  };
  int64_t i = lo;
  for (; i + kDotLanes <= hi; i += kDotLanes) {
    for (int k = 0; k < kDotLanes; ++k) acc[k] += term(i + k);
  }
  for (int k = 0; i < hi; ++i, ++k) acc[k] += term(i);
  for (int w = kDotLanes / 2; w > 0; w /= 2) {  // pairwise, fixed tree
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  }
  return acc[0];
}

template <typename T>
double range_dot(const TileSrc<T>& s, int64_t lo, int64_t hi) {
  if (s.prev) return s.delta_ref ? dot_impl<T, true, true>(s, lo, hi) : dot_impl<T, true, false>(s, lo, hi);
  return s.delta_ref ? dot_impl<T, false, true>(s, lo, hi) : dot_impl<T, false, false>(s, lo, hi);
}

template <typename T>
constexpr TileTable<T> make_table() {
  return TileTable<T>{&compose_store<T>, &sgd_tile<T>, &adam_tile<T>, &range_dot<T>};
}

extern const TileTable<float> table_f;  // external linkage (read by cpu_dispatch.cpp)
extern const TileTable<double> table_d;
const TileTable<float> table_f = make_table<float>();
const TileTable<double> table_d = make_table<double>();

}  // namespace SAPIPE_CPU_ISA
}  // namespace cpu
}  // namespace sapipe

#undef SAPIPE_SIMD
