// sapipe._C: the CPU kernels (vectorised loops, OpenMP across cores via at::parallel_for), and
// the gradient intake's autograd hooks (every device).
#include "bindings.h"
#include "codec_bindings.h"
#include "cpu_tile_types.h"
#include "gradient_intake.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "sapipe fused CPU kernels: delay compensation, WP peek, SGD / Adam(W) updates, the compression codec";
  sapipe::define_module<at::kCPU>(m, &sapipe::cpu::dc_dots, &sapipe::cpu::compose,
                                  &sapipe::cpu::sgd, &sapipe::cpu::adam);
  sapipe::define_codec<at::kCPU>(m, &sapipe::cpu::codec_encode, &sapipe::cpu::codec_sum_encode,
                                 &sapipe::cpu::codec_decode);
  sapipe::define_intake(m);
  m.attr("device_type") = "cpu";
  m.def("cpu_isa", &sapipe::cpu::isa_name,
        "Instruction set of the CPU kernels in use: \"avx512\" (the codec; AVX2 update tiles), \"avx2\" or \"base\".");
  m.def(
      "set_cpu_isa", [](const std::string& name) { return sapipe::cpu::set_isa(name.c_str()); },
      "Select the CPU kernels' instruction set (\"base\" / \"avx2\" / \"avx512\"); False if unavailable.");
#if defined(_OPENMP)
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
