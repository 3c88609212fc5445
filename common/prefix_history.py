"""PrefixHistory: content keys for every prefix of a token sequence, computed incrementally.

A block key covers the sequence up to the end of a complete block and chains from the previous block's key, so equal
keys mean equal prefixes (up to BLAKE2b-128 collisions). Every key mixes in a 32-byte identity of the model and recipe,
so two cores never share entries. An exact endpoint inside a block hashes its aligned parent plus the remaining tokens.
Conditioning events (an image's identity at an absolute token position) enter the key of every prefix that consumes
that position, in the order they were added. RecentHistories lends a new sequence the keys of the beginning it shares
with one of the last few long ones (a 16k-token system prompt sent again), so only the rest is hashed. Keys are compared
across hosts (frontends route by them): tests/common/test_prefix_history.py holds them to their definition.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from itertools import zip_longest
from typing import NamedTuple, Protocol

import numpy as np

KEY_BYTES = 16
IDENTITY_BYTES = 32


class ImageInputLike(Protocol):  # common.protocol.ImageInput, without importing the wire here
    offset: int
    identity: bytes


def _hash(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=KEY_BYTES).digest()


def _pack(tokens: list[int]) -> bytes:
    """Little-endian uint32s (keys are compared across hosts: frontends route by them)."""
    packed = array("I", tokens)  # 4 bytes on every platform CPython supports
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


class PrefixHistory:
    def __init__(self, identity: bytes, block_size: int = 64, tokens: Iterable[int] = ()) -> None:
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"identity must be {IDENTITY_BYTES} bytes")
        self.identity = identity
        self.block_size = block_size
        self.root = _hash(b"root", identity)
        self.tokens: list[int] = []
        self.block_keys: list[bytes] = []  # block_keys[i] covers tokens [0, (i + 1) * block_size)
        self._event_positions: list[int] = []  # sorted (stable for equal positions)
        self._events: list[bytes] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)
        first, last = len(self.block_keys), len(self.tokens) // self.block_size
        if last <= first:
            return
        # One pack for every new block (a 16k-token prompt: 1,000 blocks of 16), sliced per block.
        size, start = self.block_size, first * self.block_size
        packed = _pack(self.tokens[start:last * size])
        width, keys = 4 * size, self.block_keys
        parent = keys[-1] if keys else self.root
        # Blocks before the first conditioning event hash in a loop of their own: a call and a join per block are
        # half of the time of a long prompt's keys. The bytes hashed are _key's.
        after = bisect_left(self._event_positions, start)
        plain = last - first if after == len(self._events) else \
            min((self._event_positions[after] - start) // size, last - first)
        head, identity, blake2b = b"block", self.identity, hashlib.blake2b
        for offset in range(0, plain * width, width):
            parent = blake2b(head + parent + identity + packed[offset:offset + width], digest_size=KEY_BYTES).digest()
            keys.append(parent)
        for block in range(plain, last - first):
            begin = start + block * size
            parent = self._key(b"block", parent, begin, begin + size, packed[block * width:(block + 1) * width])
            keys.append(parent)

    def add_event(self, position: int, identity: bytes) -> None:
        """Conditioning at `position`; only positions not yet in a complete block can still be conditioned."""
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"event identity must be {IDENTITY_BYTES} bytes")
        if position < len(self.block_keys) * self.block_size:
            raise ValueError(f"position {position} lies in a block whose key is already fixed")
        index = bisect_left(self._event_positions, position + 1)
        self._event_positions.insert(index, position)
        self._events.insert(index, identity)

    def events_before(self, end: int) -> list[tuple[int, bytes]]:
        """The conditioning events at positions below `end`, in key order."""
        count = bisect_left(self._event_positions, end)
        return list(zip(self._event_positions[:count], self._events[:count]))

    def key_at(self, length: int) -> bytes:
        """The exact key of the prefix of `length` tokens (a block key when length is block-aligned)."""
        if not 0 < length <= len(self.tokens):
            raise ValueError(f"no prefix of length {length} in a history of {len(self.tokens)} tokens")
        blocks, rest = divmod(length, self.block_size)
        if rest == 0:
            return self.block_keys[blocks - 1]
        parent = self.block_keys[blocks - 1] if blocks else self.root
        return self._key(b"exact", parent, blocks * self.block_size, length)

    def _key(self, kind: bytes, parent: bytes, start: int, end: int, packed: bytes | None = None) -> bytes:
        """The key of tokens [start, end) after `parent`; `packed` is those tokens already packed, when at hand."""
        tokens = _pack(self.tokens[start:end]) if packed is None else packed
        events = b""
        if self._event_positions:
            first, last = bisect_left(self._event_positions, start), bisect_left(self._event_positions, end)
            events = b"".join(struct.pack("<Q", self._event_positions[i]) + self._events[i]
                              for i in range(first, last))
        return _hash(kind, parent, self.identity, tokens, events)


def salt_event(salt: str) -> tuple[int, bytes]:
    """A cache salt as a conditioning event at position 0: it enters the first block's key, and through the chain
    every later key, so requests of different salts share no cached prefix (another tenant cannot learn, from
    `cached_tokens`, what others sent). Unsalted requests have no such event."""
    return 0, hashlib.blake2b(b"cache_salt" + salt.encode(), digest_size=IDENTITY_BYTES).digest()


def prefix_events(salt: str, images: Iterable[ImageInputLike]) -> list[tuple[int, bytes]]:
    """A request's conditioning events in key order, as the engine keys its cache and frontends route by it."""
    events = [salt_event(salt)] if salt else []
    return events + [(image.offset, image.identity) for image in images]


class RecentHistories:
    """PrefixHistories that take the keys of a shared beginning from one of the last few long sequences: a prompt
    that starts with the 16,000 tokens of a recent one hashes only what follows (1,000 BLAKE2b keys in Python cost
    about a millisecond; finding the shared beginning is a comparison at C speed). A block's key depends only on the
    tokens and events up to its end, so the keys lent are those a fresh history computes."""

    def __init__(self, identity: bytes, block_size: int, entries: int = 8, min_blocks: int = 32) -> None:
        self.identity = identity
        self.block_size = block_size
        self.min_blocks = min_blocks  # shorter sequences hash in well under 0.1 ms: not worth remembering
        self._recent: deque[_Remembered] = deque(maxlen=entries)
        self.reused_blocks = 0  # keys lent so far

    def history(self, tokens: list[int], events: Iterable[tuple[int, bytes]] = ()) -> PrefixHistory:
        """A PrefixHistory of `tokens` with conditioning `events` (position, identity), added in order."""
        history = PrefixHistory(self.identity, self.block_size)
        for position, identity in events:
            history.add_event(position, identity)
        blocks = len(tokens) // self.block_size
        if blocks < self.min_blocks:
            history.extend(tokens)
            return history
        packed = np.frombuffer(_pack(tokens[:blocks * self.block_size]), dtype=np.uint32)
        lent: list[bytes] = []
        for known in reversed(self._recent):  # the newest first: a repeated prompt is usually the latest
            shared = self._shared_blocks(packed, history, known)
            if shared > len(lent):
                lent = known.keys[:shared]
                if shared == blocks:
                    break
        history.block_keys.extend(lent)
        self.reused_blocks += len(lent)
        history.extend(tokens)
        self._recent.append(_Remembered(packed, history.block_keys[:blocks],
                                        history.events_before(blocks * self.block_size)))
        return history

    def _shared_blocks(self, packed: np.ndarray, history: PrefixHistory, known: _Remembered) -> int:
        """How many leading blocks `known` shares with the new sequence, tokens and events."""
        size = self.block_size
        common = min(len(packed), len(known.packed))
        if common < size or not np.array_equal(packed[:size], known.packed[:size]):
            return 0
        differ = np.flatnonzero(packed[:common] != known.packed[:common])
        blocks = (int(differ[0]) if len(differ) else common) // size
        end = blocks * size
        # Both lists are in key order: events before the first pair that differs are the same in both, so every
        # block that ends at or before the smaller of that pair's positions has the same key.
        theirs = [event for event in known.events if event[0] < end]
        for mine, their in zip_longest(history.events_before(end), theirs):
            if mine != their:
                return min(event[0] for event in (mine, their) if event is not None) // size
        return blocks


class _Remembered(NamedTuple):
    packed: np.ndarray  # uint32 tokens of the complete blocks
    keys: list[bytes]
    events: list[tuple[int, bytes]]  # those inside the complete blocks
