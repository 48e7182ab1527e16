// sapipe CUDA kernels, free of torch: raw pointers, POD parameter structs and host-side
// launchers taking a cudaStream_t. csrc/cuda_ops.cu wraps them for ATen tensors
// (c10::Half / c10::BFloat16 / float / double); tests/test_kernels.py also compiles this header
// standalone with nvcc (instantiated for __half / __nv_bfloat16 / float / double).
//
// Per element the arithmetic is that of csrc/cpu_*.cpp and of the pure-PyTorch reference
// (sapipe/ops.py), carried out in the "op-math" type (float for 16-bit types, else T) and
// rounded to T once per stored value.
//
// Layout: elementwise kernels walk the flat segment in tiles of kThreads * kItems elements
// (grid-stride over tiles, coalesced accesses); the outer DC form looks each element's tensor
// up among the few tensors its tile spans (binary search on `offsets`). The per-tensor dot
// products of the outer form are a deterministic two-kernel reduction in double: one block per
// tile writes a partial for every tensor the tile touches into slot (tensor + tile), which are
// disjoint across tiles; then one block per tensor sums its partials in a fixed order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sapipe_cuda {

enum : int { kNoDc = 0, kDiagonal = 1, kOuter = 2 };

constexpr int kThreads = 256;
constexpr int kItems = 4;
constexpr int64_t kTileElems = int64_t(kThreads) * kItems;  // elementwise tile
constexpr int64_t kDotTile = 16384;                          // dot-product tile (per block)

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
  for (int64_t tile = int64_t(blockIdx.x) * kTileElems; tile < N;
       tile += int64_t(gridDim.x) * kTileElems) {
    const int64_t tile_end = tile + kTileElems < N ? tile + kTileElems : N;
    int64_t first = 0, last = 0;
    if (s.form == kOuter) {  // tensors spanned by this tile (uniform across the block)
      first = upper_bound(s.offsets, 0, s.nseg + 1, tile) - 1;
      last = upper_bound(s.offsets, first + 1, s.nseg + 1, tile_end - 1) - 1;
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
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

template <typename T>
struct SgdOp {
  T* param;
  T* buf;
  T* out;  // nullptr: in place
  SgdParams p;
  __device__ __forceinline__ void operator()(int64_t i, typename OpMath<T>::type d) const {
    using A = typename OpMath<T>::type;
    if (p.maximize) d = -d;
    const A x = static_cast<A>(param[i]);
    if (p.weight_decay != 0) d = d + static_cast<A>(p.weight_decay) * x;
    if (p.has_momentum) {
      const A mom = static_cast<A>(p.momentum);
      const A b = p.first ? d : static_cast<A>(buf[i]) * mom + static_cast<A>(p.damp1) * d;
      if (out == nullptr) buf[i] = static_cast<T>(b);
      d = p.nesterov ? d + mom * b : b;
    }
    const A r = x + static_cast<A>(-p.lr) * d;
    if (out == nullptr)
      param[i] = static_cast<T>(r);
    else
      out[i] = static_cast<T>(r);
  }
};

template <typename T>
struct AdamOp {
  T* param;
  T* exp_avg;
  T* exp_avg_sq;
  T* out;  // nullptr: in place
  AdamParams p;
  __device__ __forceinline__ void operator()(int64_t i, typename OpMath<T>::type g) const {
    using A = typename OpMath<T>::type;
    if (p.maximize) g = -g;
    const A x = static_cast<A>(param[i]);
    const bool has_wd = p.weight_decay != 0;
    if (has_wd && !p.decoupled) g = g + static_cast<A>(p.weight_decay) * x;
    const A ea = static_cast<A>(exp_avg[i]);
    const A w = static_cast<A>(p.lerp_weight);
    const A m = (w < A(0.5) && w > A(-0.5)) ? ea + w * (g - ea) : g - (g - ea) * (A(1) - w);
    const A v = static_cast<A>(exp_avg_sq[i]) * static_cast<A>(p.beta2) +
                (static_cast<A>(p.one_minus_beta2) * g) * g;
    const A base = (has_wd && p.decoupled) ? x * static_cast<A>(p.decay) : x;
    const A denom = sqrt(v) / static_cast<A>(p.bc2_sqrt) + static_cast<A>(p.eps);
    const A r = base + (static_cast<A>(p.neg_step_size) * m) / denom;
    if (out == nullptr) {
      exp_avg[i] = static_cast<T>(m);
      exp_avg_sq[i] = static_cast<T>(v);
      param[i] = static_cast<T>(r);
    } else {
      out[i] = static_cast<T>(r);
    }
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

template <typename T, typename Op>
cudaError_t launch_elementwise(const GradSrc<T>& s, int64_t N, const Op& op, int max_blocks,
                               cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  int64_t blocks = (N + kTileElems - 1) / kTileElems;
  if (blocks > max_blocks) blocks = max_blocks;
  elementwise_kernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s, N, op);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_compose(const GradSrc<T>& s, int64_t N, T* out, int max_blocks,
                           cudaStream_t stream) {
  return launch_elementwise(s, N, StoreOp<T>{out}, max_blocks, stream);
}

template <typename T>
cudaError_t launch_sgd(const GradSrc<T>& s, int64_t N, T* param, T* momentum_buffer, T* out,
                       const SgdParams& p, int max_blocks, cudaStream_t stream) {
  return launch_elementwise(s, N, SgdOp<T>{param, momentum_buffer, out, p}, max_blocks, stream);
}

template <typename T>
cudaError_t launch_adam(const GradSrc<T>& s, int64_t N, T* param, T* exp_avg, T* exp_avg_sq,
                        T* out, const AdamParams& p, int max_blocks, cudaStream_t stream) {
  return launch_elementwise(s, N, AdamOp<T>{param, exp_avg, exp_avg_sq, out, p}, max_blocks,
                            stream);
}

}  // namespace sapipe_cuda
