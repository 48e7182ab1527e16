// sapipe compression codec: the three local stages of a compressed sum (sapipe/compression.py,
// docs/design.md §5.9), for the C++ (CPU) and CUDA back ends.
//
// A bucket of n values (float32 or float64, "T") travels as R rows ("messages") of S values
// each, R * S >= n, the bucket's tail zero-padded. A row's values are 16-bit (fp16 / bf16
// bits) or int8; int8 rows also carry one float32 scale per block of kCodecBlock values.
// The rows live inside a byte buffer, one message after another: every kernel takes them as
// 2-D views [R, S] (values) and [R, S / kCodecBlock] (scales) whose rows are contiguous and
// `stride(0)` apart.
//
//   encode      values <- compress(src + residual); residual <- what compression dropped
//   sum_encode  the W received rows decoded and added in rank order, in T; that sum (plus the
//               server residual) compressed into one row; the residual updated
//   decode      out <- the rows decoded, row j filling out[j * S, min((j + 1) * S, n))
//
// Rounding, op for op as the pure-PyTorch reference (sapipe/codec_kernels.py):
//   fp16 / bf16: h = to16(float(v / divide)) (round to nearest even), decoded T(h) * multiply;
//   int8, per block: s = float32(max|v| / 127); q = round_half_even(v * (1 / s)) clamped to
//   +-127; decoded T(q) * T(s). A block whose s is below float32's normal range (all zeros,
//   or the ever smaller rest error feedback resends of a gradient that stays zero) travels as
//   s = 0, q = 0: 1 / s would overflow. `divide` / `multiply` apply to the 16-bit formats
//   only (an int8 scale carries the magnitude).
// Error feedback (a residual given): residual <- v - decoded(v) * divide, where v already
// includes the residual. A value whose decoded form is not finite (an overflow, a NaN or inf
// gradient) keeps its residual: the step that carries it is skipped by GradScaler, and the
// residual must not turn non-finite for every step after it. An int8 block with a non-finite
// value, or whose scale is beyond float32's range, travels as scale NaN (q = 0), so every
// value of it decodes to NaN.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace sapipe {

constexpr int64_t kCodecBlock = 64;  // int8 values per scale (= sapipe.compression.INT8_BLOCK)

struct CodecRows {
  at::Tensor values;                // [R, S] int8 / float16 / bfloat16 (rows contiguous)
  std::optional<at::Tensor> scales; // int8: [R, S / kCodecBlock] float32
};

namespace cpu {
void codec_encode(const at::Tensor& src, const std::optional<at::Tensor>& residual,
                  const CodecRows& out, double divide);
void codec_sum_encode(const CodecRows& in, const std::optional<at::Tensor>& residual,
                      const CodecRows& out, double divide, at::ScalarType dtype);
void codec_decode(const CodecRows& in, const at::Tensor& out, double multiply);
}  // namespace cpu

namespace cuda {
void codec_encode(const at::Tensor& src, const std::optional<at::Tensor>& residual,
                  const CodecRows& out, double divide);
void codec_sum_encode(const CodecRows& in, const std::optional<at::Tensor>& residual,
                      const CodecRows& out, double divide, at::ScalarType dtype);
void codec_decode(const CodecRows& in, const at::Tensor& out, double multiply);
}  // namespace cuda

}  // namespace sapipe
