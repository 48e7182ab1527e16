// AVX2 build of the CPU tile kernels (x86-64 only; used when the CPU reports AVX2).
// Every header is included before the target pragma, so nothing outside sapipe's own
// namespaced tile functions is compiled for AVX2 (no AVX2 copy of an inline library function
// can be picked by the linker for use elsewhere).
#include "cpu_tile_types.h"

#include <cmath>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC push_options
#pragma GCC target("avx2")
#define SAPIPE_CPU_ISA avx2
#include "cpu_tiles.h"
#pragma GCC pop_options
#endif
