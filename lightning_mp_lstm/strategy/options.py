"""How the ``mp_lstm`` strategy arranges its processes, as the user chose it: validated once, on construction.

:class:`ProcessOptions` holds the data-, pipeline- and tensor-parallel sizes, the schedule, the replicas' batch
shares and the run-time settings; it resolves them into a :class:`~lightning_mp_lstm.planning.layout.ParallelLayout` for
a world size, says how many processes a model needs, and checks that a data module's batches fit. Partition options
are :class:`~lightning_mp_lstm.planning.plan.PlanOptions`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_mp_lstm.base.validation import check_positive_int, check_positive_number
from lightning_mp_lstm.planning.activations import GIB, memory_per_process
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout, default_stages_per_rank, schedule_style
from lightning_mp_lstm.strategy.precision import NUMERICS

__all__ = ["CHECKPOINT_FORMATS", "ProcessOptions"]

#: ``"file"``: one file gathered on global rank 0; ``"sharded"``: every rank writes its own tensors; ``"auto"``: one
#: file where global rank 0 can hold the whole model and its optimizer state beside its own, else sharded.
CHECKPOINT_FORMATS = ("auto", "file", "sharded")


@dataclass(frozen=True)
class ProcessOptions:
    """The strategy's process options (see :class:`~lightning_mp_lstm.MPLSTMStrategy` for each); a value that can
    never work raises on construction, naming it and what is allowed."""

    pipeline_parallel_size: int | str = "auto"
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_weights: tuple[float, ...] | None = None
    stages_per_rank: int | None = None
    schedule: str = "1F1B"
    checkpoint_format: str = "file"
    timeout: timedelta = timedelta(seconds=300)
    num_threads: int | str = "auto"
    numerics: str = "default"
    memory_per_process: float | str = "auto"
    shard_replicas: bool = False

    def __post_init__(self) -> None:
        check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size, LayoutError, also=("auto",))
        check_positive_int("data_parallel_size", self.data_parallel_size, LayoutError)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size, LayoutError)
        weights = self.data_parallel_weights
        if weights is not None:
            if isinstance(weights, str) or not isinstance(weights, Sequence):
                raise LayoutError(f"data_parallel_weights must be positive numbers, one per replica, got {weights!r}")
            object.__setattr__(self, "data_parallel_weights", tuple(
                check_positive_number(f"data_parallel_weights (got {list(weights)!r}): each weight", w, LayoutError)
                for w in weights))
        if self.stages_per_rank is not None:
            check_positive_int("stages_per_rank", self.stages_per_rank, LayoutError)
        schedule_style(self.schedule)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"unknown checkpoint_format {self.checkpoint_format!r}; allowed: "
                             f"{', '.join(CHECKPOINT_FORMATS)}")
        timeout = self.timeout
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        check_positive_number("timeout (seconds or a timedelta)", seconds)
        object.__setattr__(self, "timeout", timedelta(seconds=float(seconds)))
        check_positive_int("num_threads", self.num_threads, also=("auto",))
        if self.numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {self.numerics!r}; allowed: {', '.join(NUMERICS)}")
        if self.memory_per_process != "auto":
            check_positive_number("memory_per_process (GiB, or 'auto')", self.memory_per_process)
        self._check_sharding()

    def _check_sharding(self) -> None:
        """``shard_replicas`` is a bool, and the options it cannot run with are refused by name."""
        if not isinstance(self.shard_replicas, bool):
            raise ValueError(f"shard_replicas must be True or False, got {self.shard_replicas!r}")
        if not self.shard_replicas:
            return
        if self.tensor_parallel_size > 1:
            raise LayoutError(f"shard_replicas=True with tensor_parallel_size={self.tensor_parallel_size}: sharding "
                              "the replicas of a vocabulary-split stage is not supported; use tensor_parallel_size=1")
        if self.data_parallel_weights is not None:
            raise LayoutError(f"shard_replicas=True with data_parallel_weights={list(self.data_parallel_weights)}: "
                              "sharded replicas gather their parameters together, so their batches must be equal; "
                              "use data_parallel_weights=None")

    def memory_budget(self, device: Any, local_processes: int) -> tuple[int | None, str]:
        """Bytes one process may use, and where that comes from: ``memory_per_process`` GiB, or (``"auto"``) the
        GPU's memory, or the machine's (its cgroup's limit) shared by this node's ``local_processes``."""
        if self.memory_per_process != "auto":
            return int(float(self.memory_per_process) * GIB), f"strategy.memory_per_process={self.memory_per_process}"
        where = "the GPU's memory" if device.type == "cuda" else f"this machine's over {local_processes} processes"
        return memory_per_process(device, local_processes), f"{where}; strategy.memory_per_process sets it"

    @property
    def fixed_world_size(self) -> int | None:
        """The processes the options alone determine (an explicit pipeline size), else ``None``."""
        if self.pipeline_parallel_size == "auto":
            return None
        return self.pipeline_parallel_size * self.data_parallel_size * self.tensor_parallel_size

    def resolve(self, world_size: int, n_microbatches: int | None, time_chunks: int | None = None) -> ParallelLayout:
        """The layout for ``world_size`` processes (``n_microbatches``, ``time_chunks``: ``None`` for the default)."""
        layout = ParallelLayout.resolve(world_size, self.data_parallel_size, self.pipeline_parallel_size,
                                        self.stages_per_rank, self.schedule, n_microbatches,
                                        self.tensor_parallel_size, time_chunks)
        weights = self.data_parallel_weights
        if weights is not None and len(weights) != layout.data_parallel_size:
            raise LayoutError(f"data_parallel_weights={list(weights)} must hold one positive weight per replica "
                              f"(data_parallel_size={layout.data_parallel_size})")
        return layout

    def processes_for(self, stages: int | None) -> int | None:
        """The processes a pipeline of ``stages`` stages needs (``None``: not determined by the options)."""
        if self.fixed_world_size is not None:
            return self.fixed_world_size
        if stages is None:
            return None
        _, style = schedule_style(self.schedule)
        spr = self.stages_per_rank or default_stages_per_rank(style)
        if stages % spr:
            raise LayoutError(f"the partition has {stages} stages, which is not a multiple of stages_per_rank={spr}")
        return self.data_parallel_size * self.tensor_parallel_size * (stages // spr)

    def threads(self, local_processes: int) -> int:
        """CPU threads per process: ``num_threads``, or the machine's cores shared by the local processes."""
        if self.num_threads != "auto":
            return int(self.num_threads)
        return max(1, (os.cpu_count() or 1) // max(1, local_processes))

    def check_batch(self, layout: ParallelLayout, datamodule: Any) -> None:
        """Raise :class:`LayoutError` when the data module's fixed global batch cannot be shared by the replicas and
        split into the layout's microbatches (budgets and weighted shares vary the rows: ragged batches get rows
        that add nothing to the loss)."""
        batch_size = getattr(datamodule, "batch_size", None)
        if not isinstance(batch_size, int) or getattr(datamodule, "max_tokens", None) or self.data_parallel_weights:
            return
        dp = layout.data_parallel_size
        if batch_size % dp:
            raise LayoutError(f"batch_size={batch_size} sentences must split evenly over data_parallel_size={dp} "
                              "replicas")
        layout.check_batch(batch_size // dp)
