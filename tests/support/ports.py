"""Ports for the tests' servers."""

from __future__ import annotations

from common import ranks


def free_port() -> int:
    """A port for a test's server, in a range of its own: `flare run` picks its ranks' ports below 20000 (a test run saw a
    port from `bind(0)` taken by a `--tp 2` run's gloo connections before the frontend bound it)."""
    return ranks.free_port(20000, 32000)
