"""From a module, a layout and the strategy's options to a checked plan and a running engine: the steps of the
strategy's setup, one function each. The strategy and its ``PipelineRun`` call them; they know nothing of Lightning's
Trainer."""

from __future__ import annotations

import atexit
import gc
import random
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mp_lstm.base.faults import PeerDirectory, forget_object_groups, result_from, setup_object_group
from lightning_mp_lstm.models.contract import PipelineModel, check_data
from lightning_mp_lstm.models.declaration import ModelDeclarationError
from lightning_mp_lstm.models.module_audit import NotReproducedWarning, audit, parameters_outside, render_findings
from lightning_mp_lstm.pipeline.engine import PipelineEngine, build_engine
from lightning_mp_lstm.pipeline.groups import ProcessGroups, copy_from_first
from lightning_mp_lstm.pipeline.sharding import shard_stages
from lightning_mp_lstm.pipeline.tied import TiedWeights
from lightning_mp_lstm.planning.layout import WAVEFRONT, LayoutError, ParallelLayout, schedule_style
from lightning_mp_lstm.planning.memory import MemoryPlanError
from lightning_mp_lstm.planning.plan import PipelinePlan, PlanOptions, make_plan, microbatch_candidates
from lightning_mp_lstm.strategy.memory_check import check_memory
from lightning_mp_lstm.strategy.options import ProcessOptions
from lightning_mp_lstm.strategy.precision import REFUSED_PRECISIONS

#: The precisions ``shard_replicas=True`` runs with (a "true" low precision converts the parameters after sharding).
SHARDED_PRECISIONS = ("32-true", "bf16-mixed")
#: The schedules ``shard_replicas=True`` runs with: those whose backward pass is whole. A split one (zero bubble,
#: DualPipeV) computes weight gradients of ``parameters()``, which FSDP's blocks hold as shards between their runs.
SHARDED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", WAVEFRONT)

__all__ = ["SHARDED_PRECISIONS", "SHARDED_SCHEDULES", "assemble_engine", "check_automatic_optimization",
           "check_callbacks", "check_run", "check_sharded_precision", "check_sharded_verify", "check_sharding",
           "end_process_groups", "explain_optimizer_error", "library_model", "make_verifier", "plan_memory_of_run",
           "plan_run", "replica_rows", "report_not_reproduced", "start_process_groups"]

DEFAULT_ROWS = 32  # the batch assumed for planning when the data module does not say its own
DEFAULT_LENGTH = 35
#: Lightning's weight-averaging callbacks (``WeightAveraging``, with ``EMAWeightAveraging``, since Lightning 2.6).
_WEIGHT_AVERAGING = tuple(c for c in (StochasticWeightAveraging, getattr(lightning_callbacks, "WeightAveraging", None))
                          if c is not None)


def check_automatic_optimization(model: Any) -> None:
    """Refuse to train a module with manual optimization: its ``training_step``, where it would call
    ``optimizer.step()``, is not run under the pipeline (the strategy runs the declared pieces), so the run would
    end without a single update and without an error."""
    if getattr(model, "automatic_optimization", True):
        return
    name = type(model).__name__
    raise ValueError(f"{name} sets automatic_optimization = False, which mp_lstm cannot train: the pipeline computes "
                     f"the gradients in its schedule and Lightning's automatic optimization steps the optimizer, and "
                     f"{name}.training_step, where manual optimization steps it, is not run under the pipeline (no "
                     "parameter would ever change). Use automatic optimization (clipping: Trainer(gradient_clip_val="
                     "...); an update every few batches: Trainer(accumulate_grad_batches=...)), or train this module "
                     "on one process")


def explain_optimizer_error(error: AttributeError, model_name: str, rank: int) -> AttributeError | None:
    """``configure_optimizers`` 's ``AttributeError`` again (caused by it), with a message that says how to build
    parameter groups that work on every process, when it comes from a block another process holds (``None`` there);
    else ``None``."""
    if "'NoneType' object has no attribute" not in str(error):
        return None
    explained = AttributeError(
        f"{model_name}.configure_optimizers failed on global rank {rank} ({error}): under mp_lstm it runs on each "
        "process's part of the module, where the blocks other processes hold are None. Build parameter groups by "
        "parameter name, e.g. [p for n, p in self.named_parameters() if n.startswith('embedding.')]: a group may be "
        "empty on a process")
    explained.__cause__ = error
    return explained


