"""PrefixTokenizer: a long prompt that begins like a recent one is encoded only from a cut point on, and the result
equals the tokenizer's own encoding of the whole text, for GPT-2, Llama 3 and Qwen 2 style pre-tokenizers."""

import json
import random
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from frontend.prefix_tokens import MIN_CHARS, PrefixTokenizer, splits_at_cut_points

CORE = Path(__file__).resolve().parents[2] / "cores" / "smollm2-135m"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PIECES = ["the", " cat", "Über", "naïve", " 日本語", "42", "123456", " ", "  ", "\t", "\n", "\n\n", " \n ", "'s", "'LL",
          "don't", "!!", "...", " (x)", "é", "ß", "😀", "\u0301", "a\u0301", " -", "_", "<|im_start|>", "<|im_end|>",
          "\r\n", "\u00a0", "x y", "0", "7 ", "~", "{}", "+= ", "\x08", "\x7f", "\x1f", "\u3000", "\x85", ") "]


def _tokenizer(style: str) -> Tokenizer:
    if not (CORE / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 core (make core)")
    tokenizer = Tokenizer.from_file(str(CORE / "tokenizer.json"))
    if style == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _text(rng: random.Random, length: int) -> str:
    parts, size = [], 0
    while size < length:
        piece = rng.choice(PIECES)
        parts.append(piece)
        size += len(piece)
    return "".join(parts)


@pytest.mark.parametrize("style", ["gpt2", "llama3", "qwen2"])
def test_a_prompt_sharing_a_beginning_encodes_as_the_whole_text(style):
    tokenizer = _tokenizer(style)
    cached = PrefixTokenizer(tokenizer)
    assert cached.cuts
    rng = random.Random(style)
    for case in range(60):
        first = _text(rng, MIN_CHARS + rng.randrange(4000))
        keep = rng.randrange(len(first) + 1)
        second = first[:keep] + _text(rng, rng.randrange(1, 600))
        for text in (first, second):
            got = cached.encode(text)
            want = tokenizer.encode(text, add_special_tokens=False)
            assert got.ids == want.ids, (style, case, keep)
            assert got.starts == [s for s, _ in want.offsets] and got.ends == [e for _, e in want.offsets]
    assert cached.reused > 0  # the cut path ran


def test_encoding_with_special_tokens_matches_the_post_processor():
    tokenizer = _tokenizer("gpt2")
    config = json.loads(tokenizer.to_str())
    assert config["post_processor"]  # TemplateProcessing: the wrap is derived, not assumed empty
    cached = PrefixTokenizer(tokenizer)
    rng = random.Random(1)
    base = _text(rng, MIN_CHARS * 2)
    for text in (base, base + " and more words", base[:3000] + " other ending"):
        assert cached.ids(text, add_special_tokens=True) == tokenizer.encode(text).ids


def test_a_pre_tokenizer_that_keeps_spaces_after_words_is_never_cut():
    tokenizer = _tokenizer("gpt2")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\S+\s*"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert not splits_at_cut_points(tokenizer)
    cached = PrefixTokenizer(tokenizer)
    text = "word " * 1000
    assert cached.encode(text).ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert cached.encode(text + "tail").ids == tokenizer.encode(text + "tail", add_special_tokens=False).ids
    assert cached.reused == 0


def test_a_normalizer_other_than_nfc_disables_cuts():
    tokenizer = _tokenizer("gpt2")
    tokenizer.normalizer = normalizers.Lowercase()
    assert not splits_at_cut_points(tokenizer)
