// Baseline build of the CPU codec kernels (the compiler's default target: SSE2 on x86-64).
#include "cpu_codec_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#define SAPIPE_CPU_ISA base
#include "cpu_codec_tiles.h"
