"""Sampling extras inside the captured graphs: penalties, min_tokens bans, logprobs and prompt logprobs
(docs/design.md, Executors and CUDA graphs; the reference semantics are EagerExecutor's and engine/sampling/sampler.py's).

A step whose rows ask for penalties, logprobs or bans launches the *extras* sampling graph of its sequence capacity
(one per capacity, greedy and not: grammar masks always applied, the masks buffer set to allow everything when the
step has none) instead of the plain one. Per row it reads a small extras frame, uploaded only on such steps, so
plain steps pay nothing: the penalty values and up to MAX_BANNED banned ids. One kernel
(engine/kernels/triton/penalties.py) applies the penalties from per-slot state (output token counts, tokens seen in
prompt and output) with sampling.penalise's formula, reading the state only for rows that ask (the others keep
their logits bit for bit), and masks grammar-forbidden and banned tokens; then the graph draws, writes each row's
logprobs (fp32 log_softmax over the penalised logits, before masks and bans, as the eager step) as one row of
words: [chosen token's logprob, TOP_LOGPROBS ids, TOP_LOGPROBS logprobs, best first], and counts the drawn token in
its slot's state. Tokens the host knows (a prompt chunk, a restarted request's history) enter a penalised
request's slot state by a few ops on the model stream before the graphs (engine/sampling/penalty_state.py), as
the eager step records them (bench/lab/gpu/evidence.py --only extras times such steps against plain ones).

Prompt logprobs: every extend graph keeps its final hidden states (a copy of tokens x hidden, well under a
thousandth of a prefill step), and the prompt graph, captured at PROMPT_ROWS positions, turns the positions a step
asks for into logprob rows, launched once per PROMPT_ROWS of them.

The graphs hold TOP_LOGPROBS alternatives (OpenAI's maximum) and MAX_BANNED banned ids per row: a step asking more
runs eagerly, as do label logits read anywhere but at a row's last token (engine/executor/graph.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not

import numpy as np
import torch

from common.protocol import Logprobs
from engine.executor.inputs import any_penalty
from engine.kernels.triton.penalties import process_logits
from engine.model.decoder import CausalLM
from engine.sampling.penalty_state import known_tokens, penalised_rows
from engine.sampling.sampler import token_logprobs
from engine.scheduler.plan import BANNED, PROMPT_TARGETS, SAMPLING, Row, fields

TOP_LOGPROBS = 20  # alternatives per token every extras step computes: the OpenAI maximum
MAX_BANNED = 16  # banned ids per row an extras frame carries (the stop ids before min_tokens)
PROMPT_ROWS = 256  # prompt positions per launch of the prompt-logprobs graph
PENALTIES = ("presence", "frequency", "repetition")
LOGPROBS, PROMPT_LOGPROBS = attrgetter("logprobs"), attrgetter("prompt_logprobs")
_DEFAULTS = {"presence": 0.0, "frequency": 0.0, "repetition": 1.0}
_PARAMS = {"presence": attrgetter("presence_penalty"), "frequency": attrgetter("frequency_penalty"),
           "repetition": attrgetter("repetition_penalty")}


def logprob_words(top: int) -> int:
    """Words of one logprob row: the chosen token's logprob, `top` ids, `top` logprobs."""
    return 1 + 2 * top


def extras_words(seqs: int) -> int:
    return seqs * (len(PENALTIES) + MAX_BANNED)


def _views(words: np.ndarray | torch.Tensor, seqs: int, as_float: object) -> dict:
    """The extras frame of a capacity: a float32 per penalty per row, then MAX_BANNED ids per row (-1: none)."""
    views = {name: as_float(words[i * seqs:(i + 1) * seqs]) for i, name in enumerate(PENALTIES)}
    first = len(PENALTIES) * seqs
    views["banned"] = words[first:first + seqs * MAX_BANNED].reshape(seqs, MAX_BANNED)
    return views


def host_extras_views(words: np.ndarray, seqs: int) -> dict[str, np.ndarray]:
    return _views(words, seqs, lambda view: view.view(np.float32))


def device_extras_views(words: torch.Tensor, seqs: int) -> dict[str, torch.Tensor]:
    return _views(words, seqs, lambda view: view.view(torch.float32))


