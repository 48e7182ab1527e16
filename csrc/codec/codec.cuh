// sapipe CUDA codec kernels (csrc/codec/codec.h), free of torch: raw pointers and host-side
// launchers taking a cudaStream_t. csrc/codec/cuda_codec.cu wraps them for ATen tensors;
// tests/test_kernels.py also compiles this header standalone with nvcc.
//
// One warp per tile of kTile values (8 per lane, lane-strided so that a warp's loads are
// coalesced), whatever the format. An int8 tile holds kGroups blocks of kCodecBlock values:
// a lane's elements 2g and 2g + 1 lie in block g, whose max |v| is a warp reduction (the
// four run side by side) and whose scale lane 0 writes. The sum stage reads the W received
// rows' tile in rank order into the same registers before encoding it; decoding is
// elementwise. Products and sums use the _rn intrinsics, so that nvcc contracts nothing into
// an FMA: the arithmetic is that of the CPU kernels and of the PyTorch reference, bit for bit
// (NaN payloads aside).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sapipe_codec {

enum : int { kFp16 = 0, kBf16 = 1, kInt8 = 2 };

constexpr int kBlock = 64;                  // values per int8 scale (csrc/codec/codec.h kCodecBlock)
constexpr int kTile = 256;                  // values a warp holds at a time
constexpr int kLanes = 32;
constexpr int kPerLane = kTile / kLanes;     // 8
constexpr int kGroups = kTile / kBlock;      // int8 blocks per tile: 4
constexpr int kPerGroup = kBlock / kLanes;   // a lane's elements per int8 block: 2
constexpr int kThreads = 256;                // 8 warps, 8 tiles at a time, per CUDA block
static_assert(kTile % kBlock == 0 && kBlock % kLanes == 0, "a tile holds whole int8 blocks, a block whole warps");

// Message rows: row r's values at values + r * stride (elements of the value type), its
// scales (int8) at scales + r * scale_stride.
struct Rows {
  void* values;
  int64_t stride;
  float* scales;
  int64_t scale_stride;
  int64_t rows, width;
};

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

template <typename T>
__device__ __forceinline__ bool finite(T x) {
  return isfinite(x);
}

// 16-bit bits <-> float (round to nearest even; the float is exact).
template <int kKind>
__device__ __forceinline__ uint16_t to_bits(float f) {
  if (kKind == kFp16) return __half_as_ushort(__float2half_rn(f));
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

template <int kKind>
__device__ __forceinline__ float from_bits(uint16_t h) {
  if (kKind == kFp16) return __half2float(__ushort_as_half(h));
  return __bfloat162float(__ushort_as_bfloat16(h));
}

template <int kKind>
__device__ __forceinline__ int64_t value_bytes() {
  return kKind == kInt8 ? 1 : 2;
}

// Lane's element k of a tile: lane + 32 k, in the tile's int8 block k / kPerGroup.
__device__ __forceinline__ int64_t element(int lane, int k) { return lane + int64_t(kLanes) * k; }

// Decoded value `idx` of row `r` (16-bit: not yet multiplied), in T.
template <typename T, int kKind>
__device__ __forceinline__ T decoded_at(const Rows& in, int64_t r, int64_t idx) {
  const char* row = static_cast<const char*>(in.values) + r * in.stride * value_bytes<kKind>();
  if (kKind == kInt8) {
    const T s = static_cast<T>(in.scales[r * in.scale_stride + idx / kBlock]);
    return mul_rn(static_cast<T>(reinterpret_cast<const int8_t*>(row)[idx]), s);
  }
  return static_cast<T>(from_bits<kKind>(reinterpret_cast<const uint16_t*>(row)[idx]));
}

// Encodes one tile held by a warp (v[k]: element lane + 32 k; `span` values in the row,
// int8: whole blocks; the first `count` with a residual slot) into `out` row `r`, tile `b`.
template <typename T, int kKind>
__device__ __forceinline__ void encode_warp_block(const T (&v)[kPerLane], int lane, int64_t count, int64_t span,
                                                  const Rows& out, int64_t r, int64_t b, T divide,
                                                  T* residual) {
  char* row = static_cast<char*>(out.values) + r * out.stride * value_bytes<kKind>();
  const int64_t lo = b * kTile;
  if (kKind == kInt8) {
    T m[kGroups];
    bool nonfinite[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      m[g] = T(0);
      nonfinite[g] = false;
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const T a = fabs(v[k]);
      const int g = k / kPerGroup;
      m[g] = a > m[g] ? a : m[g];
      nonfinite[g] |= !finite(v[k]);
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const T other = __shfl_xor_sync(0xffffffffu, m[g], offset);
        m[g] = other > m[g] ? other : m[g];
      }
    }
    int8_t* q = reinterpret_cast<int8_t*>(row) + lo;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      nonfinite[g] = __any_sync(0xffffffffu, nonfinite[g]);
      if (int64_t(g) * kBlock >= span) continue;  // past the row's last block (the same on every lane)
      const float s = static_cast<float>(div_rn(m[g], T(127)));
      float* scale = out.scales + r * out.scale_stride + lo / kBlock + g;
      if (nonfinite[g] || !isfinite(s)) {  // travels as NaN; the residual is kept (codec.h)
        if (lane == 0) *scale = __int_as_float(0x7fc00000);
#pragma unroll
        for (int k = g * kPerGroup; k < (g + 1) * kPerGroup; ++k) q[element(lane, k)] = 0;
        continue;
      }
      if (s < 1.17549435e-38f) {  // below float32's normal range: zeros, all of v kept (codec.h)
        if (lane == 0) *scale = 0.0f;
#pragma unroll
        for (int k = g * kPerGroup; k < (g + 1) * kPerGroup; ++k) {
          const int64_t i = element(lane, k);
          q[i] = 0;
          if (residual && i < count) residual[lo + i] = v[k];
        }
        continue;
      }
      const T inverse = div_rn(T(1), static_cast<T>(s));
      const T step = static_cast<T>(s);
#pragma unroll
      for (int k = g * kPerGroup; k < (g + 1) * kPerGroup; ++k) {
        T x = rint(mul_rn(v[k], inverse));
        x = x < T(-127) ? T(-127) : (x > T(127) ? T(127) : x);
        const int64_t i = element(lane, k);
        q[i] = static_cast<int8_t>(x);
        if (residual && i < count) residual[lo + i] = sub_rn(v[k], mul_rn(x, step));
      }
      if (lane == 0) *scale = s;
    }
    return;
  }
  uint16_t* h = reinterpret_cast<uint16_t*>(row) + lo;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = element(lane, k);
    if (i >= span) continue;
    const uint16_t bits = to_bits<kKind>(static_cast<float>(div_rn(v[k], divide)));
    h[i] = bits;
    if (residual && i < count) {
      const T decoded = mul_rn(static_cast<T>(from_bits<kKind>(bits)), divide);
      if (finite(decoded)) residual[lo + i] = sub_rn(v[k], decoded);
    }
  }
}

