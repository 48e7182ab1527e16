// Run-time choice of the CPU kernels' instruction set: the best the CPU has of
//   base   the baseline build (update tiles and codec);
//   avx2   AVX2 (+ F16C) builds of both;
//   avx512 the AVX-512 (F, BW, VL) build of the codec, with the AVX2 update tiles (their
//          loops are bound by the divider and memory, not by vector width).
// SAPIPE_CPU_ISA=base|avx2|avx512 in the environment caps the choice (e.g. avx2 where 512-bit
// vectors lower the core's clock for the training thread beside the codec); another value
// is ignored (sapipe/_ext.py warns). Every build gives the same bits (no FMA contraction
// anywhere).
#include "cpu_codec_types.h"
#include "cpu_tile_types.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace sapipe {
namespace cpu {

namespace base {
extern const TileTable<float> table_f;
extern const TileTable<double> table_d;
extern const CodecTable<float> codec_table_f;
extern const CodecTable<double> codec_table_d;
}  // namespace base

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SAPIPE_HAVE_X86_VARIANTS 1
namespace avx2 {
extern const TileTable<float> table_f;
extern const TileTable<double> table_d;
extern const CodecTable<float> codec_table_f;
extern const CodecTable<double> codec_table_d;
}  // namespace avx2
namespace avx512 {
extern const CodecTable<float> codec_table_f;
extern const CodecTable<double> codec_table_d;
}  // namespace avx512
#endif

namespace {

enum Isa : int { kBase = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"base", "avx2", "avx512"};

bool cpu_has(Isa isa) {
#ifdef SAPIPE_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");  // the codec uses F16C
  if (isa == kAvx2) return avx2;
  if (isa == kAvx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return isa == kBase;
}

int detect() {
  int cap = kAvx512;
  if (const char* env = std::getenv("SAPIPE_CPU_ISA")) {
    for (int i = kBase; i <= kAvx512; ++i)
      if (std::strcmp(env, kIsaNames[i]) == 0) cap = i;
  }
  for (int i = cap; i > kBase; --i)
    if (cpu_has(static_cast<Isa>(i))) return i;
  return kBase;
}

std::atomic<int>& choice() {
  static std::atomic<int> c{detect()};
  return c;
}

int chosen() { return choice().load(std::memory_order_relaxed); }

}  // namespace

template <>
const TileTable<float>& tiles<float>() {
#ifdef SAPIPE_HAVE_X86_VARIANTS
  if (chosen() >= kAvx2) return avx2::table_f;
#endif
  return base::table_f;
}

template <>
const TileTable<double>& tiles<double>() {
#ifdef SAPIPE_HAVE_X86_VARIANTS
  if (chosen() >= kAvx2) return avx2::table_d;
#endif
  return base::table_d;
}

template <>
const CodecTable<float>& codec_tiles<float>() {
#ifdef SAPIPE_HAVE_X86_VARIANTS
  if (chosen() == kAvx512) return avx512::codec_table_f;
  if (chosen() == kAvx2) return avx2::codec_table_f;
#endif
  return base::codec_table_f;
}

template <>
const CodecTable<double>& codec_tiles<double>() {
#ifdef SAPIPE_HAVE_X86_VARIANTS
  if (chosen() == kAvx512) return avx512::codec_table_d;
  if (chosen() == kAvx2) return avx2::codec_table_d;
#endif
  return base::codec_table_d;
}

const char* isa_name() { return kIsaNames[choice().load()]; }

bool set_isa(const char* name) {
  for (int i = kBase; i <= kAvx512; ++i) {
    if (std::strcmp(name, kIsaNames[i]) == 0 && cpu_has(static_cast<Isa>(i))) {
      choice().store(i);
      return true;
    }
  }
  return false;
}

}  // namespace cpu
}  // namespace sapipe
