"""The HTTP side of `flare chat` (README "Chat"): a conversation, and its replies streamed from a Flare server's
OpenAI route `/v1/chat/completions` (served by frontend/api/openai_chat.py). Standard library only: common/ takes
no HTTP client dependency, and a chat needs one request at a time."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


class ChatError(Exception):
    """A request the server refused or could not serve; `status` is its HTTP status (0: no answer at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Conversation:
    """What the next request sends: the system prompt and the turns so far (OpenAI message objects)."""

    system: str = ""
    messages: list[dict] = field(default_factory=list)

    def request_messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"system": self.system, "messages": self.messages}, indent=2,
                                   ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """A file `save` wrote; ValueError says what is wrong with any other."""
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in data["messages"]):
            raise ValueError(f"{path} is not a conversation saved by flare chat")
        return cls(str(data.get("system") or ""), data["messages"])


@dataclass
class Usage:
    """Tokens as the server counted them; time to first token and decode speed as this client saw them."""

    prompt: int
    completion: int
    cached: int
    ttft: float | None
    tokens_per_second: float | None

    def __str__(self) -> str:
        parts = [f"{self.prompt} prompt tokens ({self.cached} cached)", f"{self.completion} tokens"]
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft:.2f} s")
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        return " · ".join(parts)


@dataclass
class Delta:
    """One piece of a streamed reply: reasoning or answer text, or (last) the reply's usage."""

    reasoning: str = ""
    content: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


class ChatServer:
    """A Flare server at `base_url` (e.g. http://127.0.0.1:8000), with its API key if it was started with one."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def _request(self, path: str, body: dict | None = None, timeout: float | None = 30) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data, headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise ChatError(exc.code, error_message(exc.read(), exc.reason)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ChatError(0, f"no answer from {self.base_url}: {getattr(exc, 'reason', exc)}") from None

    def model(self) -> str:
        """The name the server serves (its first model card)."""
        with self._request("/v1/models") as response:
            return json.loads(response.read())["data"][0]["id"]

    def stream(self, body: dict) -> Iterator[Delta]:
        """Streams a chat completion; closing the generator (Ctrl-C) closes the connection, which cancels it."""
        started = time.monotonic()
        first_token: float | None = None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with self._request("/v1/chat/completions", body, timeout=None) as response:
            for line in response:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatError(int(chunk["error"].get("code") or 500), chunk["error"].get("message", ""))
                delta = Delta()
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    delta.reasoning = choice["delta"].get("reasoning_content") or ""
                    delta.content = choice["delta"].get("content") or ""
                    delta.finish_reason = choice.get("finish_reason")
                    if first_token is None and (delta.reasoning or delta.content):
                        first_token = time.monotonic()
                if chunk.get("usage"):
                    delta.usage = reply_usage(chunk["usage"], started, first_token)
                yield delta


def reply_usage(usage: dict, started: float, first_token: float | None) -> Usage:
    decode = time.monotonic() - first_token if first_token is not None else 0.0
    completion = usage["completion_tokens"]
    return Usage(usage["prompt_tokens"], completion,
                 (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                 None if first_token is None else first_token - started,
                 (completion - 1) / decode if decode > 0 and completion > 1 else None)


def error_message(body: bytes, fallback: str) -> str:
    """The message of an error body in OpenAI's shape, or the status's reason."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(fallback)
