// Python bindings shared by the CPU module (sapipe._C) and the CUDA module (sapipe._C_cuda):
// the GradSpec / SgdHyper / AdamHyper structs, tensor checks, SgdArgs / AdamArgs assembly, GIL
// release, version bumps. The Python-facing wrapper is sapipe/ops.py (via sapipe/_ext.py),
// which builds those structs; these entry points are low level.
#pragma once

#include "common.h"

#include "check.h"
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace sapipe {
namespace py = pybind11;

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
// sapipe/gradient_spec.py and ops._check_update.)
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

// Where an update of `s` writes. Without `peek`: OPT_peek into `out`, or OPT in place (x_t
// also into s.hist). With `peek` (g~ of the prediction; its Delta is the update's own step,
// its form kNoDc or kDiagonal, the outer form being a second call): OPT in place, x_t into
// s.hist, x~ = OPT_peek(x_t, g~) into `out`, the step's dot products into peek->dots. Which
// combinations make sense is checked once, in Python (ops._check_update); here only what the
// kernels dereference.
struct Targets {
  OptTensor out;  // the kernels' OPT_peek target
  UpdateExtras extra;
};

inline Targets targets(const GradSpec& s, const GradSpec* peek, const OptTensor& out,
                       bool on_cpu) {
  const at::Tensor& g = s.grad;
  check_like(out, g, "out");
  Targets t;
  if (!peek) {
    if (out) t.out = out;
    else t.extra.hist = s.hist;
    return t;
  }
  check_like(peek->grad, g, "the peek's grad");
  check_like(peek->prev_local, g, "the peek's prev_local");
  check_like(peek->local, g, "the peek's local");
  GradSpec p;
  p.grad = peek->grad;
  p.prev_local = peek->prev_local;
  p.n = peek->n;
  p.local = peek->local;
  p.inv_n = peek->inv_n;
  p.form = peek->form == kDiagonal ? kDiagonal : kNoDc;
  p.lam = peek->lam;
  if (peek->dots) {
    SAPIPE_CHECK(peek->offsets, "sapipe: the step's dot products need the peek's tensor offsets");
    check_offsets(*peek->offsets, g, on_cpu);
    check_dots(*peek->dots, *peek->offsets, g, "the peek's dots");
    p.offsets = peek->offsets;
    t.extra.step_dots = peek->dots;
  }
  t.extra.hist = s.hist;
  t.extra.peek_out = out;
  t.extra.peek = p;
  return t;
}

// The structs Python builds (sapipe/ops.py, `_native` and the hyper-parameter converters).
// Module-local: _C and _C_cuda each have their own.
inline void define_types(py::module_& m) {
  py::class_<GradSpec>(m, "GradSpec", py::module_local(),
                       "g~ = DC_lam(grad - prev_local/n, delta - delta_ref) + local*inv_n, and "
                       "hist (x_t of an in-place update is written there too); csrc/common.h.")
      .def(py::init<at::Tensor, OptTensor, double, OptTensor, double, int64_t, OptTensor,
                    OptTensor, double, OptTensor, OptTensor, OptTensor>(),
           py::arg("grad"), py::arg("prev_local") = py::none(), py::arg("n") = 1.0,
           py::arg("local") = py::none(), py::arg("inv_n") = 1.0, py::arg("form") = 0,
           py::arg("delta") = py::none(), py::arg("delta_ref") = py::none(),
           py::arg("lam") = 0.0, py::arg("offsets") = py::none(), py::arg("dots") = py::none(),
           py::arg("hist") = py::none());
  py::class_<SgdHyper>(m, "SgdHyper", py::module_local(), "One SGD step's numbers.")
      .def(py::init<double, double, double, double, bool, bool, bool>(), py::arg("lr"),
           py::arg("momentum"), py::arg("damp1"), py::arg("weight_decay"), py::arg("nesterov"),
           py::arg("maximize"), py::arg("first"));
  py::class_<AdamHyper>(m, "AdamHyper", py::module_local(),
                        "One Adam(W) step's numbers, and the fused peek's bias correction.")
      .def(py::init<double, double, double, double, double, double, double, double, bool, bool,
                    double, double>(),
           py::arg("neg_step_size"), py::arg("bc2_sqrt"), py::arg("lerp_weight"),
           py::arg("beta2"), py::arg("one_minus_beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("decay"), py::arg("decoupled"), py::arg("maximize"),
           py::arg("peek_neg_step_size"), py::arg("peek_bc2_sqrt"));
}

// The entry points of one device type, around its dc_dots / compose / sgd / adam.
template <at::DeviceType kDevice>
void define_module(py::module_& m, at::Tensor (*dc_dots)(const GradSpec&),
                   void (*compose)(const GradSpec&, const at::Tensor&),
                   void (*sgd)(const GradSpec&, const SgdArgs&),
                   void (*adam)(const GradSpec&, const AdamArgs&)) {
  constexpr bool on_cpu = kDevice == at::kCPU;
  auto checked = [](const GradSpec& s) -> const GradSpec& {
    SAPIPE_CHECK(s.grad.device().type() == kDevice, "sapipe: this extension handles ",
                 c10::DeviceTypeName(kDevice), " tensors, got one on ", s.grad.device());
    check_spec(s, on_cpu);
    return s;
  };
  define_types(m);

  m.def(
      "dc_dots",
      [=](const GradSpec& s) {
        SAPIPE_CHECK(s.form == kOuter && s.delta,
                     "sapipe: dc_dots needs an outer-form spec with delta");
        return dc_dots(checked(s));
      },
      "Per-tensor dot products <grad - prev_local/n, delta - delta_ref> of an outer-form spec "
      "(float64, one per tensor of its offsets).",
      py::arg("spec"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "compose",
      [=](const GradSpec& s, const at::Tensor& out) {
        check_like(out, checked(s).grad, "out");
        compose(s, out);
        bump(out);
      },
      "out = g~ of the spec (out may alias any input).", py::arg("spec"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "sgd",
      [=](const at::Tensor& param, const OptTensor& momentum_buffer, const SgdHyper& hp,
          const GradSpec& s, const GradSpec* peek, const OptTensor& out) {
        check_like(param, checked(s).grad, "param");
        const OptTensor buf = hp.momentum != 0 ? momentum_buffer : std::nullopt;
        SAPIPE_CHECK(buf || hp.momentum == 0, "sapipe: momentum != 0 needs a momentum buffer");
        check_like(buf, s.grad, "momentum_buffer");
        Targets t = targets(s, peek, out, on_cpu);
        SgdArgs a{hp, param, buf, t.out, t.extra};
        sgd(s, a);
        bump_written(a.out, a.extra, param, buf);
      },
      "One fused SGD step on a flat segment: in place (with the spec's history write, and a "
      "peek's fused OPT_peek into out and step dot products), or OPT_peek into out.",
      py::arg("param"), py::arg("momentum_buffer"), py::arg("hp"), py::arg("spec"),
      py::arg("peek").none(true), py::arg("out"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "adam",
      [=](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
          const AdamHyper& hp, const GradSpec& s, const GradSpec* peek, const OptTensor& out) {
        check_like(param, checked(s).grad, "param");
        check_like(exp_avg, s.grad, "exp_avg");
        check_like(exp_avg_sq, s.grad, "exp_avg_sq");
        Targets t = targets(s, peek, out, on_cpu);
        AdamArgs a{hp, param, exp_avg, exp_avg_sq, t.out, t.extra};
        adam(s, a);
        bump_written(a.out, a.extra, param, exp_avg, exp_avg_sq);
      },
      "One fused Adam/AdamW step on a flat segment: in place (with the spec's history write, "
      "and a peek's fused OPT_peek into out, bias correction of step + 1, and step dot "
      "products), or OPT_peek into out.",
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("hp"),
      py::arg("spec"), py::arg("peek").none(true), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace sapipe
