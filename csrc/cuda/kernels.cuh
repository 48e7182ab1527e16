// sapipe CUDA kernels, free of torch: raw pointers, POD parameter structs and host-side
// launchers taking a cudaStream_t. csrc/cuda/cuda_ops.cu wraps them for ATen tensors
// (c10::Half / c10::BFloat16 / float / double); tests/test_kernels.py also compiles this header
// standalone with nvcc (instantiated for __half / __nv_bfloat16 / float / double).
//
// Per element the arithmetic is that of csrc/cpu_*.cpp and of the pure-PyTorch reference
// (sapipe/ops.py), carried out in the "op-math" type (float for 16-bit types, else T) and
// rounded to T once per stored value.
//
// Layout: elementwise kernels walk the flat segment in tiles of kThreads * kItems<T> elements
// (grid-stride over tiles, coalesced accesses); the outer DC form looks each element's tensor
// up among the few tensors its tile spans (binary search on `offsets`). The per-tensor dot
// products of the outer form are a deterministic two-kernel reduction in double: one block per
// tile writes a partial for every tensor the tile touches into slot (tensor + tile), which are
// disjoint across tiles; then one block per tensor sums its partials in a fixed order.
//
// An in-place update can do more on the way (StepExtras: history write, fused OPT_peek from
// the updated weights and state, the step's dot products); with the dots it runs in the dot
// reduction's layout (update_dots_kernel), else as an elementwise kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sapipe_cuda {

enum : int { kNoDc = 0, kDiagonal = 1, kOuter = 2 };

constexpr int kThreads = 256;
constexpr int64_t kDotTile = 16384;  // dot-product tile (per block)

// Elements per thread of an elementwise tile. The kernels are bound by the loads each thread
// has in flight, counted in requests, not bytes (on an H100, 16-bit kernels took the same
// time per element as float32 ones at 4 each): 16-bit types take twice as many.
template <typename T>
constexpr int kItems = sizeof(T) < 4 ? 8 : 4;
template <typename T>
constexpr int64_t kTileElems = int64_t(kThreads) * kItems<T>;  // elementwise tile

template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// g~ = DC_lam(g - prev / n, delta - delta_ref) + local * inv_n, all terms optional (nullptr).
template <typename T>
struct GradSrc {
  const T* g;
  const T* prev;
  const T* local;
  const T* delta;
  const T* delta_ref;
  const int64_t* offsets;  // [nseg + 1] (outer form)
  const double* dots;      // [nseg] (outer form, filled before the elementwise pass)
  int64_t nseg;
  double n, inv_n, lam;
  int form;
};

// Extras of an in-place update (see csrc/common.h UpdateExtras), each optional: `hist` gets
// x_t too; `peek_out` gets x~ = OPT_peek(x_t, g~) from the updated weights and state, with
// g~ composed from `peek` (form kNoDc, or kDiagonal with Delta = x_t - x_{t-1}, the update's
// own step); the step's per-tensor dots <peek.g - peek.prev/n, x_t - x_{t-1}> are summed by
// launch_update_dots (tensors: peek.offsets).
template <typename T>
struct StepExtras {
  T* hist;
  T* peek_out;
  GradSrc<T> peek;
  double peek_neg_step_size, peek_bc2_sqrt;  // Adam: bias correction of step + 1
};

struct SgdParams {
  double lr, momentum, damp1, weight_decay;
  bool has_momentum, nesterov, maximize, first;
};

struct AdamParams {
  double neg_step_size, bc2_sqrt, lerp_weight, beta2, one_minus_beta2, eps, weight_decay, decay;
  bool decoupled, maximize;
};

