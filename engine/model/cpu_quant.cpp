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
// Layouts (one row of bytes per output column, groups in input order):
//   4-bit: 16 bytes a group; byte i holds code i in its low nibble and code 16 + i in its high one, so a mask and
//          a shift of the 16 bytes give codes 0..15 and 16..31, each widened to 16 int16 lanes.
//   8-bit: 32 bytes a group, the codes in order.
// scales and mins: fp32 [N, K / 32].

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t GROUP = 32;
// Rows of x kept hot while a thread's columns pass over them (large M): 64 KiB of int16, a share of L2.
constexpr int64_t TILE_VALUES = 32768;
using flare_cpu::hsum;
using flare_cpu::MIN_WORK_PER_THREAD;

// The largest |value| of four vectors.
inline float abs_max(const __m256 part[4], __m256 sign) {
  const __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, part[0]), _mm256_andnot_ps(sign, part[1]));
  const __m256 b = _mm256_max_ps(_mm256_andnot_ps(sign, part[2]), _mm256_andnot_ps(sign, part[3]));
  const __m256 v = _mm256_max_ps(a, b);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS>
struct Codes;

template <>
struct Codes<4> {
  static constexpr int64_t BYTES = 16;
  // The 32 codes of the group at q as two vectors of 16 int16, in input order.
  static inline void unpack(const uint8_t* q, __m256i c[2]) {
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    c[0] = _mm256_cvtepu8_epi16(_mm_and_si128(b, nibble));
    c[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nibble));
  }
};

template <>
struct Codes<8> {
  static constexpr int64_t BYTES = 32;
  static inline void unpack(const uint8_t* q, __m256i c[2]) {
    c[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    c[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  }
};

// One row of x as 16-bit integers per group (xq [K], xscale [G]) and the fp32 sums of its groups (xsum [G]).
void quantize_row(const float* x, int64_t G, int16_t* xq, float* xscale, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < G; ++g) {
    const float* v = x + g * GROUP;
    __m256 part[4];
    for (int i = 0; i < 4; ++i) part[i] = _mm256_loadu_ps(v + 8 * i);
    xsum[g] = hsum(_mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3])));
    const float largest = abs_max(part, sign);
    xscale[g] = largest / 32767.f;
    const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse));
    // packs works within 128-bit lanes: the permute puts the 16 values back in input order.
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2 * h], n[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP + 16 * h), packed);
    }
  }
}

// Rows r < R of the quantized x (stride K; xscale and xsum stride G) against one column: its codes q, scales and
// mins; writes out[r * N]. The R rows share each group's unpacked codes.
template <int BITS, int R>
inline void column(const int16_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G,
                   const uint8_t* q, const float* scale, const float* mins, float* out, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i c[2];
    Codes<BITS>::unpack(q + g * Codes<BITS>::BYTES, c);
    const float s = scale[g];
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * K + g * GROUP;
      const __m256i dot = _mm256_add_epi32(
          _mm256_madd_epi16(c[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
          _mm256_madd_epi16(c[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xscale[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xs = xsum + r * G;
    __m256 m = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) m = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xs + g), m);
    float tail = 0.f;
    for (; g < G; ++g) tail += mins[g] * xs[g];
    out[r * N] = hsum(_mm256_add_ps(acc[r], m)) + tail;
  }
}

template <int BITS>
void quant_mm_kernel(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
                     const float* mins, int64_t N, float* out) {
  const int64_t G = K / GROUP;
  const int64_t column_bytes = G * Codes<BITS>::BYTES;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xscale(M * G), xsum(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, MIN_WORK_PER_THREAD / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, G, &xq[m * K], &xscale[m * G], &xsum[m * G]);
  });
  const int64_t tile = std::max<int64_t>(4, TILE_VALUES / K / 4 * 4);
  const int64_t grain = std::max<int64_t>(1, MIN_WORK_PER_THREAD / (std::min(M, tile) * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* q = codes + n * column_bytes;
        const float* s = scales + n * G;
        const float* mn = mins + n * G;
        int64_t m = m0;
        for (; m + 4 <= m1; m += 4)
          column<BITS, 4>(&xq[m * K], &xscale[m * G], &xsum[m * G], K, G, q, s, mn, out + m * N + n, N);
        const int16_t* xm = xq.data() + m * K;
        const float* xc = xscale.data() + m * G;
        const float* xs = xsum.data() + m * G;
        float* o = out + m * N + n;
        switch (m1 - m) {
          case 3: column<BITS, 3>(xm, xc, xs, K, G, q, s, mn, o, N); break;
          case 2: column<BITS, 2>(xm, xc, xs, K, G, q, s, mn, o, N); break;
          case 1: column<BITS, 1>(xm, xc, xs, K, G, q, s, mn, o, N); break;
          default: break;
        }
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
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == codes.size(0) && t->size(1) == K / GROUP,
                "flare_cpu: scales and mins must be fp32 [N, K / 32]");
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
  auto kernel = bits == 4 ? quant_mm_kernel<4> : quant_mm_kernel<8>;
  kernel(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), N,
         out.data_ptr<float>());
  return out;
}

}  // namespace flare_cpu

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("quant_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) { m.impl("quant_mm", &flare_cpu::quant_mm); }
