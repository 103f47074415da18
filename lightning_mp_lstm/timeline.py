"""A measured timeline of pipeline steps: where a step's time goes on every rank.

:class:`PipelineTimeline` is a Lightning callback. For a few sampled training steps it records, on every rank,
the wall-clock span of each microbatch's forward and backward (input and weight parts where the schedule splits
them) and of each send and receive of the schedule (CUDA events on GPUs). Between sampled steps a recording
costs one attribute check per stage call. After each sampled step it logs tokens/s, every stage's busy time
and the measured bubble next to the schedule's predicted one; at the end of training global rank 0 writes a
picture (matplotlib PNG: stages x time) and a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev) with
real durations and send -> receive arrows, one process row per rank.

torch's pipelining only draws a schedule's *planned* order (unit time steps); this is what happened.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_mp_lstm.faults import gather

__all__ = ["RECORDER", "PipelineTimeline", "Span", "StepRecord", "chrome_trace", "draw", "predicted_bubble"]

COMPUTE = ("forward", "backward", "backward_input", "backward_weight", "compute")
COMMUNICATION = ("send", "recv")
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "backward_input": "#c44e52", "backward_weight": "#937860",
            "compute": "#8172b3", "send": "#55a868", "recv": "#8c8c8c"}


@dataclass(frozen=True)
class Span:
    """One recorded interval, in seconds from the start of its step (aligned across ranks).

    Attributes:
        rank: global rank that ran it.
        stage: the pipeline stage it belongs to.
        kind: one of :data:`COMPUTE` or :data:`COMMUNICATION`.
        microbatch: the microbatch index.
        start, end: seconds since the step started.
        direction: for communication, ``"forward"`` (activations) or ``"backward"`` (gradients).
        peer_stage: for communication, the stage on the other side.
    """

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    direction: str = ""
    peer_stage: int | None = None

    @property
    def flow_id(self) -> str | None:
        """Identifies a transfer: a send and its receive share it."""
        if self.kind not in COMMUNICATION or self.peer_stage is None:
            return None
        sender, receiver = (self.stage, self.peer_stage) if self.kind == "send" else (self.peer_stage, self.stage)
        return f"{self.direction}:{sender}->{receiver}:{self.microbatch}"


@dataclass
class StepRecord:
    """Every rank's spans of one training step, and what they add up to."""

    step: int
    wall: float
    spans: list[Span]
    tokens: int
    num_stages: int
    n_microbatches: int
    schedule: str
    stage_ranks: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """The inverse of ``dataclasses.asdict``."""
        fields = dict(data)
        fields["spans"] = [Span(**span) for span in data["spans"]]
        fields["stage_ranks"] = {int(k): v for k, v in data.get("stage_ranks", {}).items()}
        return cls(**fields)

    def busy(self) -> dict[int, float]:
        """Seconds of computation per stage."""
        out = {s: 0.0 for s in range(self.num_stages)}
        for span in self.spans:
            if span.kind in COMPUTE:
                out[span.stage] += span.end - span.start
        return out

    def busy_per_rank(self) -> dict[int, float]:
        """Seconds of computation per rank."""
        out: dict[int, float] = {}
        for span in self.spans:
            if span.kind in COMPUTE:
                out[span.rank] = out.get(span.rank, 0.0) + span.end - span.start
        return out

    def bubble(self) -> float:
        """Measured fraction of the step the ranks spent not computing (waiting, communicating, idle)."""
        busy = self.busy_per_rank()
        ranks = sorted({span.rank for span in self.spans}) or [0]
        return 1.0 - sum(busy.get(r, 0.0) for r in ranks) / (len(ranks) * self.wall) if self.wall > 0 else 0.0


def predicted_bubble(schedule: str, num_ranks: int, stages_per_rank: int, n_microbatches: int) -> float:
    """The idle fraction a schedule leaves with equal stage times and free communication.

    GPipe / 1F1B: ``(p - 1) / (m + p - 1)`` for ``p`` pipeline ranks and ``m`` microbatches; interleaved
    schedules with ``v`` stages per rank divide the fill and drain by ``v``: ``(p - 1) / (v m + p - 1)``.
    Zero-bubble schedules are reported with the interleaved formula (an upper bound).
    """
    p, m, v = num_ranks, n_microbatches, stages_per_rank
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)