// First index idx in [lo, hi) with a[idx] > x (hi if none).
__device__ __forceinline__ int64_t upper_bound(const int64_t* a, int64_t lo, int64_t hi,
                                               int64_t x) {
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (a[mid] <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

template <typename T, typename A>
__device__ __forceinline__ A base_grad(const GradSrc<T>& s, int64_t i) {
  A h = static_cast<A>(s.g[i]);
  if (s.prev) h = h - static_cast<A>(s.prev[i]) / static_cast<A>(s.n);
  return h;
}

template <typename T, typename A>
__device__ __forceinline__ A delta_at(const GradSrc<T>& s, int64_t i) {
  A d = static_cast<A>(s.delta[i]);
  if (s.delta_ref) d = d - static_cast<A>(s.delta_ref[i]);
  return d;
}

template <typename T, typename A>
__device__ __forceinline__ A compose(const GradSrc<T>& s, int64_t i, A coeff) {
  A h = base_grad<T, A>(s, i);
  if (s.form == kDiagonal) {
    h = h + ((h * delta_at<T, A>(s, i)) * h) * static_cast<A>(s.lam);
  } else if (s.form == kOuter) {
    h = h + h * coeff;
  }
  if (s.local) h = h + static_cast<A>(s.inv_n) * static_cast<A>(s.local[i]);
  return h;
}

// Runs op(i, g~_i) for every element; g~ composed on the fly.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(GradSrc<T> s, int64_t N, Op op) {
  using A = typename OpMath<T>::type;
  constexpr int64_t kTile = kTileElems<T>;
  for (int64_t tile = int64_t(blockIdx.x) * kTile; tile < N; tile += int64_t(gridDim.x) * kTile) {
    const int64_t tile_end = tile + kTile < N ? tile + kTile : N;
    int64_t first = 0, last = 0;
    if (s.form == kOuter) {  // tensors spanned by this tile (uniform across the block)
      first = upper_bound(s.offsets, 0, s.nseg + 1, tile) - 1;
      last = upper_bound(s.offsets, first + 1, s.nseg + 1, tile_end - 1) - 1;
    }
#pragma unroll
    for (int k = 0; k < kItems<T>; ++k) {
      const int64_t i = tile + int64_t(k) * kThreads + threadIdx.x;
      if (i < tile_end) {
        A coeff = A(0);
        if (s.form == kOuter) {
          const int64_t seg =
              first == last ? first : upper_bound(s.offsets, first + 1, last + 1, i) - 1;
          // reference: dots (tensor dtype) * lam
          coeff = static_cast<A>(s.dots[seg]) * static_cast<A>(s.lam);
        }
        op(i, compose<T, A>(s, i, coeff));
      }
    }
  }
}

template <typename T>
struct StoreOp {  // out = g~
  T* out;
  __device__ __forceinline__ void operator()(int64_t i, typename OpMath<T>::type h) const {
    out[i] = static_cast<T>(h);
  }
};

// The fused peek's g~ at element i: base (g - prev/n), the diagonal DC form with Delta = dx
// (the update's own step), + local/n.
template <typename T, typename A>
__device__ __forceinline__ A peek_grad(const GradSrc<T>& s, int64_t i, A dx) {
  A h = base_grad<T, A>(s, i);
  if (s.form == kDiagonal) h = h + ((h * dx) * h) * static_cast<A>(s.lam);
  if (s.local) h = h + static_cast<A>(s.inv_n) * static_cast<A>(s.local[i]);
  return h;
}

// torch.optim.SGD on one element: gradient d, weight x, momentum buffer value mb (unused when
// `first`); b <- the new buffer value; returns the new weight.
template <typename A>
__device__ __forceinline__ A sgd_math(const SgdParams& p, bool first, A d, A x, A mb, A& b) {
  if (p.maximize) d = -d;
  if (p.weight_decay != 0) d = d + static_cast<A>(p.weight_decay) * x;
  if (p.has_momentum) {
    const A mom = static_cast<A>(p.momentum);
    b = first ? d : mb * mom + static_cast<A>(p.damp1) * d;
    d = p.nesterov ? d + mom * b : b;
  }
  return x + static_cast<A>(-p.lr) * d;
}

// Returns the step x_t - x_{t-1} of the element (0 for a peek into `out`).
template <typename T>
struct SgdOp {
  T* param;
  T* buf;
  T* out;  // nullptr: in place
  SgdParams p;
  StepExtras<T> e;  // in place only
  __device__ __forceinline__ typename OpMath<T>::type operator()(int64_t i,
                                                                 typename OpMath<T>::type d) const {
    using A = typename OpMath<T>::type;
    const A x = static_cast<A>(param[i]);
    A b = A(0);
    const A mb = (p.has_momentum && !p.first) ? static_cast<A>(buf[i]) : A(0);
    const A r = sgd_math(p, p.first, d, x, mb, b);
    if (out != nullptr) {
      out[i] = static_cast<T>(r);
      return A(0);
    }
    const T rt = static_cast<T>(r), bt = static_cast<T>(b);
    if (p.has_momentum) buf[i] = bt;
    param[i] = rt;
    if (e.hist) e.hist[i] = rt;
    const A xn = static_cast<A>(rt);
    const A dx = xn - x;
    if (e.peek_out) {  // the momentum buffer has started (or is unused)
      A b2 = A(0);
      e.peek_out[i] = static_cast<T>(
          sgd_math(p, false, peek_grad<T, A>(e.peek, i, dx), xn, static_cast<A>(bt), b2));
    }
    return dx;
  }
};

// torch.optim.Adam(W) on one element: gradient g, weight x, moments ea / eas; m, v <- the new
// moments; returns the new weight (neg_ss / bc2s: the step's bias-correction scalars).
template <typename A>
__device__ __forceinline__ A adam_math(const AdamParams& p, double neg_ss, double bc2s, A g, A x,
                                       A ea, A eas, A& m, A& v) {
  if (p.maximize) g = -g;
  const bool has_wd = p.weight_decay != 0;
  if (has_wd && !p.decoupled) g = g + static_cast<A>(p.weight_decay) * x;
  const A w = static_cast<A>(p.lerp_weight);
  m = (w < A(0.5) && w > A(-0.5)) ? ea + w * (g - ea) : g - (g - ea) * (A(1) - w);
  v = eas * static_cast<A>(p.beta2) + (static_cast<A>(p.one_minus_beta2) * g) * g;
  const A base = (has_wd && p.decoupled) ? x * static_cast<A>(p.decay) : x;
  const A denom = sqrt(v) / static_cast<A>(bc2s) + static_cast<A>(p.eps);
  return base + (static_cast<A>(neg_ss) * m) / denom;
}

// Returns the step x_t - x_{t-1} of the element (0 for a peek into `out`).
template <typename T>
struct AdamOp {
  T* param;
  T* exp_avg;
  T* exp_avg_sq;
  T* out;  // nullptr: in place
  AdamParams p;
  StepExtras<T> e;  // in place only
  __device__ __forceinline__ typename OpMath<T>::type operator()(int64_t i,
                                                                 typename OpMath<T>::type g) const {
    using A = typename OpMath<T>::type;
    const A x = static_cast<A>(param[i]);
    A m, v;
    const A r = adam_math(p, p.neg_step_size, p.bc2_sqrt, g, x, static_cast<A>(exp_avg[i]),
                          static_cast<A>(exp_avg_sq[i]), m, v);
    if (out != nullptr) {
      out[i] = static_cast<T>(r);
      return A(0);
    }
    const T rt = static_cast<T>(r), mt = static_cast<T>(m), vt = static_cast<T>(v);
    exp_avg[i] = mt;
    exp_avg_sq[i] = vt;
    param[i] = rt;
    if (e.hist) e.hist[i] = rt;
    const A xn = static_cast<A>(rt);
    const A dx = xn - x;
    if (e.peek_out) {
      A m2, v2;
      e.peek_out[i] = static_cast<T>(adam_math(p, e.peek_neg_step_size, e.peek_bc2_sqrt,
                                               peek_grad<T, A>(e.peek, i, dx), xn,
                                               static_cast<A>(mt), static_cast<A>(vt), m2, v2));
    }
    return dx;
  }
};

// Sum over the block; the result is valid in thread 0. `shared` holds >= 32 doubles.
__device__ __forceinline__ double block_sum(double v, double* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int((blockDim.x + 31) >> 5) ? shared[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// Pass 1a: block b reduces tile b = [b*kDotTile, ...) into partials[seg + b] for every tensor
// seg the tile touches.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dots_partial_kernel(GradSrc<T> s, int64_t N, double* partials) {
  using A = typename OpMath<T>::type;
  __shared__ double shared[32];
  const int64_t b = blockIdx.x;
  const int64_t start = b * kDotTile;
  const int64_t end = start + kDotTile < N ? start + kDotTile : N;
  int64_t seg = upper_bound(s.offsets, 0, s.nseg + 1, start) - 1;
  for (;; ++seg) {
    const int64_t lo = s.offsets[seg] > start ? s.offsets[seg] : start;
    const int64_t hi = s.offsets[seg + 1] < end ? s.offsets[seg + 1] : end;
    double acc = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
      acc += static_cast<double>(base_grad<T, A>(s, i)) * static_cast<double>(delta_at<T, A>(s, i));
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) partials[seg + b] = acc;
    if (hi >= end) break;
  }
}

// Pass 1b: one block per tensor sums its partials in tile order.
__global__ void __launch_bounds__(kThreads)
    dots_finalize_kernel(const double* partials, const int64_t* offsets, int64_t nseg,
                         double* dots) {
  __shared__ double shared[32];
  for (int64_t seg = blockIdx.x; seg < nseg; seg += gridDim.x) {
    const int64_t lo = offsets[seg], hi = offsets[seg + 1];
    double acc = 0.0;
    if (hi > lo) {
      const int64_t b0 = lo / kDotTile, b1 = (hi - 1) / kDotTile;
      for (int64_t b = b0 + threadIdx.x; b <= b1; b += blockDim.x) acc += partials[seg + b];
    }
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) dots[seg] = acc;
  }
}

