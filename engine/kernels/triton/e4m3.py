"""Rounding to e4m3 in a kernel, shared by the FP8 KV cache's stores (kv_store.py, rotary.py) and the FP8 GEMM's
activation quantization (fp8_linear.py)."""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |t| < 2**22 to an integer, ties even


@triton.jit
def to_e4m3(x, scale, dtype: tl.constexpr):
    """x / scale as e4m3 (`dtype`): clamped to +-448 and rounded to nearest, ties to even, on the e4m3 grid in fp32
    first (steps of 2**(e - 3) for a value in [2**e, 2**(e + 1)), 2**-9 below 2**-6), so that the cast itself is
    exact: the Triton interpreter's rounding carries a full mantissa wrongly, and the GPU's then agrees bit for bit."""
    # The scale in fp32 whatever its buffer's dtype (a model cast to bf16 casts its KV scales with it).
    y = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale.to(tl.float32)), -E4M3_MAX), E4M3_MAX)
    a = tl.abs(y)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased; subnormals share -6's
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent + 3) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
    rounded = ((a * inverse + ROUND) - ROUND) * step
    # y's sign bit on the magnitude, by the bits: a compiler that ignores the sign of zero makes -x of 0 a +0.
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(dtype)
