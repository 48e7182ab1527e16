// AVX-512 build of the CPU codec kernels (x86-64 only; used when the CPU reports AVX-512 F,
// BW and VL): 16 values per instruction where the AVX2 build does 8. Every header is
// included before the target pragma (see cpu_tiles_avx2.cpp).
#include "cpu_codec_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12's AVX-512 intrinsics pass a self-initialised "undefined" vector as the unused
// merge source, which -Wall then reports as maybe uninitialised wherever they are inlined:
// a false positive, silenced for these headers only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c,prefer-vector-width=512")
#pragma GCC optimize("fp-contract=off")  // AVX-512F brings FMA: a * b + c must stay two roundings
#define SAPIPE_CPU_ISA avx512
#define SAPIPE_CODEC_F16C 1
#define SAPIPE_CODEC_AVX512 1  // cpu_codec_simd.h
#include "cpu_codec_tiles.h"
#pragma GCC pop_options
#endif
