// sapipe._C: loading it registers the sapipe operators and their CPU implementations
// (csrc/library.cpp, csrc/cpu/cpu_library.cpp); as a Python module it holds the gradient
// intake's autograd hooks (every device) and the CPU kernels' instruction-set switch.
#include "cpu_tile_types.h"
#include "gradient_intake.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "sapipe's C++ runtime: the gradient intake; loading it registers the torch.ops.sapipe "
      "operators (delay compensation, WP peek, SGD / Adam(W) updates, the compression codec) "
      "and their CPU kernels";
  sapipe::define_intake(m);
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