inline __device__ int64_t clamp_count(int64_t available, int64_t limit) {
  return available <= 0 ? 0 : (available < limit ? available : limit);
}

// Rows <- src[0:n) (+ residual), zero-padded; one warp per (row, tile).
template <typename T, int kKind>
__global__ void __launch_bounds__(kThreads)
    encode_kernel(const T* src, T* residual, int64_t n, Rows out, T divide) {
  const int lane = threadIdx.x % kLanes;
  const int64_t per_row = (out.width + kTile - 1) / kTile;
  const int64_t total = out.rows * per_row;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / kLanes);
  for (int64_t w = int64_t(blockIdx.x) * (kThreads / kLanes) + threadIdx.x / kLanes; w < total; w += warps) {
    const int64_t r = w / per_row, b = w % per_row;
    const int64_t lo = b * kTile, first = r * out.width + lo;  // first bucket value of the tile
    const int64_t span = clamp_count(out.width - lo, kTile);
    const int64_t count = clamp_count(n - first, span);
    T v[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = element(lane, k);
      v[k] = T(0);
      if (i < count) v[k] = residual ? add_rn(src[first + i], residual[first + i]) : src[first + i];
    }
    encode_warp_block<T, kKind>(v, lane, count, span, out, r, b, divide,
                                residual ? residual + (first - lo) : nullptr);
  }
}

// v[k] (+)= row r's decoded value at lo + element(lane, k), for the tile's first `span`
// values (v[k] = 0 past them when not kAccumulate). An int8 row's scales are read once per
// block of the tile.
template <typename T, int kKind, bool kAccumulate>
__device__ __forceinline__ void add_row(T (&v)[kPerLane], const Rows& in, int64_t r, int64_t lo, int lane,
                                        int64_t span) {
  const char* row = static_cast<const char*>(in.values) + r * in.stride * value_bytes<kKind>();
  T s[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const bool read = kKind == kInt8 && int64_t(g) * kBlock < span;  // a block of this row
    s[g] = read ? static_cast<T>(in.scales[r * in.scale_stride + lo / kBlock + g]) : T(1);
  }
  T x[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = element(lane, k);
    x[k] = T(0);
    if (i >= span) continue;
    if (kKind == kInt8) x[k] = mul_rn(static_cast<T>(reinterpret_cast<const int8_t*>(row)[lo + i]), s[k / kPerGroup]);
    else x[k] = static_cast<T>(from_bits<kKind>(reinterpret_cast<const uint16_t*>(row)[lo + i]));
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) v[k] = kAccumulate ? add_rn(v[k], x[k]) : x[k];
}

