// The sapipe operator library: the schemas of the update and codec kernels, so that the
// dispatcher picks the device (CPU implementations: csrc/cpu/cpu_library.cpp in sapipe._C;
// CUDA: csrc/cuda/cuda_library.cpp in sapipe._C_cuda), torch.compile can trace a call (the fake
// implementations are sapipe/kernels/library.py), and torch.library.opcheck can test them.
//
// Every operator writes into tensors it is given and returns nothing but dc_dots' products;
// each written argument is marked (x!). The spec arguments, in this order, are a GradSpec
// (csrc/common.h):
//     g~ = DC_lam(grad - prev_local / n, delta - delta_ref) + local * inv_n
// with form 0 (no DC), 1 (diagonal) or 2 (outer: per-tensor `offsets`, optional precomputed
// `dots`), and `hist` the weight-history slot an in-place update also writes x_t into. The
// peek_* arguments (absent: no peek) are the fused weight prediction's spec, whose Delta is the
// update's own step; `peek_dots` receives that step's per-tensor dot products. In eager use,
// `out` may alias `grad` (compose) and `delta` may alias `param` (an update reads Delta before
// it writes): the Python side (sapipe/kernels/ops.py) passes such aliases only outside traced
// code.
#include <torch/library.h>

#define SAPIPE_SPEC                                                                            \
  "Tensor grad, Tensor? prev_local, float n, Tensor? local, float inv_n, int form, "          \
  "Tensor? delta, Tensor? delta_ref, float lam, Tensor? offsets, Tensor? dots"
#define SAPIPE_PEEK                                                                            \
  "Tensor? peek_grad, Tensor? peek_prev_local, float peek_n, Tensor? peek_local, "           \
  "float peek_inv_n, int peek_form, float peek_lam, Tensor? peek_offsets"

TORCH_LIBRARY(sapipe, m) {
  m.def(
      "dc_dots(Tensor grad, Tensor? prev_local, float n, Tensor delta, Tensor? delta_ref, "
      "Tensor offsets) -> Tensor");
  m.def("compose(" SAPIPE_SPEC ", Tensor(a!) out) -> ()");
  m.def(
      "sgd(Tensor(a!) param, Tensor(b!)? momentum_buffer, float lr, float momentum, float damp1, "
      "float weight_decay, bool nesterov, bool maximize, bool first, " SAPIPE_SPEC
      ", Tensor(c!)? hist, " SAPIPE_PEEK ", Tensor(d!)? peek_dots, Tensor(e!)? out) -> ()");
  m.def(
      "adam(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float neg_step_size, "
      "float bc2_sqrt, float lerp_weight, float beta2, float one_minus_beta2, float eps, "
      "float weight_decay, float decay, bool decoupled, bool maximize, "
      "float peek_neg_step_size, float peek_bc2_sqrt, " SAPIPE_SPEC ", Tensor(d!)? hist, "
      SAPIPE_PEEK ", Tensor(e!)? peek_dots, Tensor(f!)? out) -> ()");
  m.def(
      "codec_encode(Tensor src, Tensor(a!)? residual, Tensor(b!) values, Tensor(c!)? scales, "
      "float divide) -> ()");
  m.def(
      "codec_sum_encode(Tensor values, Tensor? scales, Tensor(a!)? residual, "
      "Tensor(b!) out_values, Tensor(c!)? out_scales, float divide, ScalarType dtype) -> ()");
  m.def("codec_decode(Tensor values, Tensor? scales, Tensor(a!) out, float multiply) -> ()");
}
