"""A prediction batch's results on every rank: the last stage's predictions broadcast over its pipeline, then, where
every replica was given the whole global batch, every replica's share gathered in replica order."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mp_lstm.base import faults
from lightning_mp_lstm.planning.layout import ParallelLayout

__all__ = ["from_last_stage", "gather_replicas"]


def from_last_stage(result: dict[str, torch.Tensor] | None, pipeline: dist.ProcessGroup, last_stage_rank: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """The last stage's predictions (``result``; ``None`` on the other ranks) on every rank of ``pipeline``: their
    shapes and dtypes first, which the model decides (over the object group, gloo), then the tensors (over the
    pipeline group).

    Args:
        last_stage_rank: the last stage's rank in ``pipeline``.
        device: where the received tensors are put (this process's device).
    """
    if dist.get_world_size(pipeline) == 1:
        assert result is not None
        return result
    last = dist.get_global_rank(pipeline, last_stage_rank)
    shapes = faults.gather(lambda: {k: (tuple(v.shape), v.dtype) for k, v in result.items()}
                           if result is not None else None)[last]
    out = {}
    for key, (shape, dtype) in shapes.items():
        tensor = result[key].contiguous() if result is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, group=pipeline, group_src=last_stage_rank)
        out[key] = tensor
    return out


def gather_replicas(result: dict[str, torch.Tensor], layout: ParallelLayout,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Every replica's predictions, concatenated in replica order, on every rank (a collective of every rank).

    Every rank of a replica holds its predictions; the first rank of each replica's pipeline sends them to every
    rank over the object group (gloo: host memory, never staged through NCCL).
    """
    leads = [layout.global_rank(replica, 0) for replica in range(layout.data_parallel_size)]
    mine = dist.get_rank() in leads
    every = faults.gather(lambda: {k: v.cpu() for k, v in result.items()} if mine else None)
    return {k: torch.cat([every[lead][k] for lead in leads]).to(device) for k in result}