# --- what a step needs (host, every step: passes at C speed) -----------------------------------------------------
def samples_extras(rows: Sequence[Row]) -> bool:
    """Whether the step's sampling needs the extras graph: a penalty, logprobs or a ban in some row."""
    params = list(fields(rows, SAMPLING))
    return any_penalty(params) or any(map(is_not, map(LOGPROBS, params), repeat(None))) or any(fields(rows, BANNED))


def graph_holds_extras(rows: Sequence[Row]) -> bool:
    """Whether the captured extras cover these rows: at most TOP_LOGPROBS alternatives and MAX_BANNED bans."""
    params = list(map(SAMPLING, rows))
    asked = [k for k in (*map(LOGPROBS, params), *map(PROMPT_LOGPROBS, params)) if k is not None]
    return max(asked, default=0) <= TOP_LOGPROBS and max(map(len, map(BANNED, rows)), default=0) <= MAX_BANNED


@dataclass(frozen=True)
class StepExtras:
    """What a graph step does beyond the plain graphs (host side)."""

    sample: bool  # the extras sampling graph (penalties, bans, logprobs)
    logprobs: bool  # some row asked for logprobs: the logprob rows come back
    known: tuple[np.ndarray, np.ndarray, np.ndarray]  # known_tokens of the penalised rows
    prompt: np.ndarray  # prompt_positions: [2, 0] when no row asks prompt logprobs

    @property
    def known_count(self) -> int:
        return sum(len(index) for index in self.known)


def step_extras(rows: Sequence[Row], vocab: int) -> StepExtras | None:
    """None for a plain step (the common case, decided in passes at C speed)."""
    prompt = any(fields(rows, PROMPT_TARGETS))
    sample = samples_extras(rows)
    if not prompt and not sample:
        return None
    logprobs = any(map(is_not, map(LOGPROBS, map(SAMPLING, rows)), repeat(None)))
    return StepExtras(sample, logprobs, known_tokens(penalised_rows(rows), vocab),
                      prompt_positions(rows) if prompt else np.zeros((2, 0), dtype=np.int64))


def pack_extras(rows: Sequence[Row], views: dict[str, np.ndarray]) -> None:
    """The rows' penalty values and bans into an extras frame's views; padding rows get neutral values."""
    count = len(rows)
    params = list(map(SAMPLING, rows))
    for name in PENALTIES:
        views[name][:count] = np.fromiter(map(_PARAMS[name], params), np.float32, count)
        views[name][count:] = _DEFAULTS[name]
    views["banned"][:] = -1
    for i in compress(range(count), map(BANNED, rows)):
        views["banned"][i, :len(rows[i].banned)] = rows[i].banned


# --- the device side: the functions the graphs capture -----------------------------------------------------------
@dataclass(frozen=True)
class ExtrasBuffers:
    inputs: torch.Tensor  # int32 [extras_words(max_seqs)]: the extras frame
    counts: torch.Tensor  # int32 [slots + 1, vocab]: output token counts per slot; the last row is padding's
    seen: torch.Tensor  # bool [slots + 1, vocab]: tokens seen (prompt and output) per slot
    logprobs: torch.Tensor  # int32 [max_seqs, logprob_words(top)]: the step's logprob rows (floats as their bits)
    hidden: torch.Tensor  # [max_tokens, hidden]: the last extend step's final hidden states
    prompt_positions: torch.Tensor  # int64 [2, prompt rows]: flat token index and target of each position asked
    prompt_logprobs: torch.Tensor  # int32 [prompt rows, logprob_words(top)]
    top: int  # alternatives per row: TOP_LOGPROBS, or the vocabulary when smaller

    @property
    def prompt_rows(self) -> int:
        return self.prompt_positions.shape[1]

    @classmethod
    def allocate(cls, slots: int, max_seqs: int, max_tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, prompt_rows: int = PROMPT_ROWS) -> ExtrasBuffers:
        top = min(TOP_LOGPROBS, vocab)
        return cls(torch.zeros(extras_words(max_seqs), dtype=torch.int32, device=device),
                   torch.zeros(slots + 1, vocab, dtype=torch.int32, device=device),
                   torch.zeros(slots + 1, vocab, dtype=torch.bool, device=device),
                   torch.zeros(max_seqs, logprob_words(top), dtype=torch.int32, device=device),
                   torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
                   torch.zeros(2, prompt_rows, dtype=torch.int64, device=device),
                   torch.zeros(prompt_rows, logprob_words(top), dtype=torch.int32, device=device), top)


