"""Copies of modules that hold their parameters' shapes and no memory: for a block a process does not hold, or holds
nowhere yet (a model built on the meta device), whatever the planner needs to know of it.

:func:`meta_copy` copies a module with every parameter and buffer on the meta device (the module's own code and
attributes come along: a user's subclass stays one); :func:`fake_parameters` gives such a copy parameters that are
torch's fake tensors on a real device, so that running it inside a ``FakeTensorMode`` shows what a forward would
allocate and save, exactly as the device's kernels would, without allocating any of it.
"""

from __future__ import annotations

import copy
from itertools import chain

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["fake_parameters", "meta_copy", "module_bytes"]


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor's shape is the whole tensor's: the copy is of the unsplit module.
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (nothing of theirs is copied; a tied
    parameter stays one parameter).

    Raises:
        RuntimeError: the module holds something ``copy.deepcopy`` refuses (a non-leaf tensor as an attribute).
    """
    memo = {id(t): _meta(t) for t in chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def fake_parameters(module: nn.Module, mode: FakeTensorMode, device: torch.device) -> nn.Module:
    """Give ``module`` (a :func:`meta_copy`) parameters and buffers that are ``mode`` 's fake tensors on ``device``,
    in place; returns it."""
    swapped: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in swapped:
            with mode:
                value = mode.from_tensor(tensor.detach()).to(device)
            swapped[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                else value
        return swapped[id(tensor)]

    for part in module.modules():
        for table in (part._parameters, part._buffers):
            for key, value in table.items():
                if value is not None:
                    table[key] = fake(value)
        if isinstance(part, nn.RNNBase):
            part._init_flat_weights()  # its list of weights, now the fake ones
    return module


def module_bytes(module: nn.Module | None) -> int:
    """Bytes of a module's parameters (each counted once; a ``DTensor`` by its whole shape)."""
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())  # a DTensor's numel is the whole one
