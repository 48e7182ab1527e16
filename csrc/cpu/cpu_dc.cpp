// CPU: per-tensor dot products (outer DC, pass 1) and gradient composition (DC / WP3).
#include "cpu_common.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

namespace sapipe {
namespace cpu {

at::Tensor dc_dots(const GradSpec& gs) {
  const int64_t S = gs.offsets->numel() - 1;
  at::Tensor dots = at::empty({S}, gs.grad.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(gs.grad.scalar_type(), "sapipe_dc_dots_cpu", [&] {
    Src<scalar_t> s(gs);
    dots_impl<scalar_t>(s, gs.grad.numel(), dots.data_ptr<double>());
  });
  return dots;
}

void compose(const GradSpec& gs, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(gs.grad.scalar_type(), "sapipe_compose_cpu", [&] {
    using T = scalar_t;
    Src<T> s(gs);
    const int64_t N = gs.grad.numel();
    std::vector<double> store;
    const double* dots = outer_dots<T>(gs, s, N, store);
    T* o = out.data_ptr<T>();
    const auto kernel = tiles<T>().compose;
    for_each_tile<T>(s, N, dots, [&](int64_t off, int64_t len, T coeff) {
      kernel(s.t, o, off, len, coeff);
    });
  });
}

}  // namespace cpu
}  // namespace sapipe
