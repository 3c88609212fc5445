"""Incremental detokenization and stop strings, on the default core's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from frontend.detokenizer import IncrementalDetokenizer, StopMatcher

TEXTS = ["Hello, world! ", "Ünïcödé ✓ and emoji 🎉🎉 mixed with 中文字符 text.", "  leading spaces\nnew lines\t tabs",
         "12345 numbers 3.14159"]


@pytest.fixture(scope="module")
def tokenizer(core_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(core_dir / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_the_text_without_split_characters(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add([token]) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_emoji_split_over_byte_tokens_arrives_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level BPE splits it; the test is meaningless otherwise
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add([token]) for token in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    end = tokenizer.token_to_id("<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(tokenizer.encode("Hi", add_special_tokens=False).ids + [end]) == "Hi"


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], str]:
    out = [matcher.feed(piece) for piece in pieces]
    return out, "".join(out) + ("" if matcher.matched else matcher.flush())


def test_stop_string_spanning_pieces_is_cut_and_its_prefix_never_emitted() -> None:
    out, text = feed_all(StopMatcher(["STOP"]), ["hello S", "T", "OP and more"])
    assert text == "hello " and out == ["hello ", "", ""]


def test_held_back_prefix_that_is_not_a_stop_is_released() -> None:
    out, text = feed_all(StopMatcher(["STOP"]), ["a ST", "ATE b"])
    assert out == ["a ", "STATE b"] and text == "a STATE b"


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == "hel" and matcher.matched == "lo w"


def test_unfinished_prefix_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("end </") == "end " and matcher.flush() == "</"


def test_bytes_that_never_complete_a_character_arrive_at_the_end() -> None:
    """A synth core's byte-level tokenizer gave a greedy run of lone continuation bytes: held back while they
    might complete a character, they must still reach the client at the end, as `decode` shows them."""
    from ignition.synth import byte_level_bpe

    tokenizer = byte_level_bpe(49152)
    ids = [tokenizer.token_to_id("\u00a9")] * 7 + [tokenizer.token_to_id("\u00b0")] * 17  # bytes 0xa9, 0xb0
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add([token]) for token in ids]
    assert "".join(pieces) != tokenizer.decode(ids)  # the run is still held back before the end
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids)
    assert detokenizer.flush() == ""
