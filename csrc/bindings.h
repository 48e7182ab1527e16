// Python bindings shared by the CPU module (sapipe._C) and the CUDA module (sapipe._C_cuda):
// argument checking, GradSpec / SgdArgs / AdamArgs assembly, GIL release, version bumps.
// The Python-facing wrapper is sapipe/ops.py (via sapipe/_ext.py); these entry points are
// positional and low level.
#pragma once

#include "common.h"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace sapipe {
namespace py = pybind11;

inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "sapipe: ", name, " is on ", t.device(), ", expected ",
              ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "sapipe: ", name, " has dtype ",
              t.scalar_type(), ", expected ", ref.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "sapipe: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == ref.numel(), "sapipe: ", name, " has ", t.numel(),
              " elements, expected ", ref.numel());
}

inline void check_like(const OptTensor& t, const at::Tensor& ref, const char* name) {
  if (t) check_like(*t, ref, name);
}

// Tensor boundaries [0, ..., N] of a segment: int64, 1-D, on g's device (values checked on CPU).
inline void check_offsets(const at::Tensor& o, const at::Tensor& g, bool on_cpu) {
  TORCH_CHECK(o.device() == g.device() && o.scalar_type() == at::kLong && o.dim() == 1 &&
                  o.is_contiguous() && o.numel() >= 1,
              "sapipe: offsets must be a contiguous 1-D int64 tensor on the grad's device");
  if (on_cpu) {
    const int64_t* p = o.data_ptr<int64_t>();
    const int64_t S = o.numel() - 1;
    TORCH_CHECK(p[0] == 0 && p[S] == g.numel(), "sapipe: offsets must run from 0 to ", g.numel());
    for (int64_t i = 0; i < S; ++i)
      TORCH_CHECK(p[i] <= p[i + 1], "sapipe: offsets must be non-decreasing");
  }
}

inline void check_spec(const GradSpec& s, bool on_cpu) {
  const at::Tensor& g = s.grad;
  TORCH_CHECK(g.is_contiguous(), "sapipe: grad must be contiguous");
  TORCH_CHECK(g.is_floating_point(), "sapipe: grad must be floating point");
  check_like(s.prev_local, g, "prev_local");
  check_like(s.local, g, "local");
  check_like(s.delta, g, "delta");
  check_like(s.delta_ref, g, "delta_ref");
  TORCH_CHECK(s.form >= kNoDc && s.form <= kOuter, "sapipe: bad DC form ", s.form);
  TORCH_CHECK(s.form == kNoDc || s.delta || (s.form == kOuter && s.dots),
              "sapipe: delay compensation needs delta (or, outer form, precomputed dots)");
  TORCH_CHECK(!s.delta_ref || s.delta, "sapipe: delta_ref without delta");
  if (s.form == kOuter) {
    TORCH_CHECK(s.offsets, "sapipe: the outer DC form needs tensor offsets");
    const at::Tensor& o = *s.offsets;
    check_offsets(o, g, on_cpu);
    if (s.dots) {
      const at::Tensor& d = *s.dots;
      TORCH_CHECK(d.device() == g.device() && d.scalar_type() == at::kDouble &&
                      d.is_contiguous() && d.numel() == o.numel() - 1,
                  "sapipe: dots must be a contiguous float64 tensor with one entry per tensor");
    }
  }
}

