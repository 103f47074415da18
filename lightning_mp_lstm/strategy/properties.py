"""The ``mp_lstm`` strategy's options as the run resolved them, mixed into ``MPLSTMStrategy`` from
:class:`PipelineProperties`: the layout for the world size, the processes a model needs, the plan and the engine made
in ``setup``, this process's ranks in the mesh, and what Lightning's data loading asks of them. Read-only: the
strategy sets what they read."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.pipeline.engine import PipelineEngine
from lightning_mp_lstm.planning import report
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.plan import PipelinePlan, PlanOptions
from lightning_mp_lstm.strategy.options import ProcessOptions

__all__ = ["PipelineProperties"]


class PipelineProperties:
    """The layout, plan and engine of a run and this process's place in them, as properties of a Lightning
    ``Strategy`` that sets the options (``_options``, ``_process``), the resolved layout (``_layout``), the plan
    (``_plan``), the engine and the module it split (``_engine``, ``_engine_module``), the device mesh and the
    measurements of the report."""

    _options: PlanOptions
    _process: ProcessOptions
    _process_group_backend: str | None
    _layout: ParallelLayout | None
    _plan: PipelinePlan | None
    _engine: PipelineEngine | None
    _engine_module: Any
    _device_mesh: DeviceMesh | None
    _measurements: report.Measurements | None
    global_rank: int

    def _resolve_layout(self, world_size: int) -> ParallelLayout:
        """The layout for ``world_size`` processes, resolved once: later ``validate``/``test``/``predict`` calls
        keep what ``fit`` resolved (the ``n_microbatches`` the plan chose included)."""
        if self._plan is not None:
            return self._plan.layout
        if self._layout is None or self._layout.world_size != world_size:
            m, k = self._options.n_microbatches, self._options.time_chunks
            self._layout = self._process.resolve(world_size, m if isinstance(m, int) else None,
                                                 k if isinstance(k, int) else None)
        return self._layout

    def processes_for(self, model: pl.LightningModule) -> int | None:
        """The number of processes this strategy needs for ``model``, when its options determine it (an explicit
        ``pipeline_parallel_size``, or a partition with a stage count); else ``None``: the Trainer's devices."""
        if self._process.fixed_world_size is not None:
            return self._process.fixed_world_size
        return self._process.processes_for(self._options.stage_count(self._blocks(model).block_names))

    @property
    def layout(self) -> ParallelLayout:
        """The resolved parallel layout (once the world size is known; after planning, with the chosen number of
        microbatches)."""
        if self._plan is not None:
            return self._plan.layout
        if self._layout is None:
            raise RuntimeError("the layout is known once the processes are set up")
        return self._layout

    @property
    def plan(self) -> PipelinePlan:
        """The pipeline plan: partition, number of microbatches, costs and predictions (after ``setup``)."""
        if self._plan is None:
            raise RuntimeError("the plan is made in setup()")
        return self._plan

    @property
    def partition(self) -> list[list[str]]:
        """Block names of every pipeline stage, in stage order (known after ``setup``)."""
        return [list(stage) for stage in self.plan.partition]

    @property
    def engine(self) -> PipelineEngine:
        """The engine that runs this process's stages (after ``setup``)."""
        if self._engine is None:
            raise RuntimeError("the pipeline engine is built in setup()")
        return self._engine

    @property
    def measurements(self) -> report.Measurements | None:
        """Stage and step times measured after ``report_after_steps`` training batches."""
        return self._measurements

    @property
    def report(self) -> str:
        """The partition report: the plan, and what was measured while it ran."""
        return report.render(self.plan, self._measurements)

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
        weights = self._process.data_parallel_weights
        return list(weights) if weights is not None else None

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend


    def _blocks(self, module: pl.LightningModule) -> PipelineModel:
        """The pipeline view of ``module``: the engine's, once it split this module (it is pruned then)."""
        if self._engine is not None and self._engine_module is module:
            return self._engine.model
        return pipeline_model(module)
