"""What a completed step changed, as the scheduler reports it to the engine loop (docs/design.md, The engine loop)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import Logprobs
from engine.scheduler.request import Request


@dataclass(frozen=True)
class Finished:
    request: Request
    reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None


@dataclass
class StepResult:
    """What a completion changed: new tokens, in order, as columns (the request, the token, its logprobs when
    asked), and requests that ended."""

    finished: list[Finished] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)
    distinct: bool = False  # each request of `requests` is there once (a step without drafts: one token each)

    @property
    def tokens(self) -> list[tuple[Request, int, Logprobs | None]]:
        """(request, token, logprobs) per new token."""
        return list(zip(self.requests, self.token_ids, self.logprobs))
