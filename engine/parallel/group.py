"""The tensor-parallel process group: joining it, and the two collectives the model forward calls.

gloo on the CPU, NCCL on GPUs (one GPU per rank; bench/lab/gpu/tensor_parallel.py has run it on two H200s, the engine's ranks not
yet: tests/engine/test_tensor_parallel.py's GPU test). The group's TCPStore, hosted by rank 0 at --dist-address (and
listening on that address's host only), also hands the ranks the step channel's address.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Ranks load their shards at different speeds: all must have joined within this.
JOIN_TIMEOUT = datetime.timedelta(seconds=600)
# Ranks run the same steps in lockstep, so a collective waits only for the skew between them; a peer that is alive
# but stuck past this fails the collective. A dead peer fails it at once (its sockets close).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group."""

    rank: int
    world_size: int
    store: dist.Store
    group: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, rank r's holding sizes[r] columns. Pieces are padded
        to the widest, since gloo gathers equal sizes only."""
        width = max(sizes)
        piece = F.pad(x, (0, width - x.shape[-1])).contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.world_size)]
        dist.all_gather(pieces, piece, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A bare `cuda` becomes this rank's GPU on its host (ranks fill hosts in order)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def join(rank: int, world_size: int, address: str, device: torch.device) -> TensorParallel:
    """Join the group at HOST:PORT (rank 0 hosts its store there); returns once every rank has joined."""
    host, port = address.rsplit(":", 1)
    # Rank 0 listens on that host alone (TCPStore by itself listens on every interface): with a loopback address
    # the rendezvous cannot be reached from another host.
    listener = socket.create_server((host, int(port))).detach() if rank == 0 else None
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=JOIN_TIMEOUT,
                          master_listen_fd=listener)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, world_size, store, dist.group.WORLD)
