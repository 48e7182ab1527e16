// Hand-vectorised int8 loops of the CPU codec for the AVX-512 and AVX2 builds
// (cpu_codec_tiles.h includes this file inside its namespace; SAPIPE_CODEC_AVX512 or
// SAPIPE_CODEC_AVX2 selects the set). Everything else in the codec is plain loops that the
// vectoriser turns into vector code; these two are not, because GCC widens int8 to float in
// three steps (to 16 bits, to 32 bits, and lane extracts) where one sign-extending load does
// it, and narrows int32 to int8 through word shuffles where one conversion does. That made
// int8's sum of two rows run at about 46% of the copy's bandwidth; this runs it at about 60%
// (benchmarks/RESULTS.md §3).
//
// Same bits as the plain loops they replace: the same products and sums in the same order
// (FMA stays off), and the conversion to int32 rounds to nearest even (the default rounding
// mode, as std::nearbyint in round_half_even). tests/test_codec_kernels.py compares every
// build with the reference bit for bit.

#if defined(SAPIPE_CODEC_AVX512)
#define SAPIPE_CODEC_INT8_SIMD 1

// out[0:kCodecBlock] = x0 * s0 + x1 * s1 (two roundings: the products, then their sum); the
// bits of max|out|.
inline int32_t pair_block_i8_simd(const int8_t* x0, float s0, const int8_t* x1, float s1, float* out) {
  const __m512 a0 = _mm512_set1_ps(s0), a1 = _mm512_set1_ps(s1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m = _mm512_setzero_si512();
  for (int64_t i = 0; i < kCodecBlock; i += 16) {
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x0 + i))));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x1 + i))));
    const __m512 r = _mm512_add_ps(_mm512_mul_ps(f0, a0), _mm512_mul_ps(f1, a1));
    _mm512_storeu_ps(out + i, r);
    m = _mm512_max_epi32(m, _mm512_and_si512(_mm512_castps_si512(r), abs_mask));
  }
  return _mm512_reduce_max_epi32(m);
}

// q[0:kCodecBlock] = v * inverse rounded half to even (|v * inverse| <= 127: no clamp, and
// the narrowing keeps every value).
inline void quantize_block_i8_simd(const float* v, float inverse, int8_t* q) {
  const __m512 by = _mm512_set1_ps(inverse);
  for (int64_t i = 0; i < kCodecBlock; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), by));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
  }
}

#elif defined(SAPIPE_CODEC_AVX2)
#define SAPIPE_CODEC_INT8_SIMD 1

inline int32_t pair_block_i8_simd(const int8_t* x0, float s0, const int8_t* x1, float s1, float* out) {
  const __m256 a0 = _mm256_set1_ps(s0), a1 = _mm256_set1_ps(s1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  for (int64_t i = 0; i < kCodecBlock; i += 8) {
    const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x0 + i))));
    const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x1 + i))));
    const __m256 r = _mm256_add_ps(_mm256_mul_ps(f0, a0), _mm256_mul_ps(f1, a1));
    _mm256_storeu_ps(out + i, r);
    m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(r), abs_mask));
  }
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}

inline void quantize_block_i8_simd(const float* v, float inverse, int8_t* q) {
  const __m256 by = _mm256_set1_ps(inverse);
  // the saturating packs interleave the four vectors' 128-bit halves; this puts them back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < kCodecBlock; i += 32) {
    __m256i r[4];
    for (int j = 0; j < 4; ++j) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), by));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

#endif
