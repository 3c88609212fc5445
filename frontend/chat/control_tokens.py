"""User text that can never become a control token (docs/design.md, Decisions).

Control tokens are the tokenizer's special tokens, plus its other added tokens that the template writes itself.
Before rendering, every control token inside a user string is wrapped in two private-use markers; after rendering,
the text is split at the markers: a wrapped token is encoded as plain text, everything else normally, so only the
template's own control tokens come out as tokens. This is what transformers' `apply_chat_template(...,
sanitize_control_tokens=True)` does (the reference of the decisions route), token for token.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer

from common.errors import InvalidRequest

START, END = "\U000f0000", "\U000f0001"


def _alternation(tokens: list[str]) -> str:
    """A regex matching any of `tokens`, longer ones first (a token wins over the tokens it contains)."""
    return "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"


class ControlTokens:
    def __init__(self, tokenizer: Tokenizer, template_source: str) -> None:
        added = list(tokenizer.get_added_tokens_decoder().values())
        control = [t.content for t in added
                   if t.special or (t.content in template_source and not t.content.isspace())]
        self._control = re.compile(_alternation(control))
        self._markers = re.compile(f"{START}({_alternation([t.content for t in added])}){END}|[{START}{END}]")
        self._tokenizer = tokenizer
        self._as_text = Tokenizer.from_str(tokenizer.to_str())  # a copy: the setting below is per instance
        self._as_text.encode_special_tokens = True
        self._newline = tokenizer.encode("\n", add_special_tokens=False).ids

    def mark(self, value: Any) -> Any:
        """`value` (strings, lists and dict values, recursively; keys stay) with its control tokens wrapped.
        Markers already in a string are dropped first, so nobody can forge a wrapped token."""
        if isinstance(value, str):
            value = value.replace(START, "").replace(END, "")
            return self._control.sub(f"{START}\\g<0>{END}", value)
        if isinstance(value, dict):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(item) for item in value]
        return value

    def encode(self, text: str) -> list[int]:
        """Token ids of text rendered from marked inputs. A lone marker (a template split a wrapped token) still
        separates the text on either side, so they cannot join into a control token."""
        pieces = self._markers.split(text)  # [text, wrapped token, text, ..., text]; None for a lone marker
        ids = self._tokenizer.encode(pieces[0], add_special_tokens=False).ids
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            piece_ids = self._piece(piece, self._as_text if as_text else self._tokenizer)
            if as_text and self._tokenizer.token_to_id(piece) in piece_ids:
                raise InvalidRequest(f"cannot encode {piece!r} as text: this tokenizer makes the token from text")
            ids += piece_ids
        return ids

    def _piece(self, piece: str, tokenizer: Tokenizer) -> list[int]:
        """A piece from the middle of the text: encoded after a newline, then without it, so that a SentencePiece
        tokenizer adds no prefix space as it would at the start of a string."""
        ids = tokenizer.encode("\n" + piece, add_special_tokens=False).ids
        if ids[:len(self._newline)] == self._newline:
            return ids[len(self._newline):]
        return tokenizer.encode(piece, add_special_tokens=False).ids
