// The update kernels as torch operators (sapipe::dc_dots / compose / sgd / adam, declared in
// csrc/library.cpp): the flat schema arguments turned back into a GradSpec and SgdArgs /
// AdamArgs, the checks of what the kernels dereference, version bumps. One template serves
// the CPU registration (csrc/cpu/cpu_library.cpp, in sapipe._C) and the CUDA one
// (csrc/cuda/cuda_library.cpp, in sapipe._C_cuda); the dispatcher picks by device. The Python
// side, which checks the spec's meaning once, is sapipe/kernels/ops.py.
#pragma once

#include "common.h"

#include "check.h"
#include <torch/library.h>

namespace sapipe {

inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  SAPIPE_CHECK(t.device() == ref.device(), "sapipe: ", name, " is on ", t.device(), ", expected ",
               ref.device());
  SAPIPE_CHECK(t.scalar_type() == ref.scalar_type(), "sapipe: ", name, " has dtype ",
               t.scalar_type(), ", expected ", ref.scalar_type());
  SAPIPE_CHECK(t.is_contiguous(), "sapipe: ", name, " must be contiguous");
  SAPIPE_CHECK(t.numel() == ref.numel(), "sapipe: ", name, " has ", t.numel(),
               " elements, expected ", ref.numel());
}

inline void check_like(const OptTensor& t, const at::Tensor& ref, const char* name) {
  if (t) check_like(*t, ref, name);
}

// Tensor boundaries [0, ..., N] of a segment: int64, 1-D, on g's device (values checked on CPU).
inline void check_offsets(const at::Tensor& o, const at::Tensor& g, bool on_cpu) {
  SAPIPE_CHECK(o.device() == g.device() && o.scalar_type() == at::kLong && o.dim() == 1 &&
                   o.is_contiguous() && o.numel() >= 1,
               "sapipe: offsets must be a contiguous 1-D int64 tensor on the grad's device");
  if (on_cpu) {
    const int64_t* p = o.data_ptr<int64_t>();
    const int64_t S = o.numel() - 1;
    SAPIPE_CHECK(p[0] == 0 && p[S] == g.numel(), "sapipe: offsets must run from 0 to ", g.numel());
    for (int64_t i = 0; i < S; ++i)
      SAPIPE_CHECK(p[i] <= p[i + 1], "sapipe: offsets must be non-decreasing");
  }
}

// Per-tensor dot products: float64, one per tensor of `offsets`, on g's device.
inline void check_dots(const at::Tensor& d, const at::Tensor& offsets, const at::Tensor& g,
                       const char* name) {
  SAPIPE_CHECK(d.device() == g.device() && d.scalar_type() == at::kDouble && d.is_contiguous() &&
                   d.numel() == offsets.numel() - 1,
               "sapipe: ", name, " must be a contiguous float64 tensor with one entry per tensor");
}

// What the kernels read of a GradSpec: every tensor like grad, a Delta for delay compensation,
// the outer form's tensor boundaries and dots. (The spec's meaning is checked in Python, once:
// sapipe/kernels/gradient_spec.py and ops._check_update.)
inline void check_spec(const GradSpec& s, bool on_cpu) {
  const at::Tensor& g = s.grad;
  SAPIPE_CHECK(g.is_contiguous(), "sapipe: grad must be contiguous");
  SAPIPE_CHECK(g.is_floating_point(), "sapipe: grad must be floating point");
  check_like(s.prev_local, g, "prev_local");
  check_like(s.local, g, "local");
  check_like(s.delta, g, "delta");
  check_like(s.delta_ref, g, "delta_ref");
  check_like(s.hist, g, "hist");
  SAPIPE_CHECK(s.form >= kNoDc && s.form <= kOuter, "sapipe: bad DC form ", s.form);
  SAPIPE_CHECK(s.form == kNoDc || s.delta || (s.form == kOuter && s.dots),
               "sapipe: delay compensation needs delta (or, outer form, precomputed dots)");
  if (s.form == kOuter) {
    SAPIPE_CHECK(s.offsets, "sapipe: the outer DC form needs tensor offsets");
    check_offsets(*s.offsets, g, on_cpu);
    if (s.dots) check_dots(*s.dots, *s.offsets, g, "dots");
  }
}

