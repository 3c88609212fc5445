// Flare's weight-only 4- and 8-bit matrix product for AVX2 CPUs: y = x @ w.T with x fp32 [M, K] and w held as
// groups of 32 weights, w = scale * code + min (GGUF's Q4_0, Q4_1 and Q8_0 blocks).
// DESIGN.md, Model and kernels; engine/model/cpu_quant.py builds and loads this file, engine/model/quant.py packs
// the weights (pack_codes) and calls torch.ops.flare_cpu.quant_mm, for every row count: a row's product is the
// same bits however many rows share the call (so a prompt scores alike whether its prefix was cached or not).
//
// Why its own kernel: without AVX-512, PyTorch's _weight_int4pack_mm_for_cpu needs bfloat16 inputs and runs at
// about 2 GB/s of weights (bench/README.md, "On an AVX2-only machine").
//
// Per group g of 32 inputs, column n and row r:
//     sum_k x[k] w[k] = scale[g] * sum_k x[k] code[k] + min[g] * sum_k x[k].
// Each row's x is rounded once per call to 16-bit integers per group, xq = round(x / xscale[g]) with
// xscale[g] = max |x| over the group / 32767 (an error of at most 2^-16 of the group's largest |x|; bfloat16, what
// PyTorch's kernel takes, keeps 2^-9 of each value). Then sum_k xq[k] code[k] is exact in int32 (vpmaddwd: 16
// products a instruction, against 8 for an fp32 FMA after converting codes to floats, which measured 1.6x slower
// on a Zen 1 EPYC), becomes fp32 once per group and is scaled by scale[g] * xscale[g] into an fp32 accumulator.
// The mins meet the fp32 group sums of x in a short dot product at the end of each column.
//
// Groups go in pairs (a lone last group pairs with nothing): a pair's 64 codes unpack into four vectors of 16
// int16 with shifts and masks alone (no lane-crossing widening), lanes 0..7 of vector e holding codes 8e..8e+7 of
// the pair's first group and lanes 8..15 those of its second; the rows' xq are stored in the same order, so four
// vpmaddwd and three adds leave the first group's dot product in int32 lanes 0..3 and the second's in 4..7, and
// one conversion and one FMA scale both groups. Up to ROWS rows share each pair's unpacked codes.
//
// Layouts (one row of bytes per output column, groups in input order):
//   4-bit: 16 bytes a group; its little-endian 16-bit word i (0..7) holds codes i, 8 + i, 16 + i and 24 + i, from
//          the low nibble up.
//   8-bit: 32 bytes a group, in two halves of 8 words: word i of half h holds codes 16h + i (low byte) and
//          16h + 8 + i. A pair of groups stores its first halves, then its second ones; a lone last group its two.
// scales and mins: [N, K / 32], both fp32 or both fp16 (GGUF's own; half the bytes of a decode step's largest
// stream after the codes, and converted exactly).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t GROUP = 32;
// Rows of x kept hot while a thread's columns pass over them: 32 KiB of int16, most of L1.
constexpr int64_t TILE_BYTES = 32 * 1024;
// Rows that share a pair's unpacked codes: their accumulators and the codes fill AVX2's 16 registers.
constexpr int ROWS = 4;
// How far ahead of the column in work its weights are prefetched (measured best of 2, 4, 8 and 16).
constexpr int64_t PREFETCH_COLUMNS = 4;
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
struct Codes;

