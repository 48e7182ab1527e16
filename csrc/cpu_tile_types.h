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

template <typename T>
struct SgdTile {
  const T* param;
  T* buf;
  T* dst;  // param (in place) or out (peek)
  bool peek, has_momentum, has_wd, first, nesterov, maximize;
  T wd, mom, damp1, neg_lr;
};

template <typename T>
struct AdamTile {
  const T* param;
  T* exp_avg;
  T* exp_avg_sq;
  T* dst;
  bool peek, maximize, l2, decay_on, small_w;
  T wd, w, one_minus_w, beta2, omb2, bc2s, eps, neg_ss, decay;
};

template <typename T>
struct TileTable {
  void (*compose)(const TileSrc<T>&, T* out, int64_t off, int64_t len, T coeff);
  void (*sgd)(const TileSrc<T>&, const SgdTile<T>&, int64_t off, int64_t len, T coeff);
  void (*adam)(const TileSrc<T>&, const AdamTile<T>&, int64_t off, int64_t len, T coeff);
  double (*dot)(const TileSrc<T>&, int64_t lo, int64_t hi);  // <g - prev/n, delta - ref>
};

// The tile kernels for the best instruction set this CPU supports (see cpu_dispatch.cpp).
template <typename T>
const TileTable<T>& tiles();
const char* isa_name();
bool set_isa(const char* name);  // "base" / "avx2"; false if unknown or unsupported here

}  // namespace cpu
}  // namespace sapipe
