"""Decisions over HTTP (docs/design.md, Beyond plain decoding: Decisions): `/v1/systemone`, the System One route (one
state), and `/v1/decisions`, Flare's batch of it (a list of states, one answer set per state).

Each prompt is a scored prefill in the engine: no token is generated, the logits of its labels come back. The
prompts about one state start with the state, so the first one is sent alone and the others once it has been
computed: they find the state's pages in the prefix cache and compute only their own question. Where the prompts
part is sent as a message end of each, so that the engine keeps an exact checkpoint there: a hybrid model's
prompts continue only from those (docs/design.md, Scheduler and prefix checkpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common.errors import ExecutionFailed, InvalidRequest
from common.protocol import LabelQuery, SamplingParams, Submit
from frontend.api.fan_out import all_or_nothing
from frontend.api.json_body import json_response
from frontend.api.models import resolve
from frontend.decisions.prompts import Decider, Prompt
from frontend.decisions.questions import DecisionInvalid, Question, validate
from frontend.replicas import Replicas
from frontend.server import Frontend, frontend_of, read_json

DECIDER_KEY = web.AppKey("decider", Decider)
MAX_STATES = 256


@dataclass(frozen=True)
class Scored:
    logits: list[list[float]]  # per question of the prompt, its labels' logits
    prompt_tokens: int
    cached_tokens: int


async def score(client: Replicas, decider: Decider, prompt: Prompt, shared: int = 0) -> Scored:
    """One scored prefill; leaving early (a failure elsewhere, a gone client) aborts it in the engine. `shared`: the
    length of the prefix it shares with the other prompts about its state, sent as a message end, so the engine
    keeps an exact checkpoint there (the only place a hybrid model's next prompt can continue from)."""
    queries = [LabelQuery(position, decider.label_ids(tuple(q.labels)))
               for position, q in zip(prompt.positions, prompt.questions)]
    submit = Submit(uuid.uuid4().hex, prompt.ids, SamplingParams(temperature=0.0, max_tokens=1),
                    [shared] if 0 < shared < len(prompt.ids) else [], arrival=time.time(), label_queries=queries)
    async with contextlib.aclosing(client.updates(submit)) as updates:
        async for update in updates:
            if update.finish_reason is not None:
                if update.finish_reason != "stop" or update.label_logits is None:
                    raise ExecutionFailed(f"the scored prefill ended: {update.finish_reason}")
                return Scored(update.label_logits, update.prompt_tokens, update.cached_tokens)
    raise ExecutionFailed("the scored prefill ended without a result")


async def decide(frontend: Frontend, decider: Decider, state: Any, questions: list[Question],
                 limit: asyncio.Semaphore) -> tuple[dict[str, Any], int, int]:
    """The answers about one state, with its prompt and cached token counts."""
    prompts = await frontend.on_pool(decider.prompts, state, questions)
    shared = len(os.path.commonprefix([p.ids for p in prompts])) if len(prompts) > 1 else 0

    async def bounded(prompt: Prompt) -> Scored:
        async with limit:
            return await score(frontend.client, decider, prompt, shared)

    scored = [await bounded(prompts[0])]  # the state first: the other prompts reuse its pages
    scored += await all_or_nothing([bounded(p) for p in prompts[1:]])
    answers = {}
    for prompt, result in zip(prompts, scored):
        for question, logits in zip(prompt.questions, result.logits):
            answers[question.name] = question.answer(decider.config.probabilities(question, logits))
    return answers, sum(s.prompt_tokens for s in scored), sum(s.cached_tokens for s in scored)


async def answer(request: web.Request, states_key: str, max_states: int | None
                 ) -> tuple[dict, list[dict[str, Any]], dict[str, Any]]:
    """The validated body, one answer set per state, and the usage; a DecisionInvalid lists what is invalid."""
    frontend, decider = frontend_of(request), request.app[DECIDER_KEY]
    body = await read_json(request)
    problems = validate(body, states_key, max_states)
    if problems:
        raise DecisionInvalid(problems)
    questions = decider.questions(body["questions"])
    resolve(frontend.model, body["model"])
    if body.get("assets"):
        raise InvalidRequest("images in 'assets' are not supported yet: this server has no vision support",
                             param="assets")
    states = [body[states_key]] if max_states is None else body[states_key]
    limit = asyncio.Semaphore(frontend.client.welcome.max_active if frontend.client.welcome else 1)
    results = await all_or_nothing([decide(frontend, decider, state, questions, limit) for state in states])
    prompt_tokens, cached = sum(r[1] for r in results), sum(r[2] for r in results)
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "input_tokens_details": {"cached_tokens": cached}}
    return body, [r[0] for r in results], usage


async def systemone(request: web.Request) -> web.Response:
    """System One: its request and answer shapes, and its validation errors (422 with FastAPI's details)."""
    try:
        body, answers, usage = await answer(request, "state", None)
    except DecisionInvalid as exc:
        return json_response({"detail": exc.detail}, status=422)
    return json_response({"model": body["model"], "answers": answers[0], "usage": usage})


async def decisions(request: web.Request) -> web.Response:
    """Flare's batch: `states` instead of `state`, `answers` a list in the same order; errors in Flare's shape."""
    try:
        body, answers, usage = await answer(request, "states", MAX_STATES)
    except DecisionInvalid as exc:
        raise InvalidRequest(str(exc), param=str(exc.detail[0]["loc"][1])) from None
    return json_response({"model": body["model"], "answers": answers, "usage": usage})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/systemone", systemone)
    app.router.add_post("/v1/decisions", decisions)
