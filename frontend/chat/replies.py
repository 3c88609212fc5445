"""A reply taken apart as it streams: reasoning first (reasoning.py), then the answer's text and tool calls
(tool_parsers.py), in the formats the model's chat template shows (docs/design.md, Frontends and dialects; README.md, Reasoning
and tool calls)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from frontend.chat.reasoning import ReasoningParser
from frontend.chat.tool_parsers import ToolCallParser, tool_parser
from frontend.chat.tools import ToolCall
from frontend.generation import Delta, Finish
from frontend.model import EncodedChat, ServedModel


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: bool = False  # split <think>…</think> out of the answer
    starts_in_reasoning: bool = False  # the prompt left <think> open
    tool_format: str = "hermes"
    tool_names: frozenset[str] | None = None  # the declared tools, when calls are parsed

    @classmethod
    def of(cls, model: ServedModel, encoded: EncodedChat, tools: list[dict] | None) -> ReplyFormat:
        """The model's reply format for one request; `tools`: those whose calls are parsed (None: none)."""
        return cls(model.reasons, encoded.opens_reasoning, model.tool_format,
                   frozenset(t["function"]["name"] for t in tools) if tools else None)

    def parser(self) -> ReplyParser:
        return ReplyParser(ReasoningParser(self.starts_in_reasoning) if self.reasoning else None,
                           tool_parser(self.tool_format, set(self.tool_names)) if self.tool_names else None)


class ReplyParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools else 0

    @property
    def reasoning_now(self) -> bool:
        return self.reasoning is not None and self.reasoning.inside

    def feed(self, text: str) -> tuple[str, list[str | ToolCall]]:
        """(reasoning text, answer pieces) that are safe to show now."""
        reasoning, answer = self.reasoning.feed(text) if self.reasoning else ("", text)
        return reasoning, self._answer(answer, final=False)

    def finish(self) -> tuple[str, list[str | ToolCall]]:
        reasoning, answer = self.reasoning.finish() if self.reasoning else ("", "")
        return reasoning, self._answer(answer, final=True)

    def _answer(self, text: str, final: bool) -> list[str | ToolCall]:
        if self.tools is None:
            return [text] if text else []
        return self.tools.feed(text) + (self.tools.finish() if final else [])


async def parse_replies(events: AsyncIterator[tuple[int, Delta | Finish]], reply: ReplyFormat
                        ) -> AsyncIterator[tuple[int, Delta | ToolCall | Finish]]:
    """Generation events with reasoning moved to Delta.reasoning and tool calls taken out of the text. A choice
    that called a tool finishes with reason "tool_calls" (unless it ran out of tokens); a token generated while
    the reply was reasoning counts in Finish.reasoning_tokens. With nothing to parse, events pass through."""
    if not reply.reasoning and not reply.tool_names:
        async for index, event in events:
            yield index, event
        return
    parsers: dict[int, ReplyParser] = {}
    reasoning_tokens: dict[int, int] = {}
    async for index, event in events:
        parser = parsers.setdefault(index, reply.parser())
        if isinstance(event, Delta):
            if parser.reasoning_now:
                reasoning_tokens[index] = reasoning_tokens.get(index, 0) + len(event.token_ids)
            reasoning, pieces = parser.feed(event.text)
        else:
            reasoning, pieces = parser.finish()
        text = "".join(p for p in pieces if isinstance(p, str))
        if isinstance(event, Delta):
            yield index, dataclasses.replace(event, text=text, reasoning=reasoning)
        elif text or reasoning:
            yield index, Delta(text, [], reasoning=reasoning)
        for piece in pieces:
            if isinstance(piece, ToolCall):
                yield index, piece
        if isinstance(event, Finish):
            reason = "tool_calls" if parser.calls and event.reason == "stop" else event.reason
            yield index, dataclasses.replace(event, reason=reason, reasoning_tokens=reasoning_tokens.get(index, 0))
