// CPU codec kernels: one message row at a time, in tiles of kCodecTile values (int8: whole
// blocks of kCodecBlock values, one scale each) held on the stack, as plain loops over raw
// pointers so that one source compiles for several instruction sets (cpu_codec_tiles.cpp:
// the baseline; cpu_codec_tiles_avx2.cpp: AVX2 + F16C; cpu_codec_tiles_avx512.cpp:
// AVX-512), chosen at run time like the update kernels (cpu_dispatch.cpp). FMA stays off, so
// every ISA gives the same bits.
//
// The 16-bit conversions are written out with integer and float operations the vectoriser
// handles (no F16C, no library calls), rounding to nearest even as torch's conversions do;
// round-half-even of the int8 quotient is the rounding instruction, or in the baseline build
// the add-and-subtract of 1.5 * 2^(mantissa bits) (round_half_even). Rounding rules:
// csrc/codec/codec.h. Per-element choices are bit masks (`pick`), not branches: GCC keeps a choice
// between a float result and another value as a branch (a float operation must not be moved
// where it might trap) and then does not vectorise the loop. The AVX-512 and AVX2 builds
// replace two int8 loops that GCC vectorises poorly with intrinsics of the same bits
// (cpu_codec_simd.h).
//
// Include cpu_codec_types.h, <cmath>, <cstring> and <type_traits> before this file, then define
// SAPIPE_CPU_ISA (and SAPIPE_CODEC_F16C where F16C's conversions may be used: <immintrin.h>).
#ifndef SAPIPE_CPU_ISA
#error "define SAPIPE_CPU_ISA (the namespace of this instruction-set variant) first"
#endif

#if defined(_OPENMP)
#define SAPIPE_CODEC_SIMD _Pragma("omp simd")
#define SAPIPE_CODEC_SIMD_MAX _Pragma("omp simd reduction(max : m)")
#else
#define SAPIPE_CODEC_SIMD
#define SAPIPE_CODEC_SIMD_MAX
#endif

namespace sapipe {
namespace cpu {
namespace SAPIPE_CPU_ISA {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// `yes` where `condition` holds, else `no`, as a bit mask (no branch).
inline uint32_t pick(bool condition, uint32_t yes, uint32_t no) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return (yes & mask) | (no & ~mask);
}

// float -> IEEE half bits, round to nearest even; beyond 65504 -> inf; NaN -> quiet NaN.
inline uint16_t to_fp16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // normal halves: rebias the exponent by 127 - 15 and round away the 13 low mantissa bits
  // (a carry out of the mantissa raises the exponent, as it should)
  const uint32_t normal = (a + 0xfffu + ((a >> 13) & 1u) - (112u << 23)) >> 13;
  // subnormal halves (|f| < 2^-14): adding 0.5f rounds |f| to a multiple of 2^-24, the
  // subnormal half's unit, which then sits in the low bits of the sum
  const uint32_t subnormal = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
  uint32_t h = pick(a < 0x38800000u, subnormal, normal);
  h = pick(a >= 0x477ff000u, 0x7c00u, h);  // 65520 and above round to inf
  h = pick(a > 0x7f800000u, 0x7e00u, h);   // NaN
  return static_cast<uint16_t>(sign | h);
}

// IEEE half bits -> float (exact).
inline float from_fp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t a = h & 0x7fffu;
  // exponent and mantissa moved into float's fields, then rebiased by 2^(127 - 15): exact
  // for normal and subnormal halves alike
  const float magnitude = float_of(a << 13) * 0x1p112f;
  const uint32_t special = 0x7f800000u | (a << 13);  // inf and NaN keep their mantissa
  return float_of(sign | pick(a >= 0x7c00u, special, bits_of(magnitude)));
}

// float -> bfloat16 bits, round to nearest even; NaN -> 0x7fc0 (torch's canonical NaN).
inline uint16_t to_bf16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(pick((x & 0x7fffffffu) > 0x7f800000u, 0x7fc0u, rounded));
}

inline float from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

