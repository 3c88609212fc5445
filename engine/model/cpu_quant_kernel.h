// The kernel of Flare's weight-only product (cpu_quant.cpp: its numerics and layouts), included twice: by
// cpu_quant.cpp for AVX2 and by cpu_quant_vnni.cpp for AVX-512 VNNI, each copy in a namespace of its own
// (FLARE_QUANT_ISA). Both run the same integer sums (exact) and the same fp32 chain: the same bits.
// DESIGN.md, Model and kernels. The includer includes this file's headers first (cpu_quant_vnni.cpp must, so that
// only this file's code takes its target options).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu_simd.h"

namespace flare_cpu::FLARE_QUANT_ISA {

constexpr int64_t GROUP = 32;
constexpr int64_t COLUMNS = 8;  // a block's: the int32 lanes of a register
// Rows of x kept hot while a thread's blocks pass over them: 32 KiB of int16, most of L1.
constexpr int64_t TILE_BYTES = 32 * 1024;
// Whether this copy of the kernel is built for AVX-512 VNNI (cpu_quant_vnni.cpp, which defines FLARE_QUANT_VNNI:
// GCC's target pragma does not define __AVX512VNNI__ in C++): vpdpwssd adds a product's pairs into the accumulator
// in one instruction, and AVX-512's 32 registers hold twice the accumulators.
#ifdef FLARE_QUANT_VNNI
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif
// Rows of a tile that share each register of codes, and blocks a tile of them: R x C int32 and fp32 accumulators
// and C registers of codes in the registers. Measured best (GMAC/s, one thread, 16 and 512 rows of SmolLM2's
// shapes): with AVX2's 16 registers 4 x 1 (of 4 x 1, 4 x 2, 3 x 2, 2 x 3, 8 x 1: 65 against 37-55), with
// AVX-512's 32, 6 x 2 (of 4 x 2, 4 x 3, 6 x 2, 8 x 2: 92-97 against 65-89). One row (a decode step) takes more
// blocks instead.
constexpr int ROWS = VNNI ? 6 : 4, BLOCKS = VNNI ? 2 : 1, BLOCKS_OF_ONE_ROW = 4;
// How far ahead of the chunk in use a block's codes are asked for: with one row, the arithmetic per byte is too
// short for the hardware prefetcher to keep up with the weights' stream from memory.
constexpr int64_t PREFETCH_BYTES = 1024;
using flare_cpu::hsum;
using flare_cpu::MIN_MULTIPLY_ADDS_PER_THREAD;
using flare_cpu::MIN_WORK_PER_THREAD;

// The largest |value| of four vectors.
inline float abs_max(const __m256 part[4], __m256 sign) {
  const __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, part[0]), _mm256_andnot_ps(sign, part[1]));
  const __m256 b = _mm256_max_ps(_mm256_andnot_ps(sign, part[2]), _mm256_andnot_ps(sign, part[3]));
  return flare_cpu::hmax(_mm256_max_ps(a, b));
}

template <int BITS>
struct Codes {
  static constexpr int PAIRS = 16 / BITS;                // input pairs a chunk holds
  static constexpr int CHUNKS = GROUP / 2 / PAIRS;       // a group's
  static constexpr int64_t GROUP_BYTES = CHUNKS * 32;    // a block's group
  // Pair P of a chunk's words: 16 int16 codes, two a column.
  template <int P>
  static inline __m256i pair(__m256i w) {
    const __m256i shifted = _mm256_srli_epi16(w, P * BITS);
    if constexpr (P == PAIRS - 1) return shifted;
    return _mm256_and_si256(shifted, _mm256_set1_epi16((1 << BITS) - 1));
  }
};

// One group of x: its 32 values as four vectors of 8 int32 steps of xscale, which it returns; its sum in *sum.
inline float quantize_group(const float* v, __m256i n[4], float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 part[4];
  for (int i = 0; i < 4; ++i) part[i] = _mm256_loadu_ps(v + 8 * i);
  *sum = hsum(_mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3])));
  const float largest = abs_max(part, sign);
  const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse));
  return largest / 32767.f;
}

