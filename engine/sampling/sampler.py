"""Token sampling on tensors, with no host synchronisation and no torch RNG state.

Randomness is a counter-based hash of (request seed, output position, vocabulary id), so a seeded request draws the
same numbers whatever else shares its batch, after a preemption, or inside a replayed CUDA graph. Sampling is the
exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingTensors:
    """One row per sampled request, all on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; 0 means off
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64: index of the output token being drawn
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    # Known on the host from the requests, so the device is never asked:
    all_greedy: bool
    any_penalty: bool
    banned_rows: torch.Tensor | None = None  # [N] int64 with banned_ids: (row, token) pairs that may not be drawn
    banned_ids: torch.Tensor | None = None  # [N] int64
    allowed: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 packed grammar masks (engine/sampling/grammar.py)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # A well-mixed 32-bit integer hash; operands stay below 2**63 so int64 never overflows.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] Exp(1) samples determined by (seed, position, token id) alone."""
    key = _hash32(_hash32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    key = _hash32(key ^ (position & _MASK32))
    ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = _hash32((key[:, None] + ids[None, :] * 0x9E3779B1) & _MASK32) >> 8
    uniform = (bits.float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def apply_penalties(logits: torch.Tensor, params: SamplingTensors, output_counts: torch.Tensor,
                    seen: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence/frequency penalties over output tokens; transformers' repetition penalty over prompt and
    output tokens. output_counts [B, V] and seen [B, V] are the sampled rows' slot state."""
    if not params.any_penalty:
        return logits
    return penalise(logits, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                    output_counts, seen)


def penalise(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
             output_counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """apply_penalties' formula with per-row values [B]; neutral values (0, 0, 1) leave a row's logits bit for bit."""
    rp = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    counts = output_counts.to(logits.dtype)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def apply_token_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Tokens whose bit is clear in the packed mask (bit i of word w: token 32 w + i) can never be drawn."""
    bits = torch.arange(32, device=allowed.device, dtype=torch.int32)
    keep = ((allowed[:, :, None] >> bits) & 1).view(allowed.shape[0], -1)[:, :logits.shape[-1]]
    return logits.masked_fill(keep == 0, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [B, V] float32 (penalties applied) -> token ids [B] int64."""
    if params.allowed is not None:
        logits = apply_token_mask(logits, params.allowed)
    if params.banned_rows is not None and params.banned_rows.numel():  # stop ids before min_tokens, as vLLM does
        logits = logits.index_put((params.banned_rows, params.banned_ids),
                                  torch.tensor(float("-inf"), device=logits.device))
    greedy = logits.argmax(dim=-1)
    if params.all_greedy:
        return greedy
    vocab = logits.shape[-1]
    temperature = params.temperature.clamp_min(1e-5)[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    top_k = torch.where(params.top_k > 0, params.top_k, vocab)[:, None]
    keep = rank < top_k
    keep &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p[:, None]
    keep &= sorted_probs >= params.min_p[:, None] * sorted_probs[:, :1]
    keep &= sorted_probs > 0  # a masked-out token has no chance, however the noise falls
    keep[:, 0] = True
    noise = exponential_noise(params.seed, params.position, vocab).gather(1, order)
    # Noise can be exactly 0 in float32 (a uniform draw rounds to 1.0): 0 / 0 would be NaN, which argmax picks, so
    # dropped tokens score -1 rather than p / noise.
    choice = torch.where(keep, sorted_probs / noise, -1.0).argmax(dim=-1, keepdim=True)
    drawn = order.gather(1, choice).squeeze(1)
    return torch.where(params.temperature > 0, drawn, greedy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The logprob of each chosen token under the model's distribution, and the `top` best alternatives:
    ([B], [B, top] ids, [B, top] logprobs)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    best, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, ids, best
