"""Measured forward + backward time of blocks and stages, on the device they run on.

Every measurement here is side-effect free: gradients and the random number generators are restored
afterwards. The blocks to time come from the model contract (:class:`~lightning_mp_lstm.models.contract.PipelineModel`):
``build_block`` makes a throw-away copy on the device, ``example_input`` / ``example_targets`` its inputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["MOST_REPEATS", "block_seconds", "median_interval", "stage_seconds", "untouched"]

#: The most runs a timing repeats to fill the seconds it was asked for (a fast block is timed more often: one run of a
#: few milliseconds on a shared machine is noise).
MOST_REPEATS = 20


@contextmanager
def untouched(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Run without side effects: parameter gradients and the random number generators are restored after."""
    params = [p for module in modules for p in module.parameters()]
    grads = [p.grad for p in params]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None) if device.type != "cpu" else None
    if callable(sync):
        sync()


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _time(step: Any, make_input: Any, device: torch.device, modules: Sequence[nn.Module], repeats: int,
          warmup: int, statistic: Callable[[list[float]], float] = statistics.median, least: float = 0.0) -> float:
    """``statistic`` (the median) of the seconds of ``step(make_input())`` over ``repeats`` runs after ``warmup``,
    and more until the runs took ``least`` seconds (at most :data:`MOST_REPEATS`; gradients reset between)."""
    samples: list[float] = []
    i = 0
    while i < warmup + repeats or (sum(samples) < least and len(samples) < MOST_REPEATS):
        i += 1
        for module in modules:
            module.zero_grad(set_to_none=True)
        x = make_input()
        _synchronize(device)
        start = time.perf_counter()
        step(x)
        _synchronize(device)
        if i > warmup:
            samples.append(time.perf_counter() - start)
    for module in modules:
        module.zero_grad(set_to_none=True)
    return statistic(samples)


def _timed_chain(model: Any, names: Sequence[str], modules: Sequence[nn.Module], rows: int, length: int,
                 device: torch.device, repeats: int, warmup: int, each: bool,
                 statistic: Callable[[list[float]], float] = statistics.median, least: float = 0.0) -> list[float]:
    """Forward + backward seconds of ``modules`` (blocks ``names``) chained: one time per block (``each``) or
    one for the whole chain. The model's last block is timed with its loss."""
    last = model.block_names[-1]
    groups = [[i] for i in range(len(names))] if each else [list(range(len(names)))]
    times = []
    with untouched(modules, device), torch.enable_grad():
        source = model.example_input(names[0], rows, length, device)
        for group in groups:
            with torch.no_grad():  # the group's input and the gradient its output receives
                x = source
                for i in range(group[0]):
                    x = _first_tensor(modules[i](x))
                probe = x
                for i in group:
                    probe = _first_tensor(modules[i](probe))
            base = x.detach()
            with_loss = names[group[-1]] == last
            targets = model.example_targets(rows, length, device) if with_loss else None
            output_grad = None if with_loss else torch.randn(probe.shape, dtype=probe.dtype, device=device)

            def make_input(base: torch.Tensor = base) -> torch.Tensor:
                y = base.clone()
                return y.requires_grad_(True) if y.is_floating_point() else y

            def step(y: torch.Tensor, group: list[int] = group, targets: Any = targets,
                     grad: Any = output_grad) -> None:
                for i in group:
                    y = _first_tensor(modules[i](y))
                if targets is not None:
                    model.microbatch_loss(y, targets, block=modules[group[-1]]).backward()
                else:
                    y.backward(grad)

            times.append(_time(step, make_input, device, [modules[i] for i in group], repeats, warmup, statistic,
                               least))
    return times


def block_seconds(model: Any, names: Sequence[str], rows: int, length: int, device: torch.device,
                  repeats: int = 5, warmup: int = 2,
                  statistic: Callable[[list[float]], float] = statistics.median,
                  least: float = 0.0) -> dict[str, float]:
    """Forward + backward seconds of each block ``names`` for a microbatch of ``rows x length``, on ``device``.

    Each block is a fresh copy the model builds on ``device`` (``build_block``), so nothing of the model itself
    is touched or needs to be on ``device``, and only the timed blocks are materialized. The model's last block
    is timed with its loss. ``statistic`` (the median; ``min``: the fastest, what a run on a busy machine can still
    reach) of ``repeats`` runs after ``warmup``, and of more until a block's runs took ``least`` seconds (at most
    :data:`MOST_REPEATS`).
    """
    modules = [model.build_block(name, device) for name in names]
    try:
        return dict(zip(names, _timed_chain(model, names, modules, rows, length, device, repeats, warmup, each=True,
                                            statistic=statistic, least=least)))
    finally:
        del modules


def stage_seconds(model: Any, stage_modules: Mapping[int, Any], rows: int, length: int, device: torch.device,
                  repeats: int = 3, warmup: int = 1) -> dict[int, float]:
    """Forward + backward seconds of each of this process's stages (its real modules, on ``device``)."""
    times = {}
    for index, stage in stage_modules.items():
        names, modules = list(stage.block_names), list(stage.blocks)
        times[index] = _timed_chain(model, names, modules, rows, length, device, repeats, warmup, each=False)[0]
    return times


def median_interval(timestamps: Sequence[float]) -> float | None:
    """Median gap between consecutive timestamps (``None`` with fewer than two)."""
    gaps = [b - a for a, b in zip(timestamps, timestamps[1:])]
    return statistics.median(gaps) if gaps else None
