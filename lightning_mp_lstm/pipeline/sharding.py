"""Replicas that shard: torch's FSDP2 (``fully_shard``) over the data-parallel dimension of each pipeline stage, as
torchtitan composes it (ZeRO-3 over the replicas: each replica keeps ``1/dp`` of its stage's parameters, gradients and
optimizer state between steps).

Each block of a stage is its own FSDP unit (its parameters gathered just before it runs); the stage module is the
root, holding whatever two blocks share. Torch's pipeline stages drive FSDP themselves (``PipelineStage`` keeps the
gradients unsharded over the microbatches and reduce-scatters them after the last one). Two things are this
library's:

- The loss may run the decoder itself, a slice of tokens at a time, after the stage's forward and again in the
  backward pass (:mod:`~lightning_mp_lstm.models.decoded_loss`): such a block keeps its parameters gathered after
  its forward (until the gradients are reduced).
- A block may register the user's tensors on itself (a layer of a multi-layer ``nn.LSTM``), so FSDP's sharded
  parameters replace the block's references but not the user module's: :func:`shard_stages` points every other owner
  at the sharded parameter, and the user's module, its optimizer and its checkpoints see one set of parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["largest_share", "reduce_after_this_backward", "reshard", "shard_stages", "sharded_modules"]


# The stages hand their outputs to torch's schedules, which never change them in place (what the warning is about).
warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDP(StageModule|DecoderBlock|EmbeddingBlock|"
                        r"LSTMLayerBlock)\) returned a view tensor")


def _shared_with_another_block(blocks: Iterable[nn.Module]) -> set[int]:
    """Indices of the blocks that hold a parameter another block of the same stage holds too (tied weights)."""
    owners: dict[int, set[int]] = {}
    for index, block in enumerate(blocks):
        for parameter in block.parameters():
            owners.setdefault(id(parameter), set()).add(index)
    return {index for held in owners.values() if len(held) > 1 for index in held}


def shard_stages(stage_modules: Iterable[nn.Module], mesh: DeviceMesh, owners: nn.Module) -> None:
    """Shard every stage module's parameters over ``mesh`` (the data-parallel dimension) with ``fully_shard``.

    Gradients are summed over the replicas, not averaged: each replica's loss is already divided by the global
    batch's token count.

    Args:
        stage_modules: this process's :class:`~lightning_mp_lstm.pipeline.stages.StageModule` s (pruned, on their
            device, before any optimizer is built over them).
        mesh: the 1-D data-parallel mesh of this process's stage.
        owners: the user's module: every parameter it registers that a block also holds is replaced by the sharded
            one (the same names).
    """
    replaced: dict[int, nn.Parameter] = {}
    for stage in stage_modules:
        blocks = list(stage.blocks)
        before = [(name, parameter) for name, parameter in stage.named_parameters()]
        shared = _shared_with_another_block(blocks)
        for index, block in enumerate(blocks):
            if index in shared or not any(True for _ in block.parameters()):
                continue
            # The loss runs a decoding block's decoder after the forward and in the backward: keep it gathered.
            fully_shard(block, mesh=mesh, reshard_after_forward=not getattr(block, "decodes_in_loss", False))
        fully_shard(stage, mesh=mesh, reshard_after_forward=False)
        for module in sharded_modules([stage]):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
        after = dict(stage.named_parameters())
        replaced.update({id(old): after[name] for name, old in before})
    for module in owners.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and id(parameter) in replaced:
                module._parameters[name] = replaced[id(parameter)]


def sharded_modules(stage_modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """Every FSDP unit inside ``stage_modules`` (the blocks and the stage roots)."""
    return [module for stage in stage_modules for module in stage.modules() if isinstance(module, FSDPModule)]


def reduce_after_this_backward(stage: nn.Module, last: bool) -> None:
    """Tell a sharded ``stage`` (no-op for another) whether the backward about to run is its last of the step: only
    after that one do its FSDP units reduce-scatter the summed gradients and free what they gathered; before it they
    add whole gradients up (what torch's ``PipelineStage`` does for its schedules, for a loop of this library's)."""
    if isinstance(stage, FSDPModule):
        stage.set_requires_gradient_sync(last)
        stage.set_is_last_backward(last)
        stage.set_reshard_after_backward(last)


def reshard(stage_modules: Iterable[nn.Module]) -> None:
    """Free the gathered parameters (after a forward-only pass, which leaves the roots' gathered)."""
    with torch.no_grad():
        for module in sharded_modules(stage_modules):
            module.reshard()


def largest_share(inputs: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> int:
    """The most rows any replica's share of this batch has (a collective over ``group``): sharded replicas run every
    batch at one shape, so that their FSDP units gather together, also when a new shape makes torch's stage infer
    its buffers with a real forward and backward. Raises when the replicas' time axes differ."""
    sizes = torch.tensor([inputs.shape[0], inputs.shape[1], -inputs.shape[1]], device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    rows, longest, shortest = int(sizes[0]), int(sizes[1]), -int(sizes[2])
    if longest != shortest:
        raise ValueError(f"shard_replicas=True: the replicas' batches are {shortest} to {longest} steps long; "
                         "sharded replicas run every batch together and need one length per global batch "
                         "(LMDataModule's buckets give it)")
    return rows
