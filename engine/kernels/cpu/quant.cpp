// Flare's weight-only 4- and 8-bit matrix product for AVX2 CPUs: y = x @ w.T with x fp32 [M, K] and w held as
// groups of 32 weights, w = scale * code + min (GGUF's Q4_0, Q4_1 and Q8_0 blocks).
// docs/design.md, Models and kernels; engine/kernels/cpu/extension.py builds and loads this file, engine/model/quant.py packs
// the weights (pack) and calls torch.ops.flare_cpu.quant_mm, for every row count: a row's product is the same bits
// however many rows share the call (so a prompt scores alike whether its prefix was cached or not).
//
// Why its own kernel: without AVX-512, PyTorch's _weight_int4pack_mm_for_cpu needs bfloat16 inputs and runs at
// about 2 GB/s of weights (docs/cpu.md, "On an AVX2-only machine").
// The kernel itself is engine/kernels/cpu/quant_kernel.h, built here for AVX2 and in engine/kernels/cpu/quant_vnni.cpp for AVX-512 VNNI, which
// runs where the CPU has it (FLARE_QUANT_ISA=avx2 keeps the AVX2 copy): the same bits (docs/cpu.md, "Flare's
// kernels").
//
// Per group g of 32 inputs, column n and row r:
//     sum_k x[k] w[k] = scale[g] * sum_k x[k] code[k] + min[g] * sum_k x[k].
// Each row's x is rounded once per call to integers per group, xq = round(x / xscale[g]) with xscale[g] = max |x|
// over the group / 127 for 4-bit codes (int8, as llama.cpp's Q8_1 for its Q4 blocks: an error of at most 2^-8 of
// the group's largest |x|) and / 32767 for 8-bit ones (int16: 2^-16); bfloat16, what PyTorch's kernel takes, keeps
// 2^-9 of each value. Then D = sum_k xq[k] code[k] is exact in int32 (4-bit: vpmaddubsw, 32 products an
// instruction, pair sums exact in int16 over a group, or vpdpbusd; 8-bit: vpmaddwd, 16, or vpdpwssd), and each
// output is the fp32 chain, over the groups in order,
//     acc = fma(float(D[g]), scale[g] * xscale[g], acc);  acc = fma(min[g], xsum[g], acc)
// from acc = 0, xsum[g] the sum of the group's x (8-bit) or of its rounded x, xscale[g] * sum xq (4-bit: the
// minimum's term then carries the codes' rounding, and the two cancel where GGUF's weights centre on 0). Every
// output of every row runs exactly these operations whatever rows and columns share a call: the integer sums are
// exact in any order, and the chain is the same.
//
// Output columns go in blocks of 8, one column an int32 lane: a register holds, in each 32-bit lane, consecutive
// codes of one of the block's 8 columns (4 as bytes after unpacking 4-bit ones, 2 as int16 of 8-bit ones), and one
// multiply-add against a 32-bit broadcast of a row's inputs at those positions adds their products into each
// column's lane. A tile of R rows x C blocks shares each register of codes among its rows and each broadcast input
// among its blocks (the products of many rows: prefill, 16 decode rows), instead of reading each row's inputs once
// per column.
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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#define FLARE_QUANT_ISA avx2
#include "quant_kernel.h"
#undef FLARE_QUANT_ISA

namespace flare_cpu::avx512_vnni {
// engine/kernels/cpu/quant_vnni.cpp: the same kernel built for AVX-512 VNNI.
void quant_mm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, const void* mins,
              bool half, int64_t N, int64_t bits, float* out);
}  // namespace flare_cpu::avx512_vnni

namespace {

using flare_cpu::avx2::COLUMNS;
using flare_cpu::avx2::GROUP;

// Whether this CPU runs the AVX-512 VNNI copy; FLARE_QUANT_ISA=avx2 keeps the AVX2 one (for A/B runs, and as on an
// AVX2-only machine: the same bits either way).
bool use_vnni() {
  static const bool vnni = [] {
    const char* isa = std::getenv("FLARE_QUANT_ISA");
    return !(isa != nullptr && std::strcmp(isa, "avx2") == 0) && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  }();
  return vnni;
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
  const bool half = scales.scalar_type() == at::kHalf;
  (use_vnni() ? avx512_vnni::quant_mm : avx2::quant_mm)(xs, M, K, q, scales.data_ptr(), mins.data_ptr(), half, N,
                                                         bits, o);
  return out;
}

}  // namespace flare_cpu

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("quant_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) { m.impl("quant_mm", &flare_cpu::quant_mm); }
