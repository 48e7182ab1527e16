// sapipe._C_cuda: the CUDA kernels (csrc/cuda/kernels.cuh, launched from csrc/cuda/cuda_ops.cu).
#include "bindings.h"
#include "codec_bindings.h"

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "sapipe fused CUDA kernels: delay compensation, WP peek, SGD / Adam(W) updates, the compression codec";
  sapipe::define_module<at::kCUDA>(m, &sapipe::cuda::dc_dots, &sapipe::cuda::compose,
                                   &sapipe::cuda::sgd, &sapipe::cuda::adam);
  sapipe::define_codec<at::kCUDA>(m, &sapipe::cuda::codec_encode, &sapipe::cuda::codec_sum_encode,
                                  &sapipe::cuda::codec_decode);
  m.attr("device_type") = "cuda";
}
