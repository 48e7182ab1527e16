// CPU drivers: walk a segment in tiles across cores (at::parallel_for) and call the tile
// kernels (cpu_tiles.h, per-ISA, chosen at run time); the outer DC form's per-tensor dot
// products (first pass) are reduced here.
#pragma once

#include "common.h"
#include "cpu_tile_types.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace sapipe {
namespace cpu {

constexpr int64_t kGrain = 1 << 15;     // elements per parallel work item (at least)
constexpr int64_t kDotChunk = 1 << 15;  // fixed reduction chunk: results independent of threads

static_assert(int64_t(kDiagonal) == int64_t(sapipe::kDiagonal) &&
                  int64_t(kOuter) == int64_t(sapipe::kOuter),
              "DC form codes");

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// A GradSpec for one dtype: the tile kernels' view plus the tensor boundaries.
template <typename T>
struct Src {
  TileSrc<T> t;
  const int64_t* offsets;
  int64_t nseg;

  explicit Src(const GradSpec& s)
      : t{s.grad.data_ptr<T>(), ptr<T>(s.prev_local), ptr<T>(s.local), ptr<T>(s.delta),
          ptr<T>(s.delta_ref), static_cast<T>(s.n), static_cast<T>(s.inv_n),
          static_cast<T>(s.lam), s.form},
        offsets(s.offsets ? s.offsets->data_ptr<int64_t>() : nullptr),
        nseg(s.offsets ? s.offsets->numel() - 1 : 0) {}
};

// The tile kernels' view of an update's extras (UpdateExtras in common.h).
template <typename T>
StepExtras<T> step_extras(const UpdateExtras& e) {
  StepExtras<T> x;
  x.hist = ptr<T>(e.hist);
  x.peek_dst = ptr<T>(e.peek_out);
  if (e.peek) x.peek = Src<T>(*e.peek).t;
  x.dots = e.step_dots.has_value();
  return x;
}

// Index of the segment holding flat position `pos` (segments may be empty).
inline int64_t segment_of(const int64_t* offsets, int64_t nseg, int64_t pos) {
  return static_cast<int64_t>(std::upper_bound(offsets, offsets + nseg + 1, pos) - offsets) - 1;
}

// dots[seg] = the sum of tensor seg's chunk partials (partials[seg + c]), in chunk order.
inline void combine_partials(const int64_t* off, int64_t S, const double* partials, double* dots) {
  for (int64_t seg = 0; seg < S; ++seg) {
    if (off[seg + 1] <= off[seg]) continue;
    const int64_t c0 = off[seg] / kDotChunk;
    const int64_t c1 = (off[seg + 1] - 1) / kDotChunk;
    double acc = 0.0;
    for (int64_t c = c0; c <= c1; ++c) acc += partials[seg + c];
    dots[seg] = acc;
  }
}

// Per-tensor dot products into dots[0:S]. Deterministic: fixed chunks of kDotChunk elements;
// the partial of (chunk c, tensor s) goes to slot s + c (disjoint across chunks: a chunk's
// tensors start at or after the previous chunk's last one), combined in chunk order.
template <typename T>
void dots_impl(const Src<T>& s, int64_t N, double* dots) {
  const int64_t S = s.nseg;
  std::fill(dots, dots + S, 0.0);
  if (N == 0) return;
  const int64_t* off = s.offsets;
  const int64_t nchunks = (N + kDotChunk - 1) / kDotChunk;
  std::vector<double> partials(static_cast<size_t>(S + nchunks), 0.0);
  const auto range_dot = tiles<T>().dot;
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t start = c * kDotChunk;
      const int64_t end = std::min(N, start + kDotChunk);
      int64_t seg = segment_of(off, S, start);
      for (int64_t pos = start; pos < end; ++seg) {
        const int64_t hi = std::min(end, off[seg + 1]);
        partials[seg + c] = range_dot(s.t, pos, hi);
        pos = hi;
      }
    }
  });
  combine_partials(off, S, partials.data(), dots);
}

