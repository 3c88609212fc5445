"""The ranges of a request's sampling settings, checked by the frontends when they read a body (frontend/api/
sampling.py) and again by the engine on every Submit (engine/core.py): an engine link may carry what no frontend
validated (docs/design.md, Trust boundaries)."""

from __future__ import annotations

import math

from common.protocol import SamplingParams

TEMPERATURE = (0.0, 100.0)
TOP_P = (1e-9, 1.0)
TOP_K = (0, (1 << 31) - 1)  # 0: off; the step frames hold it as an int32
MIN_P = (0.0, 1.0)
PENALTY = (-2.0, 2.0)  # presence and frequency
REPETITION_PENALTY = (0.01, 10.0)
MAX_TOP_LOGPROBS = 20
SEED = (-(1 << 63), (1 << 63) - 1)  # the step frames hold it as an int64


def sampling_problem(params: SamplingParams, vocab_size: int) -> str | None:
    """Why these settings cannot be run, or None. The prompt-dependent bounds (max_tokens within the context) are
    the engine's own checks."""
    for name, (low, high) in (("temperature", TEMPERATURE), ("top_p", TOP_P), ("min_p", MIN_P),
                              ("presence_penalty", PENALTY), ("frequency_penalty", PENALTY),
                              ("repetition_penalty", REPETITION_PENALTY)):
        value = getattr(params, name)
        if not math.isfinite(value) or not low <= value <= high:
            return f"'{name}' must be between {low} and {high}, got {value}"
    if not TOP_K[0] <= params.top_k <= TOP_K[1]:
        return f"'top_k' must be between {TOP_K[0]} and {TOP_K[1]}, got {params.top_k}"
    if params.seed is not None and not SEED[0] <= params.seed <= SEED[1]:
        return f"'seed' must be a 64-bit integer, got {params.seed}"
    if not 0 <= params.min_tokens <= params.max_tokens:
        return f"'min_tokens' must be between 0 and max_tokens ({params.max_tokens}), got {params.min_tokens}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            return f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}, got {value}"
    if any(not 0 <= token < vocab_size for token in params.stop_token_ids):
        return f"'stop_token_ids' must lie in [0, {vocab_size})"
    return None
