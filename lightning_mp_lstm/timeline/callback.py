"""The Lightning callback: records sampled training steps on every rank, logs what they add up to and, at the end
of training, draws the last one and writes them all as a Chrome trace."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_mp_lstm.base.faults import gather
from lightning_mp_lstm.timeline.picture import draw
from lightning_mp_lstm.timeline.record import Span, StepRecord, predicted_bubble
from lightning_mp_lstm.timeline.recorder import RECORDER
from lightning_mp_lstm.timeline.torch_p2p import require
from lightning_mp_lstm.timeline.trace import chrome_trace

__all__ = ["PipelineTimeline"]


class PipelineTimeline(pl.Callback):
    """Record where sampled training steps spend their time, on every rank; log it and draw it.

    After each recorded step it logs ``timeline/tokens_per_s``, ``timeline/busy_s/stage_<i>``,
    ``timeline/bubble_measured``, ``timeline/bubble_schedule`` and ``timeline/bubble_predicted``; :attr:`records`
    holds the steps and :attr:`paths` the written files (global rank 0).

    Args:
        steps: the global steps to record (0-based; before warm-up ends the first step includes building the
            stages for new shapes). Default: steps 2 and 3.
        directory: where to write ``timeline.png`` and ``timeline.json``; default: the trainer's log directory
            (or its ``default_root_dir``).
        filename: the two files' name, without extension.
    """

    def __init__(self, steps: Sequence[int] = (2, 3), directory: str | Path | None = None,
                 filename: str = "timeline") -> None:
        self.steps = {int(s) for s in steps}
        self.directory = Path(directory) if directory is not None else None
        self.filename = filename
        #: The recorded steps, in order (every rank holds every rank's spans).
        self.records: list[StepRecord] = []
        #: ``{"png": ..., "trace": ...}``: the files written at the end of training (global rank 0).
        self.paths: dict[str, Path] = {}
        #: What the last recorded step logged.
        self.metrics: dict[str, float] = {}
        self._recording = False
        self._step = -1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.steps:
            require()  # an unsupported torch fails before training, not at the first recorded step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if step in self.steps and step not in {r.step for r in self.records} and not self._recording:
            RECORDER.start(trainer.strategy.root_device)
            self._recording, self._step = True, step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._recording:
            return
        self._recording = False
        wall, local = RECORDER.stop()
        if not local:  # a strategy whose stages do not report: the whole step counts as one computation
            local = [("compute", 0, 0, 0.0, wall, "", None)]
        engine = getattr(trainer.strategy, "engine", None)  # None under another strategy
        tokens = int(engine.last_tokens) if engine is not None and engine.last_tokens is not None else 0
        rank = trainer.global_rank
        parts = gather(lambda: (rank, wall, local))
        spans = [Span(r, stage, kind=kind, microbatch=mb, start=start, end=end, direction=direction,
                      peer_stage=peer) for r, _, rank_spans in parts
                 for kind, stage, mb, start, end, direction, peer in rank_spans]
        layout = getattr(trainer.strategy, "layout", None)
        num_stages = layout.num_stages if layout is not None else 1
        stage_ranks = {s: layout.rank_of_stage(s) for s in range(num_stages)} if layout is not None else {0: 0}
        record = StepRecord(step=self._step, wall=max(w for _, w, _ in parts), spans=spans, tokens=tokens,
                            num_stages=num_stages, n_microbatches=layout.units if layout else 1,
                            schedule=layout.schedule if layout else "none", stage_ranks=stage_ranks,
                            rank_walls={r: w for r, w, _ in parts})
        self.records.append(record)
        p = layout.pipeline_parallel_size if layout is not None else 1
        v = layout.stages_per_rank if layout is not None else 1
        metrics = {"timeline/tokens_per_s": tokens / record.wall if record.wall else 0.0,
                   "timeline/step_s": record.wall, "timeline/tail": record.tail,
                   "timeline/batch_elements": _elements(batch),
                   "timeline/bubble_measured": record.bubble(),
                   "timeline/bubble_schedule": record.schedule_bubble(),
                   "timeline/bubble_predicted": predicted_bubble(record.schedule, p, v, record.n_microbatches)}
        metrics.update({f"timeline/busy_s/stage_{s}": t for s, t in record.busy().items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._step)
        self.metrics = metrics

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.records:
            return
        # Every rank asks: Lightning's log_dir broadcasts rank 0's (a collective), so asking on rank 0 alone hangs.
        directory = self.directory or Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        directory.mkdir(parents=True, exist_ok=True)
        png, trace = directory / f"{self.filename}.png", directory / f"{self.filename}.json"
        draw(self.records[-1], png)
        trace.write_text(json.dumps(chrome_trace(self.records)))
        self.paths = {"png": png, "trace": trace}

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._recording:  # leave torch's schedules as they were for whatever runs next in this process
            self._recording = False
            RECORDER.abort()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": sorted(self.steps)}

    def records_as_dicts(self) -> list[dict[str, Any]]:
        """The records as plain data, for saving or sending between processes (:meth:`StepRecord.from_dict`
        reads one back)."""
        return [record.as_dict() for record in self.records]


def _elements(batch: Any) -> float:
    """Elements of the batch's first tensor (padding included: its shape's size), 0 when it has none: steps with
    the same count ran the same shapes."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return float(first.numel()) if isinstance(first, torch.Tensor) else 0.0