// In-place writes through data pointers bypass autograd's version counter; bump it as the
// equivalent torch in-place op would.
inline void bump(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

inline void bump_extras(const UpdateExtras& e) {
  if (e.hist) bump(*e.hist);
  if (e.peek_out) bump(*e.peek_out);
  if (e.step_dots) bump(*e.step_dots);
}

inline GradSpec make_spec(const at::Tensor& grad, const OptTensor& prev_local, double n,
                          const OptTensor& local, double inv_n, int64_t form,
                          const OptTensor& delta, const OptTensor& delta_ref, double lam,
                          const OptTensor& offsets, const OptTensor& dots, bool on_cpu) {
  GradSpec s;
  s.grad = grad;
  s.prev_local = prev_local;
  s.n = n;
  s.local = local;
  s.inv_n = inv_n;
  s.form = form;
  s.delta = delta;
  s.delta_ref = delta_ref;
  s.lam = lam;
  s.offsets = offsets;
  s.dots = form == kOuter ? dots : std::nullopt;
  check_spec(s, on_cpu);
  return s;
}

// The UpdateExtras (common.h) of an in-place update whose gradient is `s`, from the entry
// points' trailing arguments; `out` must be absent (extras belong to OPT, not OPT_peek).
inline UpdateExtras make_extras(const GradSpec& s, const OptTensor& out, const OptTensor& hist,
                                const OptTensor& peek_out, const OptTensor& peek_grad,
                                const OptTensor& peek_prev_local, double peek_n,
                                const OptTensor& peek_local, double peek_inv_n,
                                int64_t peek_form, double peek_lam,
                                const OptTensor& peek_offsets, const OptTensor& step_dots,
                                bool on_cpu) {
  UpdateExtras e;
  e.hist = hist;
  e.peek_out = peek_out;
  e.step_dots = step_dots;
  TORCH_CHECK(!out || !e.any(), "sapipe: hist / peek_out / step_dots need an in-place update (out=None)");
  check_like(hist, s.grad, "hist");
  check_like(peek_out, s.grad, "peek_out");
  if (!peek_out && !step_dots) {
    TORCH_CHECK(!peek_grad && !peek_prev_local && !peek_local && !peek_offsets,
                "sapipe: peek gradient terms given without peek_out or step_dots");
    return e;
  }
  TORCH_CHECK(peek_grad, "sapipe: peek_out / step_dots need peek_grad");
  check_like(*peek_grad, s.grad, "peek_grad");
  check_like(peek_prev_local, s.grad, "peek_prev_local");
  check_like(peek_local, s.grad, "peek_local");
  TORCH_CHECK(peek_form == kNoDc || peek_form == kDiagonal,
              "sapipe: the fused peek takes DC form none or diagonal (the outer form needs a "
              "second call with step_dots), got ", peek_form);
  GradSpec p;
  p.grad = *peek_grad;
  p.prev_local = peek_prev_local;
  p.n = peek_n;
  p.local = peek_local;
  p.inv_n = peek_inv_n;
  p.form = peek_form;
  p.lam = peek_lam;
  if (step_dots) {
    TORCH_CHECK(s.form != kOuter, "sapipe: step_dots with an outer-form update is not supported");
    TORCH_CHECK(peek_offsets, "sapipe: step_dots needs peek_offsets");
    check_offsets(*peek_offsets, s.grad, on_cpu);
    const at::Tensor& d = *step_dots;
    TORCH_CHECK(d.device() == s.grad.device() && d.scalar_type() == at::kDouble &&
                    d.is_contiguous() && d.numel() == peek_offsets->numel() - 1,
                "sapipe: step_dots must be a contiguous float64 tensor with one entry per tensor");
    p.offsets = peek_offsets;
  }
  e.peek = p;
  return e;
}

#define SAPIPE_EXTRA_ARGS                                                                   \
  py::arg("hist") = py::none(), py::arg("peek_out") = py::none(),                           \
      py::arg("peek_grad") = py::none(), py::arg("peek_prev_local") = py::none(),           \
      py::arg("peek_n") = 1.0, py::arg("peek_local") = py::none(), py::arg("peek_inv_n") = 1.0, \
      py::arg("peek_form") = 0, py::arg("peek_lam") = 0.0, py::arg("peek_offsets") = py::none(), \
      py::arg("step_dots") = py::none()

#define SAPIPE_SPEC_ARGS                                                                  \
  py::arg("grad"), py::arg("prev_local"), py::arg("n"), py::arg("local"), py::arg("inv_n"), \
      py::arg("form"), py::arg("delta"), py::arg("delta_ref"), py::arg("lam"),             \
      py::arg("offsets"), py::arg("dots")

// Impl provides dc_dots / compose / sgd / adam for one device type.
template <at::DeviceType kDevice>
void define_module(py::module_& m, at::Tensor (*dc_dots)(const GradSpec&),
                   void (*compose)(const GradSpec&, const at::Tensor&),
                   void (*sgd)(const GradSpec&, const SgdArgs&),
                   void (*adam)(const GradSpec&, const AdamArgs&)) {
  constexpr bool on_cpu = kDevice == at::kCPU;
  auto check_device = [](const at::Tensor& t) {
    TORCH_CHECK(t.device().type() == kDevice, "sapipe: this extension handles ",
                c10::DeviceTypeName(kDevice), " tensors, got one on ", t.device());
  };

  m.def(
      "dc_dots",
      [=](const at::Tensor& grad, const OptTensor& prev_local, double n,
          const at::Tensor& delta, const OptTensor& delta_ref, const at::Tensor& offsets) {
        check_device(grad);
        GradSpec s = make_spec(grad, prev_local, n, std::nullopt, 1.0, kOuter, delta, delta_ref,
                               0.0, offsets, std::nullopt, on_cpu);
        return dc_dots(s);
      },
      "Per-tensor dot products <grad - prev_local/n, delta - delta_ref> (float64, one per "
      "tensor; offsets = int64 tensor boundaries [S+1]).",
      py::arg("grad"), py::arg("prev_local"), py::arg("n"), py::arg("delta"),
      py::arg("delta_ref"), py::arg("offsets"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "compose",
      [=](const at::Tensor& out, const at::Tensor& grad, const OptTensor& prev_local, double n,
          const OptTensor& local, double inv_n, int64_t form, const OptTensor& delta,
          const OptTensor& delta_ref, double lam, const OptTensor& offsets,
          const OptTensor& dots) {
        check_device(grad);
        GradSpec s = make_spec(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam,
                               offsets, dots, on_cpu);
        check_like(out, grad, "out");
        compose(s, out);
        bump(out);
      },
      "out = DC_lam(grad - prev_local/n, delta - delta_ref) + local*inv_n (out may alias "
      "any input).",
      py::arg("out"), SAPIPE_SPEC_ARGS, py::call_guard<py::gil_scoped_release>());

  m.def(
      "sgd",
      [=](const at::Tensor& param, const OptTensor& momentum_buffer, const OptTensor& out,
          double lr, double momentum, double damp1, double weight_decay, bool nesterov,
          bool maximize, bool first, const at::Tensor& grad, const OptTensor& prev_local,
          double n, const OptTensor& local, double inv_n, int64_t form, const OptTensor& delta,
          const OptTensor& delta_ref, double lam, const OptTensor& offsets,
          const OptTensor& dots, const OptTensor& hist, const OptTensor& peek_out,
          const OptTensor& peek_grad, const OptTensor& peek_prev_local, double peek_n,
          const OptTensor& peek_local, double peek_inv_n, int64_t peek_form, double peek_lam,
          const OptTensor& peek_offsets, const OptTensor& step_dots) {
        check_device(grad);
        GradSpec s = make_spec(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam,
                               offsets, dots, on_cpu);
        check_like(param, grad, "param");
        check_like(out, grad, "out");
        UpdateExtras extra = make_extras(s, out, hist, peek_out, peek_grad, peek_prev_local,
                                         peek_n, peek_local, peek_inv_n, peek_form, peek_lam,
                                         peek_offsets, step_dots, on_cpu);
        if (momentum != 0) {
          TORCH_CHECK(momentum_buffer, "sapipe: momentum != 0 needs a momentum buffer");
          check_like(*momentum_buffer, grad, "momentum_buffer");
        }
        SgdArgs a{param, momentum != 0 ? momentum_buffer : std::nullopt, out, lr, momentum,
                  damp1, weight_decay, nesterov, maximize, first, extra};
        sgd(s, a);
        if (out) {
          bump(*out);
        } else {
          bump(param);
          if (a.momentum_buffer) bump(*a.momentum_buffer);
          bump_extras(extra);
        }
      },
      "One fused SGD step on a flat segment (in place, with optional history write, fused "
      "OPT_peek into peek_out and step dot products; or OPT_peek into out).",
      py::arg("param"), py::arg("momentum_buffer"), py::arg("out"), py::arg("lr"),
      py::arg("momentum"), py::arg("damp1"), py::arg("weight_decay"), py::arg("nesterov"),
      py::arg("maximize"), py::arg("first"), SAPIPE_SPEC_ARGS, SAPIPE_EXTRA_ARGS,
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "adam",
      [=](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
          const OptTensor& out, double neg_step_size, double bc2_sqrt, double lerp_weight,
          double beta2, double one_minus_beta2, double eps, double weight_decay, double decay,
          bool decoupled, bool maximize, const at::Tensor& grad, const OptTensor& prev_local,
          double n, const OptTensor& local, double inv_n, int64_t form, const OptTensor& delta,
          const OptTensor& delta_ref, double lam, const OptTensor& offsets,
          const OptTensor& dots, const OptTensor& hist, const OptTensor& peek_out,
          const OptTensor& peek_grad, const OptTensor& peek_prev_local, double peek_n,
          const OptTensor& peek_local, double peek_inv_n, int64_t peek_form, double peek_lam,
          const OptTensor& peek_offsets, const OptTensor& step_dots,
          double peek_neg_step_size, double peek_bc2_sqrt) {
        check_device(grad);
        GradSpec s = make_spec(grad, prev_local, n, local, inv_n, form, delta, delta_ref, lam,
                               offsets, dots, on_cpu);
        check_like(param, grad, "param");
        check_like(exp_avg, grad, "exp_avg");
        check_like(exp_avg_sq, grad, "exp_avg_sq");
        check_like(out, grad, "out");
        UpdateExtras extra = make_extras(s, out, hist, peek_out, peek_grad, peek_prev_local,
                                         peek_n, peek_local, peek_inv_n, peek_form, peek_lam,
                                         peek_offsets, step_dots, on_cpu);
        extra.peek_neg_step_size = peek_neg_step_size;
        extra.peek_bc2_sqrt = peek_bc2_sqrt;
        AdamArgs a{param, exp_avg, exp_avg_sq, out, neg_step_size, bc2_sqrt, lerp_weight, beta2,
                   one_minus_beta2, eps, weight_decay, decay, decoupled, maximize, extra};
        adam(s, a);
        if (out) {
          bump(*out);
        } else {
          bump(param);
          bump(exp_avg);
          bump(exp_avg_sq);
          bump_extras(extra);
        }
      },
      "One fused Adam/AdamW step on a flat segment (in place, with optional history write, "
      "fused OPT_peek into peek_out (bias correction of step + 1: peek_neg_step_size, "
      "peek_bc2_sqrt) and step dot products; or OPT_peek into out).",
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
      py::arg("neg_step_size"), py::arg("bc2_sqrt"), py::arg("lerp_weight"), py::arg("beta2"),
      py::arg("one_minus_beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decay"),
      py::arg("decoupled"), py::arg("maximize"), SAPIPE_SPEC_ARGS, SAPIPE_EXTRA_ARGS,
      py::arg("peek_neg_step_size") = 0.0, py::arg("peek_bc2_sqrt") = 1.0,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace sapipe
