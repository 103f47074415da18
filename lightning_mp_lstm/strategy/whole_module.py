"""The user's module made whole again on global rank 0, so that its own ``training_step`` can run on it.

The pipeline prunes each process's module to the blocks its stages hold. The numerical check of a declaration
(:mod:`~lightning_mp_lstm.strategy.verify`) runs the module's own step on the whole module, so global rank 0 keeps
the block objects pruning takes away (:class:`WholeModule`, made before the pipeline is built) and, for the check
only, puts them back in the module itself (:meth:`WholeModule.attached`): no copy of the user's module is made
(``copy.deepcopy`` fails on modules that keep non-leaf tensors as attributes, such as fastai's ``WeightDropout``, and
would double the memory). Everything the step changes on the module and its submodules (attributes such as carried
state, weights a wrapper sets in its forward, buffers, gradients, ``requires_grad``) is restored afterwards, and the
pruned blocks return to their places.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mp_lstm.models.shapes import meta_copy

__all__ = ["ModuleState", "WholeModule"]


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (root.get_submodule(head) if head else root), name


def _place(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, name = _parent(root, path)
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit():
        parent[int(name)] = value
    else:
        setattr(parent, name, value)


@dataclass
class ModuleState:
    """Every module's own state under a root, to put back after a step ran on it (a shallow record: the tensors a
    step rebinds come back; buffers it changes in place are copied back)."""

    records: list[tuple[nn.Module, dict[str, Any], dict[str, dict[str, Any]], dict[str, torch.Tensor]]]
    grads: dict[nn.Parameter, tuple[torch.Tensor | None, bool]]

    @classmethod
    def of(cls, root: nn.Module) -> ModuleState:
        records = []
        for module in root.modules():
            registries = {k: dict(getattr(module, k)) for k in ("_parameters", "_buffers", "_modules")}
            buffers = {k: b.detach().clone() for k, b in module._buffers.items() if b is not None}  # noqa: SLF001
            records.append((module, dict(vars(module)), registries, buffers))
        grads = {p: (p.grad, p.requires_grad) for p in root.parameters()}
        return cls(records, grads)

    def restore(self) -> None:
        for module, attributes, registries, buffers in self.records:
            vars(module).clear()
            vars(module).update(attributes)
            for key, registry in registries.items():
                getattr(module, key).clear()
                getattr(module, key).update(registry)
            with torch.no_grad():
                for key, values in buffers.items():
                    module._buffers[key].copy_(values)  # noqa: SLF001
        for parameter, (grad, requires_grad) in self.grads.items():
            parameter.grad = grad
            parameter.requires_grad_(requires_grad)


class WholeModule:
    """Global rank 0's hold on the declared blocks of ``module`` before the pipeline prunes it.

    Args:
        module: the user's module, whole (built normally).
        paths: the declared embedding, LSTM stack and decoder paths.
        rebuild_vocabulary: the embedding and decoder are changed in place later (tensor-parallel sharding): keep
            rebuilt copies of them (from their state dicts) rather than the modules themselves.
    """

    def __init__(self, module: nn.Module, paths: tuple[str, str, str], rebuild_vocabulary: bool = False) -> None:
        embedding, lstm, decoder = paths
        self.blocks: dict[str, nn.Module] = {path: module.get_submodule(path) for path in paths}
        stack = self.blocks[lstm]
        self.layers = list(stack) if isinstance(stack, nn.ModuleList) else None
        self.lstm = lstm
        if rebuild_vocabulary:
            tied = self.blocks[decoder].weight is self.blocks[embedding].weight
            for path in (embedding, decoder):
                self.blocks[path] = _rebuilt(self.blocks[path])
            if tied:
                self.blocks[decoder].weight = self.blocks[embedding].weight

    @contextmanager
    def attached(self, module: nn.Module, device: torch.device, convert: Any) -> Iterator[nn.Module]:
        """``module`` with its whole blocks in place (moved to ``device`` and converted by ``convert``, the precision
        plugin's ``convert_module``), and the pipeline's zero multi-layer ``nn.LSTM`` dropout (drawn inside torch's
        kernel, where it cannot be replayed); everything is restored on exit."""
        pruned = ModuleState.of(module)
        try:
            for path, block in self.blocks.items():
                _place(module, path, block)
            if self.layers is not None:
                stack = self.blocks[self.lstm]
                for index, layer in enumerate(self.layers):
                    stack[index] = layer
            for block in self.blocks.values():
                convert(block.to(device))
            whole = ModuleState.of(module)
            try:
                for part in module.modules():
                    if isinstance(part, nn.LSTM) and part.num_layers > 1:
                        part.dropout = 0.0
                yield module
            finally:
                whole.restore()
        finally:
            pruned.restore()

    def take_values(self, module: nn.Module, values: list[dict[str, torch.Tensor]]) -> None:
        """Give the whole module (attached) every process's current parameter values, by name (a resumed run's
        blocks on other processes were loaded from the checkpoint after these were kept)."""
        parameters = dict(module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for shard in values:
                for name, value in shard.items():
                    if name in parameters:
                        parameters[name].copy_(value)


def _rebuilt(block: nn.Module) -> nn.Module:
    """A new module of ``block``'s kind and values (from its state dict)."""
    copy_ = meta_copy(block).to_empty(device="cpu")
    copy_.load_state_dict({k: v.detach().cpu() for k, v in block.state_dict().items()})
    return copy_
