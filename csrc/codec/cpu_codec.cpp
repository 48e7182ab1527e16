// CPU: the codec's three stages (codec.h) over message rows, one row after another on the
// calling thread. The codec runs on a communication back-end's worker thread beside the
// training thread's own intra-op threads, so it takes no thread pool of its own.
#include "codec.h"
#include "cpu_codec_types.h"

#include <ATen/Dispatch.h>

#include <algorithm>

namespace sapipe {
namespace cpu {
namespace {

int kind_of(const at::Tensor& values) {
  switch (values.scalar_type()) {
    case at::kHalf: return kCodecFp16;
    case at::kBFloat16: return kCodecBf16;
    default: return kCodecInt8;  // the operators admit int8 and the two 16-bit types only
  }
}

// Row r of `rows` as an outgoing row.
CodecRow out_row(const CodecRows& rows, int64_t r) {
  const at::Tensor& v = rows.values;
  return CodecRow{static_cast<char*>(v.data_ptr()) + r * v.stride(0) * v.element_size(),
                  rows.scales ? rows.scales->data_ptr<float>() + r * rows.scales->stride(0) : nullptr,
                  v.size(1)};
}

CodecRowsIn in_rows(const CodecRows& rows) {
  const at::Tensor& v = rows.values;
  return CodecRowsIn{v.data_ptr(), v.stride(0), rows.scales ? rows.scales->data_ptr<float>() : nullptr,
                     rows.scales ? rows.scales->stride(0) : 0, v.size(0), v.size(1)};
}

template <typename T>
T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

}  // namespace

void codec_encode(const at::Tensor& src, const std::optional<at::Tensor>& residual,
                  const CodecRows& out, double divide) {
  const int kind = kind_of(out.values);
  const int64_t n = src.numel(), width = out.values.size(1);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "sapipe_codec_encode", [&] {
    const scalar_t* s = src.data_ptr<scalar_t>();
    scalar_t* e = ptr_or_null<scalar_t>(residual);
    const auto encode = codec_tiles<scalar_t>().encode;
    for (int64_t r = 0; r < out.values.size(0); ++r) {
      const int64_t lo = r * width;
      const int64_t len = n > lo ? std::min(width, n - lo) : 0;
      encode(kind, s + std::min(lo, n), e ? e + std::min(lo, n) : nullptr, len, out_row(out, r),
             static_cast<scalar_t>(divide));
    }
  });
}

void codec_sum_encode(const CodecRows& in, const std::optional<at::Tensor>& residual,
                      const CodecRows& out, double divide, at::ScalarType dtype) {
  const int kind = kind_of(in.values);
  AT_DISPATCH_FLOATING_TYPES(dtype, "sapipe_codec_sum_encode", [&] {
    codec_tiles<scalar_t>().sum_encode(kind, in_rows(in), ptr_or_null<scalar_t>(residual), out_row(out, 0),
                                       static_cast<scalar_t>(divide));
  });
}

void codec_decode(const CodecRows& in, const at::Tensor& out, double multiply) {
  const int kind = kind_of(in.values);
  const CodecRowsIn rows = in_rows(in);
  const int64_t n = out.numel(), bytes = in.values.element_size();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "sapipe_codec_decode", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const auto decode = codec_tiles<scalar_t>().decode;
    for (int64_t r = 0; r < rows.rows && r * rows.width < n; ++r) {
      const int64_t lo = r * rows.width;
      decode(kind, static_cast<const char*>(rows.values) + r * rows.stride * bytes,
             rows.scales ? rows.scales + r * rows.scale_stride : nullptr, std::min(rows.width, n - lo),
             o + lo, static_cast<scalar_t>(multiply));
    }
  });
}

}  // namespace cpu
}  // namespace sapipe
