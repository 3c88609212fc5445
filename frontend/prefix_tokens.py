"""Tokenizing a long prompt that begins like a recent one: only its new end is encoded (docs/design.md, Frontends and dialects).

A shared system prompt or document of 16,000 tokens costs a frontend 20-40 ms to tokenize on every request, where the
engine's prefix cache makes the model's side nearly free. So a frontend keeps its few most recent long prompts with
their tokens and, for a prompt sharing a long beginning with one of them, reuses that prompt's tokens up to a cut
point and encodes only the text after it.

Why the result equals encoding the whole text: byte-level BPE tokenizers (GPT-2, Llama 3, Qwen 2) cut text into
pre-tokens by a regular expression scanned left to right without lookbehind, and BPE merges never cross a
pre-token. In those expressions a pre-token always ends
- after a character that is not whitespace, before a space (no alternative matches something other than whitespace
  and then a space);
- after a letter, before a character that is not a letter (letters run only within one alternative, and contractions
  end in one);
- after a digit, before a character that is neither a digit nor a letter;
and where the scan restarts depends only on the text from that position. The character after the cut is ASCII, which
no NFC composition takes as its second half, so normalization never joins text across it. So at such a position
inside the shared beginning both prompts have a pre-token boundary, and the text from there encodes alone exactly as
it does inside the whole prompt. (A symbol before a letter is not a boundary: Llama 3 joins "(" to "abc".)
Added tokens are split out of the text before all of this, so no cut falls inside or right after an occurrence of
one. Tokenizers for which a probe shows otherwise (another pre-tokenizer,
a normalizer other than NFC) are never cut.
"""

from __future__ import annotations

import json
import re
import threading
from bisect import bisect_right
from collections import OrderedDict
from typing import NamedTuple

from tokenizers import Tokenizer

MIN_CHARS = 2048  # shorter prompts encode in well under a millisecond: not worth remembering
KEY_CHARS = 256  # prompts are matched by their first characters
ENTRIES = 16
MIN_SHARED = 1024  # a shared beginning shorter than this is encoded again
# Texts whose every cut position must split the encoding exactly (a prefix space, or a pre-tokenizer that keeps
# spaces after words, numbers or symbols, fails one of them).
PROBES = ("hello world", "it's  ok now", "x\n y z", "é à ß", "a  b\tc", "日本 語", "ab.cd ef", "Hello, World!",
          "a b", "3.14159 is 12345 long", "f(x) = {y} ; z", "\x08 \x7f  0 ~ ", "abc's x1234567.y", "e\u0301x ab\tc\nd",
          "q(r)s9,t0\x08u~~v")
DIGITS = "0123456789"


class Tokens(NamedTuple):
    ids: list[int]
    starts: list[int]  # character offsets of each token, as tokenizers reports them
    ends: list[int]


def splits_at_cut_points(tokenizer: Tokenizer) -> bool:
    """Whether every position `can_cut` accepts ends a pre-token, and nothing before pre-tokenization moves text
    across such a position (the condition for cutting prompts there)."""
    config = json.loads(tokenizer.to_str())
    if (config.get("normalizer") or {}).get("type", "NFC") != "NFC" or config["model"].get("type") != "BPE" or \
            config["model"].get("dropout") or tokenizer.pre_tokenizer is None:
        return False
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids
    for text in PROBES:
        bounds = {end for _, (_, end) in tokenizer.pre_tokenizer.pre_tokenize_str(text)}
        for cut in _cut_points(text):
            if cut not in bounds or ids(text) != ids(text[:cut]) + ids(text[cut:]):
                return False
    return True


def can_cut(text: str, position: int) -> bool:
    """Whether `position` (> 0) is one of the pre-token boundaries of the module's docstring."""
    before, after = text[position - 1], text[position]
    if after == " ":
        return not before.isspace()
    if not after.isascii() or after.isalpha():
        return False
    return before.isalpha() or (before in DIGITS and after not in DIGITS)


def _cut_points(text: str) -> list[int]:
    return [i for i in range(1, len(text)) if can_cut(text, i)]