// Runs fn(offset, len, coeff) over [0, N) in tiles of <= kTile that never straddle a tensor
// boundary when the outer DC form is on (coeff = T(dot) * T(lam) of that tensor, as the
// reference rounds it; 0 otherwise).
template <typename T, typename Fn>
void for_each_tile(const Src<T>& s, int64_t N, const double* dots, const Fn& fn) {
  if (N == 0) return;
  const bool outer = s.t.form == kOuter;
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    int64_t seg = outer ? segment_of(s.offsets, s.nseg, begin) : 0;
    for (int64_t pos = begin; pos < end;) {
      int64_t stop = end;
      T coeff = T(0);
      if (outer) {
        while (s.offsets[seg + 1] <= pos) ++seg;
        stop = std::min(end, s.offsets[seg + 1]);
        coeff = static_cast<T>(dots[seg]) * s.t.lam;
      }
      for (int64_t t = pos; t < stop; t += kTile) fn(t, std::min(kTile, stop - t), coeff);
      pos = stop;
    }
  });
}

// Runs fn(offset, len, lanes) over [0, N) for an update that also sums per-tensor dot
// products into dots[0:S] (tensors: offsets[0..S]; the update's own gradient must not use the
// outer form). Deterministic and in the order of dots_impl: fixed chunks of kDotChunk
// elements; each tensor's part of a chunk is walked in tiles of kTile from its first element,
// its kDotLanes lanes (summed into by fn) reduced into partials[seg + chunk], and those
// combined in chunk order. So the dots equal those of a separate dots_impl pass, bit for bit.
template <typename Fn>
void for_each_dot_tile(const int64_t* off, int64_t S, int64_t N, double* dots, const Fn& fn) {
  std::fill(dots, dots + S, 0.0);
  if (N == 0) return;
  const int64_t nchunks = (N + kDotChunk - 1) / kDotChunk;
  std::vector<double> partials(static_cast<size_t>(S + nchunks), 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t start = c * kDotChunk;
      const int64_t end = std::min(N, start + kDotChunk);
      int64_t seg = segment_of(off, S, start);
      for (int64_t pos = start; pos < end; ++seg) {
        const int64_t hi = std::min(end, off[seg + 1]);
        double lanes[kDotLanes] = {};
        for (int64_t t = pos; t < hi; t += kTile) fn(t, std::min(kTile, hi - t), lanes);
        partials[seg + c] = reduce_lanes(lanes);
        pos = hi;
      }
    }
  });
  combine_partials(off, S, partials.data(), dots);
}

// Dots for the outer form: the caller's, or computed now (first pass). nullptr otherwise.
template <typename T>
const double* outer_dots(const GradSpec& gs, const Src<T>& s, int64_t N, std::vector<double>& store) {
  if (s.t.form != kOuter) return nullptr;
  if (gs.dots) return gs.dots->data_ptr<double>();
  store.assign(static_cast<size_t>(s.nseg), 0.0);
  dots_impl<T>(s, N, store.data());
  return store.data();
}

// Runs an update tile kernel over [0, N): kernel(offset, len, coeff, lanes), through
// for_each_dot_tile when the extras ask for the step's dot products (filled in e.step_dots),
// else for_each_tile (lanes unused).
template <typename T, typename Kernel>
void run_update(const Src<T>& s, int64_t N, const double* dots, const UpdateExtras& e,
                const Kernel& kernel) {
  if (e.step_dots) {
    const at::Tensor& o = *e.peek->offsets;
    for_each_dot_tile(o.data_ptr<int64_t>(), o.numel() - 1, N, e.step_dots->data_ptr<double>(),
                      [&](int64_t off, int64_t len, double* lanes) { kernel(off, len, T(0), lanes); });
  } else {
    for_each_tile<T>(s, N, dots, [&](int64_t off, int64_t len, T coeff) {
      kernel(off, len, coeff, nullptr);
    });
  }
}

}  // namespace cpu
}  // namespace sapipe
