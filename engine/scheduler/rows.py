"""The rows of a request's next step (engine/scheduler/plan.py Row): a prompt chunk or a decode row built whole from the
request, a decode row moved on from its previous one, a verify round's row of drafts (docs/design.md, Scheduler and
prefix checkpoints; docs/speculative.md).
"""

from __future__ import annotations

from engine.scheduler.cohort import AT_OUTPUT_INDEX, AT_PAGE_TABLE, AT_START
from engine.scheduler.plan import Row
from engine.scheduler.request import Phase, Request

PREFILL = Phase.PREFILL  # (a module global: looked up once per row, not on the Enum class)


def next_row(request: Request, length: int, page_size: int) -> Row:
    """The request's next `length` positions, from its state: prompt tokens while it prefills, else one decode
    position."""
    start = request.scheduled
    end = start + length
    prefill = request.phase is PREFILL
    samples = (not prefill or end == request.prefill_target) and not request.scored
    targets = ()
    if prefill and request.sampling.prompt_logprobs is not None:
        targets = tuple(request.tokens[start + 1:min(end + 1, request.prompt_len)])
    return Row(
        slot=request.slot, generation=request.generation, start=start, length=length,
        tokens=tuple(request.tokens[start:end]) if prefill else None,
        page_table=tuple(request.pages[: -(-end // page_size)]),
        sample=samples, output_index=end - request.prompt_len, sampling=request.sampling, seed=request.seed,
        prompt_len=request.prompt_len, history=tuple(request.tokens[:start]) if request.fresh else None,
        prompt_targets=targets, epoch=request.epoch, images=request.images,
        rope_shift=request.rope_shift(start, end),
        banned=tuple(sorted(request.stop_ids)) if end - request.prompt_len < request.sampling.min_tokens else (),
        scores=tuple((p, ids) for p, ids in request.label_queries if start <= p < end),
        pool=request.pooling if request.pooling == "mean" or end == request.prefill_target and prefill else "")


def decode_row(request: Request, page_size: int) -> Row:
    """A decode row. Between two decode steps of one epoch only its position and page table move: the previous
    decode row (Request.decode_row) is moved on. Rebuilt whole on the epoch's first, after a verify round's rewind
    (pages went back), and while min_tokens bans the stop ids (`banned` depends on the position: such a row is not
    kept to move on). Its other position-dependent fields are constant past the prompt: no prompt targets, label
    queries or image spans lie there, so `scores` is () and `rope_shift` is the shift after the last image."""
    fields = request.decode_row
    if fields is None:
        built = next_row(request, 1, page_size)
        request.decode_row = None if built.banned else list(built)
        return built
    end = request.scheduled + 1
    pages = -(-end // page_size)
    if len(fields[AT_PAGE_TABLE]) != pages:
        fields[AT_PAGE_TABLE] = tuple(request.pages[:pages])
    fields[AT_START], fields[AT_OUTPUT_INDEX] = end - 1, end - request.prompt_len
    return tuple.__new__(Row, fields)


def verify_row(request: Request, draft: tuple[int, ...], page_size: int, proposer: str) -> Row:
    """A verify round's row: the last committed token, then the `proposer`'s drafts after it."""
    start = request.scheduled  # the last committed token's position: it comes first, its KV unwritten yet
    end = start + 1 + len(draft)
    return Row(slot=request.slot, generation=request.generation, start=start, length=1 + len(draft),
               tokens=(request.tokens[-1],) + draft, page_table=tuple(request.pages[: -(-end // page_size)]),
               sample=True, output_index=start + 1 - request.prompt_len, sampling=request.sampling,
               seed=request.seed, prompt_len=request.prompt_len, epoch=request.epoch, draft=draft,
               proposer=proposer, rope_shift=request.rope_shift(start, end),
               images=request.images)  # a vision model's eager step places text after images by them
