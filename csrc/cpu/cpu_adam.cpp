// CPU: Adam / AdamW (amsgrad=False) fused with the gradient composition, in place (OPT, with
// its UpdateExtras: history write, fused peek, step dots) or into `out` (OPT_peek: moments and
// weights untouched).
#include "cpu_common.h"

#include <ATen/Dispatch.h>

#include <cmath>

namespace sapipe {
namespace cpu {

void adam(const GradSpec& gs, const AdamArgs& a) {
  AT_DISPATCH_FLOATING_TYPES(gs.grad.scalar_type(), "sapipe_adam_cpu", [&] {
    using T = scalar_t;
    Src<T> s(gs);
    const int64_t N = gs.grad.numel();
    std::vector<double> store;
    const double* dots = outer_dots<T>(gs, s, N, store);
    const bool peek = a.out.has_value();
    const bool has_wd = a.weight_decay != 0;
    AdamTile<T> t;
    t.param = a.param.data_ptr<T>();
    t.exp_avg = a.exp_avg.data_ptr<T>();
    t.exp_avg_sq = a.exp_avg_sq.data_ptr<T>();
    t.dst = peek ? a.out->data_ptr<T>() : a.param.data_ptr<T>();
    t.peek = peek;
    t.maximize = a.maximize;
    t.l2 = has_wd && !a.decoupled;
    t.decay_on = has_wd && a.decoupled;
    t.wd = static_cast<T>(a.weight_decay);
    t.w = static_cast<T>(a.lerp_weight);
    t.one_minus_w = T(1) - t.w;
    t.small_w = std::abs(t.w) < T(0.5);  // torch's lerp formula switch
    t.beta2 = static_cast<T>(a.beta2);
    t.omb2 = static_cast<T>(a.one_minus_beta2);
    t.bc2s = static_cast<T>(a.bc2_sqrt);
    t.eps = static_cast<T>(a.eps);
    t.neg_ss = static_cast<T>(a.neg_step_size);
    t.decay = static_cast<T>(a.decay);
    t.peek_bc2s = static_cast<T>(a.peek_bc2_sqrt);
    t.peek_neg_ss = static_cast<T>(a.peek_neg_step_size);
    if (!peek) t.extra = step_extras<T>(a.extra);
    const auto kernel = tiles<T>().adam;
    run_update<T>(s, N, dots, a.extra, [&](int64_t off, int64_t len, T coeff, double* lanes) {
      kernel(s.t, t, off, len, coeff, lanes);
    });
  });
}

}  // namespace cpu
}  // namespace sapipe