// One row <- the sum of `in`'s rows (+ residual[0:width)), compressed.
template <typename T, int kKind>
__global__ void __launch_bounds__(kThreads)
    sum_encode_kernel(Rows in, T* residual, Rows out, T divide) {
  const int lane = threadIdx.x % kLanes;
  const int64_t per_row = (in.width + kTile - 1) / kTile;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / kLanes);
  for (int64_t b = int64_t(blockIdx.x) * (kThreads / kLanes) + threadIdx.x / kLanes; b < per_row; b += warps) {
    const int64_t lo = b * kTile;
    const int64_t span = clamp_count(in.width - lo, kTile);
    // Row by row, each lane's 8 values at once: the 8 loads of a row are independent, so
    // they are in flight together. Each value still adds the rows in rank order.
    T v[kPerLane];
    add_row<T, kKind, false>(v, in, 0, lo, lane, span);
    for (int64_t r = 1; r < in.rows; ++r) add_row<T, kKind, true>(v, in, r, lo, lane, span);
    if (residual) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t i = element(lane, k);
        if (i < span) v[k] = add_rn(v[k], residual[lo + i]);
      }
    }
    encode_warp_block<T, kKind>(v, lane, span, span, out, 0, b, divide, residual);
  }
}

// out[0:n) <- the rows decoded (16-bit: times multiply), row j filling [j * width, ...).
// Rows go over blockIdx.y and a row's values over blockIdx.x, so that no value pays for a
// 64-bit division to find its row.
template <typename T, int kKind>
__global__ void __launch_bounds__(kThreads) decode_kernel(Rows in, T* out, int64_t n, T multiply) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t r = blockIdx.y; r < in.rows && r * in.width < n; r += gridDim.y) {
    const int64_t first = r * in.width;
    const int64_t count = n - first < in.width ? n - first : in.width;
    for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < count; idx += stride) {
      const T x = decoded_at<T, kKind>(in, r, idx);
      out[first + idx] = kKind == kInt8 ? x : mul_rn(x, multiply);
    }
  }
}

inline int grid_for(int64_t items, int per_block, int max_blocks) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < max_blocks ? blocks : max_blocks));
}

template <typename T>
cudaError_t launch_encode(int kind, const T* src, T* residual, int64_t n, const Rows& out, T divide,
                          int max_blocks, cudaStream_t stream) {
  const int64_t warps = out.rows * ((out.width + kTile - 1) / kTile);
  const int grid = grid_for(warps, kThreads / kLanes, max_blocks);
  if (kind == kInt8) encode_kernel<T, kInt8><<<grid, kThreads, 0, stream>>>(src, residual, n, out, divide);
  else if (kind == kFp16) encode_kernel<T, kFp16><<<grid, kThreads, 0, stream>>>(src, residual, n, out, divide);
  else encode_kernel<T, kBf16><<<grid, kThreads, 0, stream>>>(src, residual, n, out, divide);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_sum_encode(int kind, const Rows& in, T* residual, const Rows& out, T divide, int max_blocks,
                              cudaStream_t stream) {
  const int grid = grid_for((in.width + kTile - 1) / kTile, kThreads / kLanes, max_blocks);
  if (kind == kInt8) sum_encode_kernel<T, kInt8><<<grid, kThreads, 0, stream>>>(in, residual, out, divide);
  else if (kind == kFp16) sum_encode_kernel<T, kFp16><<<grid, kThreads, 0, stream>>>(in, residual, out, divide);
  else sum_encode_kernel<T, kBf16><<<grid, kThreads, 0, stream>>>(in, residual, out, divide);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode(int kind, const Rows& in, T* out, int64_t n, T multiply, int max_blocks,
                          cudaStream_t stream) {
  const int64_t rows = in.width > 0 ? (n + in.width - 1) / in.width : 1;  // rows holding out's values
  const int grid_y = static_cast<int>(rows < 1 ? 1 : (rows < 65535 ? rows : 65535));
  const int per_row = grid_for(in.width < n ? in.width : n, kThreads, max_blocks / grid_y > 0 ? max_blocks / grid_y : 1);
  const dim3 grid(per_row, grid_y);
  if (kind == kInt8) decode_kernel<T, kInt8><<<grid, kThreads, 0, stream>>>(in, out, n, multiply);
  else if (kind == kFp16) decode_kernel<T, kFp16><<<grid, kThreads, 0, stream>>>(in, out, n, multiply);
  else decode_kernel<T, kBf16><<<grid, kThreads, 0, stream>>>(in, out, n, multiply);
  return cudaGetLastError();
}

}  // namespace sapipe_codec
