"""The executor protocol: the engine loop's only view of the device (docs/design.md, Executors and CUDA graphs)."""

from __future__ import annotations

from typing import Protocol

from engine.scheduler.plan import Completion, DiskDone, Plan


class Executor(Protocol):
    #: A file descriptor that becomes readable when a completion is ready, so the loop can sleep on it.
    wake_fd: int
    num_pages: int
    #: What the device reports once it can run nothing more (engine/executor/faults.py); `poll` then raises
    #: DeviceFault. None while it works.
    fault: str | None
    #: Whether `submit` takes a plan whose grammar masks come later (Plan.masks_later), through `give_masks`.
    late_masks: bool

    def can_submit(self) -> bool:
        """True while fewer than two submissions are in flight."""

    def next_fence(self) -> int:
        """The fence the next `submit` will carry; fences complete in submission order."""

    def submit(self, plan: Plan) -> None: ...

    def give_masks(self, masks: bytes) -> None:
        """The masks of the step submitted last, with Plan.masks_later (only where `late_masks`); its sampling runs
        after them."""

    def poll(self) -> list[tuple[Plan, Completion]]:
        """Completions that are ready, in submission order, each with the plan it ran. Raises DeviceFault once the
        device can run nothing more."""

    def disk_done(self) -> list[DiskDone]:
        """Steps whose disk work (Plan.disk, done after the step completed) ended since the last call; wake_fd wakes
        the loop for them too. The engine asks only an executor with a disk tier."""

    def close(self) -> None:
        """Wait for work in flight, then free device memory."""
