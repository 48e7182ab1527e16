// sapipe fused kernels: shared declarations of the C++ (CPU) and CUDA back ends.
//
// Every kernel works on one *segment*: a contiguous 1-D slice of a flat bucket buffer whose
// parameter tensors share one param group. The gradient a kernel consumes is described by a
// GradSpec and composed on the fly, element by element, while the kernel streams memory:
//
//     g~ = DC_lam( grad - prev_local / n ,  delta - delta_ref ) + local * (1/n)
//
// every term optional: plain g (no DC), DC-ASGD / SAPipe-DC (delta given), and WP option 3
// (prev_local, delta, local). DC forms: diagonal g + lam*g*g*D (one pass), outer
// g + lam*<g,D>_tensor*g, which needs the per-tensor dot products first (second pass); the
// tensor boundaries inside the segment are `offsets` (int64, S+1 entries, 0 ... N).
// `dots` (float64, S entries) may be supplied precomputed; otherwise the kernel computes
// them itself (two passes over memory in all).
//
// Each operation mirrors, step for step, the op sequence of the pure-PyTorch reference in
// sapipe/ops.py (torch.optim's single-tensor SGD / Adam), with every Python-side scalar
// (1 - dampening, lr / bias_correction1, ...) computed in Python exactly as the reference
// does and passed in as a double, then rounded to the tensor's compute type.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace sapipe {

using OptTensor = std::optional<at::Tensor>;

enum DcForm : int64_t { kNoDc = 0, kDiagonal = 1, kOuter = 2 };

struct GradSpec {
  at::Tensor grad;
  OptTensor prev_local;  // subtracted as prev_local / n (before DC)
  double n = 1.0;
  OptTensor local;       // added as local * inv_n (after DC)
  double inv_n = 1.0;
  int64_t form = kNoDc;
  OptTensor delta;       // DC's Delta (= delta - delta_ref when delta_ref is given)
  OptTensor delta_ref;
  double lam = 0.0;
  OptTensor offsets;     // outer form: int64 [S+1] tensor boundaries
  OptTensor dots;        // outer form: optional precomputed float64 [S] dot products
};

struct SgdArgs {
  at::Tensor param;
  OptTensor momentum_buffer;
  OptTensor out;  // OPT_peek target; nullopt = update param / buffer in place
  double lr, momentum, damp1 /* 1 - dampening */, weight_decay;
  bool nesterov, maximize, first;
};

struct AdamArgs {
  at::Tensor param, exp_avg, exp_avg_sq;
  OptTensor out;
  double neg_step_size;  // -(lr / (1 - beta1**step))
  double bc2_sqrt;       // (1 - beta2**step) ** 0.5
  double lerp_weight;    // 1 - beta1
  double beta2, one_minus_beta2, eps, weight_decay;
  double decay;          // 1 - lr * weight_decay (AdamW)
  bool decoupled, maximize;
};

namespace cpu {
at::Tensor dc_dots(const GradSpec& s);
void compose(const GradSpec& s, const at::Tensor& out);
void sgd(const GradSpec& s, const SgdArgs& a);
void adam(const GradSpec& s, const AdamArgs& a);
}  // namespace cpu

namespace cuda {
at::Tensor dc_dots(const GradSpec& s);
void compose(const GradSpec& s, const at::Tensor& out);
void sgd(const GradSpec& s, const SgdArgs& a);
void adam(const GradSpec& s, const AdamArgs& a);
}  // namespace cuda

}  // namespace sapipe