def check_callbacks(callbacks: Iterable[Any], layout: ParallelLayout) -> None:
    """Refuse the callbacks a pipeline cannot run, naming what to do instead, and warn of numbers a callback gets
    wrong under ``layout``.

    Lightning's batch-size finder (``BatchSizeFinder``, which ``Tuner.scale_batch_size`` adds) grows the batch until
    a process runs out of memory, and a pipeline rank that does leaves its peers waiting for it (its restoring
    checkpoint is also named apart on each rank). The weight-averaging callbacks copy the whole module in their
    ``setup`` hook, before the strategy splits it, then pair the copy's parameters with the rank's own by position:
    they fail, or, where the shapes happen to agree, average one weight into another. ``ModelPruning`` collects the
    layers to prune in ``setup`` too, so each rank prunes copies of layers another rank trains and, pruning globally
    (its default), ranks its own weights against those stale copies: silently another model than one process's.
    ``BaseFinetuning`` (``BackboneFinetuning``) freezes and unfreezes layers by attribute, which a process that does
    not hold them lacks, and puts its optimizer groups back in ``on_fit_start``, before the strategy restores a
    checkpoint: it fails at its first unfreezing, and a resumed run trains without the groups it added.
    ``ThroughputMonitor`` counts every process as a data-parallel replica: it is run, with a warning.
    """
    for callback in callbacks:
        if isinstance(callback, BatchSizeFinder):
            raise ValueError(f"mp_lstm does not run Lightning's batch-size finder ({type(callback).__name__}, which "
                             "Tuner.scale_batch_size adds): its trials grow the batch until a process runs out of "
                             "memory, and a pipeline rank that does leaves the others waiting for it. Set the batch "
                             "size yourself (the data module's batch_size); MPLSTMStrategy(memory_per_process=...) "
                             "checks before training that the largest batch's activations fit a process")
        if isinstance(callback, _WEIGHT_AVERAGING):
            raise ValueError(f"mp_lstm does not run Lightning's {type(callback).__name__}: it copies the whole "
                             "module before the strategy splits it over the processes, then averages the copy's "
                             "parameters into each process's own by position, which are another model's. Average in "
                             "the optimizer instead (torch.optim.ASGD, as AWD-LSTM's NT-ASGD does: each parameter's "
                             "average stays with it, on the process that holds it)")
        if isinstance(callback, ModelPruning):
            raise ValueError(f"mp_lstm does not run Lightning's {type(callback).__name__}: it collects the layers to "
                             "prune before the strategy splits the module over the processes, so each process prunes "
                             "copies of layers another one trains and, pruning globally (use_global_unstructured, its "
                             "default), ranks its own weights against those stale copies: another model than one "
                             "process prunes. Prune the trained model in one process instead (torch.nn.utils.prune "
                             "on the model loaded from the run's checkpoint)")
        if isinstance(callback, BaseFinetuning):
            raise ValueError(f"mp_lstm does not run Lightning's {type(callback).__name__}: it freezes and unfreezes "
                             "the module's layers by attribute, which a process that does not hold them lacks (its "
                             "first unfreezing fails there), and it puts its optimizer groups back before the "
                             "strategy restores a checkpoint, so a resumed run would train without them. Give the "
                             "frozen layers their own parameter group in configure_optimizers, with a learning rate "
                             "that a scheduler holds at 0 until they thaw (LambdaLR takes one function per group)")
        copies = layout.processes_per_replica
        if isinstance(callback, ThroughputMonitor) and copies > 1:
            rank_zero_warn(f"ThroughputMonitor counts each of the {layout.world_size} processes as a data-parallel "
                           f"replica, but {copies} of them share each batch ({layout.data_parallel_size} replica(s)): "
                           f"its samples, items and FLOPs per second are {copies} times the run's. The run's own "
                           "speed is logged as train/tokens_per_s_step and train/tokens_per_s_epoch")


