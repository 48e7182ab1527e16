// CPU tile kernels: the per-element arithmetic on one tile of <= kTile elements, as plain
// loops over raw pointers (no ATen, no std templates), so one source compiles for several
// instruction sets: cpu_tiles.cpp (baseline x86-64 / any arch) and cpu_tiles_avx2.cpp
// (`#pragma GCC target("avx2")`), chosen at run time (cpu_dispatch.cpp). FMA is deliberately
// not enabled, so every ISA computes bit-identical results (IEEE add/mul/div/sqrt, same order).
//
// Per tile, the composed gradient is built in a small stack buffer (L1-resident) by a few
// simple `#pragma omp simd` loops with no per-element branches (option tests are per tile),
// then the optimizer arithmetic consumes it and writes the outputs. A gradient with nothing
// to compose (no DC, no local terms) is read where it lies by the one-loop SGD and Adam
// steps: copying it to the stack first cost those steps up to half their time. Reads of an element always
// precede the write of that element, so outputs may alias inputs element-wise.
//
// An in-place update's extras (StepExtras: history write, fused peek, the step's dots) reuse
// the tile: x_t and the step x_t - x_{t-1} stay on the stack, so the prediction costs its own
// gradient terms and its output, not another pass over weights and optimizer state. (Tried and
// measured slower: one loop per tile with the options as selects - GCC then does not
// vectorise it; non-temporal stores for x~ / the history slot - no gain measurable here.)
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

// Whether the composed gradient is the gradient itself (no DC, no local terms).
template <typename T>
inline bool is_plain(const TileSrc<T>& s) {
  return !s.prev && s.form == kTileNoDc && !s.local;
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

// The common SGD step (momentum after its first step, not maximising) as one loop, each
// element's arithmetic in registers: the same operations in the same order as the general
// path of sgd_math below, so the same bits. h is only read here.
template <typename T, bool kWd, bool kNesterov>
inline void sgd_momentum_loop(const SgdTile<T>& a, const T* x, const T* mb, int64_t len,
                              const T* __restrict h, T* b, T* r) {
  const T wd = a.wd, mom = a.mom, damp1 = a.damp1, neg_lr = a.neg_lr;
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) {
    T d = h[i];
    if (kWd) d = d + wd * x[i];
    const T bi = mb[i] * mom + damp1 * d;
    b[i] = bi;
    d = kNesterov ? d + mom * bi : bi;
    r[i] = x[i] + neg_lr * d;
  }
}

// Whether sgd_math takes its one-loop path (sgd_momentum_loop), which only reads h.
template <typename T>
inline bool sgd_in_one_loop(const SgdTile<T>& a, bool first) {
  return a.has_momentum && !first && !a.maximize;
}

template <typename T>
inline void sgd_one_loop(const SgdTile<T>& a, const T* x, const T* mb, int64_t len, const T* __restrict h, T* b,
                         T* r) {
  if (a.has_wd) {
    if (a.nesterov) sgd_momentum_loop<T, true, true>(a, x, mb, len, h, b, r);
    else sgd_momentum_loop<T, true, false>(a, x, mb, len, h, b, r);
  } else {
    if (a.nesterov) sgd_momentum_loop<T, false, true>(a, x, mb, len, h, b, r);
    else sgd_momentum_loop<T, false, false>(a, x, mb, len, h, b, r);
  }
}