template <int kKind>
inline uint16_t to_16(float f) {
  return kKind == kCodecFp16 ? to_fp16(f) : to_bf16(f);
}

template <int kKind>
inline float from_16(uint16_t h) {
  return kKind == kCodecFp16 ? from_fp16(h) : from_bf16(h);
}

// A float's or double's bits as an unsigned integer of its width.
template <typename T>
struct BitsOf {
  using type = uint32_t;
};
template <>
struct BitsOf<double> {
  using type = uint64_t;
};
template <typename T>
using Bits = typename BitsOf<T>::type;

// `pick` for a float or double value.
template <typename T>
inline T pick_value(bool condition, T yes, T no) {
  using U = Bits<T>;
  U y, n;
  std::memcpy(&y, &yes, sizeof y);
  std::memcpy(&n, &no, sizeof n);
  const U mask = U(0) - static_cast<U>(condition);
  const U r = (y & mask) | (n & ~mask);
  T out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

template <typename T>
constexpr T kRoundMagic = T(12582912.0);  // 1.5 * 2^23
template <>
constexpr double kRoundMagic<double> = 6755399441055744.0;  // 1.5 * 2^52

// x rounded half to even, for the |x| <= 128 of an int8 quotient: the rounding instruction
// where the build has one (SSE4.1 and later: SAPIPE_CODEC_F16C; the rounding mode is the
// default, nearest even), else adding and subtracting 1.5 * 2^(mantissa bits), which gives
// the same result without a library call.
template <typename T>
inline T round_half_even(T x) {
#if defined(SAPIPE_CODEC_F16C)
  return std::nearbyint(x);
#else
  return (x + kRoundMagic<T>) - kRoundMagic<T>;
#endif
}

template <typename T>
constexpr T kMaxFinite = T(3.4028234663852886e38);
template <>
constexpr double kMaxFinite<double> = 1.7976931348623157e308;


inline int64_t clamp_count(int64_t available, int64_t limit) {
  return available <= 0 ? 0 : (available < limit ? available : limit);
}

// v[0:kCodecTile] = src[0:count] (+ residual), zero beyond count.
template <typename T>
inline void load_tile(const T* src, const T* residual, int64_t count, T* __restrict v) {
  if (residual) {
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < count; ++i) v[i] = src[i] + residual[i];
  } else {
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < count; ++i) v[i] = src[i];
  }
  for (int64_t i = count; i < kCodecTile; ++i) v[i] = T(0);
}

// residual[0:n] = v - r * step: what the int8 rounding r of v dropped. Called with n =
// kCodecBlock for whole blocks, so that the loop's trip count is a constant there.
template <typename T>
inline void residual_i8(const T* __restrict v, const T* __restrict r, T step, int64_t n, T* __restrict residual) {
  SAPIPE_CODEC_SIMD
  for (int64_t i = 0; i < n; ++i) residual[i] = v[i] - r[i] * step;
}

// |x|'s bits as a signed integer (never negative): signed, so that a maximum of them needs
// only the signed comparison every SIMD set has.
template <typename T>
using AbsBits = std::make_signed_t<Bits<T>>;

template <typename T>
constexpr AbsBits<T> kAbsMask = 0x7fffffff;  // all bits but the sign
template <>
constexpr int64_t kAbsMask<double> = 0x7fffffffffffffffll;

// The bits of |x|. Non-negative floats order as their bits do, and inf and NaN order above
// every finite value, so the largest abs_bits of a block is its max|v|, or an inf or NaN
// where it holds one: unlike a float maximum it does not skip NaN, so no second pass looks
// for them. And an integer maximum may be taken in any order: it vectorises to a tree.
template <typename T>
inline AbsBits<T> abs_bits(T x) {
  AbsBits<T> u;
  std::memcpy(&u, &x, sizeof u);
  return u & kAbsMask<T>;
}

// The bits of max|v| over one int8 block.
template <typename T>
inline AbsBits<T> block_max_bits(const T* __restrict v) {
  AbsBits<T> m = 0;
  SAPIPE_CODEC_SIMD_MAX
  for (int64_t i = 0; i < kCodecBlock; ++i) {
    const auto a = abs_bits(v[i]);
    m = a > m ? a : m;
  }
  return m;
}

