"""A run's memory plan, checked before any process starts: the strategy's side of
:mod:`~lightning_mp_lstm.planning.memory`.

It gathers what the plan needs from the module (its blocks' shapes, the optimizer its ``configure_optimizers``
builds) and from the data (the largest training and evaluation batches), measures the floor in this process, and
refuses a layout that cannot fit with the table and the layouts that would (:func:`check_memory`); the one-file
checkpoint format is chosen only where global rank 0 can gather the whole model (:func:`one_file_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.planning.activations import GIB, HOST, activation_bytes_per_token
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.memory import (
    BatchShape,
    MemoryPlan,
    MemoryPlanError,
    ModelMemory,
    fitting_layouts,
    in_flight_microbatches,
    memory_partition,
    plan_memory,
    process_floor,
)
from lightning_mp_lstm.planning.plan import PlanOptions

__all__ = ["candidate_layouts", "check_memory", "largest_batch", "model_memory", "optimizer_state_factor"]

#: Optimizer state bytes per parameter byte when the module's own optimizer cannot be built ahead (Adam's).
DEFAULT_OPTIMIZER_FACTOR = 2.0
#: The layouts a refusal suggests, by their ``conf/layout`` names: ``(pipeline, tensor)`` parallel sizes.
_NAMED = {(1, 1): "layout=single", (2, 1): "layout=pp2", (4, 1): "layout=pp4", (1, 2): "layout=tp2",
          (2, 2): "layout=pp2_tp2"}


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (one, a list, a dict, a tuple with schedulers)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured for o in _optimizers(item)]
    return []


def optimizer_state_factor(module: nn.Module) -> tuple[float, str]:
    """Bytes of optimizer state per parameter byte of the module's own optimizer, and what it is: the module's
    ``configure_optimizers`` builds it (on the module as it is, meta parameters included) and a copy of each optimizer
    takes one step on a small parameter. An optimizer that cannot be built ahead counts as Adam (two states).
    """
    configure = getattr(module, "configure_optimizers", None)
    try:
        built = _optimizers(configure()) if callable(configure) else []
    except Exception:  # noqa: BLE001  (a configure_optimizers that needs the Trainer: Adam's state assumed)
        built = []
    if not built:
        return DEFAULT_OPTIMIZER_FACTOR, "assumed Adam"
    factors = []
    for optimizer in built:
        options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        probe = torch.zeros(64, device=HOST, requires_grad=True)
        try:
            copy_ = type(optimizer)([probe], **options)
            probe.grad = torch.ones(64, device=HOST)
            copy_.step()
        except Exception:  # noqa: BLE001  (an optimizer whose step needs a closure or more: Adam's state assumed)
            factors.append(DEFAULT_OPTIMIZER_FACTOR)
            continue
        state = sum(v.numel() * v.element_size() for entries in copy_.state.values() for v in entries.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1)
        factors.append(state / (probe.numel() * probe.element_size()))
    return max(factors), ", ".join(sorted({type(o).__name__ for o in built}))


def model_memory(blocks: PipelineModel, module: nn.Module) -> ModelMemory:
    """What ``blocks`` need, from their shapes (nothing is allocated)."""
    counts = blocks.analytic_costs("parameters", 1, 1)
    element = next((p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
    factor, _ = optimizer_state_factor(module)
    return ModelMemory(parameters={name: int(count * element) for name, count in counts.items()},
                       activations=activation_bytes_per_token(blocks),
                       vocabulary=int(getattr(blocks, "logits_width", 0)),
                       slice_tokens=getattr(blocks, "loss_slice_tokens", None),
                       optimizer_factor=factor,
                       tied_copy=int(getattr(blocks, "tied_numel", 0) * element),
                       outputs=_output_bytes(blocks, element))


def _output_bytes(blocks: PipelineModel, element: int) -> dict[str, float]:
    """Bytes of each block's output per token, from its widths: the embedding's vectors, an LSTM layer's hidden
    states, the decoder's logits (its input where the loss decodes slices); 0 where the model does not say."""
    names = list(blocks.block_names)
    sizes = list(getattr(blocks, "sizes", None) or [])
    widths = []
    for index in range(len(names)):
        if index == 0:
            widths.append(getattr(blocks, "embedding_dim", 0))
        elif index == len(names) - 1:
            widths.append(getattr(blocks, "decoder_in", 0) if getattr(blocks, "decodes_in_loss", False)
                          else getattr(blocks, "logits_width", 0))
        else:
            widths.append(sizes[index - 1][1] if len(sizes) == len(names) - 2 else 0)
    return {name: float(width * element) for name, width in zip(names, widths, strict=True)}


