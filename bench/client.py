"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.datasets import Prompt
from bench.tokens import Tokens

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestRecord:
    index: int
    start: float                 # seconds since the benchmark started
    end: float = 0.0
    ttft: float | None = None    # seconds to the first chunk carrying text
    itl: list[float] = field(default_factory=list)  # gaps between successive text chunks, seconds
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    token_source: str = "usage"  # where output_tokens came from: usage, tokenizer or chunks
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict:
        return {**asdict(self), "e2e": self.e2e}


def api_root(base_url: str) -> str:
    """Accept `http://host:port` and `http://host:port/v1` alike."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str:
    url = f"{api_root(base_url)}/v1/models"
    try:
        async with session.get(url) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"cannot read the model from {url} ({exc}); pass --model") from exc


def request_body(endpoint: str, model: str, prompt: Prompt, ignore_eos: bool, extra: dict | None = None) -> dict:
    """One streamed request; `extra` fields (--extra-body, e.g. a response_format) are merged in last."""
    body: dict = {"model": model, "max_tokens": prompt.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        system = [{"role": "system", "content": prompt.system}] if prompt.system is not None else []
        body["messages"] = [*system, {"role": "user", "content": prompt.user}]
    else:
        body["prompt"] = prompt.user if prompt.system is None else f"{prompt.system}\n\n{prompt.user}"
    if ignore_eos:
        # Neither is in the OpenAI API: vLLM, SGLang and Flare honour ignore_eos, llama-cpp-python only min_tokens.
        body["ignore_eos"] = True
        body["min_tokens"] = prompt.output_len
    return {**body, **(extra or {})}


def chunk_text(endpoint: str, chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "completions":
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(session: aiohttp.ClientSession, base_url: str, endpoint: str, model: str, prompt: Prompt,
               index: int, ignore_eos: bool, tokens: Tokens, t0: float, extra: dict | None = None) -> RequestRecord:
    """Stream one request; failures are recorded, never raised, so one bad request cannot stop a run."""
    record = RequestRecord(index, time.perf_counter() - t0)
    texts: list[str] = []
    last = 0.0
    try:
        async with session.post(f"{api_root(base_url)}{ENDPOINTS[endpoint]}",
                                json=request_body(endpoint, model, prompt, ignore_eos, extra)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:500]}"
            else:
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter() - t0
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("message", chunk["error"]))
                        break
                    if usage := chunk.get("usage"):
                        record.prompt_tokens = usage.get("prompt_tokens", 0)
                        record.output_tokens = usage.get("completion_tokens", 0)
                        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if text := chunk_text(endpoint, chunk):
                        if record.ttft is None:
                            record.ttft = now - record.start
                        else:
                            record.itl.append(now - last)
                        last = now
                        texts.append(text)
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - t0
    if record.ok and record.ttft is None:
        record.error = "the stream carried no text"
    if record.ok and not record.output_tokens:
        count_output(record, prompt, "".join(texts), len(texts), tokens)
    return record


def count_output(record: RequestRecord, prompt: Prompt, text: str, chunks: int, tokens: Tokens) -> None:
    """The server sent no usage: count with the tokenizer if there is one, else one token per text chunk."""
    counted = tokens.count(text)
    record.output_tokens = counted if counted is not None else chunks
    record.token_source = "tokenizer" if counted is not None else "chunks"
    if not record.prompt_tokens:
        prompt_text = prompt.user if prompt.system is None else f"{prompt.system}\n\n{prompt.user}"
        record.prompt_tokens = tokens.count(prompt_text) or prompt.input_len
