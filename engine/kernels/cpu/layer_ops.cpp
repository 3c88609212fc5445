// The elementwise parts of a quantized CPU core's decoder layer, each one call where aten takes several operators
// (each worth 3-40 µs of dispatch on a Zen 1 EPYC against well under a microsecond of arithmetic for one row):
//   rms_norm      out = x / sqrt(mean(x^2) + eps) * weight (aten's rms_norm: five operators);
//   add_rms_norm  the residual add folded in: (rms_norm(x + residual), x + residual) in one pass;
//   rotary        x * cos + roll(x, D/2) * signed_sin over q and k heads together (model/rotary.py's rotate: four);
//   silu_mul      silu(gate) * up of a fused [gate | up] product (three, and a chunk).
// docs/design.md, Models and kernels; engine/kernels/cpu/extension.py builds this file with engine/kernels/cpu/quant.cpp and engine/kernels/cpu/attention.cpp,
// engine/model/backends/cpu_ops.py calls the ops for quantized CPU cores (dense cores keep aten's, bit for bit
// transformers').
// Sums and products round as aten's fp32 operators do (separate multiplies and adds, no fused multiply-add), so
// rotary and the residual add are bitwise aten's; the norms' sum of squares runs in 8 lanes and SiLU's e^x is
// engine/kernels/cpu/simd.h's, both within a few units in the last place of aten's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops.h"
#include "simd.h"

namespace {

using flare_cpu::MIN_WORK_PER_THREAD;

int64_t grain_for(int64_t width) { return std::max<int64_t>(1, MIN_WORK_PER_THREAD / std::max<int64_t>(width, 1)); }

// out = v / sqrt(mean(v^2) + eps) * w over one row of H values.
void norm_row(const float* v, const float* w, float* out, int64_t H, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= H; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(v + k), _mm256_loadu_ps(v + k), acc);
  float squares = flare_cpu::hsum(acc);
  for (int64_t t = k; t < H; ++t) squares += v[t] * v[t];
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
  const __m256 scale = _mm256_set1_ps(inverse);
  for (k = 0; k + 8 <= H; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + k), scale), _mm256_loadu_ps(w + k)));
  for (; k < H; ++k) out[k] = v[k] * inverse * w[k];
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(0),
              name, ": fp32 x [..., H] and weight [H]");
}

}  // namespace

namespace flare_cpu {

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_norm(input, weight, "rms_norm");
  const at::Tensor x = input.contiguous();
  const int64_t H = weight.size(0), M = H ? x.numel() / H : 0;
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, grain_for(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(in + m * H, w, o + m * H, H, static_cast<float>(eps));
  });
  return out;
}

// (rms_norm(x + residual), x + residual): the step's residual stream and the next branch's input in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& input, const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps) {
  check_norm(input, weight, "add_rms_norm");
  TORCH_CHECK(residual_in.sizes() == input.sizes() && residual_in.scalar_type() == at::kFloat,
              "add_rms_norm: x and residual must be fp32 of one shape");
  const at::Tensor x = input.contiguous(), r = residual_in.contiguous();
  const int64_t H = weight.size(0), M = H ? x.numel() / H : 0;
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = r.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, M, grain_for(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t at = m * H;
      int64_t k = 0;
      for (; k + 8 <= H; k += 8)
        _mm256_storeu_ps(s + at + k, _mm256_add_ps(_mm256_loadu_ps(a + at + k), _mm256_loadu_ps(b + at + k)));
      for (; k < H; ++k) s[at + k] = a[at + k] + b[at + k];
      norm_row(s + at, w, o + at, H, static_cast<float>(eps));
    }
  });
  return {out, sum};
}

// x [T, heads, D] (any strides but a unit last one: q and k are a view of the fused q/k/v product), cos and
// signed_sin [T, D] (any leading shape of T * D values) -> contiguous [T, heads, D]. Every lane is
// x[d] * cos[d] + x[(d + D/2) % D] * signed_sin[d], each product and the sum rounded once, as aten's.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "rotary: fp32 x [T, heads, D]");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary: an even head size, not ", D);
  const at::Tensor cosines = cos_in.contiguous(), sines = sin_in.contiguous();
  for (const at::Tensor* t : {&cosines, &sines})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == T * D, "rotary: fp32 cos and sin of T * D values");
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float* in = x.data_ptr<float>();
  const float* c = cosines.data_ptr<float>();
  const float* s = sines.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, T * heads, grain_for(4 * D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads;
      const float* v = in + t * row_stride + (i % heads) * head_stride;
      const float* ct = c + t * D;
      const float* st = s + t * D;
      float* r = o + i * D;
      int64_t d = 0;
      // Lanes d and d + 8 of one half: whole vectors while 8 of them stay within a half.
      for (; half % 8 == 0 && d < D; d += 8) {
        const int64_t partner = d < half ? d + half : d - half;
        _mm256_storeu_ps(r + d, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + d), _mm256_loadu_ps(ct + d)),
                                              _mm256_mul_ps(_mm256_loadu_ps(v + partner), _mm256_loadu_ps(st + d))));
      }
      for (; d < D; ++d) {
        const int64_t partner = d < half ? d + half : d - half;
        r[d] = v[d] * ct[d] + v[partner] * st[d];  // two roundings of products and one of the sum: -ffp-contract=off
      }
    }
  });
  return out;
}

// gate_up [T, 2I] (the fused gate/up product; any row stride) -> silu(gate) * up [T, I], silu(g) = g / (1 + e^-g).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: fp32 [T, 2 * I] with a unit column stride");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, grain_for(8 * I), [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = in + t * stride;
      const float* u = g + I;
      float* r = o + t * I;
      int64_t k = 0;
      for (; k + 8 <= I; k += 8) {
        const __m256 gate = _mm256_loadu_ps(g + k);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, flare_cpu::exp256(_mm256_xor_ps(gate, sign))));
        _mm256_storeu_ps(r + k, _mm256_mul_ps(silu, _mm256_loadu_ps(u + k)));
      }
      for (; k < I; ++k) r[k] = g[k] / (1.f + flare_cpu::exp1(-g[k])) * u[k];
    }
  });
  return out;
}

}  // namespace flare_cpu

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) {
  m.impl("rms_norm", &flare_cpu::rms_norm);
  m.impl("add_rms_norm", &flare_cpu::add_rms_norm);
  m.impl("rotary", &flare_cpu::rotary);
  m.impl("silu_mul", &flare_cpu::silu_mul);
}