#include "cpu_codec_simd.h"  // the AVX-512 / AVX2 builds' int8 loops (SAPIPE_CODEC_INT8_SIMD)

// One int8 block, given the bits of its max|v| (block_max_bits): its scale and kCodecBlock
// values; residual[0:count] updated (when given). Simple loops over the block, each one the
// vectoriser turns into plain vector code: the rounded quotients, their narrowing to int8,
// the residual.
template <typename T>
inline void quantize_block_i8(const T* __restrict v, int64_t count, AbsBits<T> max_bits,
                              int8_t* q, float* scale, T* residual) {
  T m;
  std::memcpy(&m, &max_bits, sizeof m);
  const float s = static_cast<float>(m / T(127));
  if (!(s <= 3.4028234663852886e38f)) {
    // the block holds an inf or a NaN, or its scale is beyond float32's range: it travels as
    // NaN; its residual is kept (codec.h)
    *scale = float_of(0x7fc00000u);
    for (int64_t i = 0; i < kCodecBlock; ++i) q[i] = 0;
    return;
  }
  if (s < 1.17549435e-38f) {
    // Below float32's normal range (all zeros, or what error feedback keeps resending of a
    // gradient that stays zero): 1 / s would overflow. The block travels as zeros and keeps
    // all of v as its residual.
    *scale = 0.0f;
    for (int64_t i = 0; i < kCodecBlock; ++i) q[i] = 0;
    if (residual) {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < count; ++i) residual[i] = v[i];
    }
    return;
  }
  // A normal scale keeps every |v| / s within 127 (1 + 2^-21), which rounds to at most 127:
  // no clamp is needed (the reference's clamp never acts).
  const T inverse = T(1) / T(s);
  *scale = s;
  if (!residual) {  // one loop: no rounded values to keep for the residual
#if defined(SAPIPE_CODEC_INT8_SIMD)
    if constexpr (std::is_same_v<T, float>) {
      quantize_block_i8_simd(v, inverse, q);
      return;
    }
#endif
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < kCodecBlock; ++i)
      q[i] = static_cast<int8_t>(static_cast<int32_t>(round_half_even(v[i] * inverse)));
    return;
  }
  alignas(64) T r[kCodecBlock];
  SAPIPE_CODEC_SIMD
  for (int64_t i = 0; i < kCodecBlock; ++i) r[i] = round_half_even(v[i] * inverse);
  SAPIPE_CODEC_SIMD
  for (int64_t i = 0; i < kCodecBlock; ++i) q[i] = static_cast<int8_t>(static_cast<int32_t>(r[i]));
  if (count == kCodecBlock) residual_i8(v, r, T(s), kCodecBlock, residual);  // a fixed trip count
  else residual_i8(v, r, T(s), count, residual);
}

// The int8 blocks of a tile, given their max_bits: v[0:span] (span a multiple of
// kCodecBlock), residual[0:count]. Every block's maximum is known before any is rounded, so
// the blocks' reductions and divisions, each a chain of dependent instructions, overlap
// instead of running one after another.
template <typename T>
inline void quantize_tile_i8(const T* __restrict v, int64_t count, int64_t span,
                             const AbsBits<T>* max_bits, int8_t* q, float* scales, T* residual) {
  for (int64_t b = 0; b < span / kCodecBlock; ++b) {
    const int64_t lo = b * kCodecBlock;
    quantize_block_i8(v + lo, clamp_count(count - lo, kCodecBlock), max_bits[b], q + lo, scales + b,
                      residual ? residual + lo : nullptr);
  }
}

// v[0:kCodecTile] = src + residual, and each block's max_bits found in the same pass.
template <typename T>
inline void load_tile_i8(const T* __restrict src, const T* __restrict residual, T* __restrict v,
                         AbsBits<T>* max_bits) {
  for (int64_t b = 0; b < kCodecTile / kCodecBlock; ++b) {
    const int64_t at = b * kCodecBlock;
    AbsBits<T> m = 0;
    SAPIPE_CODEC_SIMD_MAX
    for (int64_t i = at; i < at + kCodecBlock; ++i) {
      v[i] = src[i] + residual[i];
      const auto a = abs_bits(v[i]);
      m = a > m ? a : m;
    }
    max_bits[b] = m;
  }
}

