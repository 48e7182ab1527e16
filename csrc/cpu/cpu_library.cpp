// The CPU implementations of the sapipe operators (csrc/library.cpp): the vectorised update
// kernels (OpenMP across cores via at::parallel_for) and the compression codec.
#include "codec_ops.h"
#include "cpu_tile_types.h"
#include "update_ops.h"

namespace {
SAPIPE_DEVICE_KERNELS(CpuKernels, sapipe::cpu);
}  // namespace

TORCH_LIBRARY_IMPL(sapipe, CPU, m) {
  sapipe::register_update_ops<at::kCPU, CpuKernels>(m);
  sapipe::register_codec_ops<at::kCPU, CpuKernels>(m);
}
