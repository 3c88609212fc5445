// Flare's CPU ops as C++ functions, for the ops that compose them (engine/kernels/cpu/decoder_layer.cpp); each file
// registers its own with torch (torch.ops.flare_cpu). docs/design.md, Models and kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace flare_cpu {

// engine/kernels/cpu/quant.cpp: x [M, K] @ w.T for w held as 4- or 8-bit groups of 32 (codes, scales, mins).
at::Tensor quant_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                    int64_t bits);

// engine/kernels/cpu/layer_ops.cpp.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& input, const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in);
at::Tensor silu_mul(const at::Tensor& gate_up);

// engine/kernels/cpu/attention.cpp.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& rows,
                            const at::Tensor& page_tables, const at::Tensor& context_lens, int64_t page_size,
                            double scale, int64_t window, const c10::optional<at::Tensor>& seq_table);

}  // namespace flare_cpu
