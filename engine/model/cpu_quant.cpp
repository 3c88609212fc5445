// Flare's weight-only 4- and 8-bit matrix product for AVX2 CPUs: y = x @ w.T with x fp32 [M, K] and w held as
// groups of 32 weights, w = scale * code + min (GGUF's Q4_0, Q4_1 and Q8_0 blocks).
// DESIGN.md, Model and kernels; engine/model/cpu_quant.py builds and loads this file, engine/model/quant.py packs
// the weights (pack) and calls torch.ops.flare_cpu.quant_mm, for every row count: a row's product is the same bits
// however many rows share the call (so a prompt scores alike whether its prefix was cached or not).
//
// Why its own kernel: without AVX-512, PyTorch's _weight_int4pack_mm_for_cpu needs bfloat16 inputs and runs at
// about 2 GB/s of weights (bench/README.md, "On an AVX2-only machine").
//
// Per group g of 32 inputs, column n and row r:
//     sum_k x[k] w[k] = scale[g] * sum_k x[k] code[k] + min[g] * sum_k x[k].
// Each row's x is rounded once per call to 16-bit integers per group, xq = round(x / xscale[g]) with
// xscale[g] = max |x| over the group / 32767 (an error of at most 2^-16 of the group's largest |x|; bfloat16, what
// PyTorch's kernel takes, keeps 2^-9 of each value). Then D = sum_k xq[k] code[k] is exact in int32 (vpmaddwd: 16
// products an instruction), and each output is the fp32 chain, over the groups in order,
//     acc = fma(float(D[g]), scale[g] * xscale[g], acc);  acc = fma(min[g], xsum[g], acc)
// from acc = 0. Every output of every row runs exactly these operations whatever rows and columns share a call:
// the integer sums are exact in any order, and the chain is the same.
//
// Output columns go in blocks of 8, one column an int32 lane: a register of 16 int16 holds two consecutive codes
// of each of the block's 8 columns, and vpmaddwd against a row's two inputs at those positions (one 32-bit
// broadcast) adds both products into each column's lane. A tile of R rows x C blocks shares each register of
// codes among its rows and each broadcast input among its blocks (the products of many rows: prefill, 16 decode
// rows), instead of reading each row's inputs once per column.
//
// Layouts (N a multiple of 8; block b is columns 8b..8b+7, and holds rows 8b..8b+7 of each tensor, so blocks
// concatenate like rows):
//   codes [N, K * bits / 8] uint8: per block, its groups in input order, each as 32-byte chunks of 16
//          little-endian words; word i of a chunk holds codes of column i / 2 at inputs 2p + (i % 2) of the
//          chunk's pairs p, from the low bits up: 4-bit, 4 pairs a chunk (nibbles), 4 chunks a group; 8-bit, 2
//          pairs a chunk (bytes), 8 chunks a group.
//   scales, mins [N, K / 32]: per block, [group, column] (8 values a group), both fp32 or both fp16 (GGUF's own,
//          converted exactly; half the bytes of a decode step's largest stream after the codes).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t COLUMNS = 8;  // a block's: the int32 lanes of a register
// Rows of x kept hot while a thread's blocks pass over them: 32 KiB of int16, most of L1.
constexpr int64_t TILE_BYTES = 32 * 1024;
// Rows of a tile that share each register of codes, and blocks a tile of them: R x C int32 and fp32 accumulators
// and C registers of codes in AVX2's 16 registers. Measured (µs per product, one thread, 16 and 512 rows) best of
// 4 x 1, 4 x 2, 3 x 2, 2 x 3 and 8 x 1; one row (a decode step) takes more blocks instead.
constexpr int ROWS = 4, BLOCKS = 1, BLOCKS_OF_ONE_ROW = 4;
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
    for (int c = 0; c < C; ++c) dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(codes[c], x));
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

void check_weights(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t K,
                   int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "flare_cpu: 4- or 8-bit codes, not ", bits);
  TORCH_CHECK(K % GROUP == 0, "flare_cpu: K must be a multiple of ", GROUP);
  TORCH_CHECK(codes.size(0) % COLUMNS == 0, "flare_cpu: N must be a multiple of ", COLUMNS, " (quant.pack pads it)");
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
