"""The engine's kernels: Triton for the GPU (triton/) and C++ for quantized cores on the CPU (cpu/)."""
