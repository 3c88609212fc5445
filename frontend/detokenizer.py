"""Token ids back to text, one step at a time: never a split UTF-8 character, never a stop string's prefix."""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of the prompt decoded as context: tokenizers that drop a leading space when a token opens the text
# (sentencepiece-style) then decode the first generated token correctly.
_CONTEXT_TOKENS = 5


def special_token_ids(tokenizer: Tokenizer, keep: tuple[str, ...] = ()) -> frozenset[int]:
    """The ids of the tokenizer's special tokens, but for those spelled as in `keep`."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items()
                     if token.special and token.content not in keep)


class IncrementalDetokenizer:
    """`hidden`: token ids that never show (the special tokens, but for those a reply parser reads, such as
    Mistral's [TOOL_CALLS]); decoding them away is what the tokenizer's skip_special_tokens does for all."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], hidden: frozenset[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._hidden = hidden = special_token_ids(tokenizer) if hidden is None else hidden
        self._ids = [t for t in prompt_ids[-_CONTEXT_TOKENS:] if t not in hidden]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty while a character is still split)."""
        self._ids.extend(t for t in token_ids if t not in self._hidden)
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """At the end of generation: the text of tokens still held back. Bytes that never completed a character
        decode to U+FFFD, as `tokenizer.decode` gives them, so the whole text equals the full decode."""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return after[len(before):]


class StopMatcher:
    """Holds back text that might begin a stop string, so a stop string's prefix is never sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text that is safe to emit now. After a match, `matched` is set and everything from it on is dropped."""
        if self.matched is not None:
            return ""
        buffer = self._pending + text
        hits = [(buffer.find(stop), stop) for stop in self.stops if stop in buffer]
        if hits:
            index, self.matched = min(hits)
            self._pending = ""
            return buffer[:index]
        hold = max((k for stop in self.stops for k in range(min(len(stop) - 1, len(buffer)), 0, -1)
                    if buffer.endswith(stop[:k])), default=0)
        self._pending = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation, what was held back is text after all."""
        pending, self._pending = self._pending, ""
        return pending
