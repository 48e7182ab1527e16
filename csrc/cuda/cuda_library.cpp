// sapipe._C_cuda: the CUDA implementations of the sapipe operators (csrc/library.cpp, whose
// schemas sapipe._C registers; sapipe/kernels/_ext.py loads _C first). The update kernels are
// csrc/cuda/kernels.cuh, launched from csrc/cuda/cuda_ops.cu; the codec's are
// csrc/codec/codec.cuh.
#include "codec_ops.h"
#include "update_ops.h"

#include <torch/csrc/utils/pybind.h>

namespace {
SAPIPE_DEVICE_KERNELS(CudaKernels, sapipe::cuda);
}  // namespace

TORCH_LIBRARY_IMPL(sapipe, CUDA, m) {
  sapipe::register_update_ops<at::kCUDA, CudaKernels>(m);
  sapipe::register_codec_ops<at::kCUDA, CudaKernels>(m);
}

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "sapipe's CUDA kernels: loading it registers the CUDA implementations of the "
            "torch.ops.sapipe operators";
}
