"""Reasoning: a reply that thinks in `<think>…</think>` (Qwen3, DeepSeek-R1, Phi-4-reasoning) split into its
reasoning and its answer as it streams (docs/design.md, Frontends and dialects; README.md, Reasoning and tool calls).

A model reasons when its chat template knows the tags; its reply starts inside the reasoning when the prompt's
generation prompt opened `<think>` (Qwen3-2507's templates do), and otherwise when the reply opens it first.
Whitespace beside a tag is formatting: templates strip it when they render reasoning back, and so does the split.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(source: str) -> bool:
    return OPEN in source or CLOSE in source


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether the generation prompt (the prompt after its last message) leaves a `<think>` open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ReasoningParser:
    """Feed text as it is generated; get back (reasoning, answer) text that is safe to show. Text that may be part
    of a tag, and whitespace that may be formatting, is held back until it is known not to be."""

    def __init__(self, inside: bool) -> None:
        self._state = "reasoning" if inside else "start"  # start: only whitespace so far
        self._buffer = ""
        self._leading = True  # the current part has shown nothing yet: its leading whitespace is formatting

    @property
    def inside(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if not stripped or (OPEN.startswith(stripped) and stripped != OPEN):
                return "", ""
            if stripped.startswith(OPEN):
                self._buffer, self._state = stripped[len(OPEN):], "reasoning"
            else:
                self._state, self._leading = "answer", False  # no reasoning: the reply passes through unchanged
        if self._state == "reasoning":
            self._skip_leading()
            at = self._buffer.find(CLOSE)
            if at < 0:
                safe = len(self._buffer) - partial_suffix(self._buffer, CLOSE)
                shown = self._buffer[:safe].rstrip()
                self._buffer = self._buffer[len(shown):]
                return shown, ""
            reasoning = self._buffer[:at].rstrip()
            self._buffer, self._state, self._leading = self._buffer[at + len(CLOSE):], "answer", True
        self._skip_leading()
        answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The end of generation: held-back text is what the state says it is (a cut-off thought is reasoning)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return rest.rstrip(), ""
        return "", rest if self._state == "start" else ""

    def _skip_leading(self) -> None:
        if self._leading:
            self._buffer = self._buffer.lstrip()
            self._leading = not self._buffer


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    return max((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), default=0)