// One row of x [K] for the kernel: xq [K] int16 in input order, xscale [G] and xsum [G].
void quantize_row(const float* x, int64_t G, int16_t* xq, float* xscale, float* xsum) {
  for (int64_t g = 0; g < G; ++g) {
    __m256i n[4];
    xscale[g] = quantize_group(x + g * GROUP, n, &xsum[g]);
    // packs works within 128-bit lanes: the permute puts the 16 values back in order.
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2 * h], n[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP + 16 * h), packed);
    }
  }
}

// Per-group scales or mins of a block's 8 columns as fp32: stored as fp32 (float) or fp16 (uint16_t, converted by
// F16C, exactly).
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const uint16_t* v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
}

// A row's inputs k and k + 1 in every 32-bit lane.
inline __m256i input_pair(const int16_t* xq) {
  int32_t two;
  std::memcpy(&two, xq, sizeof(two));
  return _mm256_set1_epi32(two);
}

// The tile's rows (xq stride K, xscale and xsum stride G) against one pair P of a chunk: w[c] the chunk of block c,
// k the first input of the chunk.
template <int BITS, int R, int C, int P>
inline void chunk_pair(const __m256i w[C], const int16_t* xq, int64_t K, int64_t k, __m256i dot[R][C]) {
  __m256i codes[C];
  for (int c = 0; c < C; ++c) codes[c] = Codes<BITS>::template pair<P>(w[c]);
  for (int r = 0; r < R; ++r) {
    const __m256i x = input_pair(xq + r * K + k + 2 * P);
    for (int c = 0; c < C; ++c) {
      if constexpr (VNNI) {
        dot[r][c] = _mm256_dpwssd_epi32(dot[r][c], codes[c], x);
      } else {
        dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(codes[c], x));
      }
    }
  }
}

template <int BITS, int R, int C, int... P>
inline void chunk(const __m256i w[C], const int16_t* xq, int64_t K, int64_t k, __m256i dot[R][C],
                  std::integer_sequence<int, P...>) {
  (chunk_pair<BITS, R, C, P>(w, xq, K, k, dot), ...);
}

// R rows of the quantized x against C blocks (codes, scales and mins at the first block's; the next block's
// block_bytes and G * 8 values further); writes out[r * N + 8c + column].
template <int BITS, int R, int C, typename S>
inline void tile(const int16_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G, const uint8_t* q,
                 const S* scales, const S* mins, float* out, int64_t N) {
  using B = Codes<BITS>;
  const int64_t block_bytes = G * B::GROUP_BYTES;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm256_setzero_si256();
    const uint8_t* group = q + g * B::GROUP_BYTES;
    for (int c = 0; c < C; ++c)
      for (int64_t b = 0; b < B::GROUP_BYTES; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(group + c * block_bytes + b + PREFETCH_BYTES), _MM_HINT_T0);
    for (int j = 0; j < B::CHUNKS; ++j) {
      __m256i w[C];
      for (int c = 0; c < C; ++c)
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * block_bytes + 32 * j));
      chunk<BITS, R, C>(w, xq, K, g * GROUP + 2 * B::PAIRS * j, dot, std::make_integer_sequence<int, B::PAIRS>());
    }
    for (int c = 0; c < C; ++c) {
      const __m256 s = load8(scales + (c * G + g) * COLUMNS), mn = load8(mins + (c * G + g) * COLUMNS);
      for (int r = 0; r < R; ++r) {
        const __m256 step = _mm256_mul_ps(s, _mm256_set1_ps(xscale[r * G + g]));
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][c]), step, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r * G + g]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * N + c * COLUMNS, acc[r][c]);
}

