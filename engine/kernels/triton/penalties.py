"""A graph step's logit processing in one pass (engine/sampling/graph_extras.py): penalties from each row's slot
state, then grammar masks and banned ids.

Per row and block of the vocabulary it reads the logits once and writes them twice: penalised (what logprobs are
computed over, as the eager step does) and processed (penalised, with forbidden tokens at -inf: what is drawn
from). A row that asks no penalty never reads its slot's state, so a batch where a few rows ask pays for those few.
As torch ops the same work took about ten passes over [rows, vocab] (penalties_reference: engine/sampling/sampler.py's
penalise and apply_token_mask, then the bans). Division is IEEE (div_rn) as torch's; the compiler may fuse a
multiply and subtract, so a penalised logit can differ from the torch ops' by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.sampling.sampler import apply_token_mask, penalise

BLOCK = 1024


@triton.jit
def _process(logits_ptr, slots_ptr, counts_ptr, seen_ptr, presence_ptr, frequency_ptr, repetition_ptr, masks_ptr,
             banned_ptr, penalised_ptr, processed_ptr, vocab, mask_words, BANNED: tl.constexpr,
             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    out = row.to(tl.int64) * vocab + cols
    x = tl.load(logits_ptr + out, mask=inside, other=0.0)
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):
        state = tl.load(slots_ptr + row).to(tl.int64) * vocab + cols
        count = tl.load(counts_ptr + state, mask=inside, other=0).to(tl.float32)
        seen = tl.load(seen_ptr + state, mask=inside, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
        x = x - presence * (count > 0).to(tl.float32)
        x = x - frequency * count
    tl.store(penalised_ptr + out, x, mask=inside)
    word = tl.load(masks_ptr + row.to(tl.int64) * mask_words + cols // 32, mask=inside, other=0)
    keep = ((word >> (cols % 32)) & 1) != 0
    for i in tl.static_range(BANNED):
        keep &= cols != tl.load(banned_ptr + row * BANNED + i)
    tl.store(processed_ptr + out, tl.where(keep, x, float("-inf")), mask=inside)


def process_logits(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                   presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor, masks: torch.Tensor,
                   banned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalised, processed) [rows, vocab] float32. logits [rows, vocab] float32; slots [rows] int64: each row's
    row of counts (int32 [slots, vocab]) and seen (bool [slots, vocab]); presence, frequency, repetition [rows]
    float32; masks int32 [rows, ceil(vocab / 32)] (engine/sampling/grammar.py); banned int32 [rows, n], -1 for none."""
    rows, vocab = logits.shape
    penalised = torch.empty_like(logits)
    processed = torch.empty_like(logits)
    _process[(rows, triton.cdiv(vocab, BLOCK))](
        logits, slots, counts, seen.view(torch.uint8), presence, frequency, repetition, masks, banned, penalised,
        processed, vocab, masks.shape[1], BANNED=banned.shape[1], BLOCK=BLOCK, num_warps=4)
    return penalised, processed


def process_logits_reference(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                             presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                             masks: torch.Tensor, banned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    penalised = penalise(logits, presence, frequency, repetition, counts[slots], seen[slots])
    processed = apply_token_mask(penalised, masks)
    rows = torch.arange(len(banned), device=banned.device)[:, None].expand_as(banned)
    keep = banned >= 0
    processed[rows[keep], banned[keep].long()] = float("-inf")
    return penalised, processed
