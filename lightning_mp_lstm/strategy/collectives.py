"""The collectives of Lightning's ``Strategy`` for a pipeline: ``MPLSTMStrategy`` takes them from
:class:`StrategyCollectives`. Pickled objects travel on the gloo object group
(:func:`~lightning_mp_lstm.base.faults.object_group`), never on the training group (NCCL on GPUs)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from torch import Tensor
from typing_extensions import override

from lightning_mp_lstm.base.faults import object_group

__all__ = ["StrategyCollectives"]


class StrategyCollectives:
    """``barrier``, ``broadcast``, ``reduce`` and ``block_backward_sync``, mixed into a Lightning ``Strategy``
    (which gives ``root_device``)."""

    root_device: torch.device

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":  # NCCL's barrier guesses a device unless told this rank's
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=object_group())
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def block_backward_sync(self) -> Any:
        return nullcontext()  # gradients are reduced by the engine after the pipeline's backward, not by DDP hooks
