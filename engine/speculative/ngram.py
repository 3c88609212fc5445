"""Copy proposals (prompt lookup): the tokens that followed the most recent earlier occurrence of the sequence's
last n tokens, longest n first. An index per request, updated as tokens arrive, makes a lookup O(n)."""

from __future__ import annotations

MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram of a token sequence (n in MIN_NGRAM..MAX_NGRAM) last ended, excluding the sequence's own
    suffix, so a lookup of the suffix finds an earlier occurrence."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions <= this are in the index

    def propose(self, tokens: list[int], depth: int) -> tuple[int, ...]:
        """Up to `depth` tokens that continue `tokens` as its last earlier match did; () when nothing matches."""
        self._catch_up(tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tuple(tokens[end:end + depth])
        return ()

    def _catch_up(self, tokens: list[int]) -> None:
        # Index every n-gram ending before the last position; the suffix itself (ending at len) stays out.
        for end in range(self._indexed + 1, len(tokens)):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)
