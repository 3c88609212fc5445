"""One neutral generation, shared by every API dialect: submit, stream text deltas, finish with usage."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from common.errors import ExecutionFailed
from common.protocol import Constraint, ImageInput, Logprobs, SamplingParams, Submit
from frontend.api.logprobs import TokenLogprob, unpack
from frontend.chat.tools import ToolCall
from frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from frontend.metrics import RequestTimer
from frontend.model import ServedModel
from frontend.replicas import Replicas


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    message_ends: list[int] = field(default_factory=list)
    arrival: float = 0.0
    constraint: Constraint | None = None  # structured output (frontend/chat/structured.py)
    images: list[ImageInput] = field(default_factory=list)
    cache_salt: str = ""  # vLLM's: requests of different salts share no cached prefix


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None  # for token_ids, when the request asked for them
    prompt_logprobs: Logprobs | None = None  # once, on the first Delta, when the request asked for them
    reasoning: str = ""  # reasoning text, split from `text` by replies.parse_replies


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length"
    matched_stop: str | int | None  # the stop string or stop token id; None for end of sequence or length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, those generated while the reply was reasoning


async def generate(client: Replicas, model: ServedModel, request: GenerationRequest
                   ) -> AsyncIterator[Delta | Finish]:
    """Yields Deltas then one Finish. Leaving early (disconnect, cancellation) aborts the engine's request."""
    submit = Submit(uuid.uuid4().hex, request.prompt_ids, request.sampling, request.message_ends, request.arrival,
                    images=request.images, constraint=request.constraint, cache_salt=request.cache_salt)
    detokenizer = IncrementalDetokenizer(model.tokenizer, request.prompt_ids, model.hidden_token_ids)
    stops = StopMatcher(request.stop)
    hidden_ids = set(request.sampling.stop_token_ids)
    generated = 0
    timer = RequestTimer()
    async with contextlib.aclosing(client.updates(submit)) as updates:
        async for update in updates:
            text, kept = _consume(update.token_ids, hidden_ids, detokenizer, stops, update.finish_reason is not None)
            if kept < len(update.token_ids):  # a stop string ended inside a speculative burst: the rest never was
                update = replace(update, token_ids=update.token_ids[:kept],
                                 logprobs=_first_logprobs(update.logprobs, kept))
            generated += len(update.token_ids)
            timer.delivered(len(update.token_ids))
            delta = Delta(text, update.token_ids, update.logprobs, update.prompt_logprobs)
            if stops.matched is not None:  # leaving the updates aborts the request in the engine
                timer.finished()
                yield delta
                yield Finish("stop", stops.matched, update.prompt_tokens, generated, update.cached_tokens)
                return
            if update.finish_reason is not None:
                timer.finished()
                if update.finish_reason not in ("stop", "length"):
                    raise ExecutionFailed(f"generation ended: {update.finish_reason}")
                text += stops.flush()
                if text or update.token_ids:
                    yield Delta(text, update.token_ids, update.logprobs, update.prompt_logprobs)
                last = update.token_ids[-1] if update.token_ids else None
                matched = last if update.finish_reason == "stop" and last in hidden_ids else None
                yield Finish(update.finish_reason, matched, update.prompt_tokens, generated, update.cached_tokens)
                return
            if text or update.token_ids:
                yield delta


def _consume(token_ids: list[int], hidden_ids: set[int], detokenizer: IncrementalDetokenizer,
             stops: StopMatcher, last: bool) -> tuple[str, int]:
    """The text of new tokens that is safe to send (all of it when `last`), and how many of them count: with stop
    strings, a burst of several tokens (speculative decoding) is fed one token at a time, so tokens after a stop
    string's end are dropped as if never generated."""
    bursts = [token_ids] if not stops.stops or len(token_ids) <= 1 else [[t] for t in token_ids]
    text, count = "", 0
    for i, burst in enumerate(bursts):
        visible = [t for t in burst if t not in hidden_ids]
        pieces = detokenizer.add(visible) if visible else ""
        if last and i == len(bursts) - 1:
            pieces += detokenizer.flush()
        text += stops.feed(pieces) if pieces else ""
        count += len(burst)
        if stops.matched is not None:
            break
    return text, count


def _first_logprobs(logprobs: Logprobs | None, count: int) -> Logprobs | None:
    if logprobs is None:
        return None
    return Logprobs(logprobs.token_ids[:count], logprobs.logprobs[:count], logprobs.top_ids[:count],
                    logprobs.top_logprobs[:count])


async def merge(client: Replicas, model: ServedModel, requests: list[GenerationRequest]
                ) -> AsyncIterator[tuple[int, Delta | Finish]]:
    """Run several generations at once (n choices, several prompts); yield (choice index, event) as they come.
    The first failure ends them all; leaving early cancels every one (and so aborts it in the engine)."""
    if len(requests) == 1:
        async with contextlib.aclosing(generate(client, model, requests[0])) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Delta | Finish | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: GenerationRequest) -> None:
        try:
            async with contextlib.aclosing(generate(client, model, request)) as events:
                async for event in events:
                    queue.put_nowait((index, event))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if event is None:
                running -= 1
            elif isinstance(event, BaseException):
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Outcome:
    """One choice, gathered whole (what a non-streaming response reports)."""

    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish: Finish | None = None

    def add(self, event: Delta | ToolCall | Finish) -> None:
        if isinstance(event, Delta):
            self.text += event.text
            self.reasoning += event.reasoning
            self.token_ids += event.token_ids
            self.logprobs += unpack(event.logprobs)
            self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
        elif isinstance(event, ToolCall):
            self.tool_calls.append(event)
        else:
            self.finish = event


async def collect(events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]], n: int) -> list[Outcome]:
    outcomes = [Outcome() for _ in range(n)]
    async for index, event in events:
        outcomes[index].add(event)
    return outcomes
