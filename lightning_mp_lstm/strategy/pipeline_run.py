"""The running pipeline of one ``MPLSTMStrategy``: what the strategy delegates every step and checkpoint hook to.

:class:`PipelineRun` owns the run's state from its options to its engine: the layout the world size resolves, the plan
(partition, microbatches), the memory plan, the :class:`~lightning_mp_lstm.pipeline.engine.PipelineEngine` and the
module it split, the metrics, the step clock and what it measured, the numerical check of the declaration and the
checkpoint format. A step goes strategy hook -> :meth:`PipelineRun.train` -> ``engine.forward_backward`` -> torch's
schedule. It knows the Trainer only through the module and the arguments the strategy passes.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_mp_lstm import checkpoint as ckpt
from lightning_mp_lstm.base.faults import result_from
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.models.metrics import LanguageModelMetrics
from lightning_mp_lstm.pipeline.engine import PipelineEngine
from lightning_mp_lstm.planning import report
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.memory import BatchShape
from lightning_mp_lstm.planning.plan import PipelinePlan, PlanOptions
from lightning_mp_lstm.strategy import summary
from lightning_mp_lstm.strategy.batches import check_same_batch
from lightning_mp_lstm.strategy.options import ProcessOptions
from lightning_mp_lstm.strategy.pipeline_setup import (
    assemble_engine,
    check_automatic_optimization,
    check_run,
    check_sharded_precision,
    check_sharded_verify,
    library_model,
    make_verifier,
    plan_memory_of_run,
    plan_run,
    report_not_reproduced,
)
from lightning_mp_lstm.strategy.precision import PipelinePrecision

__all__ = ["PipelineRun", "dataloader_index"]

#: The modules a run split (pruned to its process's blocks), with that run's layout: another strategy cannot run them.
_SPLIT: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class PipelineRun:
    """The layout, plan, memory plan and engine of one strategy's run, and the steps that drive the engine.

    Args:
        options: the planning options (partition, balance, microbatches, time chunks).
        process: the process options (layout sizes, schedule, checkpoint format, budget).
        verify: the strategy's ``verify`` setting.
        report_after_steps: training batches timed for the report (``None``: never).
    """

    def __init__(self, options: PlanOptions, process: ProcessOptions, verify: bool | str,
                 report_after_steps: int | None) -> None:
        if verify not in (True, False, "auto"):
            raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
        self.options, self.process, self.verify = options, process, verify
        self._layout: ParallelLayout | None = None
        self._plan: PipelinePlan | None = None
        self._engine: PipelineEngine | None = None
        self.module: Any = None  # the module the engine split (pruned to this process's blocks)
        self.rank = 0
        #: The run's memory plan (planning.memory.MemoryPlan), when the data gives a batch; planned for training once
        #: the Trainer fits (``memory_purpose``), for evaluation or prediction alone before that, and for a
        #: prediction beside the fit's gradients and optimizer state after it.
        self.memory: Any = None
        self.memory_purpose: str | None = None
        #: A run whose data does not say its batches' shape: its device and local processes (planned from the first
        #: batch of each kind, ``_seen``: "train" or "eval" -> rows per replica and length).
        self._unsaid: tuple[torch.device, int] | None = None
        self._seen: dict[str, tuple[int, int]] = {}
        self.metrics = LanguageModelMetrics()
        self.step_clock = report.StepClock(report_after_steps)
        self.measurements: report.Measurements | None = None
        self.verifier: Any = None  # a verify.Verifier, while the declaration is still to be checked
        #: The numerical check of the module's declaration, once it ran (its table: ``verification.table()``).
        self.verification: Any = None
        self.model_names = ckpt.ModelNames()
        self.checkpoints = ckpt.checkpoint_format("file" if process.checkpoint_format == "auto"
                                                  else process.checkpoint_format)
        if process.fixed_world_size is not None:
            self.resolve_layout(process.fixed_world_size)

    # ----- what the run resolved ------------------------------------------------------------------------
    def resolve_layout(self, world_size: int) -> ParallelLayout:
        """The layout for ``world_size`` processes, resolved once: later ``validate``/``test``/``predict`` calls
        keep what ``fit`` resolved (the ``n_microbatches`` the plan chose included)."""
        if self._plan is not None:
            return self._plan.layout
        if self._layout is None or self._layout.world_size != world_size:
            m, k = self.options.n_microbatches, self.options.time_chunks
            self._layout = self.process.resolve(world_size, m if isinstance(m, int) else None,
                                                k if isinstance(k, int) else None)
        return self._layout

    @property
    def layout(self) -> ParallelLayout:
        if self._plan is not None:
            return self._plan.layout
        if self._layout is None:
            raise RuntimeError("the layout is known once the processes are set up")
        return self._layout

    @property
    def plan(self) -> PipelinePlan:
        if self._plan is None:
            raise RuntimeError("the plan is made in setup()")
        return self._plan

    @property
    def engine(self) -> PipelineEngine:
        if self._engine is None:
            raise RuntimeError("the pipeline engine is built in setup()")
        return self._engine

    @property
    def report(self) -> str:
        return report.render(self.plan, self.measurements)

    def blocks(self, module: Any) -> PipelineModel:
        """The pipeline view of ``module``: the engine's, once it split this module (it is pruned then)."""
        if self._engine is not None and self.module is module:
            return self._engine.model
        if module in _SPLIT:
            raise ValueError(
                f"this {type(module).__name__} was split by an earlier MPLSTMStrategy ({_SPLIT[module]}): this process "
                "holds only its own stages' blocks now, so another strategy (a new Trainer) cannot run it. Call fit, "
                "validate, test or predict on the Trainer that split it (to train on: its "
                "fit_loop.epoch_loop.max_steps raised, then fit), or load a checkpoint of it into a newly built module "
                "for the new Trainer")
        return pipeline_model(module)

    def processes_for(self, module: Any) -> int | None:
        """The processes ``module`` needs when the options determine it, else ``None``."""
        if self.process.fixed_world_size is not None:
            return self.process.fixed_world_size
        return self.process.processes_for(self.options.stage_count(self.blocks(module).block_names))

    def may_shard(self, precision: str) -> bool:
        """See ``MPLSTMStrategy.may_shard``: whether the checks of ``shard_replicas=True`` pass, besides the
        layout's."""
        try:
            replace(self.process, shard_replicas=True)  # its options' checks
            check_sharded_precision(str(precision))
            check_sharded_verify(self.verify)
        except ValueError:
            return False
        return True

    def check(self, module: Any, datamodule: Any, fitting: bool, memory: bool, precision: Any,
              device: torch.device | None, local_processes: int, warn: bool) -> None:
        """See ``MPLSTMStrategy.check``."""
        if fitting:
            check_automatic_optimization(module)
        if self.process.shard_replicas:
            check_sharded_verify(self.verify)
        blocks = self.blocks(module)
        check_run(blocks, type(module).__name__, precision, self.layout, self.options, self.process, datamodule,
                  planned=self._plan is not None, fitting=fitting, device=device, local_processes=local_processes,
                  module=module if memory else None)
        if self.module is not module:  # the whole module, before pruning (each warning shows once)
            report_not_reproduced(module, blocks, warn=warn, split=self.layout.processes_per_replica > 1)

    # ----- building -------------------------------------------------------------------------------------
    def build(self, module: Any, trainer: Any, precision: PipelinePrecision, mesh: DeviceMesh, rank: int,
              device: torch.device, local_processes: int) -> PipelineEngine:
        """The engine that runs ``module`` (kept when it split this module already): plan once, check the memory plan
        on every process (global rank 0's decision, before any block is materialized), make the verifier, prune
        ``module`` to this process's stages and build the engine that runs them."""
        fitting, purpose = trainer.state.fn == TrainerFn.FITTING, _purpose(trainer.state.fn)
        if self._engine is not None and self.module is module:
            if purpose == "predict" and self.memory_purpose == "fit":  # beside what the fit still holds
                self._plan_memory(module, self._engine.model, trainer.datamodule, device, local_processes,
                                  "predict_after_fit")
            if fitting and self.memory_purpose != "fit":  # an evaluation split it: its training is planned now
                self._plan_memory(module, self._engine.model, trainer.datamodule, device, local_processes, purpose)
                checked = self.verify is True or (self.verify == "auto" and not library_model(module))
                if self.verification is None and checked:
                    rank_zero_info("mp_lstm: the numerical check of the declaration is skipped: an earlier validate, "
                                   "test or predict of this Trainer built the pipeline; fit first to check it")
        else:
            # The whole model's summary, before the engine prunes it (Lightning prints it when a fit starts, a fit
            # after a validate of this Trainer too).
            summary.install(trainer, module)
            blocks = self.blocks(module)
            self.rank = rank
            self.metrics = LanguageModelMetrics(getattr(blocks, "log_name", "{split}_{metric}"),
                                                getattr(blocks, "reduction", "token_mean"))
            if self._plan is None:
                self._plan = plan_run(blocks, self.layout, self.options, trainer.datamodule, precision, device)
                self._plan_memory(module, blocks, trainer.datamodule, device, local_processes, purpose)
            if self.model_names.state_keys is None:  # the whole model, before pruning
                self.model_names = ckpt.ModelNames.of(module)
            if fitting and self.verifier is None:
                self.verifier = make_verifier(module, blocks, self.verify, rank == 0, self.layout, self.memory,
                                              sharded=self.process.shard_replicas)
            self._engine = assemble_engine(module, blocks, self._plan, mesh, rank, device,
                                           dict(self.model_names.aliases), shard=self.process.shard_replicas)
            self.module = module
            layout = self.layout
            if layout.processes_per_replica > 1 or self.process.shard_replicas:  # pruned, or sharded over replicas
                _SPLIT[module] = _sizes(layout)
        # A data module that gives each replica its own share of every batch says so; other batches are global.
        self._engine.global_batches = not getattr(trainer.datamodule, "shards_data_parallel", False)
        return self._engine

    def _plan_memory(self, module: Any, blocks: PipelineModel, datamodule: Any, device: torch.device,
                     local_processes: int, purpose: str) -> None:
        """Every rank takes global rank 0's memory plan for ``purpose``
        (:func:`~lightning_mp_lstm.planning.memory.plan_memory`; a refusal fails every rank at once); fitting,
        ``checkpoint_format="auto"`` becomes one file or sharded here. The plan is printed with it. Data that does
        not say its batches' shape is planned from the batches seen (:meth:`see_batch`)."""
        self.memory_purpose, self._unsaid = purpose, None
        self._plan_from(module, blocks, datamodule, device, local_processes)
        table = self.memory.table() if self.memory is not None else _unplanned(datamodule)
        if self.memory is None:
            self._unsaid = (device, local_processes)
            if self._seen:  # an earlier call of this Trainer ran batches
                self._plan_from(module, blocks, self._seen_shape(), device, local_processes)
                table = f"{self._seen_line()}\n{self.memory.table()}"
        plan = self.plan
        rank_zero_info(f"mp_lstm: {plan.layout}\npartition (costs by {plan.cost_kind}):\n{self.report}\n{table}")

    def _plan_from(self, module: Any, blocks: PipelineModel, source: Any, device: torch.device,
                   local_processes: int) -> None:
        purpose = self.memory_purpose  # set by _plan_memory, which every plan starts from
        if purpose == "fit" and isinstance(source, BatchShape) and "train" not in self._seen:
            purpose = "evaluate"  # a fit's sanity-check validation: no gradient or optimizer state yet
        self.memory, chosen = result_from(0, lambda: plan_memory_of_run(
            module, blocks, self.layout, self.options, self.process, source, device, local_processes, self.plan,
            purpose=purpose))
        if purpose == "fit":
            self.checkpoints = ckpt.checkpoint_format(chosen)

    def see_batch(self, module: Any, batch: Any, kind: str) -> None:
        """Where the data does not say its batches' shape, plan from the first batch of each ``kind`` (``"train"``, or
        ``"eval"`` for validation, test and prediction; global rank 0's), evaluation batches taken to be of the
        training batch's shape until one is seen: refused there, before the batch runs, where a process cannot hold
        it."""
        if self._unsaid is None or kind in self._seen:
            return
        prepare = getattr(self.engine.model, "prepare_batch", None)
        inputs = prepare(batch)[0] if prepare is not None else batch[0]
        replicas = self.layout.data_parallel_size if self.engine.global_batches else 1  # a share, or the whole
        self._seen[kind] = (math.ceil(int(inputs.shape[0]) / replicas), int(inputs.shape[1]))
        self._plan_from(module, self.engine.model, self._seen_shape(), *self._unsaid)
        rank_zero_info(f"{self._seen_line()}\n{self.memory.table()}")

    def _seen_shape(self) -> BatchShape:
        train = self._seen.get("train") or self._seen["eval"]
        return BatchShape(*train, BatchShape(*(self._seen.get("eval") or train)))

    def _seen_line(self) -> str:
        seen = "; ".join(f"{'training' if kind == 'train' else 'evaluation'} {rows} x {length}"
                         for kind, (rows, length) in sorted(self._seen.items(), reverse=True))
        rest = "" if "eval" in self._seen else "; evaluation batches taken to be of that shape"
        return f"mp_lstm: memory planned from the first batches (rows per replica x tokens: {seen}{rest}):"

    # ----- steps ----------------------------------------------------------------------------------------
    def train(self, module: Any, batch: Any, batch_idx: int, precision: PipelinePrecision) -> Tensor:
        """Run the batch forward and backward through the pipeline (the gradients wait in the precision plugin for
        Lightning's ``backward``); log and return its loss."""
        trainer = module.trainer
        with precision.train_step_context():
            result = self.engine.forward_backward(batch, accumulation=trainer.accumulate_grad_batches)
        self.engine.check_finite(result.loss, f"global step {trainer.global_step} (epoch {trainer.current_epoch}, "
                                              f"batch_idx {batch_idx})")
        self.metrics.log(module, "train", result.loss, result.tokens, _rows(batch), result.weights, result.terms,
                         rows_are_global=self.engine.global_batches or self.layout.data_parallel_size == 1)
        return result.loss

    def evaluate(self, module: Any, batch: Any, batch_idx: int, split: str, context: Any,
                 dataloader_idx: int = 0) -> Tensor:
        """The loss of a validation or test batch (no gradients), logged under ``split`` (each of several
        dataloaders on its own: ``dataloader_idx``)."""
        if batch_idx == 0:  # each dataloader's first batch
            self._check_same_batch(batch, f"the first {split} batch")
            self.engine.reset_state("eval")  # each dataloader starts the stream again
        self.see_batch(module, batch, "eval")
        with context:
            result = self.engine.evaluate(batch)
        self.metrics.log(module, split, result.loss, result.tokens, _rows(batch), result.weights, result.terms,
                         dataloader_idx=dataloader_idx)
        return result.loss

    def start_batch(self, module: Any, batch: Any, batch_idx: int, precision: PipelinePrecision,
                    device: torch.device) -> None:
        """Before a training batch: a new epoch restarts the stream; the declaration is checked on the first batch;
        the step clock ticks."""
        if batch_idx == 0:
            self._check_same_batch(batch, f"the first batch of epoch {module.trainer.current_epoch}")
            self.engine.reset_state("train")
            self.metrics.start_epoch()
        self.see_batch(module, batch, "train")
        if self.verifier is not None and not self.verifier.done:
            self._verify(module, batch, precision, device)
        self.step_clock.tick(batch)

    def end_training(self, precision: PipelinePrecision, device: torch.device) -> None:
        """Time every stage on its own process at the shape of the batch the step clock kept (a collective), off the
        training path, and report on rank 0."""
        batch = self.step_clock.take_batch()
        if batch is None:
            return
        with precision.forward_context():
            self.measurements = report.measure(self.engine, batch, device, self.step_clock.intervals)
        rank_zero_info(report.measured_line(self.plan, self.measurements, self.step_clock.after_steps))

    def _check_same_batch(self, batch: Any, where: str) -> None:
        """Where processes share each replica's batch (pipeline or tensor parallel), check that they loaded one."""
        if self.layout.processes_per_replica > 1:
            check_same_batch(batch, self.layout.coordinates(self.rank)[0], where)

    def _verify(self, module: Any, batch: Any, precision: PipelinePrecision, device: torch.device) -> None:
        from lightning_mp_lstm.strategy.verify import STEPS, VerificationError  # only when verifying

        layout = self.layout
        title = (f"mp_lstm verify: {type(module).__name__}.training_step on one process against the pipeline "
                 f"({_sizes(layout)}, {layout.n_microbatches} microbatches), {STEPS} steps on the first training "
                 "batch, random draws equal")
        started = time.perf_counter()
        comparison = self.verifier.run(self.engine, module, batch, module.trainer, title, device,
                                       precision.convert_module, precision.inner.train_step_context)
        self.verification = comparison
        if not comparison.ok:
            raise VerificationError(comparison.table())
        self.metrics.log_as(comparison.names, comparison.flags)
        rank_zero_info(f"{comparison.table()} ({time.perf_counter() - started:.2f} s)")


