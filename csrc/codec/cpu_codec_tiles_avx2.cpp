// AVX2 build of the CPU codec kernels (x86-64 only; used when the CPU reports AVX2 and F16C,
// which every AVX2 CPU has: fp16 conversions use F16C's instructions). Every header is
// included before the target pragma (see cpu_tiles_avx2.cpp).
#include "cpu_codec_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define SAPIPE_CPU_ISA avx2
#define SAPIPE_CODEC_F16C 1
#define SAPIPE_CODEC_AVX2 1  // cpu_codec_simd.h
#include "cpu_codec_tiles.h"
#pragma GCC pop_options
#endif
