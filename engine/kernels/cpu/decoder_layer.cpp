// A quantized CPU core's whole decoder layer for a step of decode rows, in one call: what the layer loop of
// engine/model/backends/cpu_ops.py (over engine/model/backends/residual.py) does through some twenty Python-level
// operator and module calls, each costing more dispatch than one decode row's arithmetic in it, done here by the
// same functions in the same order, so a row's bits are those of the Python loop (tests/kernels/test_cpu_layer_ops.py).
// docs/design.md, Models and kernels; engine/kernels/cpu/extension.py builds this file with the ops it composes
// (engine/kernels/cpu/ops.h).
//
// A Llama-style layer (pre-norms, fused q/k/v and gate/up products, SiLU; no q/k norms, no biases):
//   h, residual = add_rms_norm(x, residual, input_norm)      (rms_norm(x) and x for the first layer)
//   q, k = rotary(qkv[:, q and k]); attn = decode_attention(q, k, v, caches ...)
//   h, residual = add_rms_norm(o_proj(attn), residual, post_attention_norm)
//   returns (down_proj(silu_mul(gate_up(h))), residual)

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// weights: input_norm, qkv (codes, scales, mins), o_proj (3), post_attention_norm, gate_up (3), down_proj (3);
// bits: the code width of qkv, o_proj, gate_up and down_proj.
constexpr size_t WEIGHTS = 14, PRODUCTS = 4;

std::tuple<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                 at::TensorList w, at::IntArrayRef bits, const at::Tensor& cos,
                                                 const at::Tensor& signed_sin, at::Tensor& k_cache,
                                                 at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                                 const at::Tensor& rows, const at::Tensor& page_tables,
                                                 const at::Tensor& context_lens, int64_t page_size, double scale,
                                                 int64_t window, double eps) {
  TORCH_CHECK(w.size() == WEIGHTS && bits.size() == PRODUCTS, "decoder_layer: ", WEIGHTS, " weights and ", PRODUCTS,
              " code widths");
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 3, "decoder_layer: x [T, E] and caches [slots, KVH, D]");
  const int64_t T = x.size(0), kv_heads = k_cache.size(1), D = k_cache.size(2);
  const int64_t heads = w[1].size(0) / D - 2 * kv_heads;
  TORCH_CHECK(heads > 0 && w[1].size(0) == (heads + 2 * kv_heads) * D, "decoder_layer: q/k/v rows must be ",
              "(heads + 2 * kv heads) * head size");
  at::Tensor h, sum;
  if (residual.has_value()) {
    std::tie(h, sum) = flare_cpu::add_rms_norm(x, *residual, w[0], eps);
  } else {
    h = flare_cpu::rms_norm(x, w[0], eps);
    sum = x;
  }
  const at::Tensor qkv = flare_cpu::quant_mm(h, w[1], w[2], w[3], bits[0]);
  const at::Tensor qk = flare_cpu::rotary(qkv.narrow(1, 0, (heads + kv_heads) * D).view({T, heads + kv_heads, D}),
                                          cos, signed_sin);
  const at::Tensor attn = flare_cpu::decode_attention(
      qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads),
      qkv.narrow(1, (heads + kv_heads) * D, kv_heads * D).view({T, kv_heads, D}), k_cache, v_cache, slot_mapping,
      rows, page_tables, context_lens, page_size, scale, window, c10::nullopt);
  TORCH_CHECK(attn.size(0) == T, "decoder_layer: every row of the step must be a decode row");
  const at::Tensor out = flare_cpu::quant_mm(attn.view({T, heads * D}), w[4], w[5], w[6], bits[1]);
  std::tie(h, sum) = flare_cpu::add_rms_norm(out, sum, w[7], eps);
  const at::Tensor act = flare_cpu::silu_mul(flare_cpu::quant_mm(h, w[8], w[9], w[10], bits[2]));
  return {flare_cpu::quant_mm(act, w[11], w[12], w[13], bits[3]), sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor[] weights, int[] bits, Tensor cos, Tensor signed_sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor rows, Tensor page_tables, "
        "Tensor context_lens, int page_size, float scale, int window, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
