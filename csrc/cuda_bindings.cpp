// sapipe._C_cuda: the CUDA kernels (csrc/kernels.cuh, launched from csrc/cuda_ops.cu).
#include "bindings.h"

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "sapipe fused CUDA kernels: delay compensation, WP peek, SGD / Adam(W) updates";
  sapipe::define_module<at::kCUDA>(m, &sapipe::cuda::dc_dots, &sapipe::cuda::compose,
                                   &sapipe::cuda::sgd, &sapipe::cuda::adam);
  m.attr("device_type") = "cuda";
}
