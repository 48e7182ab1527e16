// Baseline build of the CPU tile kernels (the compiler's default target: SSE2 on x86-64).
#include "cpu_tile_types.h"

#include <cmath>

#define SAPIPE_CPU_ISA base
#include "cpu_tiles.h"