def start_process_groups(
    environment: ClusterEnvironment, backend: str, device: torch.device, layout: ParallelLayout, timeout: timedelta,
) -> tuple[DeviceMesh, PeerDirectory | None]:
    """Start the default process group (Lightning's ``_init_dist_connection``; a no-op when it runs already), the
    layout's device mesh, the gloo object group and the directory of peers (for naming a lost rank); register
    :func:`end_process_groups` to run at the process's exit.

    Returns:
        The mesh, and the peers (``None`` when no process group runs: a one-process mesh has no collectives).
    """
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
    mesh = layout.build_mesh(device.type, backend, timeout)
    if not _distributed_is_initialized():
        return mesh, None
    setup_object_group()
    atexit.unregister(end_process_groups)  # once, however many jobs this process runs
    atexit.register(end_process_groups)
    return mesh, PeerDirectory.gather()


def end_process_groups() -> None:
    """Destroy every process group and drop this library's references to them, so that their worker threads end
    while the interpreter is still whole: at the end of a job (``JobLauncher.release``) and at the process's exit.
    A gloo worker still releasing a finished operation's tensors when the interpreter finalizes aborts the process
    ("terminate called without an active exception", pytorch/pytorch#190489); Lightning destroys only nccl groups at
    exit."""
    forget_object_groups()
    if _distributed_is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the engine's groups, held in reference cycles of the finished Trainer


