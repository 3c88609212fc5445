"""The grammar engine's validation in worker processes (docs/design.md, Trust boundaries): llguidance is native code,
and a grammar that crashes it (a stack overflow, say) must take down a worker, not the frontend. A worker that dies
is replaced and the grammar that killed it is refused; validation of a bounded grammar takes milliseconds, so two
workers serve a frontend.

Validations are called from the frontend's worker threads (they wait here, the event loop does not).
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from common.constraint_limits import LLGUIDANCE_LIMITS

WORKERS = 2
TIMEOUT = 30.0  # seconds for one validation; a bounded grammar needs milliseconds
# Address space a worker may map (it starts at about 30 MB). A grammar within the bounds that llguidance still
# expands past this fails its allocation and kills the worker, rather than the host killing whatever it chooses.
WORKER_MEMORY = 1 << 30


class ValidatorCrashed(Exception):
    """The grammar engine died (or hung) on this grammar."""


def validate(kind: str, text: str) -> tuple[bool, list[str]]:
    """In a worker: llguidance's (is_error, messages) for the grammar; its own exceptions become an error."""
    from llguidance import LLMatcher, LLParserLimits, grammar_from

    try:
        return LLMatcher.validate_grammar_with_warnings(grammar_from(kind, text),  # type: ignore[arg-type]
                                                        limits=LLParserLimits(**LLGUIDANCE_LIMITS))
    except Exception as exc:  # the library's own exceptions for what it cannot read at all
        return True, [str(exc)]


def bound_memory() -> None:
    """A worker's initializer: cap its address space at WORKER_MEMORY."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))


class IsolatedValidator:
    """A small process pool for `validate`, started again when a worker dies."""

    def __init__(self, workers: int = WORKERS) -> None:
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: a fork of a process with threads and ZeroMQ sockets would copy their locks mid-use.
                self._pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"),
                                                 initializer=bound_memory)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)
        # A hung worker is killed, not waited for (the executor has no public way to stop a running call).
        for process in list((pool._processes or {}).values()):
            process.kill()

    def start(self) -> None:
        """Start the workers now rather than on the first grammar."""
        self._current().submit(validate, "regex", "a").result(TIMEOUT)

    def check(self, kind: str, text: str) -> tuple[bool, list[str]]:
        """(is_error, messages) as llguidance gives them; ValidatorCrashed when a worker died or hung on it twice
        (a worker's death fails every validation waiting on its pool: the second try tells whose grammar it was)."""
        for _ in range(2):
            pool = self._current()
            try:
                return pool.submit(validate, kind, text).result(TIMEOUT)
            except (BrokenProcessPool, TimeoutError):
                self._discard(pool)
        raise ValidatorCrashed

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


VALIDATOR = IsolatedValidator()
