"""The collectives ``MPLSTMStrategy`` gives Lightning, as functions. Pickled objects travel on the gloo object group
(:func:`~lightning_mp_lstm.base.faults.object_group`), never on the training group (NCCL on GPUs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from torch import Tensor

from lightning_mp_lstm.base.faults import object_group

__all__ = ["barrier", "broadcast_object", "reduce_tensor"]


def barrier(device: torch.device) -> None:
    """Wait for every process (nothing without a process group); NCCL's barrier is told this rank's device, which it
    would otherwise guess."""
    if not _distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as global rank ``src`` has it, on every process, pickled over the gloo object group."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=object_group())
    return box[0]


def reduce_tensor(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Lightning's reduction of a tensor across processes (anything else is returned as it is)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor
