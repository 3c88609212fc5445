"""Prefix keys (common/prefix_history.py): frontends route by them and engines find cached blocks by them, so every
way of computing them (one pass, piece by piece, reused from a recent sequence) gives the bytes of the definition."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix_history import PrefixHistory, RecentHistories, prefix_events

IDENTITY = bytes(range(32))
IMAGE = bytes([7]) * 32


def spec_keys(identity: bytes, size: int, tokens: list[int], events: list[tuple[int, bytes]]) -> list[bytes]:
    """The block keys by their definition: BLAKE2b-128 of kind, parent, identity, the block's uint32 LE tokens and
    its events (position as uint64 LE, then identity), chained from the root."""
    parent = hashlib.blake2b(b"root" + identity, digest_size=16).digest()
    keys = []
    for begin in range(0, len(tokens) - size + 1, size):
        block = b"".join(struct.pack("<I", t) for t in tokens[begin:begin + size])
        conditioning = b"".join(struct.pack("<Q", p) + e for p, e in sorted(events, key=lambda x: x[0])
                                if begin <= p < begin + size)
        parent = hashlib.blake2b(b"block" + parent + identity + block + conditioning, digest_size=16).digest()
        keys.append(parent)
    return keys


def test_keys_are_pinned() -> None:
    """Digests computed before any optimisation: a change here breaks routing across versions."""
    history = PrefixHistory(IDENTITY, 4, list(range(10)))
    assert [k.hex() for k in history.block_keys] == ["961711b3eff44716fc8fc8e65576117b",
                                                     "33d3400e30427116fbf2b88ccd4de6b9"]
    assert history.key_at(10).hex() == "fb68b26ba1e1228b24b5657fd33c6cbb"
    history = PrefixHistory(IDENTITY, 4)
    history.add_event(5, IMAGE)
    history.extend(range(100, 110))
    assert [k.hex() for k in history.block_keys] == ["ae470f2fd57b48d8cd69782baa37f801",
                                                     "87e0213e00ecbd070041d686c46de0e2"]
    assert history.key_at(10).hex() == "5a611452d0627f01948a298f8d7f3940"


tokens_st = st.lists(st.integers(0, (1 << 32) - 1), max_size=80)
events_st = st.lists(st.tuples(st.integers(0, 90), st.sampled_from([IMAGE, bytes(32)])), max_size=3)


@settings(max_examples=200, deadline=None)
@given(tokens_st, events_st, st.sampled_from([1, 4, 16]), st.integers(0, 80))
def test_keys_match_the_definition_in_one_pass_and_in_pieces(tokens: list[int], events: list[tuple[int, bytes]],
                                                             size: int, cut: int) -> None:
    whole = PrefixHistory(IDENTITY, size)
    pieces = PrefixHistory(IDENTITY, size)
    for position, identity in events:
        whole.add_event(position, identity)
        pieces.add_event(position, identity)
    whole.extend(tokens)
    pieces.extend(tokens[:cut])
    pieces.extend(tokens[cut:])
    assert whole.block_keys == pieces.block_keys == spec_keys(IDENTITY, size, tokens, events)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 60), events_st), min_size=1,
                max_size=6), st.sampled_from([1, 4, 16]))
def test_recent_histories_give_the_keys_of_a_fresh_history(requests: list, size: int) -> None:
    """Sequences that share beginnings of every length (and differ in their events or not) get the keys a fresh
    PrefixHistory computes, whichever earlier sequence lent its keys."""
    bases = [[(i * 7 + b) % 50 for i in range(100)] for b in range(4)]
    recent = RecentHistories(IDENTITY, size, entries=3, min_blocks=1)
    for base, shared, extra, events in requests:
        tokens = bases[base][:shared] + [1000 + extra + i for i in range(extra % 17)]
        history = recent.history(tokens, events)
        fresh = PrefixHistory(IDENTITY, size)
        for position, identity in events:
            fresh.add_event(position, identity)
        fresh.extend(tokens)
        assert history.block_keys == fresh.block_keys == spec_keys(IDENTITY, size, tokens, events)
        assert history.tokens == tokens
        if len(tokens) % size:
            assert history.key_at(len(tokens)) == fresh.key_at(len(tokens))


def test_a_repeated_long_beginning_is_hashed_once() -> None:
    recent = RecentHistories(IDENTITY, 16)
    prefix = list(range(16000))
    recent.history(prefix + [1, 2, 3])
    history = recent.history(prefix + [4] * 64)
    assert recent.reused_blocks == 1000
    assert history.block_keys == spec_keys(IDENTITY, 16, prefix + [4] * 64, [])


def test_an_image_that_differs_ends_the_keys_lent_at_its_block() -> None:
    recent = RecentHistories(IDENTITY, 16, min_blocks=1)
    tokens = list(range(160))
    recent.history(tokens, [(40, IMAGE)])
    history = recent.history(tokens, [(40, bytes(32))])
    assert recent.reused_blocks == 2  # blocks 0 and 1 end before position 40
    assert history.block_keys == spec_keys(IDENTITY, 16, tokens, [(40, bytes(32))])


def test_salts_keep_prefixes_apart_even_when_lent() -> None:
    tokens = list(range(16 * 40))  # long enough for RecentHistories to remember it
    recent = RecentHistories(IDENTITY, 16)
    plain = recent.history(tokens).block_keys
    salted = {salt: recent.history(tokens, prefix_events(salt, [])).block_keys for salt in ("a", "b")}
    assert not set(plain) & set(salted["a"]) and not set(salted["a"]) & set(salted["b"])
    assert recent.history(tokens, prefix_events("a", [])).block_keys == salted["a"]  # the same salt shares