// An in-place update that also sums the step's per-tensor dots (pass 1a of launch_dots, with
// the update done on the way): block b updates tile b = [b*kDotTile, ...) and writes, for
// every tensor seg of peek.offsets the tile touches, partials[seg + b] =
// sum <peek.g - peek.prev/n, x_t - x_{t-1}>. `op` returns each element's step. The update's
// own gradient does not use the outer form (coeff 0).
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads)
    update_dots_kernel(GradSrc<T> s, GradSrc<T> peek, int64_t N, Op op, double* partials) {
  using A = typename OpMath<T>::type;
  __shared__ double shared[32];
  const int64_t b = blockIdx.x;
  const int64_t start = b * kDotTile;
  const int64_t end = start + kDotTile < N ? start + kDotTile : N;
  int64_t seg = upper_bound(peek.offsets, 0, peek.nseg + 1, start) - 1;
  for (;; ++seg) {
    const int64_t lo = peek.offsets[seg] > start ? peek.offsets[seg] : start;
    const int64_t hi = peek.offsets[seg + 1] < end ? peek.offsets[seg + 1] : end;
    double acc = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const A dx = op(i, compose<T, A>(s, i, A(0)));
      acc += static_cast<double>(base_grad<T, A>(peek, i)) * static_cast<double>(dx);
    }
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) partials[seg + b] = acc;
    if (hi >= end) break;
  }
}

