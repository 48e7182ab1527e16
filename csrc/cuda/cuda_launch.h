// What the CUDA entry points (cuda_ops.cu, cuda_codec.cu) share: the grid cap and the launch
// check.
#pragma once

#include <c10/core/Device.h>
#include "check.h"
#include <cuda_runtime.h>

namespace sapipe {
namespace cuda {

// Blocks per launch: 16 per multiprocessor (grid-stride loops cover the rest).
inline int max_blocks(const at::Device& device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    sms = 132;
  }
  return sms * 16;
}

inline void check(cudaError_t err) {
  SAPIPE_CHECK(err == cudaSuccess, "sapipe CUDA kernel failed: ", cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace sapipe
