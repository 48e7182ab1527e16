// CUDA entry points of the codec (csrc/codec/codec.h) for ATen tensors: dtype dispatch, device guard,
// the current stream, around the raw kernels of csrc/codec/codec.cuh.
#include "codec.cuh"
#include "codec.h"
#include "cuda_launch.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace sapipe {
namespace cuda {
namespace {

int kind_of(const at::Tensor& values) {
  switch (values.scalar_type()) {
    case at::kHalf: return sapipe_codec::kFp16;
    case at::kBFloat16: return sapipe_codec::kBf16;
    default: return sapipe_codec::kInt8;  // the operators admit int8 and the two 16-bit types only
  }
}

sapipe_codec::Rows raw(const CodecRows& rows) {
  const at::Tensor& v = rows.values;
  return sapipe_codec::Rows{v.data_ptr(), v.stride(0), rows.scales ? rows.scales->data_ptr<float>() : nullptr,
                            rows.scales ? rows.scales->stride(0) : 0, v.size(0), v.size(1)};
}

template <typename T>
T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

cudaStream_t current(const at::Tensor& on) {
  return c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
}

}  // namespace

void codec_encode(const at::Tensor& src, const std::optional<at::Tensor>& residual,
                  const CodecRows& out, double divide) {
  c10::cuda::CUDAGuard guard(src.device());
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "sapipe_codec_encode_cuda", [&] {
    check(sapipe_codec::launch_encode<scalar_t>(kind_of(out.values), src.data_ptr<scalar_t>(),
                                                ptr_or_null<scalar_t>(residual), src.numel(), raw(out),
                                                static_cast<scalar_t>(divide), max_blocks(src.device()),
                                                current(src)));
  });
}

void codec_sum_encode(const CodecRows& in, const std::optional<at::Tensor>& residual,
                      const CodecRows& out, double divide, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(in.values.device());
  AT_DISPATCH_FLOATING_TYPES(dtype, "sapipe_codec_sum_encode_cuda", [&] {
    check(sapipe_codec::launch_sum_encode<scalar_t>(kind_of(in.values), raw(in), ptr_or_null<scalar_t>(residual),
                                                    raw(out), static_cast<scalar_t>(divide),
                                                    max_blocks(in.values.device()), current(in.values)));
  });
}

void codec_decode(const CodecRows& in, const at::Tensor& out, double multiply) {
  c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "sapipe_codec_decode_cuda", [&] {
    check(sapipe_codec::launch_decode<scalar_t>(kind_of(in.values), raw(in), out.data_ptr<scalar_t>(), out.numel(),
                                                static_cast<scalar_t>(multiply), max_blocks(out.device()),
                                                current(out)));
  });
}

}  // namespace cuda
}  // namespace sapipe