// One SGD step of torch.optim.SGD (sapipe.ops.reference_sgd) on `len` elements: h = the
// gradient (may be overwritten), x = the weights, mb = the momentum buffer (not read when
// `first`); b <- the new momentum buffer, r <- x + (-lr) * d_p. r may be x (in place); mb may
// be b.
template <typename T>
inline void sgd_math(const SgdTile<T>& a, bool first, const T* x, const T* mb, int64_t len,
                     T* __restrict h, T* b, T* r) {
  if (sgd_in_one_loop(a, first)) {
    sgd_one_loop(a, x, mb, len, h, b, r);
    return;
  }
  if (a.maximize) {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = -h[i];
  }
  if (a.has_wd) {  // d_p = d_p + wd * param
    const T wd = a.wd;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + wd * x[i];
  }
  const T* d = h;
  if (a.has_momentum) {
    const T mom = a.mom;
    if (first) {  // buf = clone(d_p)
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) b[i] = h[i];
    } else {  // buf = buf * momentum + (1 - dampening) * d_p
      const T damp1 = a.damp1;
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) b[i] = mb[i] * mom + damp1 * h[i];
    }
    if (a.nesterov) {  // d_p = d_p + momentum * buf
      SAPIPE_SIMD
      for (int64_t i = 0; i < len; ++i) h[i] = h[i] + mom * b[i];
    } else {
      d = b;
    }
  }
  const T neg_lr = a.neg_lr;  // param + (-lr) * d_p
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) r[i] = x[i] + neg_lr * d[i];
}

template <typename T>
inline void copy_tile(const T* src, int64_t len, T* dst) {
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) dst[i] = src[i];
}

// Stores x_t (xn, on the stack) into dst (the weights, where x (x_{t-1}) is read: dst may be
// x) and, if given, hist; dx <- x_t - x_{t-1}, the step the update just took (the peek's DC
// Delta). One loop: each element's x_{t-1} is read before x_t overwrites it.
template <typename T>
inline void commit_step(const T* __restrict xn, const T* x, int64_t len, T* dst, T* hist,
                        T* __restrict dx) {
  if (hist) {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) {
      dx[i] = xn[i] - x[i];
      dst[i] = xn[i];
      hist[i] = xn[i];
    }
  } else {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) {
      dx[i] = xn[i] - x[i];
      dst[i] = xn[i];
    }
  }
}

// lanes[k] += h[i] * dx[i] (in double) for i = k mod kDotLanes, in increasing i: the order
// of dot_impl, so a range split into tiles of kTile sums exactly as range_dot does.
template <typename T>
inline void dot_lanes(const T* h, const T* dx, int64_t len, double* lanes) {
  int64_t i = 0;
  for (; i + kDotLanes <= len; i += kDotLanes) {
    for (int k = 0; k < kDotLanes; ++k)
      lanes[k] += static_cast<double>(h[i + k]) * static_cast<double>(dx[i + k]);
  }
  for (int k = 0; i < len; ++i, ++k) lanes[k] += static_cast<double>(h[i]) * static_cast<double>(dx[i]);
}

// The fused peek's gradient g~ on the tile, h = its base (g - prev/n, already in h): the
// diagonal DC form with Delta = dx (the update's own step), then + local/n. (The outer form's
// coefficient needs every element's step first: a second call, with the dots of this pass.)
template <typename T>
inline void finish_peek_grad(const TileSrc<T>& s, int64_t off, int64_t len, const T* dx,
                             T* __restrict h) {
  if (s.form == kDiagonal) {
    const T lam = s.lam;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + ((h[i] * dx[i]) * h[i]) * lam;
  }
  if (s.local) {
    const T* l = s.local + off;
    const T a = s.inv_n;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + a * l[i];
  }
}

