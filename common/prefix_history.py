"""PrefixHistory: content keys for every prefix of a token sequence, computed incrementally.

A block key covers the sequence up to the end of a complete block and chains from the previous block's key, so equal
keys mean equal prefixes (up to BLAKE2b-128 collisions). Every key mixes in a 32-byte identity of the model and recipe,
so two cores never share entries. An exact endpoint inside a block hashes its aligned parent plus the remaining tokens.
Conditioning events (an image's identity at an absolute token position) enter the key of every prefix that consumes
that position, in the order they were added.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left
from collections.abc import Iterable

KEY_BYTES = 16
IDENTITY_BYTES = 32


def _hash(*parts: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        digest.update(part)
    return digest.digest()


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
        while (len(self.block_keys) + 1) * self.block_size <= len(self.tokens):
            start = len(self.block_keys) * self.block_size
            parent = self.block_keys[-1] if self.block_keys else self.root
            self.block_keys.append(self._key(b"block", parent, start, start + self.block_size))

    def add_event(self, position: int, identity: bytes) -> None:
        """Conditioning at `position`; only positions not yet in a complete block can still be conditioned."""
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"event identity must be {IDENTITY_BYTES} bytes")
        if position < len(self.block_keys) * self.block_size:
            raise ValueError(f"position {position} lies in a block whose key is already fixed")
        index = bisect_left(self._event_positions, position + 1)
        self._event_positions.insert(index, position)
        self._events.insert(index, identity)

    def key_at(self, length: int) -> bytes:
        """The exact key of the prefix of `length` tokens (a block key when length is block-aligned)."""
        if not 0 < length <= len(self.tokens):
            raise ValueError(f"no prefix of length {length} in a history of {len(self.tokens)} tokens")
        blocks, rest = divmod(length, self.block_size)
        if rest == 0:
            return self.block_keys[blocks - 1]
        parent = self.block_keys[blocks - 1] if blocks else self.root
        return self._key(b"exact", parent, blocks * self.block_size, length)

    def _key(self, kind: bytes, parent: bytes, start: int, end: int) -> bytes:
        tokens = struct.pack(f"<{end - start}I", *self.tokens[start:end])
        first, last = bisect_left(self._event_positions, start), bisect_left(self._event_positions, end)
        events = b"".join(struct.pack("<Q", self._event_positions[i]) + self._events[i] for i in range(first, last))
        return _hash(kind, parent, self.identity, tokens, events)
