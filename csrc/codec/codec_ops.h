// The codec (codec.h) as torch operators (sapipe::codec_encode / codec_sum_encode /
// codec_decode, declared in csrc/library.cpp), registered for the CPU by sapipe._C and for CUDA
// by sapipe._C_cuda: the checks of what the kernels dereference, version bumps. The Python side
// is sapipe/kernels/codec.py, which also holds the pure-PyTorch reference of every operator.
#pragma once

#include "codec.h"
#include "update_ops.h"

namespace sapipe {

template <at::DeviceType kDevice>
struct CodecChecks {
  static void device(const at::Tensor& t, const char* name) {
    SAPIPE_CHECK(t.device().type() == kDevice, "sapipe: the codec's kernel for ",
                 c10::DeviceTypeName(kDevice), " tensors got ", name, " on ", t.device());
  }

  // Message rows: [R, S] values (int8 / float16 / bfloat16), rows contiguous; int8 also
  // [R, S / kCodecBlock] float32 scales.
  static CodecRows rows(const at::Tensor& values, const OptTensor& scales, const char* name) {
    device(values, name);
    const auto t = values.scalar_type();
    SAPIPE_CHECK(t == at::kChar || t == at::kHalf || t == at::kBFloat16, "sapipe: ", name,
                 " must be int8, float16 or bfloat16; got ", t);
    SAPIPE_CHECK(values.dim() == 2 && values.stride(1) == 1 && values.stride(0) >= values.size(1),
                 "sapipe: ", name, " must be 2-D [rows, width] with contiguous rows");
    if (t == at::kChar) {
      SAPIPE_CHECK(values.size(1) % kCodecBlock == 0, "sapipe: int8 rows hold whole blocks of ",
                   kCodecBlock, " values; ", name, " has width ", values.size(1));
      SAPIPE_CHECK(scales && scales->scalar_type() == at::kFloat && scales->dim() == 2 &&
                       scales->size(0) == values.size(0) &&
                       scales->size(1) == values.size(1) / kCodecBlock && scales->stride(1) == 1,
                   "sapipe: int8 ", name, " need float32 scales [rows, width / ", kCodecBlock, "]");
      device(*scales, "the scales");
      return CodecRows{values, scales};
    }
    SAPIPE_CHECK(!scales, "sapipe: 16-bit ", name, " take no scales");
    return CodecRows{values, std::nullopt};
  }

  static void gradient(const at::Tensor& t, const char* name) {
    device(t, name);
    SAPIPE_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "sapipe: ", name,
                 " must be float32 or float64; got ", t.scalar_type());
    SAPIPE_CHECK(t.is_contiguous(), "sapipe: ", name, " must be contiguous");
  }

  static void residual(const OptTensor& r, at::ScalarType dtype, int64_t numel) {
    if (!r) return;
    gradient(*r, "residual");
    SAPIPE_CHECK(r->scalar_type() == dtype && r->numel() == numel, "sapipe: the residual must be ", dtype,
                 " with ", numel, " elements; got ", r->scalar_type(), " with ", r->numel());
  }
};

// The implementations of the three codec operators for one device type; `Kernels` names that
// device's codec_encode / codec_sum_encode / codec_decode (static members).
template <at::DeviceType kDevice, typename Kernels>
void register_codec_ops(torch::Library& m) {
  using Check = CodecChecks<kDevice>;
  m.impl("codec_encode", [](const at::Tensor& src, const OptTensor& residual,
                            const at::Tensor& values, const OptTensor& scales, double divide) {
    Check::gradient(src, "src");
    Check::residual(residual, src.scalar_type(), src.numel());
    const CodecRows out = Check::rows(values, scales, "values");
    SAPIPE_CHECK(values.size(0) * values.size(1) >= src.numel(), "sapipe: ", values.size(0),
                 " rows of ", values.size(1), " cannot hold ", src.numel(), " values");
    Kernels::codec_encode(src, residual, out, divide);
    bump(values);
    bump(scales);
    bump(residual);
  });

  m.impl("codec_sum_encode", [](const at::Tensor& values, const OptTensor& scales,
                                const OptTensor& residual, const at::Tensor& out_values,
                                const OptTensor& out_scales, double divide, at::ScalarType dtype) {
    const CodecRows in = Check::rows(values, scales, "received values");
    const CodecRows out = Check::rows(out_values, out_scales, "outgoing values");
    SAPIPE_CHECK(out_values.scalar_type() == values.scalar_type() && out_values.size(0) == 1 &&
                     out_values.size(1) == values.size(1),
                 "sapipe: the outgoing row must be one row like the received ones");
    SAPIPE_CHECK(dtype == at::kFloat || dtype == at::kDouble, "sapipe: sums are float32 or float64");
    Check::residual(residual, dtype, values.size(1));
    Kernels::codec_sum_encode(in, residual, out, divide, dtype);
    bump(out_values);
    bump(out_scales);
    bump(residual);
  });

  m.impl("codec_decode", [](const at::Tensor& values, const OptTensor& scales,
                            const at::Tensor& out, double multiply) {
    const CodecRows in = Check::rows(values, scales, "values");
    Check::gradient(out, "out");
    SAPIPE_CHECK(values.size(0) * values.size(1) >= out.numel(), "sapipe: ", values.size(0),
                 " rows of ", values.size(1), " cannot fill ", out.numel(), " values");
    Kernels::codec_decode(in, out, multiply);
    bump(out);
  });
}

}  // namespace sapipe

// `Name`: the kernels of namespace `ns` (sapipe::cpu or sapipe::cuda) as the static members
// register_update_ops and register_codec_ops call.
#define SAPIPE_DEVICE_KERNELS(Name, ns)                                \
  struct Name {                                                        \
    static constexpr auto dc_dots = &ns::dc_dots;                      \
    static constexpr auto compose = &ns::compose;                      \
    static constexpr auto sgd = &ns::sgd;                              \
    static constexpr auto adam = &ns::adam;                            \
    static constexpr auto codec_encode = &ns::codec_encode;            \
    static constexpr auto codec_sum_encode = &ns::codec_sum_encode;    \
    static constexpr auto codec_decode = &ns::codec_decode;            \
  }
