// CPU building blocks: tiled, auto-vectorised loops run across cores with at::parallel_for.
//
// A kernel streams its inputs once. Work is cut into tiles of kTile elements; per tile the
// composed gradient is built in a small stack buffer (L1-resident) by a few simple loops,
// each `#pragma omp simd` and free of per-element branches (option tests are per tile), and
// the optimizer arithmetic then consumes it and writes the outputs. Reads of an element
// always precede the write of that element, so outputs may alias inputs element-wise
// (out == grad, in-place param update, ...).
#pragma once

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace sapipe {
namespace cpu {

constexpr int64_t kTile = 512;          // elements per stack tile
constexpr int64_t kGrain = 1 << 15;     // elements per parallel work item (at least)
constexpr int64_t kDotChunk = 1 << 15;  // fixed reduction chunk: results independent of threads

#if defined(_OPENMP)
#define SAPIPE_SIMD _Pragma("omp simd")
#define SAPIPE_SIMD_SUM(v) _Pragma("omp simd reduction(+ : v)")
#else
#define SAPIPE_SIMD
#define SAPIPE_SIMD_SUM(v)
#endif

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// Raw view of a GradSpec for one dtype.
template <typename T>
struct Src {
  const T* g;
  const T* prev;
  const T* local;
  const T* delta;
  const T* delta_ref;
  T n, inv_n, lam;
  int64_t form;
  const int64_t* offsets;
  int64_t nseg;

  explicit Src(const GradSpec& s)
      : g(s.grad.data_ptr<T>()),
        prev(ptr<T>(s.prev_local)),
        local(ptr<T>(s.local)),
        delta(ptr<T>(s.delta)),
        delta_ref(ptr<T>(s.delta_ref)),
        n(static_cast<T>(s.n)),
        inv_n(static_cast<T>(s.inv_n)),
        lam(static_cast<T>(s.lam)),
        form(s.form),
        offsets(s.offsets ? s.offsets->data_ptr<int64_t>() : nullptr),
        nseg(s.offsets ? s.offsets->numel() - 1 : 0) {}
};

// h[0:len] = grad - prev / n  (the part of the gradient before DC), elements [off, off+len).
template <typename T>
inline void base_tile(const Src<T>& s, int64_t off, int64_t len, T* __restrict h) {
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

// h[0:len] = full composed gradient. `coeff` = lam * <g, D> of the tensor (outer form).
template <typename T>
inline void compose_tile(const Src<T>& s, int64_t off, int64_t len, T coeff, T* __restrict h) {
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

// Index of the segment holding flat position `pos` (segments may be empty).
inline int64_t segment_of(const int64_t* offsets, int64_t nseg, int64_t pos) {
  return static_cast<int64_t>(std::upper_bound(offsets, offsets + nseg + 1, pos) - offsets) - 1;
}

// Per-tensor dot products <grad - prev/n, delta - delta_ref>, accumulated in double.
// Deterministic: fixed chunks of kDotChunk elements, partial (chunk c, segment s) stored at
// slot s + c (disjoint across chunks), combined in chunk order.
template <typename T>
void dots_impl(const Src<T>& s, int64_t N, double* dots) {
  const int64_t S = s.nseg;
  std::fill(dots, dots + S, 0.0);
  if (N == 0) return;
  const int64_t* off = s.offsets;
  const int64_t nchunks = (N + kDotChunk - 1) / kDotChunk;
  std::vector<double> partials(static_cast<size_t>(S + nchunks), 0.0);

  auto range_dot = [&](int64_t lo, int64_t hi) -> double {
    double acc = 0.0;
    const T* g = s.g;
    const T* d = s.delta;
    const T* r = s.delta_ref;
    const T* p = s.prev;
    const T n = s.n;
    if (p && r) {
      SAPIPE_SIMD_SUM(acc)
      for (int64_t i = lo; i < hi; ++i) {
        const T h = g[i] - p[i] / n;
        const T dd = d[i] - r[i];
        acc += static_cast<double>(h) * static_cast<double>(dd);
      }
    } else if (p) {
      SAPIPE_SIMD_SUM(acc)
      for (int64_t i = lo; i < hi; ++i) {
        const T h = g[i] - p[i] / n;
        acc += static_cast<double>(h) * static_cast<double>(d[i]);
      }
    } else if (r) {
      SAPIPE_SIMD_SUM(acc)
      for (int64_t i = lo; i < hi; ++i) {
        const T dd = d[i] - r[i];
        acc += static_cast<double>(g[i]) * static_cast<double>(dd);
      }
    } else {
      SAPIPE_SIMD_SUM(acc)
      for (int64_t i = lo; i < hi; ++i) acc += static_cast<double>(g[i]) * static_cast<double>(d[i]);
    }
    return acc;
  };

  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t start = c * kDotChunk;
      const int64_t end = std::min(N, start + kDotChunk);
      int64_t seg = segment_of(off, S, start);
      for (int64_t pos = start; pos < end; ++seg) {
        const int64_t hi = std::min(end, off[seg + 1]);
        partials[seg + c] = range_dot(pos, hi);
        pos = hi;
      }
    }
  });
  for (int64_t seg = 0; seg < S; ++seg) {
    if (off[seg + 1] <= off[seg]) continue;
    const int64_t c0 = off[seg] / kDotChunk;
    const int64_t c1 = (off[seg + 1] - 1) / kDotChunk;
    double acc = 0.0;
    for (int64_t c = c0; c <= c1; ++c) acc += partials[seg + c];
    dots[seg] = acc;
  }
}

// Runs fn(offset, len, coeff) over [0, N) in tiles that never straddle a tensor boundary
// when the outer DC form is on (coeff = T(dot) * T(lam) of that tensor; 0 otherwise).
template <typename T, typename Fn>
void for_each_tile(const Src<T>& s, int64_t N, const double* dots, const Fn& fn) {
  if (N == 0) return;
  const bool outer = s.form == kOuter;
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    int64_t seg = outer ? segment_of(s.offsets, s.nseg, begin) : 0;
    for (int64_t pos = begin; pos < end;) {
      int64_t stop = end;
      T coeff = T(0);
      if (outer) {
        while (s.offsets[seg + 1] <= pos) ++seg;
        stop = std::min(end, s.offsets[seg + 1]);
        // reference: dots (tensor dtype) * lam, rounded to the tensor dtype
        coeff = static_cast<T>(dots[seg]) * s.lam;
      }
      for (int64_t t = pos; t < stop; t += kTile) fn(t, std::min(kTile, stop - t), coeff);
      pos = stop;
    }
  });
}

// Dots for the outer form: the caller's, or computed now (first pass). Empty otherwise.
template <typename T>
const double* outer_dots(const GradSpec& gs, const Src<T>& s, int64_t N, std::vector<double>& store) {
  if (s.form != kOuter) return nullptr;
  if (gs.dots) return gs.dots->data_ptr<double>();
  store.assign(static_cast<size_t>(s.nseg), 0.0);
  dots_impl<T>(s, N, store.data());
  return store.data();
}

}  // namespace cpu
}  // namespace sapipe
