// Plain data shared by the CPU codec driver (cpu_codec.cpp, ATen) and the per-ISA codec
// kernels (cpu_codec_tiles.h): no ATen, no std templates.
#pragma once

#include <cstdint>

namespace sapipe {
namespace cpu {

enum CodecKind : int { kCodecFp16 = 0, kCodecBf16 = 1, kCodecInt8 = 2 };

constexpr int64_t kCodecBlock = 64;  // int8 values per scale (= sapipe::kCodecBlock, codec.h)
// Values the kernels hold on the stack at a time: whole int8 blocks, long enough that the
// vectorised loops' set-up is paid once per several blocks.
constexpr int64_t kCodecTile = 4 * kCodecBlock;

// One outgoing row: `width` values (16-bit bits or int8) and, for int8, width / kCodecBlock
// scales.
struct CodecRow {
  void* values;
  float* scales;
  int64_t width;
};

// `rows` incoming rows of `width` values each, row r's values `stride` values after row
// r - 1's, its scales (int8) `scale_stride` floats after theirs.
struct CodecRowsIn {
  const void* values;
  int64_t stride;
  const float* scales;
  int64_t scale_stride;
  int64_t rows, width;
};

template <typename T>
struct CodecTable {
  // out <- src[0:len) (+ residual), zero-padded to out.width; residual[0:len) updated
  void (*encode)(int kind, const T* src, T* residual, int64_t len, const CodecRow& out, T divide);
  // out <- the sum of in's rows (+ residual[0:width)); residual updated
  void (*sum_encode)(int kind, const CodecRowsIn& in, T* residual, const CodecRow& out, T divide);
  // out[0:len) <- one row decoded (16-bit: times multiply)
  void (*decode)(int kind, const void* values, const float* scales, int64_t len, T* out, T multiply);
};

// The codec kernels for the best instruction set this CPU supports (see cpu_dispatch.cpp).
template <typename T>
const CodecTable<T>& codec_tiles();

}  // namespace cpu
}  // namespace sapipe
