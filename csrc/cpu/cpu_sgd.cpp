// CPU: SGD (momentum, dampening, Nesterov, weight decay, maximize) fused with the gradient
// composition, in place (OPT, with its UpdateExtras: history write, fused peek, step dots) or
// into `out` (OPT_peek, no state touched).
#include "cpu_common.h"

#include <ATen/Dispatch.h>

namespace sapipe {
namespace cpu {

void sgd(const GradSpec& gs, const SgdArgs& a) {
  AT_DISPATCH_FLOATING_TYPES(gs.grad.scalar_type(), "sapipe_sgd_cpu", [&] {
    using T = scalar_t;
    Src<T> s(gs);
    const int64_t N = gs.grad.numel();
    std::vector<double> store;
    const double* dots = outer_dots<T>(gs, s, N, store);
    const bool peek = a.out.has_value();
    SgdTile<T> t;
    t.param = a.param.data_ptr<T>();
    t.buf = ptr<T>(a.momentum_buffer);
    t.dst = peek ? a.out->data_ptr<T>() : a.param.data_ptr<T>();
    t.peek = peek;
    t.has_momentum = a.momentum != 0;
    t.has_wd = a.weight_decay != 0;
    t.first = a.first;
    t.nesterov = a.nesterov;
    t.maximize = a.maximize;
    t.wd = static_cast<T>(a.weight_decay);
    t.mom = static_cast<T>(a.momentum);
    t.damp1 = static_cast<T>(a.damp1);
    t.neg_lr = static_cast<T>(-a.lr);
    if (!peek) t.extra = step_extras<T>(a.extra);
    const auto kernel = tiles<T>().sgd;
    run_update<T>(s, N, dots, a.extra, [&](int64_t off, int64_t len, T coeff, double* lanes) {
      kernel(s.t, t, off, len, coeff, lanes);
    });
  });
}

}  // namespace cpu
}  // namespace sapipe
