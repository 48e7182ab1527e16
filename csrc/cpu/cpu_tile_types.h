// Plain data shared by the CPU drivers (cpu_*.cpp, ATen) and the per-ISA tile kernels
// (cpu_tiles.h): no ATen, no std templates.
#pragma once

#include <cstdint>

namespace sapipe {
namespace cpu {

constexpr int64_t kTile = 512;  // elements per stack tile

enum TileForm : int64_t { kTileNoDc = 0, kDiagonal = 1, kOuter = 2 };  // = sapipe::DcForm

// Raw view of a GradSpec: g~ = DC_lam(g - prev / n, delta - delta_ref) + local * inv_n.
template <typename T>
struct TileSrc {
  const T* g;
  const T* prev;
  const T* local;
  const T* delta;
  const T* delta_ref;
  T n, inv_n, lam;
  int64_t form;
};

// Extras of an in-place update (OPT), each optional, done in the same pass over memory:
//  * hist: x_t is also written here (a weight-history slot; may alias a source of the update,
//    e.g. DC's delta_ref, since every read of an element precedes its writes);
//  * peek_dst: x~ = OPT_peek(x_t, g~) from the just-updated weights and state, g~ = `peek`
//    (its own g / prev / local; form kDiagonal takes Delta = x_t - x_{t-1}, the update's own
//    step; delta / delta_ref of `peek` are unused);
//  * lanes: kDotLanes running sums of <peek.g - peek.prev/n, x_t - x_{t-1}> (the outer DC
//    form's dot products for a peek done afterwards), lane k taking the elements at distance
//    k mod kDotLanes from the tile start; tiles start kTile apart from the tensor's first
//    element, so the order of additions is that of the range dot product (dot_impl).
template <typename T>
struct StepExtras {
  T* hist = nullptr;
  T* peek_dst = nullptr;
  TileSrc<T> peek{};
  bool dots = false;
};

constexpr int kDotLanes = 16;  // partial sums of a dot product (see dot_impl)

// The lanes of a dot product summed pairwise in a fixed tree (lanes are overwritten).
inline double reduce_lanes(double* lanes) {
  for (int w = kDotLanes / 2; w > 0; w /= 2) {
    for (int k = 0; k < w; ++k) lanes[k] += lanes[k + w];
  }
  return lanes[0];
}

template <typename T>
struct SgdTile {
  const T* param;
  T* buf;
  T* dst;  // param (in place) or out (peek)
  bool peek, has_momentum, has_wd, first, nesterov, maximize;
  T wd, mom, damp1, neg_lr;
  StepExtras<T> extra;  // only with peek == false
};

template <typename T>
struct AdamTile {
  const T* param;
  T* exp_avg;
  T* exp_avg_sq;
  T* dst;
  bool peek, maximize, l2, decay_on, small_w;
  T wd, w, one_minus_w, beta2, omb2, bc2s, eps, neg_ss, decay;
  T peek_bc2s, peek_neg_ss;  // the fused peek's bias correction (step + 1)
  StepExtras<T> extra;       // only with peek == false
};

template <typename T>
struct TileTable {
  void (*compose)(const TileSrc<T>&, T* out, int64_t off, int64_t len, T coeff);
  // `lanes` (kDotLanes doubles) is used only when the extras ask for dots
  void (*sgd)(const TileSrc<T>&, const SgdTile<T>&, int64_t off, int64_t len, T coeff,
              double* lanes);
  void (*adam)(const TileSrc<T>&, const AdamTile<T>&, int64_t off, int64_t len, T coeff,
               double* lanes);
  double (*dot)(const TileSrc<T>&, int64_t lo, int64_t hi);  // <g - prev/n, delta - ref>
};

// The tile kernels for the best instruction set this CPU supports (see cpu_dispatch.cpp).
template <typename T>
const TileTable<T>& tiles();
const char* isa_name();
bool set_isa(const char* name);  // "base" / "avx2"; false if unknown or unsupported here

}  // namespace cpu
}  // namespace sapipe