def _write_logprobs(out: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, top: int) -> None:
    chosen, ids, best = token_logprobs(logits, tokens, top)
    values = out.view(torch.float32)
    values[:, 0] = chosen
    out[:, 1:1 + top] = ids
    values[:, 1 + top:] = best


@torch.inference_mode()
def extras_sample_step(logits: torch.Tensor, masks: torch.Tensor, views: dict[str, torch.Tensor],
                       extras: ExtrasBuffers, seqs: int, draw: Callable[[torch.Tensor], torch.Tensor]
                       ) -> torch.Tensor:
    """Penalties, logprobs, masks and bans around `draw` (logits -> tokens); the drawn tokens, counted in their
    slots' penalty state (rows that sample nothing count in the padding row)."""
    ev = device_extras_views(extras.inputs, seqs)
    slots = views["sample_slot"].long()
    penalised, processed = process_logits(logits, slots, extras.counts, extras.seen, ev["presence"],
                                          ev["frequency"], ev["repetition"], masks, ev["banned"])
    tokens = draw(processed)
    vocab = logits.shape[-1]
    _write_logprobs(extras.logprobs[:seqs], penalised, tokens, extras.top)
    flat = slots * vocab + tokens  # scatters: atomic adds and plain stores, safe to capture
    extras.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    extras.seen.view(-1).scatter_(0, flat, True)
    return tokens


@torch.inference_mode()
def prompt_logprobs_step(model: CausalLM, extras: ExtrasBuffers) -> None:
    """Logprob rows of the asked prompt positions, from the extend step's kept hidden states."""
    index, targets = extras.prompt_positions
    _write_logprobs(extras.prompt_logprobs, model.logits(extras.hidden[index]), targets, extras.top)


# --- reading a step's results (host) -----------------------------------------------------------------------------
def prompt_positions(rows: Sequence[Row]) -> np.ndarray:
    """int64 [2, N]: each asked prompt position's flat token index in the step and the token it predicts, in row
    order (a row's targets are its first positions, as the eager step reads them)."""
    index, targets, first = [], [], 0
    for row in rows:
        if row.prompt_targets:
            index.extend(range(first, first + len(row.prompt_targets)))
            targets.extend(row.prompt_targets)
        first += row.length
    return np.asarray([index, targets], dtype=np.int64).reshape(2, -1)


def _unpack(words: np.ndarray, top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    values = words.view(np.float32)
    return values[:, 0].tolist(), words[:, 1:1 + top].tolist(), values[:, 1 + top:].tolist()


def read_logprobs(rows: Sequence[Row], tokens: Sequence[int], words: np.ndarray, top: int
                  ) -> tuple[Logprobs | None, ...]:
    """Per sampled row, its Logprobs when its request asked (() when none did), from the step's logprob rows."""
    params = list(map(SAMPLING, rows))
    if not any(map(is_not, map(LOGPROBS, params), repeat(None))):
        return ()
    chosen, ids, best = _unpack(words[:len(rows)], top)
    out, sampled = [], 0
    for i, (row, k) in enumerate(zip(rows, map(LOGPROBS, params))):
        if not row.sample:
            continue
        out.append(None if k is None else Logprobs([tokens[sampled]], [chosen[i]], [ids[i][:k]], [best[i][:k]]))
        sampled += 1
    return tuple(out)


def read_prompt_logprobs(rows: Sequence[Row], words: np.ndarray, top: int) -> tuple[tuple[int, int, Logprobs], ...]:
    """(slot, generation, Logprobs) per row with prompt targets, from the logprob rows of `prompt_positions`."""
    chosen, ids, best = _unpack(words, top)
    out, first = [], 0
    for row in compress(rows, map(PROMPT_TARGETS, rows)):
        end = first + len(row.prompt_targets)
        k = row.sampling.prompt_logprobs or 0
        out.append((row.slot, row.generation, Logprobs(list(row.prompt_targets), chosen[first:end],
                                                       [i[:k] for i in ids[first:end]],
                                                       [b[:k] for b in best[first:end]])))
        first = end
    return tuple(out)