def largest_batch(datamodule: Any, layout: ParallelLayout) -> BatchShape | None:
    """The training batch of the longest bucket, one replica's rows (``None``: the data does not say its shape): as
    many sentences as the batch size (or token budget) allows and the longest bucket holds (``LMDataModule``'s
    bucketed training split tells; a corpus with one long line has a batch of one there); with it, the evaluation
    batch of the most tokens (``eval_batch_size`` rows, or as many as a validation or test bucket holds)."""
    lengths = getattr(datamodule, "bucket_lengths", None)
    rows, tokens = getattr(datamodule, "batch_size", None), getattr(datamodule, "max_tokens", None)
    if not lengths or not (rows or tokens):
        return None
    longest = max(lengths)
    train_held, eval_held = _held(datamodule, ("train",)), _held(datamodule, ("valid", "test"))
    train_rows = min(rows or tokens, max(1, tokens // longest)) if tokens else rows
    train_rows = min(train_rows, train_held[longest]) if train_held.get(longest) else train_rows
    eval_rows = getattr(datamodule, "eval_batch_size", None) or rows
    shapes = []
    for length in lengths:
        count = min(eval_rows or tokens, max(1, tokens // length)) if tokens else eval_rows
        count = min(count, eval_held.get(length, 0)) if eval_held else count
        if count:
            shapes.append((count * length, length, count))
    replicas = layout.data_parallel_size
    evaluation = max(shapes, default=None)
    return BatchShape(math.ceil(train_rows / replicas), longest,
                      BatchShape(math.ceil(evaluation[2] / replicas), evaluation[1]) if evaluation else None)


def _held(datamodule: Any, splits: tuple[str, ...]) -> dict[int, int]:
    """Sentences each bucket length holds in the fullest of ``splits`` (empty: the data module does not say, or
    its batches are windows of a stream)."""
    dataset = getattr(datamodule, "dataset", None)
    if not callable(dataset) or getattr(datamodule, "mode", "sentences") != "sentences":
        return {}
    held: dict[int, int] = {}
    for split in splits:
        try:
            data = dataset(split)
        except (OSError, ValueError):  # a split the corpus cannot give: its own loader says why, when it is asked
            continue
        lengths, counts = np.unique(np.asarray(data.buckets)[data.bucket_indices], return_counts=True)
        for length, count in zip(lengths.tolist(), counts.tolist(), strict=True):
            held[int(length)] = max(held.get(int(length), 0), int(count))
    return held


def candidate_layouts(layout: ParallelLayout, tensor_parallel: bool) -> dict[str, ParallelLayout]:
    """One pipeline of 1, 2, 4 or 8 processes, with the vocabulary layers split over 2 where the model allows it, on
    the run's schedule: the layouts a refusal weighs."""
    found = {}
    for tp in (1, 2) if tensor_parallel else (1,):
        for pp in (1, 2, 4, 8):
            name = _NAMED.get((pp, tp), f"pipeline_parallel_size={pp} tensor_parallel_size={tp}")
            try:
                found[name] = ParallelLayout.resolve(pp * tp, 1, pp, layout.stages_per_rank if pp > 1 else None,
                                                     layout.schedule, None, tp)
            except LayoutError:
                continue
    return found


def _describe(plan: MemoryPlan) -> str:
    fullest = max(plan.ranks, key=lambda rank: rank.total)
    return f"{fullest.total / GIB:,.2f} GiB on pipeline rank {fullest.pipeline_rank}"


def check_memory(blocks: PipelineModel, module: nn.Module, layout: ParallelLayout, options: PlanOptions,
                 datamodule: Any, budget: int | None, source: str,
                 budget_for: Callable[[ParallelLayout], tuple[int | None, str]],
                 partition: list[list[str]] | None = None, one_file_checkpoint: bool = False,
                 shard: int = 1, purpose: str = "fit") -> MemoryPlan | None:
    """The run's memory plan, refused when a process cannot hold its share.

    Args:
        blocks, module: the model's pipeline view and the module.
        layout, options: the resolved layout and the partition options.
        datamodule: gives the largest training batch (nothing is checked when it does not); or the batches
            themselves (a ``BatchShape``: those a run whose data does not say them has seen).
        budget, source: bytes a process may use, and where that comes from (``None``: not checked).
        budget_for: the budget of another layout (for the layouts a refusal suggests).
        partition: the plan's partition; ``None``: the options' own when it needs no costs, else the partition
            that holds the least memory (measured balancing decides later: the check is then a lower bound).
        one_file_checkpoint: global rank 0 gathers the whole model and its optimizer state to save.
        shard: replicas each stage's parameters are sharded over (``shard_replicas``; 1: none).
        purpose: ``"fit"``, ``"evaluate"`` or ``"predict"`` (:func:`~lightning_mp_lstm.planning.memory.plan_memory`).

    Raises:
        MemoryPlanError: naming the layout, the fullest process, the budget, the table and the layouts that fit.
    """
    batch = datamodule if isinstance(datamodule, BatchShape) else largest_batch(datamodule, layout)
    if batch is None:
        return None
    model = model_memory(blocks, module)
    names = list(blocks.block_names)
    partition = partition or options.fixed_partition(names, layout.num_stages) or memory_partition(model, layout,
                                                                                                  batch)
    floor = process_floor()
    plan = plan_memory(model, layout, partition, batch, floor, budget, source, one_file_checkpoint, shard, purpose)
    if plan.fits:
        return plan
    if one_file_checkpoint and plan_memory(model, layout, partition, batch, floor, budget, source, shard=shard).fits:
        raise MemoryPlanError(
            f"saving a one-file checkpoint gathers the whole model and its optimizer state on global rank 0: "
            f"{_describe(plan)}, more than the {budget / GIB:,.2f} GiB a process may use ({source}). Save sharded "
            f"checkpoints (strategy.checkpoint_format=sharded, or auto)\n{plan.table()}")
    fitting = fitting_layouts(model, candidate_layouts(layout, hasattr(blocks, "parallelize_vocabulary")), batch,
                              floor, budget_for, purpose)
    alternatives = "; ".join(f"{name} ({p.peak / GIB:,.2f} of {p.budget / GIB:,.2f} GiB)" for name, p in fitting[:4]
                             if p.budget is not None)
    fullest = max(plan.ranks, key=lambda rank: rank.total)
    biggest = max(("parameters, gradients and optimizer state", fullest.parameters + fullest.gradients +
                   fullest.optimizer), ("activations", fullest.activations), ("the loss's logits", fullest.loss),
                  ("an evaluation batch", fullest.evaluation if fullest.evaluating > fullest.training else 0),
                  key=lambda item: item[1])[0]
    advice = {
        "activations": _activations_advice(plan, fullest, batch, datamodule),
        "the loss's logits": "an adaptive softmax (model.softmax=adaptive) or a smaller data.batch_size",
        "parameters, gradients and optimizer state": "more pipeline stages, or an optimizer with less state",
        "an evaluation batch": _evaluation_advice(batch),
    }[biggest]
    raise MemoryPlanError(
        f"{layout.world_size} process(es) of {layout} cannot hold this model and batch: the fullest needs about "
        f"{_describe(plan)} (mostly {biggest}), more than the {budget / GIB:,.2f} GiB a process may use ({source}).\n"
        f"{plan.table()}\n"
        + (f"Layouts that fit: {alternatives}." if alternatives else "No layout of up to 8 processes fits.")
        + f" Or: {advice}.")


def _evaluation_advice(batch: BatchShape) -> str:
    """What to change when an evaluation batch does not fit."""
    shape = batch.evaluation
    assert shape is not None  # noqa: S101  (only an evaluation batch's plan names it)
    return (f"the largest evaluation batch ({shape.rows:,} sentences of {shape.length:,} tokens per replica) is "
            "what does not fit: a smaller data.eval_batch_size (LMDataModule(eval_batch_size=...)), or a loss that "
            "decodes slices of tokens (declare no loss hook)")


def _activations_advice(plan: MemoryPlan, fullest: Any, batch: BatchShape, datamodule: Any) -> str:
    """What to change when a batch's activations do not fit: the batch, its longest line, what is in flight."""
    layout = plan.layout
    rows = math.ceil(batch.rows / layout.n_microbatches)
    in_flight = sum(in_flight_microbatches(layout, s) for s in layout.stage_indices(fullest.pipeline_rank)) * rows
    where = ""
    describe = getattr(datamodule, "longest_sentence", None)
    if callable(describe):
        length, place = describe()
        if length >= batch.length:
            where = f", as long as the longest training line ({place}, {length:,} tokens)"
    sentences = f"{batch.rows} sentence{'s' if batch.rows != 1 else ''}"
    flight = (f"{sentences} in flight" if in_flight <= batch.rows else
              f"{sentences}; {in_flight} rows in flight with the empty rows that fill its {layout.n_microbatches} "
              "microbatches")
    return (f"a training batch of the longest bucket ({batch.length:,} tokens{where}) keeps about "
            f"{fullest.activations / GIB:,.1f} GiB of activations on pipeline rank {fullest.pipeline_rank} "
            f"({flight}). Cap the bucket length (train.py: buckets.max_length=<tokens>; "
            "LMDataModule(max_bucket_length=...)): longer lines are then split into pieces; or lower data.batch_size "
            "/ data.max_tokens")
