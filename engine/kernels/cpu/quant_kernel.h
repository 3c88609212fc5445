// The kernel of Flare's weight-only product (engine/kernels/cpu/quant.cpp: its numerics and layouts), included twice: by
// engine/kernels/cpu/quant.cpp for AVX2 and by engine/kernels/cpu/quant_vnni.cpp for AVX-512 VNNI, each copy in a namespace of its own
// (FLARE_QUANT_ISA). Both run the same integer sums (exact) and the same fp32 chain: the same bits.
// docs/design.md, Models and kernels. The includer includes this file's headers first (engine/kernels/cpu/quant_vnni.cpp must, so that
// only this file's code takes its target options).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>

#include "simd.h"

namespace flare_cpu::FLARE_QUANT_ISA {

constexpr int64_t GROUP = 32;
constexpr int64_t COLUMNS = 8;  // a block's: the int32 lanes of a register
// Rows of x kept hot while a thread's blocks pass over them: 32 KiB of inputs, most of L1.
constexpr int64_t TILE_BYTES = 32 * 1024;
// Whether this copy of the kernel is built for AVX-512 VNNI (engine/kernels/cpu/quant_vnni.cpp, which defines FLARE_QUANT_VNNI:
// GCC's target pragma does not define __AVX512VNNI__ in C++): vpdpbusd and vpdpwssd add a product's 4 or 2 terms
// a lane into the int32 accumulator in one instruction, and AVX-512's 32 registers hold twice the accumulators.
#ifdef FLARE_QUANT_VNNI
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif
// How far ahead of the chunk in use a block's codes are asked for: with one row, the arithmetic per byte is too
// short for the hardware prefetcher to keep up with the weights' stream from memory.
constexpr int64_t PREFETCH_BYTES = 1024;
using flare_cpu::hsum;
using flare_cpu::MIN_MULTIPLY_ADDS_PER_THREAD;
using flare_cpu::MIN_WORK_PER_THREAD;

// What each code width takes: the integer type of the inputs, rounded per group of 32 to steps of
// (largest |x|) / LARGEST.
//   4-bit codes meet int8 inputs: vpmaddubsw multiplies 32 unsigned codes by 32 signed inputs and adds pairs into
//   int16 (at most 2 * 15 * 127 a pair, so a group's 16 pairs a lane sum exactly in int16, at most 30480), and one
//   vpmaddwd against ones a group widens the sums to int32; VNNI's vpdpbusd does both in one. 64 multiply-adds a
//   lane a group take 8 vpmaddubsw and 8 adds, against 16 vpmaddwd and 16 adds with int16 inputs (AVX2, one
//   thread, 16 x 576 -> 1536: 65 -> 110 GMAC/s; VNNI 95 -> 160; docs/cpu.md, "Flare's kernels").
//   8-bit codes meet int16 inputs (8-bit codes by int8 inputs would overflow vpmaddubsw's int16 pair sums):
//   vpmaddwd, 2 products a lane, then an add; VNNI's vpdpwssd does both.
template <int BITS>
struct Inputs;
template <>
struct Inputs<4> {
  using T = int8_t;
  static constexpr float LARGEST = 127.f;
};
template <>
struct Inputs<8> {
  using T = int16_t;
  static constexpr float LARGEST = 32767.f;
};
// Rows of a tile that share each register of codes, and blocks a tile of them: R x C int32 (or int16) and fp32
// accumulators and C registers of codes in the registers. Measured best (GMAC/s, one thread, 16 and 512 rows of
// SmolLM2's shapes), with int16 inputs: with AVX2's 16 registers 4 x 1 (of 4 x 1, 4 x 2, 3 x 2, 2 x 3, 8 x 1: 65
// against 37-55), with AVX-512's 32, 6 x 2 (of 4 x 2, 4 x 3, 6 x 2, 8 x 2: 92-97 against 65-89); with int8 inputs
// on AVX2, 4 x 1, 2 x 2 and 5 x 1 alike (110-119), 3 x 1 and 6 x 1 slower (80-100). One row (a decode step) takes
// more blocks instead.
constexpr int ROWS = VNNI ? 6 : 4, BLOCKS = VNNI ? 2 : 1, BLOCKS_OF_ONE_ROW = 4;

// The largest |value| of four vectors.
inline float abs_max(const __m256 part[4], __m256 sign) {
  const __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, part[0]), _mm256_andnot_ps(sign, part[1]));
  const __m256 b = _mm256_max_ps(_mm256_andnot_ps(sign, part[2]), _mm256_andnot_ps(sign, part[3]));
  return flare_cpu::hmax(_mm256_max_ps(a, b));
}

