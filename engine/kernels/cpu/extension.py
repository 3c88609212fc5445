"""Builds and loads Flare's AVX2 CPU kernels: the weight-only 4/8-bit product (engine/kernels/cpu/quant.cpp, its kernel
engine/kernels/cpu/quant_kernel.h, and that kernel's AVX-512 VNNI copy engine/kernels/cpu/quant_vnni.cpp, which the product runs where the CPU
has it unless FLARE_QUANT_ISA=avx2: the same bits either way), a decoder layer's
elementwise ops (engine/kernels/cpu/layer_ops.cpp), decode attention (engine/kernels/cpu/attention.cpp) and a whole layer of a decode step
(engine/kernels/cpu/decoder_layer.cpp), all beside this file.

docs/design.md, Models and kernels. The C++ sources are compiled on first use with torch's extension builder (-O3 -mavx2
-mfma -mf16c -ffp-contract=off -fopenmp) into one library in torch's extension cache, under a name carrying the sources'
and flags' hash, so a changed kernel builds anew and concurrent processes share one build (torch locks the build
directory). Where the CPU lacks AVX2/FMA, the build fails, or FLARE_QUANT_KERNEL=torch asks for it, quantized
linears keep PyTorch's int4 kernel and the layers aten's operators (one log line). `make install` builds it once so
that tests and servers find it cached: `python -m engine.kernels.cpu.extension`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name)
           for name in ("quant.cpp", "quant_vnni.cpp", "layer_ops.cpp", "attention.cpp",
                        "decoder_layer.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "ops.h", "quant_kernel.h")]
log = logging.getLogger("flare.engine")


def _build() -> None:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the ninja wheel installs it beside this interpreter's scripts, which a venv's
    # python run by its full path does not have on PATH.
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    # -ffp-contract=off: a multiply and an add stay two roundings, as aten's, unless the source asks for an FMA
    # (GCC would otherwise fuse even intrinsics' multiplies and adds, and rotary would lose its bitwise equality).
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(flags).encode())
    load(name=f"flare_cpu_quant_{digest.hexdigest()[:12]}", sources=[str(path) for path in SOURCES],
         is_python_module=False, extra_cflags=flags, extra_ldflags=["-fopenmp"])


@functools.cache
def quant_mm() -> Callable[..., torch.Tensor] | None:
    """torch.ops.flare_cpu.quant_mm(x, codes, scales, mins, bits) (see engine/kernels/cpu/quant.cpp for the layouts), built on the
    first call, or None where it cannot run here."""
    if os.environ.get("FLARE_QUANT_KERNEL") == "torch":
        log.info("FLARE_QUANT_KERNEL=torch: quantized linears run PyTorch's int4 kernel")
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("no AVX2/FMA on this CPU: quantized linears run PyTorch's int4 kernel")
        return None
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - any build failure means the fallback, not a dead engine
        log.warning("building %s failed (%s): quantized linears run PyTorch's int4 kernel",
                    SOURCES[0].name, str(exc).strip().splitlines()[-1:] or exc)
        return None
    return torch.ops.flare_cpu.quant_mm


def layer_ops_ready() -> bool:
    """Whether the decoder-layer ops run here (torch.ops.flare_cpu: rms_norm, add_rms_norm, rotary and silu_mul of
    engine/kernels/cpu/layer_ops.cpp, decode_attention of engine/kernels/cpu/attention.cpp, decoder_layer of engine/kernels/cpu/decoder_layer.cpp): they build
    with the product, into one library."""
    return quant_mm() is not None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("flare_cpu.quant_mm:", "ready" if quant_mm() is not None else "unavailable (PyTorch's int4 kernel)")
