"""How a model computes, apart from what it is: engine/model/decoder.py (and qwen3_vl.py) define the layers, their
weights and the torch reference forward; each module here is another implementation of the same function, chosen
once, at load (select.py), which prepares the weights it needs then:

- triton.py: the kernel path (the GPU's; what CUDA graphs capture): fused q/k/v and gate/up products, Triton
  attention, rotary, add-RMSNorm, SiLU-and-mul and fused MoE (triton_layers.py), the residual stream beside the
  branches (residual.py), and steps of a single token as fused GEMVs (few_rows.py); a vision tower's attention as
  one Triton launch over every image.
- cpu_ops.py: a quantized fp32 core on the CPU: the same residual stream over Flare's C++ ops, each Llama-style
  layer of a decode step in one call.
"""