class Recorder:
    """Collects spans in this process while a step is being recorded (one per process: :data:`RECORDER`)."""

    def __init__(self) -> None:
        self.active = False
        self._device: torch.device | None = None
        self._origin = 0.0
        self._raw: list[tuple[Any, ...]] = []
        self._tags: dict[int, tuple[str, str, int, int, int]] = {}
        self._pending: dict[int, tuple[list[tuple[str, str, int, int, int]], float]] = {}
        self._patched: dict[str, Any] = {}

    # ----- clocks ------------------------------------------------------------------------------------------
    def _mark(self) -> Any:
        if self._device is not None and self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark - self._origin
        return self._reference.elapsed_time(mark) / 1000.0  # CUDA events: milliseconds after the reference

    # ----- recording -------------------------------------------------------------------------------------
    @contextmanager
    def _span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self._raw.append((kind, stage, microbatch, start, self._mark(), "", None))

    def span(self, kind: str, stage: int, microbatch: int) -> Any:
        """A context manager recording ``kind`` work of ``stage`` on ``microbatch`` (nothing when inactive)."""
        return self._span(kind, stage, microbatch) if self.active else nullcontext()

    def tag(self, ops: Sequence[Any], kind: str, direction: str, stage: int, microbatch: int) -> Sequence[Any]:
        """Remember what the point-to-point ``ops`` carry, so their wait is recorded as ``kind`` spans."""
        if self.active:
            peer = stage + 1 if (direction == "forward") == (kind == "send") else stage - 1
            for op in ops:
                self._tags[id(op)] = (kind, direction, stage, microbatch, peer)
        return ops

    def _batch_p2p(self, ops: list[Any], desc: str | None = None) -> list[Any]:
        issued = time.perf_counter()
        works = self._patched["_batch_p2p"](ops, desc=desc)
        tags = [self._tags.pop(id(op)) for op in ops if id(op) in self._tags]
        for work in works:
            self._pending[id(work)] = (tags, issued)
        return works

    def _wait_batch_p2p(self, works: list[Any]) -> None:
        start = time.perf_counter()
        self._patched["_wait_batch_p2p"](works)
        end = time.perf_counter()
        seen = set()
        for work in works:
            tags, issued = self._pending.pop(id(work), ([], start))
            for kind, direction, stage, microbatch, peer in tags:
                if (kind, direction, stage, microbatch) in seen:
                    continue
                seen.add((kind, direction, stage, microbatch))
                # A receive waits for data from the wait's start; a send is in flight from when it was issued.
                begin = issued if kind == "send" else start
                self._raw.append((kind, stage, microbatch, begin, end, direction, peer))

    def start(self, device: torch.device) -> None:
        """Begin recording a step; aligns the clock of every rank (a barrier when a process group exists)."""
        from torch.distributed.pipelining import schedules

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._device = device
        self._raw, self._tags, self._pending = [], {}, {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record()
        self._origin = time.perf_counter()
        for name in ("_batch_p2p", "_wait_batch_p2p"):
            self._patched[name] = getattr(schedules, name)
            setattr(schedules, name, getattr(self, name))
        self.active = True

    def stop(self) -> tuple[float, list[tuple[Any, ...]]]:
        """End the step; returns its wall time and this rank's spans (``(kind, stage, mb, start, end, ...)``)."""
        from torch.distributed.pipelining import schedules

        self.active = False
        for name, original in self._patched.items():
            setattr(schedules, name, original)
        self._patched = {}
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        wall = time.perf_counter() - self._origin
        spans = []
        for kind, stage, microbatch, start, end, direction, peer in self._raw:
            if kind in COMMUNICATION:  # host clock
                begin, finish = start - self._origin, end - self._origin
            else:
                begin, finish = self._seconds(start), self._seconds(end)
            spans.append((kind, stage, microbatch, begin, max(finish, begin + 1e-6), direction, peer))
        self._raw = []
        return wall, spans


#: The recorder of this process; pipeline stages report to it.
RECORDER = Recorder()


def chrome_trace(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The recorded steps as a Chrome trace (``{"traceEvents": [...]}``, microseconds): one process per rank,
    a thread for computation and one each for sends and receives, and a flow arrow from every send to its
    receive. Steps follow each other on the time axis."""
    events: list[dict[str, Any]] = []
    threads = {"compute": 0, "send": 1, "recv": 2}
    offset = 0.0
    ranks = sorted({span.rank for record in records for span in record.spans})
    for rank in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for thread, tid in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": thread}})
    for record in records:
        for span in record.spans:
            tid = threads["compute"] if span.kind in COMPUTE else threads[span.kind]
            ts, dur = (offset + span.start) * 1e6, max((span.end - span.start) * 1e6, 1.0)
            events.append({"name": f"{span.kind} mb{span.microbatch}", "cat": span.kind, "ph": "X", "ts": ts,
                           "dur": dur, "pid": span.rank, "tid": tid,
                           "args": {"stage": span.stage, "microbatch": span.microbatch, "step": record.step}})
            flow = span.flow_id
            if flow is not None:
                # The arrow leaves the send when it is issued and enters the receive when its wait ends.
                phase, at = ("s", ts) if span.kind == "send" else ("f", ts + dur)
                event = {"name": "transfer", "cat": "flow", "ph": phase, "id": f"{record.step}:{flow}", "ts": at,
                         "pid": span.rank, "tid": tid}
                if phase == "f":
                    event["bp"] = "e"
                events.append(event)
        offset += record.wall + 1e-3
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw(record: StepRecord, path: str | Path) -> Any:
    """A picture of one step: one row per stage of every rank that ran it (with data parallelism each replica
    gets its own rows), time across; forward, backward and communication in their colours, microbatch numbers
    on the spans, idle time left blank. Saved as PNG; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # Rows: (stage, rank) pairs, replica by replica (a rank's offset from its stage's rank in replica 0 groups
    # the replicas), stages in order within each.
    pairs = sorted({(span.stage, span.rank) for span in record.spans} or {(0, 0)},
                   key=lambda p: (p[1] - record.stage_ranks.get(p[0], p[1]), p[0]))
    row_of = {pair: i for i, pair in enumerate(pairs)}
    rows = len(pairs)
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.7 * rows), dpi=100)
    for span in record.spans:
        compute = span.kind in COMPUTE
        row = row_of[(span.stage, span.rank)]
        height, bottom = (0.6, row - 0.3) if compute else (0.18, row + 0.32)
        start, width = span.start * 1e3, (span.end - span.start) * 1e3
        axes.broken_barh([(start, width)], (bottom, height), facecolors=_COLOURS[span.kind], edgecolor="white",
                         linewidth=0.3)
        if compute and width > record.wall * 1e3 / 80:
            axes.text(start + width / 2, row, str(span.microbatch), ha="center", va="center", fontsize=7,
                      color="white")
    axes.set_yticks(range(rows))
    axes.set_yticklabels([f"stage {stage} (rank {rank})" for stage, rank in pairs])
    axes.set_ylim(rows - 0.5, -0.5)
    axes.set_xlim(0, record.wall * 1e3)
    axes.set_xlabel("milliseconds since the step started")
    predicted = predicted_bubble(record.schedule, len(set(record.stage_ranks.values())) or 1,
                                 max(1, record.num_stages // max(1, len(set(record.stage_ranks.values())))),
                                 record.n_microbatches)
    axes.set_title(f"step {record.step}: {record.schedule}, {record.n_microbatches} microbatches, "
                   f"{record.wall * 1e3:.1f} ms; bubble measured {record.bubble():.1%}, predicted {predicted:.1%}")
    kinds = sorted({span.kind for span in record.spans}, key=list(_COLOURS).index)
    axes.legend(handles=[Patch(color=_COLOURS[k], label=k) for k in kinds], loc="upper right", fontsize=7,
                ncol=len(kinds))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return figure


class PipelineTimeline(pl.Callback):
    """Record where sampled training steps spend their time, on every rank; log it and draw it.

    Args:
        steps: the global steps to record (0-based; before warm-up ends the first step includes building the
            stages for new shapes). Default: steps 2 and 3.
        directory: where to write ``timeline.png`` and ``timeline.json``; default: the trainer's log directory
            (or its ``default_root_dir``).
        filename: the two files' name, without extension.

    After each recorded step it logs ``timeline/tokens_per_s``, ``timeline/busy_s/stage_<i>``,
    ``timeline/bubble_measured`` and ``timeline/bubble_predicted``; :attr:`records` holds the steps and
    :attr:`paths` the written files (global rank 0).
    """

    def __init__(self, steps: Sequence[int] = (2, 3), directory: str | Path | None = None,
                 filename: str = "timeline") -> None:
        self.steps = {int(s) for s in steps}
        self.directory = Path(directory) if directory is not None else None
        self.filename = filename
        self.records: list[StepRecord] = []
        self.paths: dict[str, Path] = {}
        self._recording = False
        self._step = -1
        self.metrics: dict[str, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if step in self.steps and step not in {r.step for r in self.records} and not self._recording:
            RECORDER.start(trainer.strategy.root_device)
            self._recording, self._step = True, step

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
                            num_stages=num_stages, n_microbatches=layout.n_microbatches if layout else 1,
                            schedule=layout.schedule if layout else "none", stage_ranks=stage_ranks)
        self.records.append(record)
        p = layout.pipeline_parallel_size if layout is not None else 1
        v = layout.stages_per_rank if layout is not None else 1
        metrics = {"timeline/tokens_per_s": tokens / record.wall if record.wall else 0.0,
                   "timeline/bubble_measured": record.bubble(),
                   "timeline/bubble_predicted": predicted_bubble(record.schedule, p, v, record.n_microbatches)}
        metrics.update({f"timeline/busy_s/stage_{s}": t for s, t in record.busy().items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._step)
        self.metrics = metrics

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.records or not trainer.is_global_zero:
            return
        directory = self.directory or Path(trainer.log_dir or trainer.default_root_dir)
        directory.mkdir(parents=True, exist_ok=True)
        png, trace = directory / f"{self.filename}.png", directory / f"{self.filename}.json"
        draw(self.records[-1], png)
        trace.write_text(json.dumps(chrome_trace(self.records)))
        self.paths = {"png": png, "trace": trace}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": sorted(self.steps)}

    def records_as_dicts(self) -> list[dict[str, Any]]:
        """The records, for saving or sending between processes."""
        return [{**asdict(r), "spans": [asdict(s) for s in r.spans]} for r in self.records]