template <typename T>
inline void encode_tile_i8(const T* __restrict v, int64_t count, int64_t span, int8_t* q, float* scales,
                           T* residual) {
  AbsBits<T> max_bits[kCodecTile / kCodecBlock];
  for (int64_t b = 0; b < span / kCodecBlock; ++b) max_bits[b] = block_max_bits(v + b * kCodecBlock);
  quantize_tile_i8(v, count, span, max_bits, q, scales, residual);
}

// Whether x = 2^k (1, 2, 4, ... or 1/2, ...): dividing by it is multiplying by 1 / x, exactly.
template <typename T>
inline bool is_power_of_two(T x) {
  int exponent = 0;
  return x > T(0) && std::frexp(x, &exponent) == T(0.5);
}

// Division by a row's `value` (the 16-bit formats carry v / W): a multiplication by
// `inverse` where that is exact (value = 2^k). Made once per row.
template <typename T>
struct Divisor {
  T value, inverse;
  bool exact;
  explicit Divisor(T d) : value(d), inverse(T(1) / d), exact(is_power_of_two(d)) {}
};

// h[0:n] = f[0:n] in 16 bits; F16C's conversion instruction where this build has it (the
// same rounding as to_fp16).
template <int kKind>
inline void to_16_bits(const float* __restrict f, uint16_t* __restrict h, int64_t n) {
  int64_t i = 0;
#if defined(SAPIPE_CODEC_F16C)
  if (kKind == kCodecFp16) {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  SAPIPE_CODEC_SIMD
  for (int64_t j = i; j < n; ++j) h[j] = to_16<kKind>(f[j]);
}

// f[0:n] = h[0:n] decoded (exact).
template <int kKind>
inline void from_16_bits(const uint16_t* __restrict h, float* __restrict f, int64_t n) {
  int64_t i = 0;
#if defined(SAPIPE_CODEC_F16C)
  if (kKind == kCodecFp16) {
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    }
  }
#endif
  SAPIPE_CODEC_SIMD
  for (int64_t j = i; j < n; ++j) f[j] = from_16<kKind>(h[j]);
}

// One 16-bit tile: `span` values as v / divide (a row's last tile may be short);
// residual[0:count] updated (when given).
template <typename T, int kKind>
inline void encode_tile_16(const T* __restrict v, int64_t count, int64_t span, uint16_t* h, const Divisor<T>& d,
                           T* residual) {
  const bool exact_inverse = d.exact;  // then v * inverse is v / divide
  const T inverse = d.inverse, divide = d.value;
  if (kKind == kCodecBf16) {  // the conversion is a few integer operations: in the same loop
    if (exact_inverse) {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < span; ++i) h[i] = to_bf16(static_cast<float>(v[i] * inverse));
    } else {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < span; ++i) h[i] = to_bf16(static_cast<float>(v[i] / divide));
    }
  } else {  // fp16: through a float tile, for F16C's conversion
    alignas(64) float f[kCodecTile];
    if (exact_inverse) {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < span; ++i) f[i] = static_cast<float>(v[i] * inverse);
    } else {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < span; ++i) f[i] = static_cast<float>(v[i] / divide);
    }
    to_16_bits<kKind>(f, h, span);
  }
  if (residual) {
    alignas(64) float f[kCodecTile];
    from_16_bits<kKind>(h, f, count);
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < count; ++i) {
      const T decoded = static_cast<T>(f[i]) * divide;
      residual[i] = pick_value(std::fabs(decoded) <= kMaxFinite<T>, v[i] - decoded, residual[i]);
    }
  }
}

