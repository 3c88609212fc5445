"""Structured output in the engine (docs/design.md, Beyond plain decoding): grammars compiled off the loop, a matcher
per constrained request, and the packed token masks a step's sampling applies.

The grammar engine is llguidance: a grammar spec (kind, text) from the wire becomes an llguidance grammar, and a
matcher built from it for this engine's tokenizer is the compiled form. Compiles run on a small thread pool (the
library drops the GIL), so a slow one never stalls the loop; finished compiles wake the loop through `wake_fd`.
Each request compiles a matcher of its own, so that a step's masks are computed in parallel (GrammarCompiler.compile).

Masks are int32 words, bit i of word w allowing token 32 w + i, one row per plan row (all ones for rows that are
not constrained), carried in the Plan as bytes so that tensor-parallel ranks receive them with the step.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from common.constraint_limits import LLGUIDANCE_LIMITS, constraint_problem
from engine.scheduler.plan import SAMPLE, SLOT, Plan, fields

# Every request compiles its matcher (GrammarCompiler.compile): more threads on a larger host, so that a burst of
# requests under a large schema (several ms a compile) is admitted as fast as the host allows.
COMPILE_THREADS = max(2, len(os.sched_getaffinity(0)) // 4)


class GrammarError(ValueError):
    """The spec does not compile for this tokenizer: a 400 for its request only."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # an llguidance grammar format: "json_schema", "regex", "choice", "lark", "gbnf", ...
    text: str


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles specs on worker threads; `take_done()` on the loop hands back what finished."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._done: collections.deque[tuple[object, Future]] = collections.deque()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self.executor = llguidance.LLExecutor()  # computes a batch's masks in parallel, GIL released

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher of its own for the spec (blocking); raises GrammarError. Never a copy of another request's:
        llguidance's copies share their lexer state behind one lock, which would make a step's masks for them run one
        after another whatever the executor's threads (a JSON schema's matcher compiles in under a millisecond)."""
        # The frontend refused whatever is over these bounds (and validated the rest in a process of its own);
        # checked again here because llguidance runs in this process, and a grammar past them can crash it.
        problem = constraint_problem(spec.kind, spec.text)
        if problem is not None:
            raise GrammarError(problem)
        try:
            grammar = llguidance.grammar_from(spec.kind, spec.text)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LLGUIDANCE_LIMITS))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def submit(self, key: object, spec: GrammarSpec) -> None:
        """Compile in the background; (key, future) comes back from take_done()."""
        future = self._pool.submit(self.compile, spec)
        future.add_done_callback(lambda f: self._finished(key, f))

    def _finished(self, key: object, future: Future) -> None:
        self._done.append((key, future))
        os.write(self._wake_write, b"x")

    def take_done(self) -> list[tuple[object, Future]]:
        try:
            os.read(self.wake_fd, 1 << 16)
        except BlockingIOError:
            pass
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.wake_fd)
        os.close(self._wake_write)


def constrained_rows(plan: Plan, slots: Container[int]) -> list[tuple[int, int]]:
    """(row index, slot) of the plan's sampled rows whose slot is in `slots`."""
    rows = plan.rows
    return [(i, slot) for i, (slot, sample) in enumerate(zip(fields(rows, SLOT), fields(rows, SAMPLE)))
            if sample and slot in slots]


def plan_masks(plan: Plan, matchers: dict[int, llguidance.LLMatcher], words: int,
               executor: llguidance.LLExecutor) -> bytes:
    """The plan's masks: one row per plan row, all ones except sampled rows of constrained slots (`matchers` maps
    a slot to its request's matcher). Empty when no row is constrained. A matcher that fails to compute its mask
    (a parser limit) is left in its error state, for the caller to end its request."""
    constrained = [(matchers[slot], i) for i, slot in constrained_rows(plan, matchers)]
    if not constrained:
        return b""
    masks = np.full((len(plan.rows), words), -1, dtype=np.int32)
    fill_next_token_bitmask_par(executor, constrained, masks)
    return masks.tobytes()
