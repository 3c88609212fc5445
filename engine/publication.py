"""The columns of an Outputs message (common/protocol.py) built from a step's results: which requests have news and
what each carries (tokens, logprobs, a scored prefill's label logits, an embedding)."""

from __future__ import annotations

from dataclasses import dataclass

from common import protocol as wire
from engine.scheduler.request import Request
from engine.scheduler.results import Finished, StepResult


@dataclass(frozen=True)
class RequestColumns:
    """The Outputs columns that depend only on which requests a message covers, and their one owner (None: several).
    A request's id, prompt length, cached tokens, owner and prompt-logprobs setting never change once it has news,
    so at steady decode, where the same requests publish step after step, the last step's columns are reused."""

    requests: list[Request]
    owner: bytes | None
    request_ids: list[str]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    prompt_logprobs: bool  # some request asked for prompt logprobs

    @staticmethod
    def of(requests: list[Request]) -> RequestColumns:
        owners = {r.owner for r in requests}
        return RequestColumns(requests, owners.pop() if len(owners) == 1 else None,
                              [r.request_id for r in requests], [r.prompt_len for r in requests],
                              [r.cached_tokens for r in requests],
                              any(r.sampling.prompt_logprobs is not None for r in requests))


def news_of(result: StepResult) -> tuple[list[Request], list[list[int]]]:
    """The requests with new tokens, in the order of their first, and each one's tokens. A step without drafts has
    at most one per request: its columns as they are."""
    if result.distinct or len(set(result.requests)) == len(result.requests):
        return result.requests, [[token] for token in result.token_ids]
    news: dict[Request, list[int]] = {}
    for request, token in zip(result.requests, result.token_ids):
        if (tokens := news.get(request)) is None:
            news[request] = [token]
        else:
            tokens.append(token)
    return list(news), list(news.values())


def join_logprobs(pieces: list[wire.Logprobs]) -> wire.Logprobs | None:
    if not pieces:
        return None
    if len(pieces) == 1:
        return pieces[0]
    return wire.Logprobs([t for p in pieces for t in p.token_ids], [x for p in pieces for x in p.logprobs],
                         [t for p in pieces for t in p.top_ids], [x for p in pieces for x in p.top_logprobs])


def label_logits(request: Request, end: Finished | None) -> list[list[float]]:
    """A scored prefill's answer, in query order, once it ended well; nothing for any other request or news."""
    if end is None or end.reason != "stop" or not request.scored:
        return []
    return [list(request.label_logits[position]) for position, _ in request.label_queries]


def embedding(request: Request, end: Finished | None) -> bytes:
    """An embedding's vector as the wire carries it, once it ended well; nothing for any other request or news."""
    if end is None or end.reason != "stop" or not request.pooling:
        return b""
    return request.embedding().astype("<f4").tobytes()


def take(pieces: list[wire.Logprobs]) -> list[wire.Logprobs]:
    """Hand over the pieces gathered so far, leaving the list empty."""
    taken = list(pieces)
    pieces.clear()
    return taken
