"""Sampling settings from a request body, shared by every dialect: field names that differ between dialects (max
tokens, stop strings, logprobs) are resolved by the dialect and passed in; the rest are read here by their common
names, so an OpenAI extra like `top_k` or `repetition_penalty` works the same in every dialect."""

from __future__ import annotations

import msgspec

from common.errors import InvalidRequest
from common.protocol import SamplingParams
from common.sampling_bounds import (MAX_TOP_LOGPROBS, MIN_P, PENALTY, REPETITION_PENALTY, SEED, TEMPERATURE, TOP_K,
                                    TOP_P)
from frontend.api.params import get_bool, get_int, get_int_list, get_number
from frontend.model import ServedModel


def sampling_params(model: ServedModel, body: dict, prompt_len: int, max_tokens: int | None, *,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    context: int | None = None) -> SamplingParams:
    """`max_tokens` None means up to the context limit: the core's, or a smaller window the request asked for
    (`context`, Ollama's num_ctx). The core's generation defaults fill what is absent."""
    defaults = model.manifest.generation
    window = "This model's maximum context length" if context is None else "The requested context window"
    context = context or model.manifest.context_limit
    vocab = model.tokenizer.get_vocab_size()
    top_k = get_int(body, "top_k", defaults.top_k, -1, TOP_K[1])
    params = SamplingParams(
        temperature=get_number(body, "temperature", defaults.temperature, *TEMPERATURE),
        top_p=get_number(body, "top_p", defaults.top_p, *TOP_P),
        top_k=max(top_k, 0),  # -1 is vLLM's and SGLang's "off"
        min_p=get_number(body, "min_p", defaults.min_p, *MIN_P),
        seed=get_int(body, "seed", None, *SEED),
        max_tokens=max_tokens if max_tokens is not None else max(context - prompt_len, 1),
        min_tokens=get_int(body, "min_tokens", 0, 0, context),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stop_token_ids=get_int_list(body, "stop_token_ids", vocab),
        presence_penalty=get_number(body, "presence_penalty", 0.0, *PENALTY),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0, *PENALTY),
        repetition_penalty=get_number(body, "repetition_penalty", defaults.repetition_penalty, *REPETITION_PENALTY),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        speculative=get_bool(body, "speculative", True))
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(f"'min_tokens' ({params.min_tokens}) must not exceed the maximum output tokens "
                             f"({params.max_tokens})", param="min_tokens")
    if prompt_len + params.max_tokens > context:
        raise InvalidRequest(
            f"{window} is {context} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            "context_hint: shorten the prompt or lower the maximum output tokens", param="max_tokens")
    return params


def requested_max_tokens(body: dict, *names: str) -> int | None:
    """The first of `names` present (e.g. max_completion_tokens before the deprecated max_tokens)."""
    for name in names:
        value = get_int(body, name, None, 1, 1 << 31)
        if value is not None:
            return value
    return None


def top_logprobs(body: dict, name: str) -> int | None:
    return get_int(body, name, None, 0, MAX_TOP_LOGPROBS)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n draws with seed + i, so a seeded n > 1 request stays reproducible."""
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + index) % (1 << 63))
