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

// The C++ side of sapipe.kernels.gradient_spec.GradientSpec: the operators take its fields as
// flat arguments (csrc/library.cpp; built in one place, sapipe/kernels/ops.py's `_spec_args`)
// and update_ops.h gathers them here.
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
  OptTensor hist;        // an in-place update also writes x_t here (UpdateExtras::hist)
};

// Extras of an in-place update (OPT), done in the same pass over memory, so that staleness
// compensation costs no extra pass for them (each optional; only without `out`):
//   hist       x_t is written here too: a weight-history slot (DC). It may alias a source of
//              the update, e.g. delta_ref: every element is read before it is written.
//   peek_out   x~ = OPT_peek(x_t, g~), computed from the just-updated weights and optimizer
//              state (WP's prediction), with g~ = `peek`: its own grad / prev_local / local and
//              form kNoDc or kDiagonal, whose Delta is x_t - x_{t-1}, the update's own step
//              (wp3: no weight history needed).
//   step_dots  float64 [S]: <peek.grad - peek.prev_local/n, x_t - x_{t-1}> per tensor
//              (tensors: peek.offsets), the outer DC form's dot products for a peek that runs
//              as a second call (its coefficient needs every element's step first).
// The operators (update_ops.h) build them from the update's hist and the peek's arguments
// (peek_dots: the step_dots target).
struct UpdateExtras {
  OptTensor hist;
  OptTensor peek_out;
  std::optional<GradSpec> peek;  // g~ of peek_out, and the first factor of step_dots
  OptTensor step_dots;
};

// The numbers of one SGD step, computed in Python as the reference computes them.
struct SgdHyper {
  double lr = 0.0, momentum = 0.0, damp1 = 1.0 /* 1 - dampening */, weight_decay = 0.0;
  bool nesterov = false, maximize = false, first = false;
};

struct SgdArgs : SgdHyper {
  at::Tensor param;
  OptTensor momentum_buffer;
  OptTensor out;  // OPT_peek target; nullopt = update param / buffer in place
  UpdateExtras extra;
};

// The numbers of one Adam / AdamW step (and of the fused peek after it), computed in Python
// as the reference computes them.
struct AdamHyper {
  double neg_step_size = 0.0;  // -(lr / (1 - beta1**step))
  double bc2_sqrt = 1.0;       // (1 - beta2**step) ** 0.5
  double lerp_weight = 0.0;    // 1 - beta1
  double beta2 = 0.0, one_minus_beta2 = 1.0, eps = 0.0, weight_decay = 0.0;
  double decay = 1.0;          // 1 - lr * weight_decay (AdamW)
  bool decoupled = false, maximize = false;
  double peek_neg_step_size = 0.0;  // the fused peek's -(lr / (1 - beta1**(step + 1)))
  double peek_bc2_sqrt = 1.0;       // the fused peek's (1 - beta2**(step + 1)) ** 0.5
};

struct AdamArgs : AdamHyper {
  at::Tensor param, exp_avg, exp_avg_sq;
  OptTensor out;
  UpdateExtras extra;
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
