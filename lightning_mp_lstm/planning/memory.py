"""The memory plan: what each process of a layout will hold at its peak, predicted from shapes before anything is
allocated, and checked against the memory a process may use before any process starts.

A process holds what it runs on (the interpreter, torch, Lightning and the data, measured in the planning process
itself: the *floor*), its blocks' parameters and gradients, the optimizer's state of them (as many bytes per
parameter byte as the module's own optimizer keeps: Adam two, SGD with momentum one), the activations its stages keep
for the backward pass while the schedule has microbatches in flight (counted per token on copies of the blocks made of
fake tensors: :mod:`~lightning_mp_lstm.planning.activations`), and, on the process with the decoder, the working set of
the loss: three copies of a slice of logits (:mod:`~lightning_mp_lstm.models.decoded_loss`), or of a microbatch's
whole logits when the module computes its own loss from them; and its largest block's gradient once more, computed
whole before it is added to the gradient its parameters hold. One-file checkpoints gather the whole model and its
optimizer state on global rank 0 while saving (what it receives from the other processes). Evaluation batches, often
larger than training ones (``eval_batch_size``), are planned too (:func:`evaluation_bytes`): a process holds either a
training step's working set or an evaluation batch's, beside its parameters, gradients and optimizer state.

:func:`plan_memory` makes a :class:`MemoryPlan` for a partition; :func:`fitting_layouts` names the layouts whose best
partition for memory fits, for a message that says what to do instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.partition import compact_blocks, partition_blocks

__all__ = ["BatchShape", "MemoryPlanError", "MemoryPlan", "ModelMemory", "RankMemory", "evaluation_bytes",
           "fitting_layouts", "in_flight_microbatches", "memory_partition", "plan_memory", "process_floor"]

MIB, GIB = 2**20, 2**30
#: The purposes (:func:`plan_memory`) whose evaluation batches are predictions: every microbatch's logits merged.
_PREDICTING = ("predict", "predict_after_fit")


class MemoryPlanError(ValueError):
    """A layout some process of which cannot hold its share: raised before launch, with the memory table."""


def process_floor() -> int:
    """Bytes this process holds now (its resident set): the interpreter, the libraries and the data, what every process
    of the run holds before its blocks (on the host; a GPU's own memory starts empty)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class BatchShape:
    """The training batch that needs the most memory: ``rows`` sequences per replica of ``length`` tokens; and the
    evaluation batch that needs the most (``None``: not planned)."""

    rows: int
    length: int
    evaluation: BatchShape | None = None


@dataclass(frozen=True)
class ModelMemory:
    """What the model's blocks need, from their shapes.

    Attributes:
        parameters: bytes of every block's parameters, in model order (a tied matrix on the embedding's).
        activations: bytes every block keeps for the backward pass per training token.
        vocabulary: words the decoder scores (its logits' width).
        slice_tokens: tokens per slice of logits in the loss; ``None``: the module's own loss takes a microbatch's
            logits whole.
        optimizer_factor: optimizer state bytes per parameter byte.
        tied_copy: bytes of the embedding's matrix that the decoder shares (0: untied): a process with the decoder
            and not the embedding holds a copy.
        outputs: bytes of every block's output per token (the decoder's: its logits, or its input where the loss
            decodes slices), which a stage keeps of every microbatch while evaluating.
    """

    parameters: Mapping[str, int]
    activations: Mapping[str, float]
    vocabulary: int
    slice_tokens: int | None
    optimizer_factor: float
    tied_copy: int = 0
    outputs: Mapping[str, float] = field(default_factory=dict)

    @property
    def block_names(self) -> list[str]:
        return list(self.parameters)


@dataclass(frozen=True)
class RankMemory:
    """One process's predicted peak, by what holds it (bytes)."""

    pipeline_rank: int
    blocks: tuple[str, ...]
    floor: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    loss: int
    temporary: int = 0
    saving: int = 0
    evaluation: int = 0

    @property
    def training(self) -> int:
        """The peak while training, without a one-file save."""
        return (self.floor + self.parameters + self.gradients + self.optimizer + self.activations + self.loss
                + self.temporary)

    @property
    def evaluating(self) -> int:
        """The peak while evaluating (mid-training, the gradients and optimizer state still held)."""
        return self.floor + self.parameters + self.gradients + self.optimizer + self.evaluation

    @property
    def total(self) -> int:
        """The peak, a one-file save on global rank 0 included."""
        return max(self.training, self.evaluating) + self.saving


@dataclass(frozen=True)
class MemoryPlan:
    """Every pipeline rank's predicted peak (the replicas of a rank hold the same), and the budget per process."""

    layout: ParallelLayout
    ranks: tuple[RankMemory, ...]
    budget: int | None
    source: str

    @property
    def peak(self) -> int:
        """The largest process's peak."""
        return max(rank.total for rank in self.ranks)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    def table(self) -> str:
        """The plan as a fixed-width table, MiB."""
        header = ["rank", "blocks", "floor", "params", "grads", "optim", "activ", "loss", "temp", "eval", "save",
                  "peak"]
        rows = [[str(r.pipeline_rank), compact_blocks(r.blocks), *(f"{v / MIB:,.0f}" for v in (
            r.floor, r.parameters, r.gradients, r.optimizer, r.activations, r.loss, r.temporary, r.evaluation,
            r.saving, r.total))] for r in self.ranks]
        widths = [max(len(header[c]), *(len(row[c]) for row in rows)) for c in range(len(header))]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(widths[i]) if i == 1 else c.rjust(widths[i]) for i, c in enumerate(cells))

        budget = (f"{self.budget / MIB:,.0f} MiB per process ({self.source})" if self.budget is not None
                  else "not known")
        return "\n".join([f"memory per process (MiB, predicted peak; budget {budget}; eval: an evaluation batch's "
                          "forward, instead of activ + loss + temp):", line(header),
                          "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def in_flight_microbatches(layout: ParallelLayout, stage: int) -> int:
    """Microbatches whose activations ``stage`` keeps at once: every one under GPipe-like schedules and the
    wavefront (all its time chunks), at most the stages from it to the last under 1F1B and the interleaved schedules
    (torch's warm-up)."""
    m = layout.n_microbatches
    if layout.schedule in ("GPipe", "LoopedBFS") or layout.style == "wavefront":
        return m
    return max(1, min(m, layout.num_stages - stage))


def plan_memory(model: ModelMemory, layout: ParallelLayout, partition: Sequence[Sequence[str]], batch: BatchShape,
                floor: int, budget: int | None = None, source: str = "", one_file_checkpoint: bool = False,
                shard: int = 1, purpose: str = "fit") -> MemoryPlan:
    """The predicted peak of every pipeline rank for ``partition``.

    Args:
        model: the blocks' memory (:class:`ModelMemory`).
        layout: the layout (its stages, schedule, microbatches and tensor-parallel split).
        partition: block names per stage.
        batch: the training batch that needs the most memory (rows per replica), and the evaluation batch.
        floor: bytes every process holds before its blocks (:func:`process_floor`).
        budget, source: bytes a process may use and where that comes from (``None``: unknown).
        one_file_checkpoint: checkpoints are one file gathered on global rank 0 (its peak while saving).
        shard: replicas each stage's parameters, gradients and optimizer state are sharded over (FSDP2,
            ``shard_replicas``): ``1/shard`` of each is held, plus what a step gathers whole (:func:`_gathered`).
        purpose: ``"fit"``: the run trains (and evaluates); ``"evaluate"`` or ``"predict"``: it only evaluates or
            predicts (``validate``, ``test`` or ``predict`` on a new Trainer), and its processes hold the parameters
            and the evaluation batch's working set, nothing else; ``"predict_after_fit"``: a Trainer that has fitted
            predicts, its processes still holding the fit's gradients and optimizer state.
    """
    tp = layout.tensor_parallel_size
    embedding, decoder = model.block_names[0], model.block_names[-1]
    split = {embedding, decoder} if tp > 1 else set()
    microbatch_rows = math.ceil(batch.rows / layout.n_microbatches)
    whole = sum(model.parameters.values())
    ranks = []
    for pipeline_rank in range(layout.pipeline_parallel_size):
        stages = layout.stage_indices(pipeline_rank)
        blocks = [name for s in sorted(stages) for name in partition[s]]
        parameters = sum(model.parameters[b] / (tp if b in split else 1) for b in blocks)
        if decoder in blocks and embedding not in blocks:
            parameters += model.tied_copy
        activations = 0.0
        for s in stages:
            tokens = in_flight_microbatches(layout, s) * microbatch_rows * batch.length
            activations += tokens * sum(model.activations[b] for b in partition[s])
        loss = 0
        if decoder in blocks:
            tokens = microbatch_rows * batch.length
            width = model.vocabulary / tp
            loss = int(3 * min(tokens, model.slice_tokens or tokens) * width * 4)
        # A block's gradient is computed whole before it is added to the one its parameters hold.
        temporary = max(model.parameters[b] / (tp if b in split else 1) for b in blocks)
        held, gathered, gradients = parameters / shard, 0.0, parameters / shard
        if shard > 1:
            gathered = _gathered(model, blocks, layout.n_microbatches)
            gradients += gathered if layout.n_microbatches > 1 else 0
        evaluation = (evaluation_bytes(model, layout, [partition[s] for s in sorted(stages)], batch.evaluation,
                                       predicting=purpose in _PREDICTING) if batch.evaluation is not None else 0)
        if purpose != "fit":  # no training step: the fit's gradients and optimizer state at most
            trained = purpose == "predict_after_fit"
            ranks.append(RankMemory(pipeline_rank, tuple(blocks), floor, int(held + gathered),
                                    int(gradients) if trained else 0,
                                    int(held * model.optimizer_factor) if trained else 0, 0, 0,
                                    evaluation=evaluation))
            continue
        ranks.append(RankMemory(pipeline_rank, tuple(blocks), floor, int(held + gathered), int(gradients),
                                int(held * model.optimizer_factor), int(activations), loss, int(temporary),
                                evaluation=evaluation))
    if one_file_checkpoint and purpose == "fit":  # rank 0 receives every other process's tensors, not its own
        ranks[0] = replace(ranks[0], saving=int((whole - ranks[0].parameters) * (1 + model.optimizer_factor)))
    return MemoryPlan(layout, tuple(ranks), budget, source)


def evaluation_bytes(model: ModelMemory, layout: ParallelLayout, stages: Sequence[Sequence[str]],
                     batch: BatchShape, predicting: bool = False) -> int:
    """Bytes a process holds for an evaluation ``batch`` (rows per replica) beside its parameters, gradients and
    optimizer state, over its ``stages`` (block names each): every microbatch's outputs of each stage until the step
    ends (torch's stages keep them for a backward that evaluation never runs) and the buffers a later stage receives
    them in; one microbatch's forward at a time, three outputs of an LSTM layer (its output, and its input and output
    reordered for the kernel: without a backward torch's CPU kernel keeps no workspace, measured with torch's
    profiler); and, with the decoder, the loss's working set: its log-probabilities of a slice of tokens, or of a
    microbatch's whole logits when the module's own loss takes them (the logits are the decoder's output, counted
    with the outputs). ``predicting``: the predictions' log-probabilities of the whole batch's logits, merged from
    the microbatches (a slice at a time where the loss decodes slices)."""
    tp = layout.tensor_parallel_size
    names = model.block_names
    embedding, decoder = names[0], names[-1]
    microbatches = layout.n_microbatches
    tokens = math.ceil(batch.rows / microbatches) * batch.length
    held = 0.0
    for blocks in stages:
        first, last = names.index(blocks[0]), blocks[-1]
        held += microbatches * tokens * model.outputs.get(last, 0.0) / (tp if tp > 1 and last == decoder else 1)
        if first > 0:
            held += microbatches * tokens * model.outputs.get(names[first - 1], 0.0)
        held += tokens * max((3 * model.outputs.get(b, 0.0) for b in blocks if b not in (embedding, decoder)),
                             default=0.0)
        if decoder in blocks:
            width = model.vocabulary / tp
            whole = microbatches if predicting and not model.slice_tokens else 1
            held += (2 if model.slice_tokens else whole) * min(tokens, model.slice_tokens or tokens) * width * 4
    return int(held)


def _gathered(model: ModelMemory, blocks: Sequence[str], microbatches: int) -> float:
    """Bytes of sharded parameters a step holds whole: with one microbatch, the largest block being run and the
    decoder (the loss runs it after the forward); with several, every block from the first backward to the last
    (torch's stages reduce the gradients, also held whole, once the last microbatch's backward runs)."""
    if microbatches > 1:
        return float(sum(model.parameters[b] for b in blocks))
    decoder = model.block_names[-1]
    kept = model.parameters[decoder] if decoder in blocks else 0
    return float(kept + max((model.parameters[b] for b in blocks if b != decoder), default=0))


def memory_partition(model: ModelMemory, layout: ParallelLayout, batch: BatchShape) -> list[list[str]]:
    """The contiguous partition of the layout's stages that holds the least on its fullest process (parameters with
    their gradients and optimizer state, and activations in flight at the first stage's count)."""
    names = model.block_names
    in_flight = in_flight_microbatches(layout, 0) * math.ceil(batch.rows / layout.n_microbatches) * batch.length
    costs = {b: model.parameters[b] * (2 + model.optimizer_factor) + model.activations[b] * in_flight for b in names}
    return partition_blocks(names, costs, layout.num_stages)


def fitting_layouts(model: ModelMemory, candidates: Mapping[str, ParallelLayout], batch: BatchShape, floor: int,
                    budget_for: Callable[[ParallelLayout], tuple[int | None, str]],
                    purpose: str = "fit") -> list[tuple[str, MemoryPlan]]:
    """The candidate layouts (by name) whose best partition for memory fits ``budget_for(layout)`` (bytes and its
    source), smallest peak first (``purpose``: as :func:`plan_memory`)."""
    fitting = []
    for name, layout in candidates.items():
        if layout.num_stages > len(model.block_names):
            continue
        budget, source = budget_for(layout)
        plan = plan_memory(model, layout, memory_partition(model, layout, batch), batch, floor, budget, source,
                           purpose=purpose)
        if plan.fits:
            fitting.append((name, plan))
    return sorted(fitting, key=lambda item: (item[1].layout.world_size, item[1].peak))