def _purpose(fn: TrainerFn) -> str:
    """What a Trainer call's memory is planned for (:func:`~lightning_mp_lstm.planning.memory.plan_memory`)."""
    return {TrainerFn.FITTING: "fit", TrainerFn.PREDICTING: "predict"}.get(fn, "evaluate")


def _unplanned(datamodule: Any) -> str:
    """Why a run has no memory plan yet: its data does not say its batches' shape."""
    source = (f"{type(datamodule).__name__} does not say its" if datamodule is not None else
              "the dataloaders given to the Trainer do not say their")
    return ("memory per process: planned from the first batches: a larger batch later is found only by running it "
            f"({source} batches' shape: batch_size and bucket_lengths, as LMDataModule gives them: "
            "lightning_mp_lstm.models.contract.PipelineData)")


def _sizes(layout: ParallelLayout) -> str:
    """The layout's sizes and schedule, as the strategy's messages name them."""
    return (f"data x pipeline x tensor = {layout.data_parallel_size} x {layout.pipeline_parallel_size} x "
            f"{layout.tensor_parallel_size}, {layout.schedule}")


def _rows(batch: Any) -> int:
    """Sequences in this replica's batch (for Lightning's logging weights)."""
    return int(batch[0].shape[0])


def dataloader_index(args: tuple, kwargs: dict) -> int:
    """Which of an evaluation's dataloaders a step's batch is from, given what Lightning passes a step after
    ``batch_idx``: the index when there are several (and the module's step takes it)."""
    return int(args[0]) if args else int(kwargs.get("dataloader_idx", 0))
