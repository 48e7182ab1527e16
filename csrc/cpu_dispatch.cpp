// Run-time choice of the CPU kernels' instruction set (update tiles and codec): AVX2 where the
// CPU has it, else the baseline build. SAPIPE_CPU_ISA=base in the environment forces the
// baseline.
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
#define SAPIPE_HAVE_AVX2 1
namespace avx2 {
extern const TileTable<float> table_f;
extern const TileTable<double> table_d;
extern const CodecTable<float> codec_table_f;
extern const CodecTable<double> codec_table_d;
}  // namespace avx2
#endif

namespace {

bool cpu_has_avx2() {
#ifdef SAPIPE_HAVE_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");  // the codec uses F16C
#else
  return false;
#endif
}

int detect() {
  const char* env = std::getenv("SAPIPE_CPU_ISA");
  if (env && std::strcmp(env, "base") == 0) return 0;
  return cpu_has_avx2() ? 1 : 0;
}

std::atomic<int>& choice() {
  static std::atomic<int> c{detect()};
  return c;
}

}  // namespace

template <>
const TileTable<float>& tiles<float>() {
#ifdef SAPIPE_HAVE_AVX2
  if (choice().load(std::memory_order_relaxed) == 1) return avx2::table_f;
#endif
  return base::table_f;
}

template <>
const TileTable<double>& tiles<double>() {
#ifdef SAPIPE_HAVE_AVX2
  if (choice().load(std::memory_order_relaxed) == 1) return avx2::table_d;
#endif
  return base::table_d;
}

template <>
const CodecTable<float>& codec_tiles<float>() {
#ifdef SAPIPE_HAVE_AVX2
  if (choice().load(std::memory_order_relaxed) == 1) return avx2::codec_table_f;
#endif
  return base::codec_table_f;
}

template <>
const CodecTable<double>& codec_tiles<double>() {
#ifdef SAPIPE_HAVE_AVX2
  if (choice().load(std::memory_order_relaxed) == 1) return avx2::codec_table_d;
#endif
  return base::codec_table_d;
}

const char* isa_name() { return choice().load() == 1 ? "avx2" : "base"; }

bool set_isa(const char* name) {
  if (std::strcmp(name, "base") == 0) {
    choice().store(0);
    return true;
  }
  if (std::strcmp(name, "avx2") == 0 && cpu_has_avx2()) {
    choice().store(1);
    return true;
  }
  return false;
}

}  // namespace cpu
}  // namespace sapipe
