"""Text of a requested token length, and token counts when the server reports none.

With the server's tokenizer (`--tokenizer`), prompts are random vocabulary tokens cut to the exact length. Without
one, prompts are common English words, each of which is one token in the BPE vocabularies of the usual models, so
the word count approximates the token count; the server's usage then reports the true input length.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

# Each is a single token (with its leading space) in GPT-2-style BPE vocabularies such as Llama 3's and SmolLM2's.
WORDS = ("the of and to in is that for it as with was on be by at this from or an are not have but had his they you "
         "which one were all we her she there been if more when will would who so no time year people way day man "
         "thing woman life child world school state family student group country problem hand part place case week "
         "company system program question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head house service friend "
         "father power hour game line end member law car city community name president team minute idea kid body "
         "information back parent face others level office door health person art war history party result change "
         "morning reason research girl guy moment air teacher force education").split()

# Decoding random ids and encoding the text again can merge or split tokens; a few rounds settle the length.
FIT_ROUNDS = 8


class Tokens:
    """Builds prompt text of a token length and counts tokens, with or without a tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.get_added_tokens_decoder())
            self.vocab = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=False)) if i not in special]

    @classmethod
    def load(cls, path: Path | None) -> Tokens:
        """`path` is a tokenizer.json, or a directory holding one (a Flare core, a Hugging Face checkpoint)."""
        if path is None:
            return cls(None)
        file = path / "tokenizer.json" if path.is_dir() else path
        return cls(Tokenizer.from_file(str(file)))

    def text(self, rng: random.Random, length: int) -> str:
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS) for _ in range(length))
        ids = [rng.choice(self.vocab) for _ in range(length)]
        for _ in range(FIT_ROUNDS):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == length:
                return text
            ids = ids[:length] + [rng.choice(self.vocab) for _ in range(length - len(ids))]
        return self.tokenizer.decode(ids)

    def count(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
