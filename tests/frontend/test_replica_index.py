"""A replica's routing index follows its engine's announcements: keys on the device and keys in its host tier count
as cached alike, until announced evicted (docs/design.md, Host retention)."""

from __future__ import annotations

from common import protocol as wire
from frontend.replicas import Replica

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_hosted_keys_count_as_cached_until_evicted() -> None:
    replica = Replica(0, client=None)
    replica.announce(wire.decode_cache_events(wire.encode(wire.CacheEvents("e", stored=[A], hosted=[B]))))
    assert replica.cached_run([A, B, C]) == 2
    replica.announce(wire.CacheEvents("e", evicted=[B]))
    assert replica.cached_run([A, B, C]) == 1
    replica.announce(wire.CacheEvents("e", stored=[B], hosted=[A, C], full=True))
    assert replica.cached_run([A, B, C]) == 3