template <>
struct Codes<4> {
  static constexpr int64_t BYTES = 16;  // a group's
  // The pair's 64 codes at q as four vectors of 16 int16 (see the layout above).
  static inline void unpack(const uint8_t* q, __m256i c[4]) {
    const __m256i nibble = _mm256_set1_epi16(15);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    c[0] = _mm256_and_si256(w, nibble);
    c[1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
    c[2] = _mm256_and_si256(_mm256_srli_epi16(w, 8), nibble);
    c[3] = _mm256_srli_epi16(w, 12);
  }
  // A lone last group's 32 codes, lanes 8..15 zero.
  static inline void unpack_lone(const uint8_t* q, __m256i c[4]) {
    alignas(32) uint8_t pair[32] = {};
    std::copy(q, q + BYTES, pair);
    unpack(pair, c);
  }
};

template <>
struct Codes<8> {
  static constexpr int64_t BYTES = 32;
  static inline void unpack(const uint8_t* q, __m256i c[4]) {
    const __m256i low = _mm256_set1_epi16(255);
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * h));
      c[2 * h] = _mm256_and_si256(w, low);
      c[2 * h + 1] = _mm256_srli_epi16(w, 8);
    }
  }
  static inline void unpack_lone(const uint8_t* q, __m256i c[4]) {
    alignas(32) uint8_t pair[64] = {};
    std::copy(q, q + 16, pair);
    std::copy(q + 16, q + 32, pair + 32);
    unpack(pair, c);
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

// One row of x [K] for the kernel: xq [P * 64] int16 in the pairs' order, xscale [P * 8] (each pair's two input
// scales, four lanes each, matching the int32 lanes of its dot products) and xsum [G], for P = ceil(G / 2) pairs.
void quantize_row(const float* x, int64_t G, int16_t* xq, float* xscale, float* xsum) {
  for (int64_t g = 0; g < G; g += 2) {
    __m256i first[4], second[4];
    const float scale0 = quantize_group(x + g * GROUP, first, &xsum[g]);
    float scale1 = 0.f;
    if (g + 1 < G) {
      scale1 = quantize_group(x + (g + 1) * GROUP, second, &xsum[g + 1]);
    } else {
      for (int i = 0; i < 4; ++i) second[i] = _mm256_setzero_si256();
    }
    // packs works within 128-bit lanes: the permute puts each group's 8 values back together.
    for (int e = 0; e < 4; ++e) {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(first[e], second[e]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP + 16 * e), packed);
    }
    _mm256_storeu_ps(xscale + g * 4, _mm256_setr_ps(scale0, scale0, scale0, scale0, scale1, scale1, scale1, scale1));
  }
}

// The int32 dot products of one row's pair (xr: its 64 int16) with the unpacked codes c, as fp32.
inline __m256 pair_dot(const __m256i c[4], const int16_t* xr) {
  const __m256i* x = reinterpret_cast<const __m256i*>(xr);
  const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(c[0], _mm256_loadu_si256(x)),
                                     _mm256_madd_epi16(c[1], _mm256_loadu_si256(x + 1)));
  const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(c[2], _mm256_loadu_si256(x + 2)),
                                     _mm256_madd_epi16(c[3], _mm256_loadu_si256(x + 3)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

// Per-group scales or mins as fp32: stored as fp32 (float) or fp16 (uint16_t, converted by F16C, exactly).
inline float load1(const float* v) { return *v; }
inline float load1(const uint16_t* v) { return _cvtsh_ss(*v); }
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const uint16_t* v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
}
// A pair's two values at v, each in four lanes (0..3 and 4..7: the int32 lanes of its groups' dot products).
inline __m256 load_pair(const float* v) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
inline __m256 load_pair(const uint16_t* v) {
  int32_t bits;
  std::memcpy(&bits, v, sizeof(bits));
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Rows r < R of the quantized x (xq stride XS values, xscale stride XS / 8, xsum stride G) against one column: its
// codes q, scales and mins; writes out[r * N]. The R rows share each pair's unpacked codes.
template <int BITS, int R, typename S>
inline void column(const int16_t* xq, const float* xscale, const float* xsum, int64_t XS, int64_t G,
                   const uint8_t* q, const S* scale, const S* mins, float* out, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    __m256i c[4];
    Codes<BITS>::unpack(q + g * Codes<BITS>::BYTES, c);
    const __m256 s = load_pair(scale + g);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_loadu_ps(xscale + r * (XS / 8) + g * 4);
      acc[r] = _mm256_fmadd_ps(pair_dot(c, xq + r * XS + g * GROUP), _mm256_mul_ps(s, xs), acc[r]);
    }
  }
  if (g < G) {
    __m256i c[4];
    Codes<BITS>::unpack_lone(q + g * Codes<BITS>::BYTES, c);
    const __m256 s = _mm256_set1_ps(load1(scale + g));  // lanes 4..7 meet zero codes and a zero input scale
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_loadu_ps(xscale + r * (XS / 8) + g * 4);
      acc[r] = _mm256_fmadd_ps(pair_dot(c, xq + r * XS + g * GROUP), _mm256_mul_ps(s, xs), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xs = xsum + r * G;
    __m256 m = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= G; h += 8) m = _mm256_fmadd_ps(load8(mins + h), _mm256_loadu_ps(xs + h), m);
    float tail = 0.f;
    for (; h < G; ++h) tail += load1(mins + h) * xs[h];
    out[r * N] = hsum(_mm256_add_ps(acc[r], m)) + tail;
  }
}

