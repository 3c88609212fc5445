"""The engine's logprobs (common.protocol.Logprobs, columnar) in each dialect's shape.

Chat completions and Responses share one shape per token ({token, logprob, bytes, top_logprobs}); legacy
completions use parallel lists ({tokens, token_logprobs, top_logprobs, text_offset}), where an echoed prompt's
first token has no logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import Logprobs
from frontend.model import ServedModel

# OpenAI reports impossible tokens as -9999.0; -inf is not valid JSON.
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: not computed (an echoed prompt's first token, or a token read from the cache)
    top: list[tuple[int, float]]


def unpack(logprobs: Logprobs | None) -> list[TokenLogprob]:
    if logprobs is None:
        return []
    return [TokenLogprob(t, _finite(x), [(i, _finite(y)) for i, y in zip(ids, xs)])
            for t, x, ids, xs in zip(logprobs.token_ids, logprobs.logprobs, logprobs.top_ids, logprobs.top_logprobs)]


def prompt_entries(prompt_ids: list[int], logprobs: Logprobs | None) -> list[TokenLogprob]:
    """One entry per prompt token. The engine scores the tokens after the first that it computed, so its list
    aligns with the prompt's end; what it lacks at the front has no logprob."""
    scored = unpack(logprobs)
    missing = len(prompt_ids) - len(scored)
    return [TokenLogprob(t, None, []) for t in prompt_ids[:missing]] + scored


def _finite(x: float) -> float:
    return max(x, FLOOR) if x == x else FLOOR


def token_string(model: ServedModel, token_id: int) -> str:
    """The token as text; a piece of a multi-byte character is spelled as its bytes, as OpenAI does."""
    raw = model.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _alternative(model: ServedModel, token_id: int, logprob: float) -> dict:
    return {"token": token_string(model, token_id), "logprob": logprob, "bytes": list(model.token_bytes(token_id))}


def token_logprobs(model: ServedModel, entries: list[TokenLogprob]) -> list[dict]:
    """Chat completions' `logprobs.content` and Responses' output_text `logprobs`."""
    return [{**_alternative(model, e.token_id, e.logprob if e.logprob is not None else FLOOR),
             "top_logprobs": [_alternative(model, i, x) for i, x in e.top]} for e in entries]


def legacy_logprobs(model: ServedModel, entries: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    """Completions' `logprobs` for these tokens, whose text starts at character `offset` of the choice's text;
    also returns the offset after them (a stream continues from it)."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(token_string(model, e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_string(model, i): x for i, x in e.top} if e.logprob is not None else None
                             for e in entries],
            "text_offset": offsets}, offset