// One group of x: its 32 values as four vectors of 8 int32 steps of xscale (at most `largest` of them), which it
// returns; its sum in *sum.
inline float quantize_group(const float* v, float largest_step, __m256i n[4], float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 part[4];
  for (int i = 0; i < 4; ++i) part[i] = _mm256_loadu_ps(v + 8 * i);
  *sum = hsum(_mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3])));
  const float largest = abs_max(part, sign);
  const __m256 inverse = _mm256_set1_ps(largest > 0.f ? largest_step / largest : 0.f);
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse));
  return largest / largest_step;
}

// One row of x [K] for 8-bit codes: xq [K] int16 in input order, xscale [G] and xsum [G].
inline void quantize_row(const float* x, int64_t G, int16_t* xq, float* xscale, float* xsum) {
  for (int64_t g = 0; g < G; ++g) {
    __m256i n[4];
    xscale[g] = quantize_group(x + g * GROUP, Inputs<8>::LARGEST, n, &xsum[g]);
    // packs works within 128-bit lanes: the permute puts the 16 values back in order.
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2 * h], n[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP + 16 * h), packed);
    }
  }
}

// One row of x [K] for 4-bit codes: xq [K] int8 in the order a chunk's codes take them (inputs 0, 4, 1, 5, 2, 6,
// 3, 7 of each 8: the low nibbles of a lane's 4 bytes are inputs 0, 4, 1, 5, the high ones 2, 6, 3, 7; see
// engine/kernels/cpu/quant.cpp's layouts), xscale [G] and xsum [G], here the sum of the rounded inputs (xscale * sum xq, as
// llama.cpp's Q8_1 keeps): the minimum's term then carries the same rounding as the codes' term, and a group's
// error is sum (xq xscale - x) w, w centred about 0 in GGUF's blocks, instead of sum (xq xscale - x) scale code,
// codes of 0 to 15 (the logits of tests/engine/test_quant.py's parity prompts moved by up to 4.2 against 1.1 so).
inline void quantize_row(const float* x, int64_t G, int8_t* xq, float* xscale, float* xsum) {
  const __m256i chunk_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < G; ++g) {
    __m256i n[4];
    float unrounded_sum;
    xscale[g] = quantize_group(x + g * GROUP, Inputs<4>::LARGEST, n, &unrounded_sum);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    xsum[g] = xscale[g] * static_cast<float>(flare_cpu::hsum_epi32(total));  // at most 32 * 127: exact in fp32
    for (int i = 0; i < 4; ++i) n[i] = _mm256_permutevar8x32_epi32(n[i], chunk_order);
    // The packs interleave 4-value runs of their operands within 128-bit lanes; the same permute of 32-bit runs
    // puts them back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP), _mm256_permutevar8x32_epi32(bytes, chunk_order));
  }
}

// Per-group scales or mins of a block's 8 columns as fp32: stored as fp32 (float) or fp16 (uint16_t, converted by
// F16C, exactly).
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const uint16_t* v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
}

// Four bytes of a row's inputs (two int16 or four int8) in every 32-bit lane.
inline __m256i broadcast_lane(const void* xq) {
  int32_t four;
  std::memcpy(&four, xq, sizeof(four));
  return _mm256_set1_epi32(four);
}

// One group's dot products D[r][c] of R rows (xq stride K, the group's inputs from k) against C blocks (the group's
// codes at group + c * block_bytes): int32 lanes, exact. 4-bit codes, int8 inputs.
template <int R, int C>
inline void group_dot(const uint8_t* group, int64_t block_bytes, const int8_t* xq, int64_t K, int64_t k,
                      __m256i dot[R][C]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i sums[R][C];  // int16 pair sums (int32 with VNNI)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {  // 32-byte chunks: 8 inputs of the block's 8 columns
    __m256i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * block_bytes + 32 * j));
      lo[c] = _mm256_and_si256(w, low);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xlo = broadcast_lane(xq + r * K + k + 8 * j), xhi = broadcast_lane(xq + r * K + k + 8 * j + 4);
      for (int c = 0; c < C; ++c) {
        if constexpr (VNNI) {
          sums[r][c] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sums[r][c], lo[c], xlo), hi[c], xhi);
        } else {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xlo), _mm256_maddubs_epi16(hi[c], xhi));
          // The empty asm keeps each sum in a register of its own here: GCC would otherwise reassociate the sums
          // of the four chunks into a tree of all 8 R C products of a group at once, more registers than AVX2 has
          // (spilled: 88 against 110 GMAC/s at 16 rows x 576 -> 1536).
          sums[r][c] = _mm256_add_epi16(sums[r][c], pairs);
          asm("" : "+x"(sums[r][c]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      dot[r][c] = VNNI ? sums[r][c] : _mm256_madd_epi16(sums[r][c], _mm256_set1_epi16(1));
}

// Pair P of a chunk's 8-bit codes: 16 int16 codes, two a column.
template <int P>
inline __m256i pair_of_bytes(__m256i w) {
  const __m256i shifted = _mm256_srli_epi16(w, P * 8);
  if constexpr (P == 1) return shifted;
  return _mm256_and_si256(shifted, _mm256_set1_epi16(0xFF));
}

// The rows against pair P of a chunk of 8-bit codes (w[c] the chunk of block c, k its first input).
template <int R, int C, int P>
inline void pair_dot(const __m256i w[C], const int16_t* xq, int64_t K, int64_t k, __m256i dot[R][C]) {
  __m256i codes[C];
  for (int c = 0; c < C; ++c) codes[c] = pair_of_bytes<P>(w[c]);
  for (int r = 0; r < R; ++r) {
    const __m256i x = broadcast_lane(xq + r * K + k + 2 * P);
    for (int c = 0; c < C; ++c) {
      if constexpr (VNNI) {
        dot[r][c] = _mm256_dpwssd_epi32(dot[r][c], codes[c], x);
      } else {
        dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(codes[c], x));
      }
    }
  }
}