// out[0:n] = (add ? out + : ) x * s: x int8 quotients, or 16-bit values already widened.
template <typename T, typename X>
inline void scaled(const X* __restrict x, T s, int64_t n, bool add, T* __restrict out) {
  if (add) {
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] + static_cast<T>(x[i]) * s;
  } else {
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i]) * s;
  }
}

// out[0:count] = (add ? out + : ) one int8 block decoded (count <= kCodecBlock; a whole
// block with a constant trip count).
template <typename T>
inline void decode_block_i8(const int8_t* q, float scale, int64_t count, bool add, T* out) {
  if (count == kCodecBlock) scaled(q, static_cast<T>(scale), kCodecBlock, add, out);
  else scaled(q, static_cast<T>(scale), count, add, out);
}

// out[0:kCodecBlock] = (add ? out + : ) x * s, as `scaled`, returning the bits of the
// block's new max|out| (block_max_bits): the last pass over a block finds its maximum too.
template <typename T, typename X>
inline AbsBits<T> scaled_block_max(const X* __restrict x, T s, bool add, T* __restrict out) {
  AbsBits<T> m = 0;
  if (add) {
    SAPIPE_CODEC_SIMD_MAX
    for (int64_t i = 0; i < kCodecBlock; ++i) {
      out[i] = out[i] + static_cast<T>(x[i]) * s;
      const auto a = abs_bits(out[i]);
      m = a > m ? a : m;
    }
  } else {
    SAPIPE_CODEC_SIMD_MAX
    for (int64_t i = 0; i < kCodecBlock; ++i) {
      out[i] = static_cast<T>(x[i]) * s;
      const auto a = abs_bits(out[i]);
      m = a > m ? a : m;
    }
  }
  return m;
}

// out[0:kCodecBlock] = x0 * s0 + x1 * s1, the first two rows of a sum in one pass (the same
// two roundings as one row after the other); with `max_bits`, the bits of the block's
// max|out| there too.
template <typename T>
inline void scaled_pair_block(const int8_t* __restrict x0, T s0, const int8_t* __restrict x1, T s1,
                              T* __restrict out, AbsBits<T>* max_bits) {
#if defined(SAPIPE_CODEC_INT8_SIMD)
  if constexpr (std::is_same_v<T, float>) {
    const int32_t m = pair_block_i8_simd(x0, s0, x1, s1, out);
    if (max_bits) *max_bits = m;
    return;
  }
#endif
  if (!max_bits) {
    SAPIPE_CODEC_SIMD
    for (int64_t i = 0; i < kCodecBlock; ++i) out[i] = static_cast<T>(x0[i]) * s0 + static_cast<T>(x1[i]) * s1;
    return;
  }
  AbsBits<T> m = 0;
  SAPIPE_CODEC_SIMD_MAX
  for (int64_t i = 0; i < kCodecBlock; ++i) {
    out[i] = static_cast<T>(x0[i]) * s0 + static_cast<T>(x1[i]) * s1;
    const auto a = abs_bits(out[i]);
    m = a > m ? a : m;
  }
  *max_bits = m;
}

// v[0:span] = the sum of in's int8 rows over the tile at `lo` in row order (+ residual[0:span]),
// and each block's max_bits, found in the last pass (the last row's, or the residual's: x * 1
// is x). The first two rows are added in one pass.
template <typename T>
inline void sum_tile_i8(const CodecRowsIn& in, int64_t lo, int64_t span, const T* residual, T* __restrict v,
                        AbsBits<T>* max_bits) {
  const int64_t blocks = span / kCodecBlock;
  const auto row = [&](int64_t r) { return static_cast<const int8_t*>(in.values) + r * in.stride + lo; };
  const auto scales = [&](int64_t r) { return in.scales + r * in.scale_stride + lo / kCodecBlock; };
  const int64_t passes = in.rows + (residual ? 1 : 0);  // each row in turn, then the residual
  int64_t r = 0;
  if (in.rows >= 2) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = b * kCodecBlock;
      scaled_pair_block(row(0) + at, static_cast<T>(scales(0)[b]), row(1) + at, static_cast<T>(scales(1)[b]),
                        v + at, passes == 2 ? max_bits + b : nullptr);
    }
    if (passes == 2) return;
    r = 2;
  }
  for (; r < in.rows - (residual ? 0 : 1); ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      scaled(row(r) + b * kCodecBlock, static_cast<T>(scales(r)[b]), kCodecBlock, r > 0, v + b * kCodecBlock);
    }
  }
  if (residual) {
    for (int64_t b = 0; b < blocks; ++b) {
      max_bits[b] = scaled_block_max(residual + b * kCodecBlock, T(1), true, v + b * kCodecBlock);
    }
    return;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kCodecBlock;
    max_bits[b] = scaled_block_max(row(r) + at, static_cast<T>(scales(r)[b]), r > 0, v + at);
  }
}

