// sapipe._C.GradientIntake: backward's gradients into their buckets without a Python call per
// parameter (the Python side is sapipe/runtime/intake.py).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace sapipe {
void define_intake(pybind11::module_& m);
}  // namespace sapipe
