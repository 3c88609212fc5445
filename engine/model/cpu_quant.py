"""Builds and loads Flare's AVX2 weight-only 4/8-bit kernel (cpu_quant.cpp beside this file).

DESIGN.md, Model and kernels. The C++ source is compiled on first use with torch's extension builder (-O3 -mavx2
-mfma -fopenmp) into torch's extension cache, under a name carrying the source's hash, so a changed kernel builds
anew and concurrent processes share one build (torch locks the build directory). Where the CPU lacks AVX2/FMA, the
build fails, or FLARE_QUANT_KERNEL=torch asks for it, quantized linears keep PyTorch's int4 kernel (one log line).
`make install` builds it once so that tests and servers find it cached: `python -m engine.model.cpu_quant`.
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

SOURCE = Path(__file__).with_name("cpu_quant.cpp")
log = logging.getLogger("flare.engine")


def _build() -> None:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the ninja wheel installs it beside this interpreter's scripts, which a venv's
    # python run by its full path does not have on PATH.
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    load(name=f"flare_cpu_quant_{digest}", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])


@functools.cache
def quant_mm() -> Callable[..., torch.Tensor] | None:
    """torch.ops.flare_cpu.quant_mm(x, codes, scales, mins, bits) (see cpu_quant.cpp for the layouts), built on the
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
                    SOURCE.name, str(exc).strip().splitlines()[-1:] or exc)
        return None
    return torch.ops.flare_cpu.quant_mm


def rms_norm() -> Callable[..., torch.Tensor] | None:
    """torch.ops.flare_cpu.rms_norm(x, weight, eps): fp32 RMSNorm in one call, where the kernels build here."""
    return torch.ops.flare_cpu.rms_norm if quant_mm() is not None else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("flare_cpu.quant_mm:", "ready" if quant_mm() is not None else "unavailable (PyTorch's int4 kernel)")