// Rows m0 <= m < m1 against one column, ROWS at a time.
template <int BITS, int R, typename S>
inline void rows_against_column(const int16_t* xq, const float* xscale, const float* xsum, int64_t XS, int64_t G,
                                int64_t count, const uint8_t* q, const S* s, const S* mn, float* out,
                                int64_t N) {
  int64_t m = 0;
  for (; m + R <= count; m += R)
    column<BITS, R, S>(xq + m * XS, xscale + m * (XS / 8), xsum + m * G, XS, G, q, s, mn, out + m * N, N);
  if constexpr (R > 1) {
    if (m < count)
      rows_against_column<BITS, R - 1, S>(xq + m * XS, xscale + m * (XS / 8), xsum + m * G, XS, G, count - m, q, s,
                                       mn, out + m * N, N);
  }
}

// Asks for column n's codes, scales and mins ahead of their use: with one row, a column's arithmetic is too short
// for the hardware prefetcher to keep up with the weights' stream from memory (30% faster a decode step's products).
template <typename S>
inline void prefetch_column(const uint8_t* codes, const S* scales, const S* mins, int64_t column_bytes, int64_t G,
                            int64_t n) {
  const char* q = reinterpret_cast<const char*>(codes + n * column_bytes);
  for (int64_t b = 0; b < column_bytes; b += 64) _mm_prefetch(q + b, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + n * G), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mins + n * G), _MM_HINT_T0);
}

template <int BITS, typename S>
void quant_mm_kernel(const float* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, const S* mins,
                     int64_t N, float* out) {
  const int64_t G = K / GROUP;
  const int64_t XS = (G + 1) / 2 * 2 * GROUP;  // a row's int16 values, its lone last group padded to a pair
  const int64_t column_bytes = G * Codes<BITS>::BYTES;
  std::vector<int16_t> xq(M * XS);
  std::vector<float> xscale(M * XS / 8), xsum(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, MIN_WORK_PER_THREAD / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, G, &xq[m * XS], &xscale[m * XS / 8], &xsum[m * G]);
  });
  // Rows in tiles whose xq stays in L1 while the thread's columns pass over it: a column's codes are unpacked once
  // per ROWS rows of a tile and come from memory once a tile.
  const int64_t tile = std::max<int64_t>(ROWS, TILE_BYTES / (XS * sizeof(int16_t)) / ROWS * ROWS);
  const int64_t grain = std::max<int64_t>(1, MIN_MULTIPLY_ADDS_PER_THREAD / (std::min(M, tile) * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += tile) {
      const int64_t count = std::min(tile, M - m);
      for (int64_t n = n0; n < n1; ++n) {
        if (n + PREFETCH_COLUMNS < n1) prefetch_column(codes, scales, mins, column_bytes, G, n + PREFETCH_COLUMNS);
        rows_against_column<BITS, ROWS, S>(&xq[m * XS], &xscale[m * XS / 8], &xsum[m * G], XS, G, count,
                                           codes + n * column_bytes, scales + n * G, mins + n * G, out + m * N + n,
                                           N);
      }
    }
  });
}

void check_weights(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t K,
                   int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "flare_cpu: 4- or 8-bit codes, not ", bits);
  TORCH_CHECK(K % GROUP == 0, "flare_cpu: K must be a multiple of ", GROUP);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == K * bits / 8,
              "flare_cpu: codes must be uint8 [N, K * bits / 8]");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == codes.size(0) && t->size(1) == K / GROUP,
                "flare_cpu: scales and mins must be both fp32 or both fp16 [N, K / 32]");
  }
}

}  // namespace

namespace flare_cpu {

at::Tensor quant_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                    int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "quant_mm: x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_weights(codes, scales, mins, K, bits);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xs = x.data_ptr<float>();
  const uint8_t* q = codes.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (scales.scalar_type() == at::kHalf) {
    const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const auto* mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
    (bits == 4 ? quant_mm_kernel<4, uint16_t> : quant_mm_kernel<8, uint16_t>)(xs, M, K, q, s, mn, N, o);
  } else {
    const float* s = scales.data_ptr<float>();
    const float* mn = mins.data_ptr<float>();
    (bits == 4 ? quant_mm_kernel<4, float> : quant_mm_kernel<8, float>)(xs, M, K, q, s, mn, N, o);
  }
  return out;
}

}  // namespace flare_cpu

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("quant_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) { m.impl("quant_mm", &flare_cpu::quant_mm); }
