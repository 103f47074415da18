"""The process groups of one process's place in the ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroups", "shared"]


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of this process's place in the mesh: its pipeline, its stage's replicas, its stage's
    tensor-parallel shards (each may have one member)."""

    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup
    tensor_parallel: dist.ProcessGroup

    @classmethod
    def of(cls, mesh: DeviceMesh) -> ProcessGroups:
        """The groups of a ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh."""
        return cls(*(mesh[name].get_group() for name in ("pipeline_parallel", "data_parallel", "tensor_parallel")))


def shared(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has other members than this process."""
    return dist.get_world_size(group) > 1