// out[0:count] = (add ? out + : ) the tile decoded (int8: block b's scale at scales[b]);
// 16-bit values times `multiply`.
template <typename T, int kKind>
inline void decode_tile(const void* values, const float* scales, int64_t count, T multiply,
                        bool add, T* __restrict out) {
  if (kKind == kCodecInt8) {
    const int8_t* q = static_cast<const int8_t*>(values);
    for (int64_t lo = 0, b = 0; lo < count; lo += kCodecBlock, ++b) {
      decode_block_i8(q + lo, scales[b], clamp_count(count - lo, kCodecBlock), add, out + lo);
    }
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(values);
  if (kKind == kCodecBf16) {  // a shift: in the same loop
    if (add) {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < count; ++i) out[i] = out[i] + static_cast<T>(from_bf16(h[i])) * multiply;
    } else {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(from_bf16(h[i])) * multiply;
    }
    return;
  }
  alignas(64) float f[kCodecTile];
  from_16_bits<kKind>(h, f, count);
  scaled(f, multiply, count, add, out);
}

template <int kKind>
inline int64_t value_bytes() {
  return kKind == kCodecInt8 ? 1 : 2;
}

inline const char* row_at(const void* base, int64_t row, int64_t stride, int64_t bytes) {
  return static_cast<const char*>(base) + row * stride * bytes;
}

// The tile of an outgoing row that starts at value `lo`: its first `span` values from v
// (int8: whole blocks, span a multiple of kCodecBlock), residual[0:count] updated.
template <typename T, int kKind>
inline void encode_tile(const T* v, int64_t count, int64_t span, const CodecRow& out, int64_t lo,
                        const Divisor<T>& divide, T* residual) {
  char* values = static_cast<char*>(out.values) + lo * value_bytes<kKind>();
  if (kKind != kCodecInt8) {
    encode_tile_16<T, kKind>(v, count, span, reinterpret_cast<uint16_t*>(values), divide, residual);
    return;
  }
  encode_tile_i8(v, count, span, reinterpret_cast<int8_t*>(values), out.scales + lo / kCodecBlock, residual);
}

template <typename T, int kKind>
void encode_row_impl(const T* src, T* residual, int64_t len, const CodecRow& out, T divide_by) {
  const Divisor<T> divide(divide_by);
  alignas(64) T v[kCodecTile];
  for (int64_t lo = 0; lo < out.width; lo += kCodecTile) {
    const int64_t span = clamp_count(out.width - lo, kCodecTile);
    const int64_t count = clamp_count(len - lo, span);
    if (kKind == kCodecInt8 && residual && count == kCodecTile) {  // the maxima found while adding
      AbsBits<T> max_bits[kCodecTile / kCodecBlock];
      load_tile_i8(src + lo, residual + lo, v, max_bits);
      quantize_tile_i8(v, count, span, max_bits, static_cast<int8_t*>(out.values) + lo,
                       out.scales + lo / kCodecBlock, residual + lo);
      continue;
    }
    const T* tile = v;
    if (count == kCodecTile && !residual) tile = src + lo;  // read in place: nothing to add
    else load_tile(src + lo, residual ? residual + lo : nullptr, count, v);
    encode_tile<T, kKind>(tile, count, span, out, lo, divide, residual ? residual + lo : nullptr);
  }
}

