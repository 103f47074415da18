"""``MPLSTMStrategy``: pipeline (x data x tensor) parallel training of an LSTM language model, in Lightning.

Shaped like Lightning's ``ModelParallelStrategy``: Lightning's launchers and cluster environments start the
processes, the accelerator picks device and backend (gloo on CPU, nccl on CUDA), checkpoint IO and the precision
are Lightning's. The strategy is plumbing: every Lightning hook is here, each a call into one collaborator. The run's
state, from the resolved layout to the :class:`~lightning_mp_lstm.pipeline.engine.PipelineEngine`, is one
:class:`~lightning_mp_lstm.strategy.pipeline_run.PipelineRun` (the steps and the engine's setup), the checkpoint hooks
call its checkpoint format (:mod:`~lightning_mp_lstm.checkpoint`), and
:class:`~lightning_mp_lstm.strategy.precision.PipelinePrecision` plugs the gradient reductions and the global-norm clip
into Lightning's optimizer step. The module never holds the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_mp_lstm import checkpoint as ckpt
from lightning_mp_lstm.base import collector
from lightning_mp_lstm.base.allocator import return_freed_memory, steady_threshold
from lightning_mp_lstm.base.faults import PeerDirectory
from lightning_mp_lstm.checkpoint.formats import check_one_step
from lightning_mp_lstm.pipeline.engine import PipelineEngine
from lightning_mp_lstm.planning import report
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.plan import PipelinePlan, PlanOptions
from lightning_mp_lstm.strategy.batches import seed_workers_by_replica
from lightning_mp_lstm.strategy.collectives import barrier, broadcast_object, reduce_tensor
from lightning_mp_lstm.strategy.launcher import JobLauncher, count_job_call, job_released
from lightning_mp_lstm.strategy.options import ProcessOptions
from lightning_mp_lstm.strategy.pipeline_run import PipelineRun, dataloader_index
from lightning_mp_lstm.strategy.pipeline_setup import (
    check_callbacks,
    explain_optimizer_error,
    share_random_state,
    start_process_groups,
)
from lightning_mp_lstm.strategy.precision import PipelinePrecision, set_numerics
from lightning_mp_lstm.strategy.stopping import StopOnSignal, check_stop_signals

__all__ = ["MPLSTMStrategy"]


class MPLSTMStrategy(ParallelStrategy):
    """Split an LSTM language model into pipeline stages across processes.

    ``Trainer(strategy="mp_lstm", devices=4)`` runs a 4-stage pipeline of any LightningModule that declares its
    blocks in ``configure_pipeline()`` (:class:`~lightning_mp_lstm.LSTMBlocks`). Losses and gradients equal one
    process on the same global batch. The strategy runs the module's training, validation, test and prediction steps
    itself (through the pipeline) and logs the loss under the declaration's names.

    Args:
        pipeline_parallel_size: processes per pipeline; ``"auto"``: from the partition's stage count when it has
            one (``"balanced4"``, explicit lists, ``"per_block"``), else world size / ``data_parallel_size``.
        data_parallel_size: number of pipeline replicas; data is sharded across replicas only.
        tensor_parallel_size: processes every stage's vocabulary layers (embedding rows, decoder columns) are split
            over with torch's tensor-parallel API; the loss is computed on the sharded logits (``loss_parallel``).
        data_parallel_weights: relative batch share of each replica, for unequal devices (MXNet's
            ``work_load_list``); gradients stay exact because the loss is divided by the global batch's weight.
        stages_per_rank: pipeline stages per process; ``None``: 1 for GPipe/1F1B, 2 for interleaved and V-shaped
            schedules.
        schedule: one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
            (torch's, splitting the batch's rows) or Wavefront (splitting its time axis; case-insensitive).
        n_microbatches: microbatches per replica batch; default: the number of stages (1 for Wavefront); ``"auto"``:
            the count with the lowest step time predicted from stage times measured at every candidate size.
        time_chunks: chunks of every batch's time axis (Wavefront only), at most the shortest bucket; default: the
            number of stages; ``"auto"``: with ``n_microbatches``, the rows x chunks pair with the lowest predicted
            step time.
        partition: ``"even"``, ``"balanced"`` (the exact contiguous split minimizing the slowest stage; see
            ``balance_by``), ``"balanced<N>"`` (the same over N stages), ``"per_block"`` (one block per stage) or
            one list of block names per stage.
        balance_by: what ``"balanced"`` balances: ``"time"`` (forward + backward measured on the devices),
            ``"flops"`` or ``"memory"``.
        stage_speeds: relative speed of each stage's device for balancing (default: all equal).
        report_after_steps: the step time of this many training batches, and every stage timed at that batch's
            shape when training ends (off the training path), in one logged line (with the plan: :attr:`report`;
            ``None``: never).
        checkpoint_format: ``"file"``: one checkpoint file, gathered on global rank 0 while saving (loads anywhere,
            plain Lightning included); ``"sharded"``: a directory where every rank writes its own tensors with
            ``torch.distributed.checkpoint`` (nothing is gathered; loads on any ``mp_lstm`` layout); ``"auto"``: one
            file where the memory plan says global rank 0 can gather the whole model and its optimizer state beside
            its own share, else sharded.
        timeout: process-group timeout (seconds or ``timedelta``): a crashed rank ends the run instead of hanging
            it.
        num_threads: CPU threads per process; ``"auto"`` shares the machine's cores between the local processes.
            Ignored on GPUs.
        numerics: ``"default"`` (torch's float32 settings: TF32 in cuDNN RNNs on recent GPUs) or ``"exact"`` (IEEE
            float32 and deterministic cuDNN kernels, to compare layouts with one process to 1e-5 on GPUs).
        verify: before training on the first batch, compare the module's own ``training_step`` on one process with
            the pipeline on it (:mod:`~lightning_mp_lstm.strategy.verify`); a difference stops the run, naming it.
            ``"auto"``: for a user's module whenever global rank 0 holds all of it (skipped with one line otherwise);
            ``True``: always (the library's own model too); ``False``: never.
        process_group_backend: override the backend chosen from the device (gloo on CPU, nccl on CUDA).
        memory_per_process: GiB of memory one process may use (``"auto"``: the GPU's, or the machine's over its
            processes): the memory plan (parameters, gradients, optimizer state, activations in flight and the loss's
            logits of every process, predicted from shapes) is checked against it, and a layout some process of which
            cannot hold its share is refused before launch, with the table and the layouts that would fit.
        stop_signals: signals that stop every rank at a step boundary (the next but one) with a checkpoint
            (:class:`~lightning_mp_lstm.strategy.stopping.StopOnSignal`, added to the Trainer); ``()``: Lightning's
            handling.
        shard_replicas: shard each stage's parameters, gradients and optimizer state over its replicas with torch's
            FSDP2 (ZeRO-3 over ``data_parallel_size``; :mod:`~lightning_mp_lstm.pipeline.sharding`): GPipe, 1F1B,
            Interleaved1F1B, LoopedBFS or Wavefront, no tensor parallelism, equal replicas, float32 parameters.
    """

    strategy_name = "mp_lstm"

    def __init__(
        self,
        pipeline_parallel_size: int | str = "auto",
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_weights: Sequence[float] | None = None,
        stages_per_rank: int | None = None,
        schedule: str = "1F1B",
        n_microbatches: int | str | None = None,
        time_chunks: int | str | None = None,
        partition: Sequence[Sequence[str]] | str | None = "even",
        balance_by: str = "time",
        stage_speeds: Sequence[float] | None = None,
        report_after_steps: int | None = 5,
        checkpoint_format: str = "auto",
        timeout: float | timedelta = 300.0,
        num_threads: int | str = "auto",
        numerics: str = "default",
        verify: bool | str = "auto",
        process_group_backend: str | None = None,
        memory_per_process: float | str = "auto",
        stop_signals: Sequence[str] = ("SIGTERM",),
        shard_replicas: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         checkpoint_io=checkpoint_io if checkpoint_io is not None else ckpt.AtomicCheckpointIO())
        options = PlanOptions(partition="even" if partition is None else partition, balance_by=balance_by,
                              stage_speeds=tuple(stage_speeds) if stage_speeds is not None else None,
                              n_microbatches=n_microbatches, time_chunks=time_chunks)
        process = ProcessOptions(pipeline_parallel_size, data_parallel_size, tensor_parallel_size,
                                 data_parallel_weights, stages_per_rank, schedule, checkpoint_format, timeout,
                                 num_threads, numerics, memory_per_process, shard_replicas)
        self._run = PipelineRun(options, process, verify, report_after_steps)
        self._process_group_backend = process_group_backend
        self._stop_signals = tuple(s.name for s in check_stop_signals(stop_signals))
        self.num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        self._peers: PeerDirectory | None = None

    # ----- Lightning plumbing ----------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def is_distributed(self) -> bool:
        # The data module shards by data-parallel replica itself. A DistributedSampler injected by Lightning would
        # also shard across pipeline stages, which must all see the same batch.
        return False

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be pruned and the optimizers built before state is loaded

    @property
    @override
    def precision_plugin(self) -> PipelinePrecision:
        # Whatever Lightning chose from Trainer(precision=...), wrapped: the pipeline's backward, reductions, clip.
        if self._pipeline_precision is None:
            plugin = self._precision_plugin
            self._pipeline_precision = plugin if isinstance(plugin, PipelinePrecision) else PipelinePrecision(plugin)
        return self._pipeline_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Kept as given (None until Lightning sets it): Lightning reads ``_precision_plugin`` as the user's choice.
        self._precision_plugin = plugin
        self._pipeline_precision: PipelinePrecision | None = None

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """With ``empty_init=True`` (``trainer.init_module(empty_init=True)``) the model is built on the meta
        device: no process allocates blocks it will not hold; ``setup`` materializes this process's blocks."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this when the Trainer is built: fail on a wrong process count before any launch.
        world_size = self.num_nodes * self.num_processes
        if world_size:
            self._run.resolve_layout(world_size)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = JobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        count_job_call()  # a rank process re-running a script must be on the launching process's call
        super().setup_environment()
        layout = self._run.resolve_layout(self.world_size)
        # Everything that can be wrong is checked here, on every rank, before the first collective.
        trainer = self.lightning_module.trainer
        check_callbacks(trainer.callbacks, layout)
        # Memory is planned once the processes can agree (every rank takes global rank 0's plan: PipelineRun.build).
        self.check(self.lightning_module, trainer.datamodule, fitting=trainer.state.fn == TrainerFn.FITTING,
                   memory=False)
        if self.root_device.type == "cpu":
            torch.set_num_threads(self._run.process.threads(self.num_processes))
            return_freed_memory()  # a rank's peak is then what it holds (lightning_mp_lstm.base.allocator)
        set_numerics(self._run.process.numerics)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        assert self.cluster_environment is not None
        if self._device_mesh is None:
            self._device_mesh, self._peers = start_process_groups(
                self.cluster_environment, self._process_group_backend, self.root_device, layout,
                self._run.process.timeout)
        share_random_state(self.root_device)

    def check(self, model: pl.LightningModule, datamodule: Any = None, fitting: bool = True,
              memory: bool = True) -> None:
        """Check that this strategy can run ``model`` on ``datamodule``'s batches, without starting anything.

        Runs on every rank before the first collective (so a bad setting fails everywhere at once instead of hanging
        the others); call it yourself to fail before any process is launched. Needs a known layout (an explicit
        ``pipeline_parallel_size``, or a strategy already attached to a Trainer).

        Raises:
            ValueError: ``fitting`` a module with manual optimization (``automatic_optimization = False``).
            TypeError: the model declares no pipeline (the message shows what to add), or planning needs the data's
                batch shape and the data module does not say it.
            PartitionError: the partition or ``stage_speeds`` do not fit the model and layout.
            LayoutError: ``n_microbatches`` does not fit the batch, or ``time_chunks`` the shortest bucket.
            MemoryPlanError: (``memory``) some process of the layout cannot hold its share of the model, its optimizer
                state and the largest training batch's activations, or of the largest evaluation batch, within
                ``memory_per_process`` (for the partition that holds the least when the partition is measured later);
                not ``fitting``: its share of the model and the largest evaluation batch.
        """
        self._run.check(model, datamodule, fitting, memory, self.precision_plugin,
                        self.root_device if self.parallel_devices else None, self.num_processes,
                        warn=self.global_rank == 0)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._stop_signals and not any(isinstance(c, StopOnSignal) for c in trainer.callbacks):
            trainer.callbacks.append(StopOnSignal(self._stop_signals))
        self.precision_plugin.engine = self._run.build(self.lightning_module, trainer, self.precision_plugin,
                                                       self.device_mesh, self.global_rank, self.root_device,
                                                       self.num_processes)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.root_device.type == "cpu":  # built: steps reuse what the step before freed, where there is room
            memory = self._run.memory
            return_freed_memory(steady_threshold(*(getattr(memory, key, None) for key in ("peak", "budget")),
                                                 sharded=self.precision_plugin.engine.sharded))
        collector.leave_out_built_objects()  # no step waits on a pass over them (lightning_mp_lstm.base.collector)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Seed the loader's workers by data-parallel replica, not by global rank (``seed_workers_by_replica``):
        every process of a replica must load the same batch (:mod:`~lightning_mp_lstm.strategy.batches`)."""
        seed_workers_by_replica(dataloader, self.data_parallel_rank)
        return dataloader

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's, on this process's part of the module (a block another process holds is ``None`` here)."""
        try:
            super().setup_optimizers(trainer)
        except AttributeError as error:
            raise explain_optimizer_error(error, type(self.lightning_module).__name__, self.global_rank) or error

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ----- steps: through the pipeline; the module's own *_step methods are not called ------------------------
    @override
    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        """Run the batch forward and backward through the pipeline (the gradients wait in the precision plugin for
        Lightning's ``backward``); log and return its loss."""
        return self._run.train(self.lightning_module, batch, batch_idx, self.precision_plugin)

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        return self._run.evaluate(self.lightning_module, batch, batch_idx, "val",
                                  self.precision_plugin.val_step_context(), dataloader_index(args, kwargs))

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        return self._run.evaluate(self.lightning_module, batch, batch_idx, "test",
                                  self.precision_plugin.test_step_context(), dataloader_index(args, kwargs))

    @override
    def predict_step(self, batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The model's predictions of the batch (for a language model: per-token target log-probabilities,
        next-token ids and the target mask), identical on every rank of a replica and row for row the batch Lightning
        gave this process (:meth:`~lightning_mp_lstm.pipeline.engine.PipelineEngine.predict`)."""
        if batch_idx == 0:
            self.engine.reset_state("eval")  # each dataloader starts the stream again
        self._run.see_batch(self.lightning_module, batch, "eval")
        with self.precision_plugin.predict_step_context():
            return self.engine.predict(batch)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._run.start_batch(self.lightning_module, batch, batch_idx, self.precision_plugin, self.root_device)

    @override
    def on_train_end(self) -> None:
        """Time every stage at the shape of the batch the step clock kept (a collective, off the training path) and
        report on rank 0."""
        self._run.end_training(self.precision_plugin, self.root_device)

    # ----- checkpoints: the run's format (one file, or sharded) --------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """One file: the whole model's state dict on global rank 0 (empty elsewhere), gathered from all stages.
        Sharded: this process's own tensors (nothing is gathered)."""
        return self._run.checkpoints.model_state(self.lightning_module, self._run.model_names)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Name-keyed optimizer state: of every stage, merged on global rank 0 (one file), or this process's."""
        return self._run.checkpoints.optimizer_state(self.lightning_module, optimizer, self._run.model_names)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """One file written atomically on global rank 0 (:class:`~lightning_mp_lstm.checkpoint.AtomicCheckpointIO`),
        or a directory every rank writes its own tensors to; a failed write fails every rank, and nothing is written
        when the ranks are at different steps (:func:`~lightning_mp_lstm.checkpoint.formats.check_one_step`)."""
        check_one_step(checkpoint, filepath)
        self._run.checkpoints.save(checkpoint, filepath, self.checkpoint_io, self._run.model_names, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint of either format on every rank; a truncated or foreign file gets a message naming it."""
        return self._run.checkpoints.load(checkpoint_path, self.lightning_module, self.optimizers, self.checkpoint_io,
                                          weights_only, self._run.model_names)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self._run.checkpoints.remove(filepath, self.checkpoint_io)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._run.checkpoints.load_model_state(self.lightning_module, checkpoint, strict, self._run.model_names)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._run.checkpoints.load_optimizer_state(self.lightning_module, self.optimizers, checkpoint,
                                                   self._run.model_names)

    # ----- collectives (lightning_mp_lstm.strategy.collectives) -------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return reduce_tensor(tensor, group, reduce_op)

    @override
    def block_backward_sync(self) -> Any:
        return nullcontext()  # gradients are reduced by the engine after the pipeline's backward, not by DDP hooks

    # ----- the run as resolved ----------------------------------------------------------------------------
    def processes_for(self, model: pl.LightningModule) -> int | None:
        """The number of processes this strategy needs for ``model``, when its options determine it (an explicit
        ``pipeline_parallel_size``, or a partition with a stage count); else ``None``: the Trainer's devices."""
        return self._run.processes_for(model)

    @property
    def layout(self) -> ParallelLayout:
        """The resolved parallel layout (once the world size is known; after planning, with the chosen number of
        microbatches)."""
        return self._run.layout

    @property
    def plan(self) -> PipelinePlan:
        """The pipeline plan: partition, number of microbatches, costs and predictions (after ``setup``)."""
        return self._run.plan

    @property
    def partition(self) -> list[list[str]]:
        """Block names of every pipeline stage, in stage order (known after ``setup``)."""
        return [list(stage) for stage in self.plan.partition]

    @property
    def engine(self) -> PipelineEngine:
        """The engine that runs this process's stages (after ``setup``)."""
        return self._run.engine

    @property
    def report(self) -> str:
        """The partition report: the plan, and what was measured while it ran."""
        return self._run.report

    @property
    def measurements(self) -> report.Measurements | None:
        """Stage and step times measured after ``report_after_steps`` training batches."""
        return self._run.measurements

    @property
    def verification(self) -> Any:
        """The numerical check of the module's declaration, once it ran (its table: ``verification.table()``)."""
        return self._run.verification

    @property
    def memory(self) -> Any:
        """The run's memory plan (:class:`~lightning_mp_lstm.planning.memory.MemoryPlan`: every process's predicted
        peak by what holds it, and the budget) of the Trainer's latest call that planned one (a fit, a call before
        any fit, or a predict after a fit); ``None`` before, or when the data does not give its batch shape."""
        return self._run.memory

    def memory_budget(self, device: torch.device, processes: int) -> tuple[int | None, str]:
        """Bytes one process may use when a node runs ``processes`` of them on ``device``, and where that comes
        from (``memory_per_process``, or the device's memory shared by the processes)."""
        return self._run.process.memory_budget(device, processes)

    def may_shard(self, precision: str = "32-true") -> bool:
        """Whether this strategy's other options allow ``shard_replicas=True`` at ``precision`` (the autopilot's)."""
        return self._run.may_shard(precision)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(data_parallel, pipeline_parallel, tensor_parallel)`` device mesh."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the process group is initialized")
        return self._device_mesh

    @property
    def pipeline_rank(self) -> int:
        return self.layout.coordinates(self.global_rank)[1]

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank)[0]

    @property
    def tensor_parallel_rank(self) -> int:
        """Which shard of its stage's split weights this process holds."""
        return self.layout.tensor_rank(self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def data_parallel_weights(self) -> list[float] | None:
        """Relative batch share of each data-parallel replica (``None``: equal shares)."""
        weights = self._run.process.data_parallel_weights
        return list(weights) if weights is not None else None

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ----- the end ----------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed when this rank's error is only the symptom of losing it."""
        if self._peers is not None:
            self._peers.explain(exception)

    @override
    def teardown(self) -> None:
        # As Lightning's ModelParallelStrategy: the model and optimizer state stay on their devices (no round trip
        # to the CPU between fit, validate and test; sharded parameters keep their device mesh's device).
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._run.module is not None:
            self.engine.flush()
        collector.take_back_built_objects()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def shutdown(self) -> None:
        """End the job: wait for the processes this strategy launched and release the process group, so that another
        ``Trainer`` in this process (the next job of a Hydra multirun) starts its own set of processes.

        Call it after the script's last ``fit``/``validate``/``test``/``predict`` with this strategy: the rank processes
        run the script themselves and follow it call by call, so one released before a later call refuses it (and so
        does one started for it, which would run the script's earlier calls first).
        """
        if isinstance(self._launcher, JobLauncher):
            self._launcher.release()
        job_released()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Re-register a class re-created by ``importlib.reload`` of this module, so the name never yields a stale one.
        if cls.strategy_name not in strategy_registry or strategy_registry[cls.strategy_name]["strategy"] is not cls:
            strategy_registry.register(cls.strategy_name, cls, override=True,
                                       description="pipeline (x data x tensor) parallel training of LSTM models")
