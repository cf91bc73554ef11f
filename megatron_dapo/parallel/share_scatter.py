"""The driver hands each trainer rank its data-parallel share of the batch, and nothing more.

Global rank 0 (the driver) holds the kept batch; every rank of data-parallel replica r (its TP x PP ranks) needs
share r. The driver sends each rank its share as PackedShare tensors over a gloo group of its own (host memory:
the batch is built on the host, and NCCL takes device tensors only), so a rank receives 1/DP of the batch instead
of all of it, and nothing is pickled.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.parallel.rank_shares import PackedShare

_DTYPES = [torch.int32, torch.int64, torch.int64, torch.float64, torch.float64, torch.bool, torch.int64, torch.uint8,
           torch.int64, torch.int64]


class ShareScatter:
    """Collective to construct (every rank, same order): a gloo group over the world, and which data-parallel
    rank each global rank is."""

    def __init__(self, dp_rank: int, timeout: timedelta | None = None):
        self.group = dist.new_group(backend="gloo", timeout=timeout)  # the run's parallel.distributed_timeout_minutes
        ranks = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        ranks[dist.get_rank()] = dp_rank
        dist.all_reduce(ranks, group=self.group)
        self.dp_rank_of = ranks.tolist()  # global rank -> data-parallel rank

    def send(self, shares: list[PackedShare]) -> PackedShare:
        """Driver: shares[r] to every rank of replica r; returns the driver's own."""
        works = []
        for dst in range(1, dist.get_world_size()):
            share = shares[self.dp_rank_of[dst]]
            works.append(dist.isend(_header(share), dst, group=self.group))
            works += [dist.isend(t, dst, group=self.group) for t in share.tensors() if t.numel()]
        for work in works:
            work.wait()
        return shares[self.dp_rank_of[0]]

    def receive(self) -> PackedShare:
        """Every other rank: its replica's share."""
        header = torch.empty(len(_DTYPES), dtype=torch.int64)
        dist.recv(header, 0, group=self.group)
        tensors = [torch.empty(n, dtype=dtype) for n, dtype in zip(header.tolist(), _DTYPES)]
        for t in tensors:
            if t.numel():
                dist.recv(t, 0, group=self.group)
        return PackedShare(*tensors)


def _header(share: PackedShare) -> torch.Tensor:
    tensors = share.tensors()
    if [t.dtype for t in tensors] != _DTYPES:
        raise TypeError(f"PackedShare dtypes {[t.dtype for t in tensors]} are not the wire's {_DTYPES}")
    return torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