// group_dot for 8-bit codes and int16 inputs: 8 chunks of 2 pairs.
template <int R, int C>
inline void group_dot(const uint8_t* group, int64_t block_bytes, const int16_t* xq, int64_t K, int64_t k,
                      __m256i dot[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) dot[r][c] = _mm256_setzero_si256();
  // Not unrolled: GCC would otherwise reassociate the sums of the 8 chunks into a tree of all their products, more
  // registers than AVX2 has (spilled: 45 against 62 GMAC/s at 16 rows x 576 -> 49152).
#pragma GCC unroll 1
  for (int j = 0; j < 8; ++j) {
    __m256i w[C];
    for (int c = 0; c < C; ++c)
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * block_bytes + 32 * j));
    pair_dot<R, C, 0>(w, xq, K, k + 4 * j, dot);
    pair_dot<R, C, 1>(w, xq, K, k + 4 * j, dot);
  }
}

// R rows of the rounded x against C blocks (codes, scales and mins at the first block's; the next block's
// block_bytes and G * 8 values further); writes out[r * N + 8c + column].
template <int BITS, int R, int C, typename S>
inline void tile(const typename Inputs<BITS>::T* xq, const float* xscale, const float* xsum, int64_t K, int64_t G,
                 const uint8_t* q, const S* scales, const S* mins, float* out, int64_t N) {
  constexpr int64_t GROUP_BYTES = GROUP * BITS;  // a block's 8 columns
  const int64_t block_bytes = G * GROUP_BYTES;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = q + g * GROUP_BYTES;
    for (int c = 0; c < C; ++c)
      for (int64_t b = 0; b < GROUP_BYTES; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(group + c * block_bytes + b + PREFETCH_BYTES), _MM_HINT_T0);
    __m256i dot[R][C];
    group_dot<R, C>(group, block_bytes, xq, K, g * GROUP, dot);
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
void rows_against_blocks(const typename Inputs<BITS>::T* xq, const float* xscale, const float* xsum, int64_t K,
                         int64_t G, const uint8_t* codes, const S* scales, const S* mins, int64_t b0, int64_t b1,
                         float* out, int64_t N) {
  constexpr int C = R == 1 ? BLOCKS_OF_ONE_ROW : BLOCKS;
  const int64_t block_bytes = G * GROUP * BITS, block_values = G * COLUMNS;
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
void rows_of_tile(int64_t count, const typename Inputs<BITS>::T* xq, const float* xscale, const float* xsum,
                  int64_t K, int64_t G, const uint8_t* codes, const S* scales, const S* mins, int64_t b0, int64_t b1,
                  float* out, int64_t N) {
  if (count == R) {
    rows_against_blocks<BITS, R, S>(xq, xscale, xsum, K, G, codes, scales, mins, b0, b1, out, N);
  } else if constexpr (R > 1) {
    rows_of_tile<BITS, R - 1, S>(count, xq, xscale, xsum, K, G, codes, scales, mins, b0, b1, out, N);
  }
}

template <int BITS, typename S>
void quant_mm_kernel(const float* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, const S* mins,
                     int64_t N, float* out) {
  using X = typename Inputs<BITS>::T;
  const int64_t G = K / GROUP, blocks = N / COLUMNS;
  std::vector<X> xq(M * K);
  std::vector<float> xscale(M * G), xsum(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, MIN_WORK_PER_THREAD / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, G, &xq[m * K], &xscale[m * G], &xsum[m * G]);
  });
  // Rows in tiles whose xq stays in L1 while the thread's blocks pass over them: a block's codes come from memory
  // once a tile and are unpacked once per ROWS rows of it.
  const int64_t tile = std::max<int64_t>(ROWS, TILE_BYTES / (K * int64_t{sizeof(X)}) / ROWS * ROWS);
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
// defines its own copy, in its own namespace, which engine/kernels/cpu/quant.cpp calls.
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
