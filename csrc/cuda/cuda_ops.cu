// CUDA entry points for ATen tensors: dtype dispatch, device guard, current stream, and the
// outer-form dots pass, around the raw kernels of csrc/cuda/kernels.cuh.
#include "common.h"
#include "cuda_launch.h"
#include "kernels.cuh"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

// (ATen/cuda/CUDAContext.h is avoided on purpose: it needs the cuBLAS / cuSPARSE headers,
// which a minimal CUDA toolkit lacks; these kernels need only the runtime.)

namespace sapipe {
namespace cuda {
namespace {

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

template <typename T>
sapipe_cuda::GradSrc<T> make_src(const GradSpec& s) {
  sapipe_cuda::GradSrc<T> r;
  r.g = s.grad.data_ptr<T>();
  r.prev = ptr<T>(s.prev_local);
  r.local = ptr<T>(s.local);
  r.delta = ptr<T>(s.delta);
  r.delta_ref = ptr<T>(s.delta_ref);
  r.offsets = s.offsets ? s.offsets->data_ptr<int64_t>() : nullptr;
  r.dots = s.dots ? s.dots->data_ptr<double>() : nullptr;
  r.nseg = s.offsets ? s.offsets->numel() - 1 : 0;
  r.n = s.n;
  r.inv_n = s.inv_n;
  r.lam = s.lam;
  r.form = static_cast<int>(s.form);
  return r;
}

// Fills src.dots for the outer form when the caller gave none; `keep` owns the storage.
template <typename T>
void ensure_dots(const GradSpec& s, sapipe_cuda::GradSrc<T>& src, at::Tensor& keep,
                 cudaStream_t stream) {
  if (src.form != sapipe_cuda::kOuter || src.dots != nullptr) return;
  const int64_t N = s.grad.numel();
  at::Tensor ws = at::empty({sapipe_cuda::dots_workspace(N, src.nseg) + src.nseg},
                            s.grad.options().dtype(at::kDouble));
  double* partials = ws.data_ptr<double>();
  double* dots = partials + sapipe_cuda::dots_workspace(N, src.nseg);
  check(sapipe_cuda::launch_dots<T>(src, N, partials, dots, stream));
  src.dots = dots;
  keep = ws;
}

// The raw view of an update's extras; for step dots, `keep` gets the reduction workspace and
// `partials` points into it (the dots go straight into e.step_dots).
template <typename T>
sapipe_cuda::StepExtras<T> make_extras(const UpdateExtras& e, at::Tensor& keep,
                                       double*& partials, double*& dots) {
  sapipe_cuda::StepExtras<T> x{};
  x.hist = ptr<T>(e.hist);
  x.peek_out = ptr<T>(e.peek_out);
  if (e.peek) x.peek = make_src<T>(*e.peek);
  partials = dots = nullptr;
  if (e.step_dots) {
    const int64_t N = e.peek->grad.numel();
    keep = at::empty({sapipe_cuda::dots_workspace(N, x.peek.nseg)},
                     e.step_dots->options());
    partials = keep.data_ptr<double>();
    dots = e.step_dots->data_ptr<double>();
  }
  return x;
}

}  // namespace

#define SAPIPE_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

at::Tensor dc_dots(const GradSpec& s) {
  c10::cuda::CUDAGuard guard(s.grad.device());
  const int64_t N = s.grad.numel();
  const int64_t S = s.offsets->numel() - 1;
  at::Tensor dots = at::empty({S}, s.grad.options().dtype(at::kDouble));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  SAPIPE_DISPATCH(s.grad.scalar_type(), "sapipe_dc_dots_cuda", [&] {
    auto src = make_src<scalar_t>(s);
    at::Tensor partials = at::empty({sapipe_cuda::dots_workspace(N, S)}, dots.options());
    check(sapipe_cuda::launch_dots<scalar_t>(src, N, partials.data_ptr<double>(),
                                             dots.data_ptr<double>(), stream));
  });
  return dots;
}

void compose(const GradSpec& s, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(s.grad.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  SAPIPE_DISPATCH(s.grad.scalar_type(), "sapipe_compose_cuda", [&] {
    auto src = make_src<scalar_t>(s);
    at::Tensor keep;
    ensure_dots(s, src, keep, stream);
    check(sapipe_cuda::launch_compose<scalar_t>(src, s.grad.numel(), out.data_ptr<scalar_t>(),
                                                max_blocks(s.grad.device()), stream));
  });
}

void sgd(const GradSpec& s, const SgdArgs& a) {
  c10::cuda::CUDAGuard guard(s.grad.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  sapipe_cuda::SgdParams p{a.lr, a.momentum, a.damp1, a.weight_decay,
                           a.momentum != 0, a.nesterov, a.maximize, a.first};
  SAPIPE_DISPATCH(s.grad.scalar_type(), "sapipe_sgd_cuda", [&] {
    auto src = make_src<scalar_t>(s);
    at::Tensor keep, workspace;
    ensure_dots(s, src, keep, stream);
    double *partials, *dots;
    auto extra = make_extras<scalar_t>(a.extra, workspace, partials, dots);
    check(sapipe_cuda::launch_sgd<scalar_t>(src, s.grad.numel(), a.param.data_ptr<scalar_t>(),
                                            ptr<scalar_t>(a.momentum_buffer),
                                            ptr<scalar_t>(a.out), p, extra, partials, dots,
                                            max_blocks(s.grad.device()), stream));
  });
}

void adam(const GradSpec& s, const AdamArgs& a) {
  c10::cuda::CUDAGuard guard(s.grad.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  sapipe_cuda::AdamParams p{a.neg_step_size, a.bc2_sqrt, a.lerp_weight, a.beta2,
                            a.one_minus_beta2, a.eps, a.weight_decay, a.decay,
                            a.decoupled, a.maximize};
  SAPIPE_DISPATCH(s.grad.scalar_type(), "sapipe_adam_cuda", [&] {
    auto src = make_src<scalar_t>(s);
    at::Tensor keep, workspace;
    ensure_dots(s, src, keep, stream);
    double *partials, *dots;
    auto extra = make_extras<scalar_t>(a.extra, workspace, partials, dots);
    extra.peek_neg_step_size = a.peek_neg_step_size;  // the fused peek's bias correction
    extra.peek_bc2_sqrt = a.peek_bc2_sqrt;
    check(sapipe_cuda::launch_adam<scalar_t>(
        src, s.grad.numel(), a.param.data_ptr<scalar_t>(), a.exp_avg.data_ptr<scalar_t>(),
        a.exp_avg_sq.data_ptr<scalar_t>(), ptr<scalar_t>(a.out), p, extra, partials, dots,
        max_blocks(s.grad.device()), stream));
  });
}

}  // namespace cuda
}  // namespace sapipe
