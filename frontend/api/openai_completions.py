"""The OpenAI legacy completions dialect: /v1/completions with string, string-list and token-id prompts, n choices,
`echo`, and `logprobs` (with the prompt's own logprobs when echoed), streaming and not."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from common.errors import InvalidRequest
from frontend.api.errors import finish_openai_stream
from frontend.api.json_body import json_response
from frontend.api.logprobs import legacy_logprobs, prompt_entries, unpack
from frontend.api.models import requested_model
from frontend.api.openai_chat import MAX_CHOICES, choices_count, output_constraint, stream_options, usage
from frontend.api.params import get_bool, get_cache_salt, get_stop, get_str
from frontend.api.sampling import choice_params, requested_max_tokens, sampling_params, top_logprobs
from frontend.generation import Delta, Finish, GenerationRequest, Outcome, collect, merge
from frontend.model import ServedModel
from frontend.server import frontend_of, read_json
from frontend.streaming import open_stream, primed, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this route


def completion_prompts(model: ServedModel, body: dict) -> list[list[int] | str]:
    prompt = body.get("prompt")
    vocab = model.tokenizer.get_vocab_size()
    if isinstance(prompt, str):
        return [prompt]

    def valid_ids(p: object) -> bool:
        return isinstance(p, list) and bool(p) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p)

    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if valid_ids(prompt):
            return [list(prompt)]
        if all(valid_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("'prompt' must be a non-empty string, list of strings, or list of token ids "
                         f"(each below the vocabulary size {vocab})", param="prompt")


class ChoiceLogprobs:
    """One choice's logprobs in the legacy shape, built in pieces as its tokens arrive."""

    def __init__(self, model: ServedModel, prompt_ids: list[int] | None) -> None:
        self.model = model
        self.prompt_ids = prompt_ids  # echoed: the prompt's tokens lead the choice's logprobs
        self.offset = 0

    def piece(self, delta: Delta) -> dict:
        entries = unpack(delta.logprobs)
        if self.prompt_ids is not None:
            entries = prompt_entries(self.prompt_ids, delta.prompt_logprobs) + entries
            self.prompt_ids = None
        result, self.offset = legacy_logprobs(self.model, entries, self.offset)
        return result


async def completions(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    prompts = completion_prompts(frontend.model, body)
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    echo = get_bool(body, "echo", False)
    logprobs = top_logprobs(body, "logprobs")
    if get_str(body, "suffix"):
        raise InvalidRequest("'suffix' (fill in the middle) is not supported", param="suffix")
    n = choices_count(body)
    if len(prompts) * n > MAX_CHOICES * 4:
        raise InvalidRequest(f"at most {MAX_CHOICES * 4} choices per request (prompts times n)", param="prompt")
    encoded = [p if isinstance(p, list) else await frontend.on_pool(frontend.model.encode_text, p) for p in prompts]
    max_tokens = requested_max_tokens(body, "max_tokens")
    constraint = await frontend.on_pool(output_constraint, body, None, "response_format", body.get("response_format"))
    stop = get_stop(body, "stop")
    arrival = time.time()
    requests, salt = [], get_cache_salt(body)
    for ids in encoded:
        params = sampling_params(frontend.model, body, len(ids), max_tokens or DEFAULT_MAX_TOKENS, logprobs=logprobs,
                                 prompt_logprobs=logprobs if echo else None)
        requests.extend(GenerationRequest(ids, choice_params(params, i), stop, [], arrival, constraint,
                                          cache_salt=salt) for i in range(n))
    prefixes = [(frontend.model.decode(r.prompt_ids) if echo else "") for r in requests]
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(arrival), "model": name}
    async with contextlib.aclosing(merge(frontend.client, frontend.model, requests)) as events:
        if stream:
            pieces = [ChoiceLogprobs(frontend.model, r.prompt_ids if echo else None) if logprobs is not None
                      else None for r in requests]
            return await stream_completions(request, await primed(events), meta, prefixes, pieces, n,
                                            include_usage)
        outcomes = await collect(events, len(requests))
    choices = []
    for i, (request_, outcome) in enumerate(zip(requests, outcomes)):
        entries = prompt_entries(request_.prompt_ids, outcome.prompt_logprobs) if echo else []
        choices.append({"index": i, "text": prefixes[i] + outcome.text,
                        "logprobs": legacy_logprobs(frontend.model, entries + outcome.logprobs, 0)[0]
                        if logprobs is not None else None,
                        "finish_reason": outcome.finish.reason, "stop_reason": outcome.finish.matched_stop})
    if get_bool(body, "return_token_ids", False):
        for choice, request_, outcome in zip(choices, requests, outcomes):
            choice["prompt_token_ids"] = request_.prompt_ids
            choice["token_ids"] = outcome.token_ids
    return json_response({**meta, "choices": choices, "usage": usage(outcomes, n)})


async def stream_completions(request: web.Request, events: AsyncIterator[tuple[int, Delta | Finish]], meta: dict,
                             prefixes: list[str], pieces: list[ChoiceLogprobs | None], n: int,
                             include_usage: bool) -> web.StreamResponse:
    stream = await open_stream(request)

    def chunk(index: int, text: str, finish: Finish | None, logprobs: dict | None = None) -> bytes:
        payload = {**meta, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish.reason if finish else None,
                                        "stop_reason": finish.matched_stop if finish else None}]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    outcomes = [Outcome() for _ in prefixes]
    echoed = [not prefix for prefix in prefixes]
    finished = 0

    async def body() -> None:
        nonlocal finished
        async for index, event in events:
            outcomes[index].add(event)
            if isinstance(event, Delta):
                text = event.text if echoed[index] else prefixes[index] + event.text
                echoed[index] = True
                logprobs = pieces[index].piece(event) if pieces[index] is not None else None
                if text or logprobs:
                    stream.add(chunk(index, text, None, logprobs))
            else:
                stream.add(chunk(index, "", event))
                finished += 1
            if finished < len(prefixes):  # after the last finish, the stream ends without waiting: one write
                await stream.flush()
        if include_usage:
            stream.add(sse({**meta, "choices": [], "usage": usage(outcomes, n)}))

    return await finish_openai_stream(stream, body())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
