// AVX2 helpers shared by Flare's CPU kernels (engine/kernels/cpu/quant.cpp, engine/kernels/cpu/layer_ops.cpp, engine/kernels/cpu/attention.cpp).
// docs/design.md, Models and kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace flare_cpu {

// Fewest units of elementwise work (values a row times the op's cost per value) worth a thread of its own: below it
// the fork costs more than it saves. A decode row's norms, rotary and SiLU stay on one thread; prefill rows split.
constexpr int64_t MIN_WORK_PER_THREAD = 1 << 16;

// Fewest multiply-adds of a product or of decode attention worth a second thread. A decode step at one stream
// (products of 0.3 to 1.8 million, attention of 0.2 million) then runs on one thread but for its output layer (28
// million), and prefill chunks and batches of 16 on all: on a two-core machine the frontend and the engine loop
// need the other core at one stream, and every parallel region waits for its slower thread, which other work may
// hold (docs/cpu.md, "Threads").
constexpr int64_t MIN_MULTIPLY_ADDS_PER_THREAD = int64_t{1} << 22;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x in 8 lanes, within 2 units in the last place of fp32 for x in [-87, 88] (Cephes' expf: x = n ln 2 + r with
// |r| <= ln 2 / 2, a degree-7 polynomial for e^r, 2^n put into the exponent). Below -87 it returns about 1e-38
// rather than a subnormal; above 88, about 2.4e38 rather than infinity: a softmax's or a SiLU's use of it cannot
// tell. The aten CPU operators use Sleef, whose last bits differ: callers are compared with a tolerance.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // r = x - n ln 2, with ln 2 in two parts so that n * (first part) is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// e^x of one value, through the same polynomial (the tails of rows that are not a multiple of 8 long).
inline float exp1(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }

}  // namespace flare_cpu