// ---- host-side launchers -------------------------------------------------------------------

// Workspace (doubles) that launch_dots needs for `partials`.
inline int64_t dots_workspace(int64_t N, int64_t nseg) {
  return nseg + (N + kDotTile - 1) / kDotTile;
}

// dots[seg] = <g - prev/n, delta - delta_ref> over tensor seg; s.offsets / s.nseg used.
template <typename T>
cudaError_t launch_dots(const GradSrc<T>& s, int64_t N, double* partials, double* dots,
                        cudaStream_t stream) {
  if (s.nseg == 0) return cudaSuccess;
  if (N == 0) return cudaMemsetAsync(dots, 0, sizeof(double) * s.nseg, stream);
  const int64_t tiles = (N + kDotTile - 1) / kDotTile;
  dots_partial_kernel<T><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(s, N, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t blocks = s.nseg < 65535 ? s.nseg : 65535;
  dots_finalize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      partials, s.offsets, s.nseg, dots);
  return cudaGetLastError();
}

// The in-place update `op` over [0, N) and dots[seg] = the step's dot products per tensor of
// peek.offsets (see update_dots_kernel); `partials` holds dots_workspace(N, peek.nseg).
template <typename T, typename Op>
cudaError_t launch_update_dots(const GradSrc<T>& s, const GradSrc<T>& peek, int64_t N,
                               const Op& op, double* partials, double* dots,
                               cudaStream_t stream) {
  if (peek.nseg == 0) return cudaSuccess;
  if (N == 0) return cudaMemsetAsync(dots, 0, sizeof(double) * peek.nseg, stream);
  const int64_t tiles = (N + kDotTile - 1) / kDotTile;
  update_dots_kernel<T, Op><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(s, peek, N, op,
                                                                                    partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t blocks = peek.nseg < 65535 ? peek.nseg : 65535;
  dots_finalize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      partials, peek.offsets, peek.nseg, dots);
  return cudaGetLastError();
}

template <typename T, typename Op>
cudaError_t launch_elementwise(const GradSrc<T>& s, int64_t N, const Op& op, int max_blocks,
                               cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  int64_t blocks = (N + kTileElems<T> - 1) / kTileElems<T>;
  if (blocks > max_blocks) blocks = max_blocks;
  elementwise_kernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s, N, op);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_compose(const GradSrc<T>& s, int64_t N, T* out, int max_blocks,
                           cudaStream_t stream) {
  return launch_elementwise(s, N, StoreOp<T>{out}, max_blocks, stream);
}

// An update `op` (SgdOp / AdamOp): elementwise, or with the step's dots when `dots` is given
// (then `partials` holds dots_workspace(N, e.peek.nseg) doubles).
template <typename T, typename Op>
cudaError_t launch_update(const GradSrc<T>& s, int64_t N, const Op& op, double* partials,
                          double* dots, int max_blocks, cudaStream_t stream) {
  if (dots != nullptr) return launch_update_dots(s, op.e.peek, N, op, partials, dots, stream);
  return launch_elementwise(s, N, op, max_blocks, stream);
}

template <typename T>
cudaError_t launch_sgd(const GradSrc<T>& s, int64_t N, T* param, T* momentum_buffer, T* out,
                       const SgdParams& p, const StepExtras<T>& e, double* partials,
                       double* dots, int max_blocks, cudaStream_t stream) {
  return launch_update(s, N, SgdOp<T>{param, momentum_buffer, out, p, e}, partials, dots,
                       max_blocks, stream);
}

template <typename T>
cudaError_t launch_adam(const GradSrc<T>& s, int64_t N, T* param, T* exp_avg, T* exp_avg_sq,
                        T* out, const AdamParams& p, const StepExtras<T>& e, double* partials,
                        double* dots, int max_blocks, cudaStream_t stream) {
  return launch_update(s, N, AdamOp<T>{param, exp_avg, exp_avg_sq, out, p, e}, partials, dots,
                       max_blocks, stream);
}

}  // namespace sapipe_cuda
