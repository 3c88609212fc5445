"""The frontend's bounds on what one HTTP request may cost before it is refused (docs/design.md, Trust boundaries).
Structured-output bounds, which the engine checks too, are in common/constraint_limits.py; the flags' defaults
(body size, body time, images) are in frontend/main.py.

Each bound is checked before the work it protects: a prompt's characters before it is tokenized, stop strings before
the matcher holds them, headers and body before the request counts against admission.
"""

from __future__ import annotations

from common.errors import InvalidRequest

# A token of a real tokenizer is rarely longer than 16 characters on average over a prompt (English text averages
# about 4; the default model's longest token is 81), so a prompt over this many characters per context token
# cannot fit, and is refused before tokenizing it (tokenizing 31 MiB takes the better part of a minute).
PROMPT_CHARS_PER_TOKEN = 16

# OpenAI's bounds on `stop`; Anthropic's `stop_sequences` get the same. StopMatcher's work per token grows with both.
MAX_STOPS = 16
MAX_STOP_CHARS = 256

# Bytes of bodies being read at once (by their Content-Length), in largest bodies (--body-limit): bodies are read
# before admission, so this bounds their memory instead. Bodies up to SMALL_BODY_BYTES (any chat turn) are always
# read, so ordinary requests still pass while big ones trickle.
BODIES_IN_FLIGHT = 4
SMALL_BODY_BYTES = 64 << 10

HEADER_TIMEOUT = 15.0  # seconds from a connection's start (or its previous response) to a request's headers
BODY_TIMEOUT = 30.0  # seconds to read a request's body (--body-timeout); slower is a 408

RETRY_AFTER_SECONDS = 1  # on a 429 or 503 of the frontend's own

# Inputs of one embeddings request (OpenAI's bound); each is a request in the engine.
MAX_EMBEDDING_INPUTS = 2048

# JSON bodies larger than this are parsed on the worker pool rather than on the event loop.
OFFLOAD_JSON_BYTES = 1 << 20


def check_prompt_chars(chars: int, context_limit: int, param: str) -> None:
    """A prompt of `chars` characters that cannot fit the context is a 400 before it is tokenized."""
    limit = context_limit * PROMPT_CHARS_PER_TOKEN
    if chars > limit:
        raise InvalidRequest(f"the prompt is {chars} characters, more than can fit the model's context of "
                             f"{context_limit} tokens (at most {limit} characters, {PROMPT_CHARS_PER_TOKEN} per "
                             f"token)", param=param)


def check_stops(stops: list[str], param: str) -> list[str]:
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"'{param}' has {len(stops)} strings, over the limit of {MAX_STOPS}", param=param)
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"'{param}[{i}]' is {len(stop)} characters, over the limit of {MAX_STOP_CHARS}",
                                 param=param)
    return stops
