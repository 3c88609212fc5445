"""Triton kernels for the GPU path, each with its plain-torch reference beside it (docs/design.md, Models and kernels).

Importing this package imports Triton: model code imports it only on the kernel path, so CPU serving never needs
Triton, and tests can set TRITON_INTERPRET=1 before the first import to run the kernels on the CPU.
"""