// R rows against blocks b0 <= b < b1, C blocks a tile.
template <int BITS, int R, typename S>
void rows_against_blocks(const int16_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G,
                         const uint8_t* codes, const S* scales, const S* mins, int64_t b0, int64_t b1, float* out,
                         int64_t N) {
  constexpr int C = R == 1 ? BLOCKS_OF_ONE_ROW : BLOCKS;
  const int64_t block_bytes = G * Codes<BITS>::GROUP_BYTES, block_values = G * COLUMNS;
  int64_t b = b0;
  for (; b + C <= b1; b += C)
    tile<BITS, R, C, S>(xq, xscale, xsum, K, G, codes + b * block_bytes, scales + b * block_values,
                        mins + b * block_values, out + b * COLUMNS, N);
  for (; b < b1; ++b)
    tile<BITS, R, 1, S>(xq, xscale, xsum, K, G, codes + b * block_bytes, scales + b * block_values,
                        mins + b * block_values, out + b * COLUMNS, N);
}

// `count` <= R rows against blocks b0 <= b < b1.
template <int BITS, int R, typename S>
void rows_of_tile(int64_t count, const int16_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G,
                  const uint8_t* codes, const S* scales, const S* mins, int64_t b0, int64_t b1, float* out,
                  int64_t N) {
  if (count == R) {
    rows_against_blocks<BITS, R, S>(xq, xscale, xsum, K, G, codes, scales, mins, b0, b1, out, N);
  } else if constexpr (R > 1) {
    rows_of_tile<BITS, R - 1, S>(count, xq, xscale, xsum, K, G, codes, scales, mins, b0, b1, out, N);
  }
}

template <int BITS, typename S>
void quant_mm_kernel(const float* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, const S* mins,
                     int64_t N, float* out) {
  const int64_t G = K / GROUP, blocks = N / COLUMNS;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xscale(M * G), xsum(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, MIN_WORK_PER_THREAD / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, G, &xq[m * K], &xscale[m * G], &xsum[m * G]);
  });
  // Rows in tiles whose xq stays in L1 while the thread's blocks pass over them: a block's codes come from memory
  // once a tile and are unpacked once per ROWS rows of it.
  const int64_t tile = std::max<int64_t>(ROWS, TILE_BYTES / (K * int64_t{sizeof(int16_t)}) / ROWS * ROWS);
  const int64_t grain = std::max<int64_t>(1, MIN_MULTIPLY_ADDS_PER_THREAD / (std::min(M, tile) * K * COLUMNS));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      for (int64_t b = b0; b < b1; b += BLOCKS_OF_ONE_ROW)
        for (int64_t m = m0; m < m1; m += ROWS)
          rows_of_tile<BITS, ROWS, S>(std::min<int64_t>(ROWS, m1 - m), &xq[m * K], &xscale[m * G], &xsum[m * G],
                                      K, G, codes, scales, mins, b, std::min(b1, b + BLOCKS_OF_ONE_ROW),
                                      out + m * N, N);
    }
  });
}

// The product with scales and mins of either width (half: fp16), for 4- or 8-bit codes. Not inline: each includer
// defines its own copy, in its own namespace, which cpu_quant.cpp calls.
void quant_mm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, const void* mins,
              bool half, int64_t N, int64_t bits, float* out) {
  if (half) {
    const auto* s = static_cast<const uint16_t*>(scales);
    const auto* mn = static_cast<const uint16_t*>(mins);
    (bits == 4 ? quant_mm_kernel<4, uint16_t> : quant_mm_kernel<8, uint16_t>)(x, M, K, codes, s, mn, N, out);
  } else {
    const auto* s = static_cast<const float*>(scales);
    const auto* mn = static_cast<const float*>(mins);
    (bits == 4 ? quant_mm_kernel<4, float> : quant_mm_kernel<8, float>)(x, M, K, codes, s, mn, N, out);
  }
}

}  // namespace flare_cpu::FLARE_QUANT_ISA