// In-place writes through data pointers bypass autograd's version counter; bump it as the
// equivalent torch in-place op would.
inline void bump(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

inline void bump(const OptTensor& t) {
  if (t) bump(*t);
}

// Bumps what an update wrote: `out` (OPT_peek), or the weights, state and extras (in place).
template <typename... State>
void bump_written(const OptTensor& out, const UpdateExtras& e, const State&... state) {
  if (out) {
    bump(*out);
    return;
  }
  (bump(state), ...);
  bump(e.hist);
  bump(e.peek_out);
  bump(e.step_dots);
}

// A GradSpec from a schema's flat spec arguments (the order of csrc/library.cpp's SPEC).
inline GradSpec spec_of(const at::Tensor& grad, const OptTensor& prev_local, double n,
                        const OptTensor& local, double inv_n, int64_t form, const OptTensor& delta,
                        const OptTensor& delta_ref, double lam, const OptTensor& offsets,
                        const OptTensor& dots, const OptTensor& hist) {
  return GradSpec{grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam, offsets, dots, hist};
}

// Where an update of `s` writes. Without a peek (`peek_grad` absent): OPT_peek into `out`, or
// OPT in place (x_t also into s.hist). With a peek (g~ of the prediction; its Delta is the
// update's own step, its form kNoDc or kDiagonal, the outer form being a second call): OPT in
// place, x_t into s.hist, x~ = OPT_peek(x_t, g~) into `out`, the step's dot products into
// `peek_dots`. Which combinations make sense is checked once, in Python
// (ops._check_update); here only what the kernels dereference.
struct Targets {
  OptTensor out;  // the kernels' OPT_peek target
  UpdateExtras extra;
};

inline Targets targets(const GradSpec& s, const OptTensor& peek_grad, const OptTensor& peek_prev_local,
                       double peek_n, const OptTensor& peek_local, double peek_inv_n, int64_t peek_form,
                       double peek_lam, const OptTensor& peek_offsets, const OptTensor& peek_dots,
                       const OptTensor& out, bool on_cpu) {
  const at::Tensor& g = s.grad;
  check_like(out, g, "out");
  Targets t;
  if (!peek_grad) {
    if (out) t.out = out;
    else t.extra.hist = s.hist;
    return t;
  }
  check_like(*peek_grad, g, "the peek's grad");
  check_like(peek_prev_local, g, "the peek's prev_local");
  check_like(peek_local, g, "the peek's local");
  GradSpec p;
  p.grad = *peek_grad;
  p.prev_local = peek_prev_local;
  p.n = peek_n;
  p.local = peek_local;
  p.inv_n = peek_inv_n;
  p.form = peek_form == kDiagonal ? kDiagonal : kNoDc;
  p.lam = peek_lam;
  if (peek_dots) {
    SAPIPE_CHECK(peek_offsets, "sapipe: the step's dot products need the peek's tensor offsets");
    check_offsets(*peek_offsets, g, on_cpu);
    check_dots(*peek_dots, *peek_offsets, g, "the peek's dots");
    p.offsets = peek_offsets;
    t.extra.step_dots = peek_dots;
  }
  t.extra.hist = s.hist;
  t.extra.peek_out = out;
  t.extra.peek = p;
  return t;
}

// The implementations of the four update operators for one device type. `Kernels` names that
// device's dc_dots / compose / sgd / adam (static members), so that every implementation is a
// stateless function, as the dispatcher registers them.
template <at::DeviceType kDevice, typename Kernels>
void register_update_ops(torch::Library& m) {
  constexpr bool on_cpu = kDevice == at::kCPU;

  m.impl("dc_dots", [](const at::Tensor& grad, const OptTensor& prev_local, double n,
                       const at::Tensor& delta, const OptTensor& delta_ref,
                       const at::Tensor& offsets) -> at::Tensor {
    GradSpec s = spec_of(grad, prev_local, n, std::nullopt, 1.0, kOuter, delta, delta_ref, 0.0,
                         offsets, std::nullopt, std::nullopt);
    check_spec(s, on_cpu);
    return Kernels::dc_dots(s);
  });

  m.impl("compose", [](const at::Tensor& grad, const OptTensor& prev_local, double n,
                       const OptTensor& local, double inv_n, int64_t form, const OptTensor& delta,
                       const OptTensor& delta_ref, double lam, const OptTensor& offsets,
                       const OptTensor& dots, const at::Tensor& out) {
    GradSpec s = spec_of(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam, offsets,
                         dots, std::nullopt);
    check_spec(s, on_cpu);
    check_like(out, grad, "out");
    Kernels::compose(s, out);
    bump(out);
  });

  m.impl("sgd", [](const at::Tensor& param, const OptTensor& momentum_buffer, double lr,
                   double momentum, double damp1, double weight_decay, bool nesterov,
                   bool maximize, bool first, const at::Tensor& grad, const OptTensor& prev_local,
                   double n, const OptTensor& local, double inv_n, int64_t form,
                   const OptTensor& delta, const OptTensor& delta_ref, double lam,
                   const OptTensor& offsets, const OptTensor& dots, const OptTensor& hist,
                   const OptTensor& peek_grad, const OptTensor& peek_prev_local, double peek_n,
                   const OptTensor& peek_local, double peek_inv_n, int64_t peek_form,
                   double peek_lam, const OptTensor& peek_offsets, const OptTensor& peek_dots,
                   const OptTensor& out) {
    GradSpec s = spec_of(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam, offsets,
                         dots, hist);
    check_spec(s, on_cpu);
    check_like(param, grad, "param");
    const OptTensor buf = momentum != 0 ? momentum_buffer : std::nullopt;
    SAPIPE_CHECK(buf || momentum == 0, "sapipe: momentum != 0 needs a momentum buffer");
    check_like(buf, grad, "momentum_buffer");
    Targets t = targets(s, peek_grad, peek_prev_local, peek_n, peek_local, peek_inv_n, peek_form,
                        peek_lam, peek_offsets, peek_dots, out, on_cpu);
    SgdArgs a{SgdHyper{lr, momentum, damp1, weight_decay, nesterov, maximize, first}, param, buf,
              t.out, t.extra};
    Kernels::sgd(s, a);
    bump_written(a.out, a.extra, param, buf);
  });

  m.impl("adam", [](const at::Tensor& param, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, double neg_step_size, double bc2_sqrt,
                    double lerp_weight, double beta2, double one_minus_beta2, double eps,
                    double weight_decay, double decay, bool decoupled, bool maximize,
                    double peek_neg_step_size, double peek_bc2_sqrt, const at::Tensor& grad,
                    const OptTensor& prev_local, double n, const OptTensor& local, double inv_n,
                    int64_t form, const OptTensor& delta, const OptTensor& delta_ref, double lam,
                    const OptTensor& offsets, const OptTensor& dots, const OptTensor& hist,
                    const OptTensor& peek_grad, const OptTensor& peek_prev_local, double peek_n,
                    const OptTensor& peek_local, double peek_inv_n, int64_t peek_form,
                    double peek_lam, const OptTensor& peek_offsets, const OptTensor& peek_dots,
                    const OptTensor& out) {
    GradSpec s = spec_of(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam, offsets,
                         dots, hist);
    check_spec(s, on_cpu);
    check_like(param, grad, "param");
    check_like(exp_avg, grad, "exp_avg");
    check_like(exp_avg_sq, grad, "exp_avg_sq");
    Targets t = targets(s, peek_grad, peek_prev_local, peek_n, peek_local, peek_inv_n, peek_form,
                        peek_lam, peek_offsets, peek_dots, out, on_cpu);
    AdamArgs a{AdamHyper{neg_step_size, bc2_sqrt, lerp_weight, beta2, one_minus_beta2, eps,
                         weight_decay, decay, decoupled, maximize, peek_neg_step_size,
                         peek_bc2_sqrt},
               param, exp_avg, exp_avg_sq, t.out, t.extra};
    Kernels::adam(s, a);
    bump_written(a.out, a.extra, param, exp_avg, exp_avg_sq);
  });
}

}  // namespace sapipe
