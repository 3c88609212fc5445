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
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable

KEY_BYTES = 16
IDENTITY_BYTES = 32


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
        start = first * self.block_size
        packed = _pack(self.tokens[start:last * self.block_size])
        width = 4 * self.block_size
        parent = self.block_keys[-1] if self.block_keys else self.root
        for block in range(last - first):
            begin = start + block * self.block_size
            parent = self._key(b"block", parent, begin, begin + self.block_size,
                               packed[block * width:(block + 1) * width])
            self.block_keys.append(parent)

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

    def _key(self, kind: bytes, parent: bytes, start: int, end: int, packed: bytes | None = None) -> bytes:
        """The key of tokens [start, end) after `parent`; `packed` is those tokens already packed, when at hand."""
        tokens = _pack(self.tokens[start:end]) if packed is None else packed
        events = b""
        if self._event_positions:
            first, last = bisect_left(self._event_positions, start), bisect_left(self._event_positions, end)
            events = b"".join(struct.pack("<Q", self._event_positions[i]) + self._events[i]
                              for i in range(first, last))
        return _hash(kind, parent, self.identity, tokens, events)