def replica_rows(datamodule: Any, layout: ParallelLayout) -> int:
    """Sequences in one replica's batch: the data module's ``batch_size`` over the data-parallel replicas."""
    rows = getattr(datamodule, "batch_size", None) or DEFAULT_ROWS
    return max(1, int(rows) // layout.data_parallel_size)


def check_run(
    blocks: PipelineModel, model_name: str, precision: Precision, layout: ParallelLayout, options: PlanOptions,
    process: ProcessOptions, datamodule: Any = None, planned: bool = False, fitting: bool = True,
    device: torch.device | None = None, local_processes: int = 1, module: torch.nn.Module | None = None,
) -> None:
    """Everything about a run that can be wrong before its first collective (see ``MPLSTMStrategy.check``).

    Args:
        blocks: the model's pipeline declaration.
        model_name: the module's class name, for messages.
        precision: Lightning's precision plugin for the run.
        layout: the resolved parallel layout.
        options: the planning options (partition, microbatches).
        process: the process options (batch checks).
        datamodule: where the batch shape comes from.
        planned: a plan exists already (``validate``/``test``/``predict`` after ``fit`` keep it).
        fitting: the run trains (the batch must split into the microbatches; its activations must fit).
        device: this process's device (the memory plan's budget; ``None``: memory is not checked).
        local_processes: the processes on this node (they share its memory).
        module: the module whose memory to plan (:func:`~lightning_mp_lstm.strategy.memory_check.check_memory`);
            ``None``: memory is not checked.
    """
    name = getattr(precision, "precision", None)
    if getattr(precision, "scaler", None) is not None or name in REFUSED_PRECISIONS:
        raise ValueError(f"precision={name!r} (float16) is not supported: the pipeline runs backward itself, "
                         "without a loss scaler, on a loss divided by the global token count; use "
                         "precision='32-true', 'bf16-mixed' (LSTMs in float32) or 'bf16-true'")
    options.check(blocks.block_names, layout)
    if process.shard_replicas:
        check_sharding(layout, name)
    if layout.tensor_parallel_size > 1:
        if not hasattr(blocks, "parallelize_vocabulary"):
            raise TypeError(f"tensor_parallel_size={layout.tensor_parallel_size} needs a model that splits its "
                            f"vocabulary layers (parallelize_vocabulary(mesh)); {model_name}'s has none")
        check_tensor_parallel = getattr(blocks, "check_tensor_parallel", None)
        if check_tensor_parallel is not None:
            check_tensor_parallel(layout.tensor_parallel_size)
    if planned:
        return
    measured = options.partition == "balanced" and options.balance_by == "time"
    if measured or options.auto_microbatches or options.auto_time_chunks:
        check_data(datamodule, "partition='balanced' with balance_by='time'" if measured
                   else "n_microbatches='auto'" if options.auto_microbatches else "time_chunks='auto'")
    if options.auto_microbatches:
        microbatch_candidates(layout, replica_rows(datamodule, layout), options.max_microbatches)
    elif fitting:
        process.check_batch(layout, datamodule)
    if layout.time_chunks > 1 and not options.auto_time_chunks:
        layout.check_time_chunks(getattr(datamodule, "bucket_lengths", None) or [])
    if device is not None and module is not None:
        plan_memory_of_run(module, blocks, layout, options, process, datamodule, device, local_processes,
                           purpose="fit" if fitting else "evaluate")


def check_sharding(layout: ParallelLayout, precision: str | None) -> None:
    """Refuse, by name, what ``shard_replicas=True`` cannot run with: its FSDP units run through schedules whose
    backward pass is whole (a split one asks each block for gradients of the parameters it holds between steps,
    which are shards), and parameters keep the dtype they were sharded in."""
    if schedule_style(layout.schedule)[0] not in SHARDED_SCHEDULES:
        raise LayoutError(f"shard_replicas=True with schedule={layout.schedule!r}: sharded replicas run schedules "
                          f"whose backward pass is whole; allowed: {', '.join(SHARDED_SCHEDULES)}")
    check_sharded_precision(precision)


def check_sharded_verify(verify: bool | str) -> None:
    """Refuse ``verify=True`` with sharded replicas: its check compares whole parameters."""
    if verify is True:
        raise ValueError("verify=True with shard_replicas=True: the check compares whole parameters, which "
                         "sharded replicas never hold; use verify='auto' or False, or shard_replicas=False")


def check_sharded_precision(precision: str | None) -> None:
    """Refuse a ``precision`` that sharded replicas cannot run at, naming the allowed ones."""
    if precision not in SHARDED_PRECISIONS:
        raise ValueError(f"shard_replicas=True with precision={precision!r}: sharded parameters keep float32; "
                         f"allowed: {', '.join(SHARDED_PRECISIONS)}")


def plan_memory_of_run(module: torch.nn.Module, blocks: PipelineModel, layout: ParallelLayout, options: PlanOptions,
                       process: ProcessOptions, datamodule: Any, device: torch.device, local_processes: int,
                       plan: PipelinePlan | None = None, purpose: str = "fit") -> Any:
    """The run's memory plan against what a process may use, refused when some process cannot hold its share (for
    the ``plan`` 's partition, or before planning for the partition that holds the least); the one-file checkpoint is
    counted unless the format is ``"sharded"`` (``"auto"`` saves sharded where one file would not fit). A run that
    only evaluates or predicts (``purpose``: :func:`~lightning_mp_lstm.planning.memory.plan_memory`) is planned for
    its parameters and evaluation batches, and saves nothing."""
    budget, source = process.memory_budget(device, local_processes)

    def budget_for(other: ParallelLayout) -> tuple[int | None, str]:
        return process.memory_budget(device, other.world_size) if process.memory_per_process == "auto" else (
            budget, source)

    arguments = (blocks, module, plan.layout if plan else layout, options, datamodule, budget, source, budget_for,
                 [list(stage) for stage in plan.partition] if plan else None)
    shard = layout.data_parallel_size if process.shard_replicas else 1
    if purpose != "fit":
        return check_memory(*arguments, shard=shard, purpose=purpose), process.checkpoint_format
    if process.checkpoint_format == "auto":
        try:
            return check_memory(*arguments, one_file_checkpoint=True, shard=shard), "file"
        except MemoryPlanError:
            return check_memory(*arguments, shard=shard), "sharded"
    return check_memory(*arguments, one_file_checkpoint=process.checkpoint_format == "file", shard=shard), \
        process.checkpoint_format


def plan_run(
    blocks: PipelineModel, layout: ParallelLayout, options: PlanOptions, datamodule: Any, precision: Precision,
    device: torch.device,
) -> PipelinePlan:
    """The run's plan, with blocks timed (where the options measure) in the dtypes they will train in."""
    length = getattr(datamodule, "mean_padded_length", None) or DEFAULT_LENGTH
    with precision.tensor_init_context(), precision.forward_context():
        return make_plan(blocks, layout, options, replica_rows(datamodule, layout), max(1, round(length)), device,
                         getattr(datamodule, "bucket_lengths", None))


def assemble_engine(
    module: torch.nn.Module, blocks: PipelineModel, plan: PipelinePlan, mesh: DeviceMesh, rank: int,
    device: torch.device, aliases: dict[str, str], shard: bool = False,
) -> PipelineEngine:
    """Prune ``module`` to this process's stages and build the engine that runs them: tensor-parallel vocabulary
    layers on the mesh's ``tensor_parallel`` dimension, and the tied-weight groups of the copies this process
    holds (after pruning); with ``shard``, each stage's parameters sharded over its replicas (FSDP2,
    :mod:`~lightning_mp_lstm.pipeline.sharding`)."""
    layout = plan.layout
    data_parallel_rank, pipeline_rank = layout.coordinates(rank)[:2]
    engine = build_engine(blocks, layout, plan.partition, pipeline_rank, data_parallel_rank, ProcessGroups.of(mesh),
                          device, seed=torch.initial_seed())
    # Replicas and tensor-parallel peers start from the first one's values, as DDP's replicas do: a process that drew
    # its own (no seed_everything) would otherwise train another model than its peers.
    held = _held_tensors(module, engine)
    copy_from_first(held, engine.groups.data_parallel)
    copy_from_first(held, engine.groups.tensor_parallel)  # the blocks it does not split are computed by each peer
    if layout.tensor_parallel_size > 1:
        blocks.parallelize_vocabulary(mesh["tensor_parallel"])
    if shard and layout.data_parallel_size > 1:
        shard_stages(engine.stage_modules.values(), mesh["data_parallel"], module)
        engine.sharded = True
    engine.tied = TiedWeights.build(module, aliases, layout)
    engine.tied.copy_first_owners()
    for stage in engine.stage_modules.values():  # the user's modules keep the modes Lightning and the user give them
        stage.leave_modes_to(module)
    return engine


def _held_tensors(module: torch.nn.Module, engine: PipelineEngine) -> list[torch.Tensor]:
    """This process's parameters and buffers, its stages' (a model's adapter blocks included) and its module's, each
    once, in an order every replica of its stages shares."""
    seen: set[int] = set()
    held = []
    for part in (*(engine.stage_modules[index] for index in sorted(engine.stage_modules)), module):
        for tensor in (*part.parameters(), *part.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                held.append(tensor)
    return held


def share_random_state(device: torch.device) -> None:
    """Give every process global rank 0's random state: torch's (on the CPU and a CUDA ``device``), numpy's and
    Python's (a collective). After ``seed_everything`` (Lightning's ``reset_seed`` restored it on every process)
    nothing changes. Without it each process drew its own, and a shuffling ``DataLoader`` or a random transform of the
    user's would give each process other batches: a replica's processes must load the same one, and replicas given the
    whole global batch take their rows of the same one."""
    def states() -> tuple[Any, ...]:
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return torch.get_rng_state(), np.random.get_state(), random.getstate(), accelerator

    cpu, numpy_state, python_state, accelerator = result_from(0, states)
    torch.set_rng_state(cpu)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if accelerator is not None and device.type == "cuda":
        torch.cuda.set_rng_state(accelerator, device)


def report_not_reproduced(module: torch.nn.Module, blocks: PipelineModel, warn: bool = True,
                          split: bool = False) -> None:
    """Name, before training, what the pipeline would not reproduce of ``module`` 's own training step and, when
    ``split`` (each process holds part of the model), its gradient hooks
    (:mod:`~lightning_mp_lstm.models.module_audit`): parameters outside the declared blocks stop the run (they would
    never be trained); everything else is one :class:`~lightning_mp_lstm.models.module_audit.NotReproducedWarning` (when
    ``warn``: on one rank).

    Raises:
        ModelDeclarationError: parameters no declared block holds.
    """
    declaration = getattr(blocks, "declaration", None)
    if declaration is None or getattr(blocks, "module", None) is not module:
        return  # a custom pipeline model: it says itself what it runs
    name = type(module).__name__
    outside = parameters_outside(module, [declaration.embedding, declaration.lstm, declaration.decoder])
    if outside:
        raise ModelDeclarationError(
            f"{name} has parameters outside its declared blocks, which the pipeline would never train: "
            f"{', '.join(outside)}. mp_lstm splits embedding -> LSTM layers -> decoder; move them into those "
            "modules, or keep this model on one process")
    findings = audit(module, declaration, split=split)
    if findings and warn:
        warnings.warn(render_findings(name, findings), NotReproducedWarning, stacklevel=2)


def library_model(module: Any) -> bool:
    """Whether ``module`` is one of this library's own models (their declared pieces are their training step, which
    the library's tests check; ``verify="auto"`` leaves them out)."""
    return type(module).__module__.startswith("lightning_mp_lstm.")


def make_verifier(module: torch.nn.Module, blocks: PipelineModel, verify: bool | str, rank_zero: bool,
                  layout: ParallelLayout, memory: Any = None, sharded: bool = False) -> Any:
    """The :class:`~lightning_mp_lstm.strategy.verify.Verifier` of ``module`` 's declaration, made before the pipeline
    prunes the module (global rank 0 keeps hold of every block: ``rank_zero``), or ``None`` where it is skipped
    (``verify=False`` too), with one line saying why. ``verify="auto"`` checks a user's module whenever global rank 0
    holds all of it (built normally, not on the meta device, and with room for its gradients beside its own share where
    the memory plan has a budget); the library's own :class:`~lightning_mp_lstm.LSTMLanguageModel`, whose pieces are
    its training step, is checked by the test suite. Every rank decides alike (from the module's kind and global rank
    0's memory plan).

    Raises:
        TypeError: ``verify=True`` on a custom pipeline model (it has no ``training_step`` of its own to compare).
    """
    from lightning_mp_lstm.strategy.verify import Verifier  # only when verifying
    from lightning_mp_lstm.strategy.whole_module import WholeModule

    declaration = getattr(blocks, "declaration", None)
    name = type(module).__name__
    if declaration is None or getattr(blocks, "module", None) is not module:
        if verify is True:
            raise TypeError("verify=True compares a module with its LSTMBlocks declaration; a custom pipeline model "
                            "has no training_step of its own to compare with")
        return None
    skip = None
    if verify is False:
        skip = "verify=False"
    elif sharded:
        skip = "shard_replicas=True keeps no replica's parameters whole to compare"
    elif any(p.is_meta for p in module.parameters()):
        skip = (f"{name} was built on the meta device (trainer.init_module(empty_init=True)), and no process holds the "
                "whole model to run its own training_step; build it normally to check the declaration")
    elif verify == "auto" and library_model(module):
        skip = (f"{name} is this library's own model, whose declared pieces are its training step (checked by the "
                "library's tests); verify=True checks it here too")
    elif verify == "auto" and memory is not None and memory.budget is not None:
        whole = 2 * sum(p.numel() * p.element_size() for p in module.parameters())
        need = memory.ranks[0].training + whole
        if need > memory.budget:
            skip = (f"global rank 0 would need {need / 2**20:,.0f} MiB to run {name}'s own training_step beside its "
                    f"share (budget {memory.budget / 2**20:,.0f} MiB); verify=True checks it anyway")
    if skip is not None:
        rank_zero_info(f"mp_lstm: the numerical check of the declaration is skipped: {skip}")
        return None
    paths = (declaration.embedding, declaration.lstm, declaration.decoder)
    whole = WholeModule(module, paths, layout.tensor_parallel_size > 1) if rank_zero else None
    return Verifier(whole, blocks.block_names, declaration.time_first, declaration.log_name, declaration.lstm,
                    declaration.reduction)