class AddedTokens:
    """Where the tokenizer's added tokens occur around a position, overlapping occurrences included."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        contents = sorted({added["content"] for added in json.loads(tokenizer.to_str()).get("added_tokens", [])
                           if added["content"]}, key=len, reverse=True)
        self.longest = len(contents[0]) if contents else 0
        self._any = re.compile("(?=(" + "|".join(map(re.escape, contents)) + "))") if contents else None

    def span(self, text: str, position: int) -> bool:
        """Whether an occurrence starts before `position` and reaches it. One that ends exactly there counts too:
        it may strip the whitespace after it. (Cut points never follow whitespace, so one that strips the whitespace
        before it starts at the position at the earliest.)"""
        if self._any is None:
            return False
        for match in self._any.finditer(text, max(position - self.longest, 0), position + self.longest):
            if match.start() < position <= match.start() + len(match.group(1)):
                return True
        return False


def _shared_length(a: str, b: str) -> int:
    """The length of the common beginning, by bisection over slice comparisons (each at C speed). Each compares
    only what lies past the beginning known to be common, so the slices copied add up to about the length once
    (whole beginnings each time copied 17 times 35,000 characters for a 70,000-character prompt)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def special_wrap(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text's own (a BOS, say), or None where it does more."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            before, after = full[:i], full[i + len(plain):]
            other = tokenizer.encode("b c", add_special_tokens=True).ids
            if other == before + tokenizer.encode("b c", add_special_tokens=False).ids + after:
                return before, after
    return None


class PrefixTokenizer:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=False)`'s ids and offsets; `ids(text,
    True)` equals `tokenizer.encode(text).ids`."""

    def __init__(self, tokenizer: Tokenizer, entries: int = ENTRIES) -> None:
        self.tokenizer = tokenizer
        self.cuts = splits_at_cut_points(tokenizer)
        self._wrap = special_wrap(tokenizer)
        self._added = AddedTokens(tokenizer)
        self.entries = entries
        self._recent: OrderedDict[str, tuple[str, Tokens]] = OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0  # tokens taken from remembered prompts

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return self.encode(text).ids
        if self._wrap is None:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        before, after = self._wrap
        return [*before, *self.encode(text).ids, *after]

    def encode(self, text: str) -> Tokens:
        if not self.cuts or len(text) < MIN_CHARS:
            return self._encode(text)
        key = text[:KEY_CHARS]
        with self._lock:
            known = self._recent.get(key)
        tokens = self._reuse(text, *known) if known else None
        if tokens is None:
            tokens = self._encode(text)
        with self._lock:
            self._recent[key] = (text, tokens)
            self._recent.move_to_end(key)
            while len(self._recent) > self.entries:
                self._recent.popitem(last=False)
        return tokens

    def _encode(self, text: str) -> Tokens:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = encoding.offsets
        return Tokens(encoding.ids, [start for start, _ in offsets], [end for _, end in offsets])

    def _reuse(self, text: str, known_text: str, known: Tokens) -> Tokens | None:
        shared = _shared_length(text, known_text)
        if shared < MIN_SHARED:
            return None
        # The last cut point inside the shared beginning (whose characters, and so whose scan, are the same).
        cut = next((p for p in range(shared - 1, MIN_SHARED // 2, -1)
                    if can_cut(text, p) and not self._added.span(text, p)), 0)
        if cut == 0:
            return None
        kept = bisect_right(known.ends, cut)
        if kept == 0 or known.ends[kept - 1] != cut or (kept < len(known.starts) and known.starts[kept] < cut):
            return None  # not a token boundary after all: encode the whole text
        rest = self._encode(text[cut:])
        with self._lock:
            self.reused += kept
        # Each list is copied once (a slice, then the short rest appended), not twice as `a[:k] + b` does.
        ids, starts, ends = known.ids[:kept], known.starts[:kept], known.ends[:kept]
        ids += rest.ids
        starts += [s + cut for s in rest.starts]
        ends += [e + cut for e in rest.ends]
        return Tokens(ids, starts, ends)