// torch.optim.SGD's single-tensor step on the tile: OPT in place (with a.extra: also the
// history write, the fused peek and the step's dot products), or OPT_peek into a.dst.
template <typename T>
void sgd_tile(const TileSrc<T>& s, const SgdTile<T>& a, int64_t off, int64_t len, T coeff,
              double* lanes) {
  alignas(64) T h[kTile];
  alignas(64) T b[kTile];
  const T* p = a.param + off;
  const T* mb = a.buf ? a.buf + off : nullptr;
  const StepExtras<T>& e = a.extra;
  const bool need_step = e.peek_dst || e.dots;
  // The new momentum goes straight into the state (OPT), or onto the stack (OPT_peek).
  T* nb = !a.peek && a.has_momentum ? a.buf + off : b;
  if (is_plain(s) && (a.peek || !need_step) && sgd_in_one_loop(a, a.first)) {
    // the gradient as it is, read where it lies: no tile to compose
    sgd_one_loop(a, p, mb, len, s.g + off, nb, a.dst + off);
    if (e.hist) copy_tile(a.dst + off, len, e.hist + off);
    return;
  }
  compose_tile(s, off, len, coeff, h);
  if (a.peek || !need_step) {  // plain OPT / OPT_peek, and OPT + history write
    sgd_math(a, a.first, p, mb, len, h, nb, a.dst + off);
    if (e.hist) copy_tile(a.dst + off, len, e.hist + off);  // after every read of the sources
    return;
  }
  alignas(64) T xn[kTile];  // x_t
  alignas(64) T dx[kTile];  // x_t - x_{t-1}
  alignas(64) T hp[kTile];  // the peek's gradient, its base read with the update's sources
  base_tile(e.peek, off, len, hp);
  sgd_math(a, a.first, p, mb, len, h, nb, xn);
  // every source element is read: the writes may alias sources from here on
  commit_step(xn, p, len, a.dst + off, e.hist ? e.hist + off : nullptr, dx);
  if (e.dots) dot_lanes(hp, dx, len, lanes);
  if (e.peek_dst) {  // x~ = OPT_peek(x_t, g~): the momentum buffer has started (or is unused);
    // the peek's own momentum is scratch (b), the state keeps the update's (nb)
    finish_peek_grad(e.peek, off, len, dx, hp);
    sgd_math(a, false, xn, nb, len, hp, b, e.peek_dst + off);
  }
}

// The common Adam(W) step (not maximising) as one loop, each element's arithmetic in
// registers: the same operations in the same order as the general path of adam_math below.
template <typename T, bool kL2, bool kSmallW, bool kDecay>
inline void adam_loop(const AdamTile<T>& a, T neg_ss, T bc2s, const T* x, const T* ea,
                      const T* eas, int64_t len, const T* __restrict h, T* m, T* v, T* r) {
  const T wd = a.wd, w = a.w, one_minus_w = a.one_minus_w, beta2 = a.beta2, omb2 = a.omb2;
  const T eps = a.eps, dec = a.decay;
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) {
    T g = h[i];
    if (kL2) g = g + wd * x[i];
    const T e = ea[i];
    const T mi = kSmallW ? e + w * (g - e) : g - (g - e) * one_minus_w;
    const T vi = eas[i] * beta2 + (omb2 * g) * g;
    m[i] = mi;
    v[i] = vi;
    const T base = kDecay ? x[i] * dec : x[i];
    r[i] = base + (neg_ss * mi) / (std::sqrt(vi) / bc2s + eps);
  }
}

template <typename T, bool kL2>
inline void adam_loop_for(const AdamTile<T>& a, T neg_ss, T bc2s, const T* x, const T* ea,
                          const T* eas, int64_t len, const T* h, T* m, T* v, T* r) {
  if (a.small_w) {
    if (a.decay_on) adam_loop<T, kL2, true, true>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
    else adam_loop<T, kL2, true, false>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
  } else {
    if (a.decay_on) adam_loop<T, kL2, false, true>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
    else adam_loop<T, kL2, false, false>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
  }
}

// adam_math's one-loop path (not maximising), which only reads h.
template <typename T>
inline void adam_one_loop(const AdamTile<T>& a, T neg_ss, T bc2s, const T* x, const T* ea, const T* eas,
                          int64_t len, const T* h, T* m, T* v, T* r) {
  if (a.l2) adam_loop_for<T, true>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
  else adam_loop_for<T, false>(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
}

// One Adam(W) step of torch.optim.Adam (sapipe.ops.reference_adam) on `len` elements: h = the
// gradient (may be overwritten), x = the weights, ea / eas = the moments; m, v <- the new
// moments, r <- the new weights. r may be x, m may be ea, v may be eas (element-wise in place).
template <typename T>
inline void adam_math(const AdamTile<T>& a, T neg_ss, T bc2s, const T* x, const T* ea,
                      const T* eas, int64_t len, T* __restrict h, T* m, T* v, T* r) {
  if (!a.maximize) {
    adam_one_loop(a, neg_ss, bc2s, x, ea, eas, len, h, m, v, r);
    return;
  }
  // maximising: the step on -g, loop by loop
  SAPIPE_SIMD
  for (int64_t i = 0; i < len; ++i) h[i] = -h[i];
  if (a.l2) {  // g = g + wd * param
    const T wd = a.wd;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) h[i] = h[i] + wd * x[i];
  }
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
  // base + (-step_size) * m / (sqrt(v) / sqrt(bc2) + eps), base = param (* (1 - lr*wd))
  const T eps = a.eps;
  if (a.decay_on) {
    const T dec = a.decay;
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i)
      r[i] = x[i] * dec + (neg_ss * m[i]) / (std::sqrt(v[i]) / bc2s + eps);
  } else {
    SAPIPE_SIMD
    for (int64_t i = 0; i < len; ++i) r[i] = x[i] + (neg_ss * m[i]) / (std::sqrt(v[i]) / bc2s + eps);
  }
}

