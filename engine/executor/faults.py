"""Device faults: errors after which a CUDA context runs nothing more (docs/design.md, Errors).

A device-side assert, an illegal address or a launch failure is sticky: CUDA reports it from every later call of
the process, so each step after it would fail as well, forever. A failed step is therefore followed by one probe of
the device; when the probe fails too, the executor raises DeviceFault from `poll`, the engine fails every request
with the fault and exits, and `flare run` stops (or, with replicas, restarts that replica while the others serve).
A step that failed on its own (out of memory for a shape, a bad input) leaves a working device: only its requests
fail.
"""

from __future__ import annotations

import torch


class DeviceFault(RuntimeError):
    """The device can no longer run steps; the message is CUDA's."""


def sticky_fault(device: torch.device) -> str | None:
    """After a failed step: None while `device` still completes work, else the error it now reports for everything."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # torch raises its own error type for every CUDA error
        return f"{type(exc).__name__}: {exc}".strip()
    return None
