"""Decisions per second: a ~500-token state with 8 questions through `/v1/systemone` (one scored prefill per
question, the state's pages shared), against the same prompts through `/v1/chat/completions` with `max_tokens: 1`
and logprobs (what a client does without the route: one generation per question, sent together).

    python -m bench.lab.host.decisions --core cores/smollm2-135m             # starts `flare run` on the core, then measures
    python -m bench.lab.host.decisions --url http://127.0.0.1:8000           # a server already running

A synthetic core (`ignition synth`) has no single-token `Yes`/`No`: `--noul-labels Y,N` writes a `decision.json`
with those labels into the core first (and the chat prompts use them too).

Every state differs from the others from its first token, so one state's questions share a prefix and nothing else
does. Prints a table: states, decisions, seconds, decisions/s, latency per state, prompt and cached tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp

from bench.lab.host.served import add_server_flags, print_rows, served
from frontend.chat.templates import ChatTemplate
from frontend.decisions.prompts import GENERIC_PROMPT
from frontend.decisions.questions import parse_question

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "angry": {"type": "noul", "instructions": "Is the customer angry?",
              "criteria": {"true": "Insults, threats or capitals", "false": None}},
    "tone": {"type": "choice", "instructions": "What is the tone of the last message?",
             "criteria": {"calm": "Polite and patient", "annoyed": None, "furious": "Threatens to leave"}},
    "topic": {"type": "choice", "instructions": "What is the main topic?",
              "criteria": {"billing": None, "shipping": None, "quality": None, "account": None, "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent is an answer?",
                "criteria": ["Can wait", "This week", "Today", "Within the hour"]},
    "satisfaction": {"type": "score", "instructions": "How satisfied is the customer?",
                     "criteria": ["Very unhappy", "Unhappy", "Neutral", "Happy", "Very happy"]},
    "escalate": {"type": "noul", "instructions": "Should a manager handle this?"},
    "language": {"type": "choice", "instructions": "Which language is the conversation in?",
                 "criteria": {"English": None, "French": None, "German": None}},
}


def state(index: int, lines: int) -> str:
    """A support conversation of about 12 tokens a line; `index` first, so states differ from their start."""
    turns = [f"Ticket {index}."]
    for i in range(lines):
        who = "Customer" if i % 2 == 0 else "Agent"
        turns.append(f"{who}: message {i} about order {index * 1000 + i}, still not delivered after {i % 9} days.")
    return "\n".join(turns)


def chat_prompts(state_text: str, labels: dict[str, list[str]]) -> list[str]:
    """The user message of each question: the generic decision prompt, as /v1/systemone builds it."""
    generic = ChatTemplate(GENERIC_PROMPT)
    questions = [parse_question(name, q, labels, ["true", "false"]) for name, q in QUESTIONS.items()]
    return [generic.render([], state=state_text, question=q.template_value()).text for q in questions]


async def one_systemone(session: aiohttp.ClientSession, url: str, model: str, text: str,
                        labels: dict[str, list[str]]) -> tuple[int, int]:
    async with session.post(f"{url}/v1/systemone", json={"model": model, "state": text,
                                                         "questions": QUESTIONS}) as response:
        payload = await response.json()
        if response.status != 200:
            raise RuntimeError(f"/v1/systemone answered {response.status}: {payload}")
    usage = payload["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


async def one_chat(session: aiohttp.ClientSession, url: str, model: str, text: str,
                   labels: dict[str, list[str]]) -> tuple[int, int]:
    async def ask(content: str) -> tuple[int, int]:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
                "temperature": 0.0, "logprobs": True, "top_logprobs": 20}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"/v1/chat/completions answered {response.status}: {payload}")
        usage = payload["usage"]
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    results = await asyncio.gather(*(ask(content) for content in chat_prompts(text, labels)))
    return sum(r[0] for r in results), sum(r[1] for r in results)


async def measure(url: str, model: str, route: str, states: int, concurrency: int, lines: int,
                  offset: int, labels: dict[str, list[str]]) -> dict:
    one = one_systemone if route == "systemone" else one_chat
    limit = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def run(index: int) -> tuple[int, int]:
        async with limit:
            started = time.perf_counter()
            result = await one(session, url, model, state(offset + index, lines), labels)
            latencies.append(time.perf_counter() - started)
            return result

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, url, model, state(offset - 1, lines), labels)  # warm-up, not counted
        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(states)))
        elapsed = time.perf_counter() - started
    decisions = states * len(QUESTIONS)
    return {"route": route, "states": states, "decisions": decisions, "seconds": elapsed,
            "decisions/s": decisions / elapsed, "latency/state s": sum(latencies) / len(latencies),
            "prompt tokens": sum(r[0] for r in results), "cached tokens": sum(r[1] for r in results)}


def write_decision_config(core: Path, labels: dict[str, list[str]]) -> None:
    """decision.json with these labels, recorded in the manifest as `ignition export` would."""
    from common.manifest import load_manifest, sha256_file, write_manifest

    (core / "decision.json").write_text(json.dumps({"labels": labels}))
    manifest = load_manifest(core)
    manifest.files["decision.json"] = sha256_file(core / "decision.json")
    write_manifest(core, manifest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.decisions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser, 8123)
    parser.add_argument("--states", type=int, default=8, help="states per route")
    parser.add_argument("--concurrency", type=int, default=4, help="states in flight at once")
    parser.add_argument("--lines", type=int, default=19, help="lines of conversation per state (~26 tokens each)")
    parser.add_argument("--noul-labels", help="with --core: single-token labels of true,false (e.g. Y,N)")
    args = parser.parse_args(argv)
    labels = {"noul": args.noul_labels.split(",")} if args.noul_labels else {}
    if labels and args.core:
        write_decision_config(args.core, labels)
    with served(args, args.flare_arg) as (url, model):
        rows = [asyncio.run(measure(url, model, route, args.states, args.concurrency, args.lines, offset, labels))
                for route, offset in (("systemone", 1000), ("chat", 2000))]
    print(f"model {model}, {len(QUESTIONS)} questions per state, {args.concurrency} states in flight, "
          f"{os.cpu_count()} CPUs here")
    print_rows(rows)

if __name__ == "__main__":
    main()
