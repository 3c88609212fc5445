// Flare's weight-only product (engine/kernels/cpu/quant.cpp) built for AVX-512 VNNI: the kernel of engine/kernels/cpu/quant_kernel.h with
// vpdpbusd and vpdpwssd and AVX-512's 32 registers, the same bits as the AVX2 copy. engine/kernels/cpu/quant.cpp calls it where
// the CPU has AVX-512 VNNI; only the kernel's own code takes the target options (the headers come first), so
// nothing shared with the AVX2 code is compiled for AVX-512. docs/design.md, Models and kernels.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>

#include "simd.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#define FLARE_QUANT_ISA avx512_vnni
#define FLARE_QUANT_VNNI
#include "quant_kernel.h"

#undef FLARE_QUANT_VNNI
#undef FLARE_QUANT_ISA
#pragma GCC pop_options
