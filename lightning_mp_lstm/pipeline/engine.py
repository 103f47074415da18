"""The pipeline engine: runs batches forward and backward through this process's stages (no Lightning here).

:func:`split_model` prunes a model to the blocks of one pipeline rank and materializes them; :func:`build_engine`
makes its stages and the :class:`PipelineEngine` that runs them. The engine keeps one ``PipelineStage`` + schedule
per batch shape (a stage sizes its receive buffers at its first step: MXNet's "one executor per bucket"; for
``schedule="Wavefront"`` a :class:`~lightning_mp_lstm.pipeline.wavefront.WavefrontSchedule`), at most
``max_cached_shapes``, normalizes the loss by the global batch's token count, sums gradients over replicas (during the
backward pass where it can: :mod:`~lightning_mp_lstm.pipeline.replica_sums`) and tied copies, and clips them by the
global norm. The training loop (the ``mp_lstm`` strategy, or any other) owns the engine and calls it; no model does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_mp_lstm.base import faults
from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.pipeline import predictions
from lightning_mp_lstm.pipeline.gradients import clip_grad_norm_
from lightning_mp_lstm.pipeline.groups import ProcessGroups
from lightning_mp_lstm.pipeline.groups import shared as _shared
from lightning_mp_lstm.pipeline.norm_exchange import NormExchange
from lightning_mp_lstm.pipeline.replica_sums import ReplicaSums, sum_the_rest
from lightning_mp_lstm.pipeline.sharding import largest_share, reshard
from lightning_mp_lstm.pipeline.stages import Stage, StageModule, StageRandomness, hold_receive_buffers, release_step
from lightning_mp_lstm.pipeline.tied import TiedWeights
from lightning_mp_lstm.pipeline.transport import posts_receives_ahead
from lightning_mp_lstm.pipeline.wavefront import WavefrontSchedule
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.timeline.recorder import RECORDER

__all__ = ["PipelineEngine", "StepResult", "build_engine", "split_model"]

#: The tags of the loss terms the last stage's rank sends and of the clip's norms (apart from the schedules' messages).
_TERMS_TAG, _NORM_TAG = 1 << 20, (1 << 20) + 1


@dataclass(frozen=True)
class StepResult:
    """What a batch gave, the same on every rank (detached).

    Attributes:
        loss: the batch loss as the model defines it (its terms included).
        tokens: the global batch's target tokens.
        weights: its global counts (``[tokens, sequences]`` for a language model), what the loss is averaged over.
        terms: the loss's named terms (each a part of ``loss``), if the model reports any.
    """

    loss: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor | None = None
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


def split_model(model: PipelineModel, partition: Sequence[Sequence[str]], stage_ids: Sequence[int],
                device: torch.device) -> None:
    """Prune ``model`` to the blocks of the stages ``stage_ids`` and give those still on the meta device their
    initial values on ``device`` (parameter names never change)."""
    own = [name for s in stage_ids for name in partition[s]]
    model.keep_blocks(own)
    model.materialize_blocks(own, device)


def build_engine(model: PipelineModel, layout: ParallelLayout, partition: Sequence[Sequence[str]],
                 pipeline_rank: int, data_parallel_rank: int, groups: ProcessGroups, device: torch.device,
                 seed: int | None = None, tied: TiedWeights | None = None) -> PipelineEngine:
    """Split ``model`` for ``pipeline_rank`` and return the engine that runs its stages.

    Args:
        model: the model's pipeline view (pruned in place).
        layout: the validated layout; ``partition``: block names of every stage.
        pipeline_rank, data_parallel_rank: this process's place in the mesh.
        groups: its process groups.
        device: its device.
        seed: seed of every stage's dropout stream (:class:`~lightning_mp_lstm.pipeline.stages.StageRandomness`);
            ``None``: the global stream.
        tied: the tied weights' owner groups (:meth:`TiedWeights.build`, after the split).
    """
    stage_ids = layout.stage_indices(pipeline_rank)
    split_model(model, partition, stage_ids, device)
    last = model.block_names[-1]
    context = getattr(model, "microbatch_context", None)
    stages = {
        s: StageModule(model.blocks(partition[s]),
                       StageRandomness(seed, data_parallel_rank, s, device) if seed is not None else None,
                       last_block=last, microbatch_context=context).to(device)
        for s in stage_ids
    }
    loss_blocks = set(getattr(model, "loss_blocks", [last]))
    term_stages = [s for s, names in enumerate(partition) if loss_blocks & set(names)]
    return PipelineEngine(model, stages, layout, groups, device, tied or TiedWeights(),
                          data_parallel_rank=data_parallel_rank, term_stages=term_stages)


class PipelineEngine:
    """Runs training, evaluation and prediction batches through this process's pipeline stages.

    Args:
        model: the model's pipeline view (its contract gives the loss, padding rows and predictions).
        stage_modules: global stage index -> :class:`~lightning_mp_lstm.pipeline.stages.StageModule` of this process.
        layout: the validated layout.
        groups: this process's pipeline, data-parallel and tensor-parallel groups.
        device: this process's device.
        tied: the tied weights this process holds a copy of.
        max_cached_shapes: the most stages + schedules kept (one per batch shape and mode); the least recently
            used is dropped. Only the schedule in use holds its receive buffers (:func:`hold_receive_buffers`).
        data_parallel_rank: this process's replica.
        term_stages: the stages that compute pieces of the loss (default: the last; a penalty adds its stage).

    Attributes:
        global_batches: every replica is given the whole global batch and takes its contiguous share of the rows
            (a user's data); ``False``: each replica is given its own share already (``LMDataModule``).
        sharded: the stages are sharded over the replicas (:mod:`~lightning_mp_lstm.pipeline.sharding`); torch's
            stage drops their gradients at a new shape: one that accumulates holds them aside (as the strategy does).
    """

    def __init__(self, model: PipelineModel, stage_modules: dict[int, StageModule], layout: ParallelLayout,
                 groups: ProcessGroups, device: torch.device, tied: TiedWeights, max_cached_shapes: int = 32,
                 data_parallel_rank: int = 0, term_stages: Sequence[int] | None = None) -> None:
        self.model = model
        self.data_parallel_rank = data_parallel_rank
        self.global_batches = True
        self.sharded = False
        self.stage_modules = stage_modules
        self.layout = layout
        self.groups = groups
        self.device = device
        self.tied = tied
        self.max_cached_shapes = max_cached_shapes
        self._schedules: OrderedDict[tuple[int, int, str], Any] = OrderedDict()
        self._holding: Any = None  # the schedule whose stages hold their receive buffers (the last run)
        #: The names of the loss terms the model reports, agreed by every rank at its first batch of each mode.
        self._term_names: dict[str, list[str]] = {}
        #: The global token count of the last batch run.
        self.last_tokens: torch.Tensor | None = None
        self.has_first_stage = 0 in stage_modules
        self.has_last_stage = layout.num_stages - 1 in stage_modules
        # Pipeline rank that holds the last stage: the last rank, except for V-shaped schedules.
        self._last_stage_rank = layout.rank_of_stage(layout.num_stages - 1)
        #: Whether that rank computes every piece of the loss (no penalty on an earlier rank's stage).
        self._terms_on_last_rank = all(layout.rank_of_stage(s) == self._last_stage_rank
                                       for s in (term_stages or [layout.num_stages - 1]))
        self._sends: list[Any] = []
        self._norms = NormExchange(groups.pipeline, device, _NORM_TAG)
        #: Replicated gradients summed during the backward pass; ``_summed``: the parameters it summed, ``_filled``:
        #: the ids of those that joined as zeros.
        self.replica_sums = ReplicaSums(groups.data_parallel) if _shared(groups.data_parallel) else None
        self._summed, self._filled = [], set()

    # ----- running batches ---------------------------------------------------------------------------------
    def forward_backward(self, batch: Any, accumulation: int = 1) -> StepResult:
        """Run a training batch forward and backward: this process's parameters get the batch's gradients added to
        their ``.grad``, summed over the replicas where the backward pass could post their sums
        (:mod:`~lightning_mp_lstm.pipeline.replica_sums`); :meth:`reduce_gradients` sums the rest.

        Args:
            batch: ``(inputs, targets, ...)`` in the model's batch layout (this replica's share).
            accumulation: batches accumulated per optimizer step; the gradients are divided by it.
        """
        for module in self.stage_modules.values():
            module.reset_finite_checks()
        self._summed, self._filled = [], set()
        sums = self.replica_sums
        if sums is None or self.sharded or accumulation > 1:  # accumulated gradients are summed at the last batch
            return self._run(batch, "train", accumulation)
        sums.attach(self.stage_modules)
        with sums.step():
            result = self._run(batch, "train", accumulation)
        self._summed, self._filled = sums.finish(), sums.filled
        return result

    def evaluate(self, batch: Any) -> StepResult:
        """The loss of an evaluation batch (forward only)."""
        with torch.no_grad():
            result = self._run(batch, "eval", 1)
        if self.sharded:  # the roots stay gathered after a forward
            reshard(self.stage_modules.values())
        return result

    def predict(self, batch: Any) -> dict[str, torch.Tensor]:
        """The model's predictions of a batch, identical on every rank of a replica's pipeline and row for row the
        batch Lightning gave this process (what its ``batch_indices`` name): with several replicas given the whole
        global batch (:attr:`global_batches`), every replica's share, gathered in replica order; given its own share
        (``LMDataModule``), this replica's, as under DDP."""
        self.flush()
        inputs, targets, rows = self.prepare(batch)
        self._set_mode(train=False)
        schedule = self._schedule(inputs.shape, "predict")
        with torch.no_grad():
            logits = schedule.eval(*((inputs,) if self.has_first_stage else ()))
        release_step(schedule)
        if self.sharded:
            reshard(self.stage_modules.values())
        result = self.model.predictions(logits, targets) if self.has_last_stage and logits is not None else None
        result = predictions.from_last_stage(result, self.groups.pipeline, self._last_stage_rank, self.device)
        result = {k: v[:rows] for k, v in result.items()}
        if self.global_batches and _shared(self.groups.data_parallel):
            result = predictions.gather_replicas(result, self.layout, self.device)
        restore = getattr(self.model, "restore_layout", None)
        return restore(result) if restore is not None else result

    def _run(self, batch: Any, mode: str, accumulation: int) -> StepResult:
        self.flush()
        inputs, targets, rows, whole = self._prepare(batch)
        weights = self._global_weights(targets[:rows], whole)
        tokens = weights[0]
        self.last_tokens = tokens
        size = inputs.shape[0] // self.layout.n_microbatches
        self.model.start_batch(weights, [max(0, min(size, rows - i * size)) for i in range(self.layout.n_microbatches)],
                               accumulation)
        self._set_mode(train=mode == "train")
        schedule = self._schedule(inputs.shape, mode)
        args = (inputs,) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        early = self._receive_terms_early(mode)
        with self._loss_context():  # forward and backward of a vocabulary-parallel loss run inside it
            if mode == "train":
                schedule.step(*args, target=target, return_outputs=False)
            else:
                schedule.eval(*args, target=target, return_outputs=False)
        release_step(schedule)
        terms = self._reduce_terms(self.model.finish_batch(), mode, early)
        terms = {name: value * accumulation for name, value in terms.items()}
        loss = terms.pop("loss")
        return StepResult(loss, tokens, weights, terms)

    def _global_weights(self, share: torch.Tensor, whole: torch.Tensor | None) -> torch.Tensor:
        """The global batch's counts. A replica holding the whole global batch counts it itself (the counts are
        additive over rows, so this is the replicas' sum) and no collective lines the replicas up before the
        schedule; a replica given only its share sums its counts over the replicas."""
        if whole is not None:
            return self.model.batch_weights(whole)
        return self._sum_over_replicas(self.model.batch_weights(share))

    def _receive_terms_early(self, mode: str) -> tuple[torch.Tensor, Any] | None:
        """Where the transport allows (:mod:`~lightning_mp_lstm.pipeline.transport`), a rank that takes the batch's
        terms from the last stage's (:meth:`_from_last_stage`) posts its receive before the schedule: the terms land
        while it finishes its part, and it finds them there. Elsewhere the receive follows the schedule's own."""
        names = self._term_names.get(mode)
        if (names is None or self.has_last_stage or not self._terms_on_last_rank or not _shared(self.groups.pipeline)
                or not posts_receives_ahead(self.groups.pipeline)):
            return None
        buffer = torch.empty(len(names), dtype=torch.float64, device=self.device)
        return buffer, dist.irecv(buffer, group=self.groups.pipeline, group_src=self._last_stage_rank, tag=_TERMS_TAG)

    def _reduce_terms(self, local: dict[str, torch.Tensor], mode: str,
                      early: tuple[torch.Tensor, Any] | None = None) -> dict[str, torch.Tensor]:
        """The batch's loss terms summed over the pipeline's stages and the replicas (one collective each), under the
        names every rank agreed on at its first batch of ``mode`` (``early``: the receive
        :meth:`_receive_terms_early` posted)."""
        names = self._term_names.get(mode)
        if names is None:
            names = self.model.term_names
            if names is None:  # the module's own methods name them: learn them once, from every rank
                every = {name for ranks in faults.gather(lambda: sorted(local)) for name in ranks}
                names = ["loss", *sorted(every - {"loss"})]
            self._term_names[mode] = names
        unknown = sorted(set(local) - set(names))
        if unknown:
            raise ValueError(f"the model reported loss terms {unknown} that its first {mode} batch did not; a loss or "
                             f"penalty method must return the same terms every batch ({names})")
        values = torch.stack([local[n] if n in local else torch.zeros((), dtype=torch.float64, device=self.device)
                              for n in names]).to(device=self.device, dtype=torch.float64)
        if not _shared(self.groups.pipeline):
            values = self._sum_over_replicas(values)
        elif self._terms_on_last_rank:
            values = self._from_last_stage(values, early)
        else:  # a penalty on an earlier stage's rank: every rank's pieces, summed
            dist.all_reduce(values, group=self.groups.pipeline)
            values = self._sum_over_replicas(values)
        return dict(zip(names, values.unbind(), strict=True))

    def _from_last_stage(self, values: torch.Tensor, early: tuple[torch.Tensor, Any] | None = None) -> torch.Tensor:
        """The batch's terms when the last stage's rank computes every piece: it sums them over the replicas and sends
        them to the rest of its pipeline without waiting, so it goes on to its optimizer step while the first stages
        finish their backward (a collective here would hold it until the last of them); the others take the terms
        after their own part of the schedule, already sent. The sends are waited for at the next batch."""
        group, last = self.groups.pipeline, self._last_stage_rank
        if self.has_last_stage:
            values = self._sum_over_replicas(values)
            self._sends = [dist.isend(values, group=group, group_dst=peer, tag=_TERMS_TAG)
                           for peer in range(dist.get_world_size(group)) if peer != last]
            return values
        if early is not None:
            buffer, work = early
            work.wait()
            return buffer
        dist.recv(values, group=group, group_src=last, tag=_TERMS_TAG)
        return values

    def flush(self) -> None:
        """Wait for the last batch's terms and clip norms to reach the rest of the pipeline (sent by then)."""
        for work in [*self._sends, *self._norms.take_sends()]:
            work.wait()
        self._sends = []

    # ----- after the backward pass ---------------------------------------------------------------------------
    def reduce_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Sum gradients over the data-parallel replicas and over the owners of each tied weight (once per
        optimizer step, before clipping: the global norm must see the summed gradient)."""
        if not self.sharded and _shared(self.groups.data_parallel):  # sharded: FSDP reduced them already
            sum_the_rest(parameters, self._summed, self._filled, self.groups.data_parallel, self.device)
        self._summed, self._filled = [], set()
        self.tied.all_reduce()

    def expect_clip(self) -> None:
        """This optimizer step ends in :meth:`clip_grad_norm_` on every rank: post the norms' receives (gloo)."""
        self._norms.expect()

    def cancel_clip(self) -> None:
        """Answer the receives :meth:`expect_clip` posted if no clip took them (call it when the step ends)."""
        self._norms.cancel()

    def clip_grad_norm_(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (every stage and shard; a tied weight counted once)."""
        params = list(parameters)
        shards = self.groups.data_parallel if self.sharded else self.groups.tensor_parallel
        tensor = shards if _shared(shards) else None
        return clip_grad_norm_(params, max_norm, self.device, self.groups.pipeline, tensor,
                               counted=self.tied.in_norm(params), pipeline_sum=self._norms.take())

    def check_finite(self, loss: torch.Tensor, where: str) -> None:
        """Raise ``FloatingPointError`` on every rank (the loss is the same everywhere) when ``loss`` is not finite,
        naming ``where`` and the first block whose output was not finite. Reads the loss on the host: one
        synchronization per step."""
        if bool(torch.isfinite(loss).all()):
            return
        raise FloatingPointError(
            f"mp_lstm: the training loss is {float(loss)} at {where}; the first non-finite value came from "
            f"{self.non_finite_source()}. Lower the learning rate, clip gradients (gradient_clip_val) or check the data"
        )

    def non_finite_source(self) -> str:
        """Where the last training batch first produced a non-finite value (a collective: call on every rank)."""
        local = [(index, block) for index, module in sorted(self.stage_modules.items())
                 for block in [module.first_non_finite()] if block is not None]
        for rank, blocks in enumerate(faults.gather(lambda: local)):
            for stage, block in blocks:
                replica, pipeline_rank = self.layout.coordinates(rank)
                return f"block {block} (stage {stage}, pipeline rank {pipeline_rank}, replica {replica})"
        return f"block {self.model.block_names[-1]} or the loss (every earlier block's output was finite)"

    def reset_state(self, mode: str) -> None:
        """Forget the recurrent state carried across batches in ``"train"`` or ``"eval"`` mode (if any)."""
        reset = getattr(self.model, "reset_state", None)
        if reset is not None:
            reset(mode)

    @property
    def cached_shapes(self) -> list[tuple[int, int, str]]:
        """Keys ``(rows, length, mode)`` of the stages + schedules kept now."""
        return sorted(self._schedules)

    # ----- helpers -----------------------------------------------------------------------------------------
    def prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This replica's inputs and targets, rows first, padded to a multiple of the microbatch count, and its real
        row count."""
        return self._prepare(batch)[:3]

    def _prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """:meth:`prepare`, and the whole global batch's targets when this replica was given all of it."""
        prepare = getattr(self.model, "prepare_batch", None)
        inputs, targets = prepare(batch) if prepare is not None else (batch[0], batch[1])
        replicas = self.layout.data_parallel_size
        whole = None
        if self.global_batches and replicas > 1:
            if inputs.shape[0] < replicas:
                raise ValueError(f"a global batch of {inputs.shape[0]} rows cannot be shared by data_parallel_size="
                                 f"{replicas} replicas; use batches of at least {replicas} sequences")
            whole = targets
            inputs = inputs.tensor_split(replicas)[self.data_parallel_rank]
            targets = targets.tensor_split(replicas)[self.data_parallel_rank]
        rows = int(inputs.shape[0])
        # Ragged batches (sharded: every replica's, to the largest share) get rows that add nothing to the loss.
        padded = largest_share(inputs, self.groups.data_parallel, self.device) if self.sharded else rows
        extra = padded - rows + (-padded % self.layout.n_microbatches)
        if extra:
            inputs, targets = self.model.pad_rows(inputs, targets, extra)
        return inputs, targets, rows, whole

    def _set_mode(self, train: bool) -> None:
        for module in self.stage_modules.values():
            module.set_mode(train)

    def _loss_context(self) -> Any:
        make = getattr(self.model, "loss_context", None)
        return make() if make is not None else nullcontext()

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Torch's schedules and the wavefront compute the loss right after the last stage's forward of the microbatch.
        last = self.stage_modules[self.layout.num_stages - 1]
        return self.model.microbatch_loss(logits, targets, None if last.inferring_shapes else last.microbatch)

    def _recorded_loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Torch's schedules compute the loss after the stage's forward (the wavefront inside its forward span): a span
        # of its own, so the timeline and the bound count the last stage's whole work on a microbatch.
        index = self.layout.num_stages - 1
        last = self.stage_modules[index]
        if last.inferring_shapes:
            return self._loss_fn(logits, targets)
        with RECORDER.span("loss", index, last.microbatch or 0):
            return self._loss_fn(logits, targets)

    def _schedule(self, shape: torch.Size, mode: str) -> Any:
        key = (int(shape[0]), int(shape[1]), mode)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._build_schedule(mode, rows=key[0], length=key[1])
            self._schedules[key] = schedule
            while len(self._schedules) > self.max_cached_shapes:
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        self._holding = hold_receive_buffers(schedule, self._holding)
        return schedule

    def _build_schedule(self, mode: str, rows: int, length: int) -> Any:
        layout = self.layout
        loss_fn = self._loss_fn if mode != "predict" else None
        if layout.style == "wavefront":  # this library's own loop: chunks of the time axis
            return WavefrontSchedule(self.stage_modules, layout, self.groups.pipeline, self.device, rows, length,
                                     layout.time_chunks, loss_fn, self.replica_sums)
        if layout.stages_per_rank > 1 and mode != "train":
            # torch 2.13's schedules of several stages per process cannot always run forward only (ZBVZeroBubble, and
            # Interleaved1F1B on one process, ask a stage without backward for its input gradient): evaluation goes
            # through this library's loop, one time chunk, the same stage placement.
            return WavefrontSchedule(self.stage_modules, layout, self.groups.pipeline, self.device, rows, length, 1,
                                     loss_fn)
        ahead = layout.style == "single" and posts_receives_ahead(self.groups.pipeline)  # Stage.receive_ahead
        stages = [Stage(module, index, layout.num_stages, self.device, group=self.groups.pipeline, receive_ahead=ahead,
                        replica_sums=self.replica_sums) for index, module in self.stage_modules.items()]
        schedule_cls = get_schedule_class(layout.schedule)
        target = stages[0] if layout.style == "single" else stages
        recorded = self._recorded_loss_fn if loss_fn is not None else None
        return schedule_cls(target, layout.n_microbatches, loss_fn=recorded, scale_grads=False)

    def _sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _shared(self.groups.data_parallel):
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.groups.data_parallel)
        return tensor
