"""Verification: which drafts the target accepts, on the device, with no host synchronisation.

Every position of a verify row is sampled by the target exactly as a plain decode step would sample it (the same
filters, the same (seed, output position) noise of engine/sampling/sampler.py). A draft is accepted while it equals the
target's sample at its position; the first disagreement yields the target's sample there (the correction), and a
fully accepted row yields the sample after its last draft (the bonus). For greedy rows this is the longest matching
prefix plus the target's token. For sampled rows it is rejection sampling with a one-hot proposal q = δ(d): the
draft survives with probability p(d) = min(1, p(d)/q(d)), and on rejection the target's sample is a draw from
p restricted to tokens other than d, i.e. from the residual norm(max(p - q, 0)). So the output distribution is the
target's, and a seeded request's tokens are the very tokens it would get without speculation.
"""

from __future__ import annotations

import torch


def accept(sampled: torch.Tensor, drafts: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sampled [B, W] target tokens at each position, drafts [B, W - 1], widths [B] positions in use (1 + drafts)
    -> (accepted drafts [B], the token after them [B])."""
    columns = torch.arange(drafts.shape[1], device=drafts.device)
    agree = (sampled[:, :-1] == drafts) & (columns[None, :] < widths[:, None] - 1)
    accepted = agree.long().cumprod(dim=1).sum(dim=1)
    return accepted, sampled.gather(1, accepted[:, None]).squeeze(1)