template <typename T, int kKind>
void sum_encode_row_impl(const CodecRowsIn& in, T* residual, const CodecRow& out, T divide_by) {
  const Divisor<T> divide(divide_by);
  alignas(64) T v[kCodecTile];
  const int64_t bytes = value_bytes<kKind>();
  for (int64_t lo = 0; lo < in.width; lo += kCodecTile) {
    const int64_t span = clamp_count(in.width - lo, kCodecTile);
    if (kKind == kCodecInt8) {  // the blocks' maxima found while summing
      AbsBits<T> max_bits[kCodecTile / kCodecBlock];
      sum_tile_i8(in, lo, span, residual ? residual + lo : nullptr, v, max_bits);
      quantize_tile_i8(v, span, span, max_bits, static_cast<int8_t*>(out.values) + lo,
                       out.scales + lo / kCodecBlock, residual ? residual + lo : nullptr);
      continue;
    }
    for (int64_t r = 0; r < in.rows; ++r) {
      const void* values = row_at(in.values, r, in.stride, bytes) + lo * bytes;
      const float* scales = in.scales ? in.scales + r * in.scale_stride + lo / kCodecBlock : nullptr;
      decode_tile<T, kKind>(values, scales, span, T(1), r > 0, v);
    }
    if (residual) {
      SAPIPE_CODEC_SIMD
      for (int64_t i = 0; i < span; ++i) v[i] = v[i] + residual[lo + i];
    }
    encode_tile<T, kKind>(v, span, span, out, lo, divide, residual ? residual + lo : nullptr);
  }
}

template <typename T, int kKind>
void decode_row_impl(const void* values, const float* scales, int64_t len, T* out, T multiply) {
  const int64_t bytes = value_bytes<kKind>();
  for (int64_t lo = 0; lo < len; lo += kCodecTile) {
    decode_tile<T, kKind>(static_cast<const char*>(values) + lo * bytes, scales ? scales + lo / kCodecBlock : nullptr,
                          clamp_count(len - lo, kCodecTile), multiply, false, out + lo);
  }
}

template <typename T>
void encode_row(int kind, const T* src, T* residual, int64_t len, const CodecRow& out, T divide) {
  if (kind == kCodecInt8) encode_row_impl<T, kCodecInt8>(src, residual, len, out, divide);
  else if (kind == kCodecFp16) encode_row_impl<T, kCodecFp16>(src, residual, len, out, divide);
  else encode_row_impl<T, kCodecBf16>(src, residual, len, out, divide);
}

template <typename T>
void sum_encode_row(int kind, const CodecRowsIn& in, T* residual, const CodecRow& out, T divide) {
  if (kind == kCodecInt8) sum_encode_row_impl<T, kCodecInt8>(in, residual, out, divide);
  else if (kind == kCodecFp16) sum_encode_row_impl<T, kCodecFp16>(in, residual, out, divide);
  else sum_encode_row_impl<T, kCodecBf16>(in, residual, out, divide);
}

template <typename T>
void decode_row(int kind, const void* values, const float* scales, int64_t len, T* out, T multiply) {
  if (kind == kCodecInt8) decode_row_impl<T, kCodecInt8>(values, scales, len, out, multiply);
  else if (kind == kCodecFp16) decode_row_impl<T, kCodecFp16>(values, scales, len, out, multiply);
  else decode_row_impl<T, kCodecBf16>(values, scales, len, out, multiply);
}

template <typename T>
constexpr CodecTable<T> make_codec_table() {
  return CodecTable<T>{&encode_row<T>, &sum_encode_row<T>, &decode_row<T>};
}

extern const CodecTable<float> codec_table_f;  // external linkage (read by cpu_dispatch.cpp)
extern const CodecTable<double> codec_table_d;
const CodecTable<float> codec_table_f = make_codec_table<float>();
const CodecTable<double> codec_table_d = make_codec_table<double>();

}  // namespace SAPIPE_CPU_ISA
}  // namespace cpu
}  // namespace sapipe

#undef SAPIPE_CODEC_SIMD
#undef SAPIPE_CODEC_SIMD_MAX
