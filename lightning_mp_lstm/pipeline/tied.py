"""Weights shared by blocks on different processes (tied embedding and decoder), kept identical.

A tied weight is one parameter registered under several names (``embedding.weight`` and ``decoder.weight``).
When the pipeline puts those blocks on different processes, each owner keeps its own copy, starting from the
same values. Once per optimizer step, before clipping, :meth:`TiedWeights.all_reduce` sums the copies' gradients
between their owners (DeepSpeed's ``TiedLayerSpec`` does the same), so every copy gets the gradient the one
shared parameter gets in one process, and identical updates keep the copies equal. Checkpoints and optimizer
state use the parameter's first name, the one a one-process model and its optimizer know it by.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp_lstm.base.faults import gather
from lightning_mp_lstm.pipeline.gradients import local_tensor
from lightning_mp_lstm.pipeline.groups import copy_from_first
from lightning_mp_lstm.planning.layout import ParallelLayout

__all__ = ["TiedWeights", "shared_parameter_aliases"]


def shared_parameter_aliases(module: nn.Module) -> dict[str, str]:
    """Every further name of a parameter registered under several names -> its first name.

    Call it on the whole model before pruning. The first name is the one ``named_parameters()`` gives and the
    one a one-process optimizer's state is paired with; ``{"decoder.weight": "embedding.weight"}`` for a tied
    language model, ``{}`` for an untied one.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


@dataclass
class TiedWeights:
    """The tied weights this process holds a copy of, with the process group of each weight's owners.

    Attributes:
        shared: ``(parameter, group)`` for every tied weight whose owners in this pipeline replica are several
            processes, this one included.
        not_in_norm: ids of this process's copies that another owner counts in the global gradient norm.
    """

    shared: list[tuple[nn.Parameter, dist.ProcessGroup]] = field(default_factory=list)
    not_in_norm: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, module: nn.Module, aliases: dict[str, str], layout: ParallelLayout) -> TiedWeights:
        """Find the owners of every tied weight and create their process groups (a collective: every rank calls
        it, after pruning; without a process group nothing is shared).

        Args:
            module: this process's part of the model.
            aliases: :func:`shared_parameter_aliases` of the whole model.
            layout: the layout (which ranks form each pipeline replica).
        """
        tied = sorted(set(aliases.values()))
        if not tied:
            return cls()
        local = {aliases.get(name, name): p for name, p in module.named_parameters() if aliases.get(name, name) in tied}
        # named_parameters() names a copy by the first name it finds: an alias when the first owner is elsewhere.
        not_in_norm = {id(p) for name, p in module.named_parameters() if name in aliases}
        if not (dist.is_available() and dist.is_initialized()):
            return cls(not_in_norm=not_in_norm)
        held = gather(lambda: sorted(local))
        me = dist.get_rank()
        shared = []
        for name in tied:
            for replica in range(layout.data_parallel_size):
                owners = [rank for rank, names in enumerate(held)
                          if name in names and layout.coordinates(rank)[0] == replica]
                if len(owners) < 2:
                    continue
                group = dist.new_group(owners)  # every rank takes part in creating every group
                if me in owners:
                    shared.append((local[name], group))
        return cls(shared=shared, not_in_norm=not_in_norm)

    def copy_first_owners(self) -> None:
        """Give every copy of a tied weight its first owner's values (a process that drew its own initial values, with
        no ``seed_everything``, would otherwise hold another weight than the copy it is tied to)."""
        for parameter, group in self.shared:
            copy_from_first([local_tensor(parameter)], group)

    def all_reduce(self) -> None:
        """Sum each tied weight's gradient over its owners (a copy without a gradient contributes zeros)."""
        for parameter, group in self.shared:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(local_tensor(parameter.grad), group=group)  # sharded replicas: equal slices

    def in_norm(self, parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``parameters`` without the copies another owner counts in the global norm (each weight counts once)."""
        return [p for p in parameters if id(p) not in self.not_in_norm]