// torch.optim.Adam(W)'s single-tensor step on the tile: OPT in place (with a.extra: also the
// history write, the fused peek and the step's dot products), or OPT_peek into a.dst.
template <typename T>
void adam_tile(const TileSrc<T>& s, const AdamTile<T>& a, int64_t off, int64_t len, T coeff,
               double* lanes) {
  alignas(64) T h[kTile];
  alignas(64) T m[kTile];
  alignas(64) T v[kTile];
  const T* p = a.param + off;
  T* ea = a.exp_avg + off;
  T* eas = a.exp_avg_sq + off;
  const StepExtras<T>& e = a.extra;
  const bool need_step = e.peek_dst || e.dots;
  // The new moments go straight into the state (OPT), or onto the stack (OPT_peek).
  T* nm = a.peek ? m : ea;
  T* nv = a.peek ? v : eas;
  if (is_plain(s) && (a.peek || !need_step) && !a.maximize) {
    // the gradient as it is, read where it lies: no tile to compose
    adam_one_loop(a, a.neg_ss, a.bc2s, p, ea, eas, len, s.g + off, nm, nv, a.dst + off);
    if (e.hist) copy_tile(a.dst + off, len, e.hist + off);
    return;
  }
  compose_tile(s, off, len, coeff, h);
  if (a.peek || !need_step) {  // plain OPT / OPT_peek, and OPT + history write
    adam_math(a, a.neg_ss, a.bc2s, p, ea, eas, len, h, nm, nv, a.dst + off);
    if (e.hist) copy_tile(a.dst + off, len, e.hist + off);  // after every read of the sources
    return;
  }
  alignas(64) T xn[kTile];  // x_t
  alignas(64) T dx[kTile];  // x_t - x_{t-1}
  alignas(64) T hp[kTile];  // the peek's gradient, its base read with the update's sources
  base_tile(e.peek, off, len, hp);
  adam_math(a, a.neg_ss, a.bc2s, p, ea, eas, len, h, nm, nv, xn);
  // every source element is read: the writes may alias sources from here on
  commit_step(xn, p, len, a.dst + off, e.hist ? e.hist + off : nullptr, dx);
  if (e.dots) dot_lanes(hp, dx, len, lanes);
  if (e.peek_dst) {  // x~ = OPT_peek(x_t, g~) with the new moments, bias correction of step + 1;
    // the peek's own moments are scratch (m, v), the state keeps the update's
    finish_peek_grad(e.peek, off, len, dx, hp);
    adam_math(a, a.peek_neg_ss, a.peek_bc2s, xn, nm, nv, len, hp, m, v, e.peek_dst + off);
  }
}

// <g - prev/n, delta - delta_ref> over [lo, hi): products and sums in double, in kDotLanes
// independent partial sums (lane k takes the elements i = lo + k mod kDotLanes) combined in a
// fixed order at the end. The order is written out, not left to the vectoriser (no
// reassociation), so every ISA gets the same bits; the lanes break the add-latency chain.
template <typename T, bool kPrev, bool kRef>
double dot_impl(const TileSrc<T>& s, int64_t lo, int64_t hi) {
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
  return reduce_lanes(acc);
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
