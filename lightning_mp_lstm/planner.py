"""Choosing a partition and a microbatch count from costs of the real model on the real device.

The pure arithmetic (cost models, exact balancing, step-time model, report) lives in
:mod:`lightning_mp_lstm.partition`; this module feeds it numbers measured on live modules.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_mp_lstm.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.partition import (
    COST_KINDS,
    ModelShape,
    PartitionError,
    flop_costs,
    memory_costs,
    microbatch_step_time,
    profile_block_times,
)

__all__ = [
    "block_costs",
    "choose_n_microbatches",
    "microbatch_candidates",
    "example_input",
    "median_interval",
    "model_shape",
    "optimizer_kind",
    "stage_seconds",
]


@contextmanager
def _untouched(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Profile without side effects: gradients and the random number generators are restored after."""
    params = [p for module in modules for p in module.parameters()]
    grads = [p.grad for p in params]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of an :class:`~lightning_mp_lstm.model.LSTMLanguageModel`."""
    hp = model.hparams
    return ModelShape(hp.vocab_size, hp.embedding_dim, hp.hidden_size, hp.num_layers, bool(hp.tie_weights))


def optimizer_kind(model: Any) -> str:
    """The optimizer name :func:`~lightning_mp_lstm.partition.memory_costs` expects for ``model``."""
    name = str(model.hparams.optimizer).lower()
    if name == "sgd":
        return "sgd_momentum" if model.hparams.momentum else "sgd"
    return "adam"


def example_input(block: nn.Module, rows: int, length: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A random input of the shape ``block`` takes: token ids for the embedding, activations otherwise."""
    if isinstance(block, nn.Embedding):
        return torch.randint(1, vocab_size, (rows, length), device=device)
    width = block.input_size if isinstance(block, nn.LSTM) else block.in_features
    return torch.randn(rows, length, width, device=device)


def block_costs(model: Any, kind: str, rows: int, length: int, device: torch.device) -> dict[str, float]:
    """Per-block cost of ``model`` (all blocks present) for microbatches of ``rows`` x ``length`` tokens.

    Args:
        model: an unpruned :class:`~lightning_mp_lstm.model.LSTMLanguageModel`.
        kind: ``"time"`` (forward + backward seconds measured on ``device``), ``"flops"`` (analytic) or
            ``"memory"`` (parameter, gradient and optimizer-state bytes).
        rows: sentences per microbatch.
        length: tokens per sentence (e.g. the mean bucket length).
        device: where to measure.
    """
    shape = model_shape(model)
    if kind == "time":
        blocks = dict(model.blocks())
        with _untouched(list(blocks.values()), device):
            tokens = example_input(blocks["embedding"], rows, length, shape.vocab_size, device)
            return profile_block_times(blocks, tokens)
    if kind == "flops":
        return flop_costs(shape, batch_size=rows, bucket_lengths=[length])
    if kind == "memory":
        return memory_costs(shape, optimizer=optimizer_kind(model))
    raise PartitionError(f"unknown balance_by {kind!r}; allowed: {', '.join(COST_KINDS)}")


def stage_seconds(
    stage_modules: Mapping[int, Any], rows: int, length: int, vocab_size: int, device: torch.device
) -> dict[int, float]:
    """Forward + backward seconds of each stage module, measured in isolation on ``device``."""
    times = {}
    for index, stage in stage_modules.items():
        blocks = dict(zip(stage.block_names, stage.blocks))
        first = next(iter(blocks.values()))
        with _untouched(list(blocks.values()), device):
            measured = profile_block_times(blocks, example_input(first, rows, length, vocab_size, device))
        times[index] = sum(measured.values())
    return times


def microbatch_candidates(layout: ParallelLayout, batch_rows: int, max_microbatches: int = 32) -> list[int]:
    """The microbatch counts ``n_microbatches: auto`` may choose: divisors of the per-replica batch, at most
    ``max_microbatches``, that the layout's schedule accepts.

    Raises:
        LayoutError: there is none (the message names the batch, the schedule and the stage count).
    """
    candidates = []
    for m in range(1, min(batch_rows, max_microbatches) + 1):
        if batch_rows % m:
            continue
        try:
            replace(layout, n_microbatches=m)
        except LayoutError:
            continue
        candidates.append(m)
    if not candidates:
        raise LayoutError(
            f"n_microbatches='auto' found no count: none of 1..{min(batch_rows, max_microbatches)} divides the "
            f"per-replica batch of {batch_rows} sentences and suits schedule {layout.schedule} with "
            f"{layout.num_stages} stages; use a larger batch_size or a fixed n_microbatches"
        )
    return candidates


def choose_n_microbatches(
    model: Any,
    partition: Sequence[Sequence[str]],
    layout: ParallelLayout,
    batch_rows: int,
    length: int,
    device: torch.device,
    max_microbatches: int = 32,
) -> tuple[int, dict[int, float]]:
    """Pick the number of microbatches that minimizes the predicted step time.

    For each ``m`` that divides the per-replica batch and that the schedule accepts, every process's
    forward + backward time for one microbatch of ``B/m`` sentences is measured and turned into a step
    time by :func:`~lightning_mp_lstm.partition.microbatch_step_time`. It leaves out communication and
    the optimizer step (on the seed's model on 2 CPU ranks: 1.26 s predicted, 1.46 s measured), so it
    ranks candidates rather than timing them. Interleaving is not modelled.

    Returns:
        The chosen ``m`` and the predicted seconds per step for every candidate.
    """
    blocks = dict(model.blocks())
    owner = {name: s for s, stage in enumerate(partition) for name in stage}
    rank_of = {s: r for r in range(layout.pipeline_parallel_size) for s in layout.stage_indices(r)}
    pp = layout.pipeline_parallel_size
    predictions: dict[int, float] = {}
    for m in microbatch_candidates(layout, batch_rows, max_microbatches):
        with _untouched(list(blocks.values()), device):
            tokens = example_input(blocks["embedding"], batch_rows // m, length, model.hparams.vocab_size, device)
            per_block = profile_block_times(blocks, tokens, repeats=3, warmup=1)
        per_rank = [0.0] * pp
        for name, seconds in per_block.items():
            per_rank[rank_of[owner[name]]] += seconds
        predictions[m] = microbatch_step_time(per_rank, m)
    best = min(predictions, key=lambda m: (predictions[m], m))
    return best, predictions


def median_interval(timestamps: Sequence[float]) -> float | None:
    """Median gap between consecutive timestamps (``None`` with fewer than two)."""
    gaps = [b - a for a, b in zip(timestamps, timestamps[1:])]
    return statistics.median(gaps) if gaps else None
