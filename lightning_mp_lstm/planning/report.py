"""The partition report: a plan, and what was measured while it ran, as a fixed-width table.

The plan (:class:`~lightning_mp_lstm.planning.plan.PipelinePlan`) is never changed; measurements arrive separately as
:class:`Measurements` and :func:`render` puts the two side by side.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp_lstm.base.faults import gather
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.planning.partition import compact_blocks, even_partition, stage_totals
from lightning_mp_lstm.planning.plan import ChunkCost, PipelinePlan

__all__ = ["Measurements", "cost_text", "measure", "measured_line", "render", "stage_summary", "step_times"]


@dataclass(frozen=True)
class Measurements:
    """What the strategy measured after some training steps.

    Attributes:
        stage_seconds: forward + backward seconds of one microbatch, per stage (stage order).
        step_seconds: median seconds per training step.
    """

    stage_seconds: tuple[float, ...] | None = None
    step_seconds: float | None = None


class StepClock:
    """The start times of the first ``after_steps + 1`` training batches (``None``: never measure), and the batch at
    whose shape the stages are timed once training ends (off the training path: timing them between two steps would
    stall one)."""

    def __init__(self, after_steps: int | None) -> None:
        self.after_steps = after_steps
        self.starts: list[float] = []
        self._batch: Any = None

    def tick(self, batch: Any = None) -> bool:
        """Record a batch's start; ``True`` once, at the start that completes ``after_steps`` intervals (``batch`` is
        then kept for :meth:`take_batch`)."""
        if self.after_steps is None or len(self.starts) > self.after_steps:
            return False
        self.starts.append(time.perf_counter())
        done = len(self.starts) == self.after_steps + 1
        if done:
            self._batch = batch
        return done

    def take_batch(self) -> Any:
        """The batch kept by :meth:`tick` (once; ``None`` when the clock has not completed)."""
        batch, self._batch = self._batch, None
        return batch

    @property
    def intervals(self) -> list[float]:
        """The start times without the first batch's: its interval includes building the stages for new shapes."""
        return self.starts[1:]


def measure(engine: Any, batch: Any, device: torch.device, step_starts: Sequence[float]) -> Measurements:
    """Time every stage on its own process at ``batch``'s microbatch shape (a collective), with the median interval
    between ``step_starts`` as the step time.

    Args:
        engine: the :class:`~lightning_mp_lstm.pipeline.engine.PipelineEngine` whose stages to time.
        batch: a training batch, as the engine is given them.
        device: this process's device.
        step_starts: when training steps started (host clock).
    """
    inputs, _, _ = engine.prepare(batch)
    rows, length = -(-int(inputs.shape[0]) // engine.layout.n_microbatches), int(inputs.shape[1])
    parts = gather(lambda: profile.stage_seconds(engine.model, engine.stage_modules, rows, length, device))
    merged = {s: t for part in reversed(parts) for s, t in part.items()}
    return Measurements(stage_seconds=tuple(merged[s] for s in range(engine.layout.num_stages)),
                        step_seconds=profile.median_interval(step_starts))


def _shares(values: Sequence[float]) -> list[float]:
    total = float(sum(values))
    return [v / total if total else 0.0 for v in values]


def stage_summary(plan: PipelinePlan) -> dict[str, list[float]]:
    """Per-stage totals of the plan: ``costs``, ``parameters``, ``memory`` (bytes) and the ``even`` split's costs.

    With tensor parallelism ``parameters`` and ``memory`` are those of one process of the stage: a split block
    counts ``1 / tensor_parallel_size`` of its own.
    """
    costs, names = dict(plan.block_costs), [name for name, _ in plan.block_costs]
    even = even_partition(names, len(plan.partition))
    tp = plan.layout.tensor_parallel_size

    def per_rank(pairs: Sequence[tuple[str, float]]) -> dict[str, float]:
        return {name: value / tp if name in plan.split_blocks else value for name, value in pairs}

    return {
        "costs": stage_totals(plan.partition, costs),
        "parameters": stage_totals(plan.partition, per_rank(plan.block_parameters)),
        "memory": stage_totals(plan.partition, per_rank(plan.block_memory)),
        "even": stage_totals(even, costs),
    }


def render(plan: PipelinePlan, measurements: Measurements | None = None) -> str:
    """The plan (and measurements, when given) as a table with the bottleneck against the even split."""
    summary = stage_summary(plan)
    speeds = plan.stage_speeds or (1.0,) * len(plan.partition)
    measured = measurements.stage_seconds if measurements is not None else None
    tp = plan.layout.tensor_parallel_size
    per = "/rank" if tp > 1 else ""
    header = ["stage", "blocks", f"params{per}", f"memory MiB{per}", f"{plan.cost_kind} %"] + (
        ["measured %"] if measured else [])
    cost_shares = _shares(summary["costs"])
    measured_shares = _shares(measured) if measured else None
    rows = []
    for s, blocks in enumerate(plan.partition):
        split = [b for b in blocks if b in plan.split_blocks]
        shown = compact_blocks(blocks) + (f" ({', '.join(split)} split /{tp})" if split else "")
        row = [str(s), shown, f"{int(summary['parameters'][s]):,}", f"{summary['memory'][s] / 2**20:.1f}",
               f"{100 * cost_shares[s]:.1f}"]
        if measured_shares:
            row.append(f"{100 * measured_shares[s]:.1f}")
        rows.append(row)
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[c]) if c == 1 else cell.rjust(widths[c]) for c, cell in enumerate(row))

    bottleneck = max(c / v for c, v in zip(summary["costs"], speeds))
    even_bottleneck = max(c / v for c, v in zip(summary["even"], speeds))
    names = [name for name, _ in plan.block_costs]
    even = " | ".join(compact_blocks(stage) for stage in even_partition(names, len(plan.partition)))
    lines = [fmt(header).rstrip(), "  ".join("-" * w for w in widths), *(fmt(r).rstrip() for r in rows)]
    unit = f"per microbatch of {plan.microbatch_rows} x {plan.length}" if plan.cost_kind != "memory" else "per rank"
    lines.append(f"bottleneck stage: {cost_text(bottleneck, plan.cost_kind)} {unit} (even split: "
                 f"{cost_text(even_bottleneck, plan.cost_kind)}; {even})")
    ratio = bottleneck / even_bottleneck if even_bottleneck else 1.0
    lines.append(f"predicted step-time ratio vs even split: {ratio:.3f}")
    predicted = dict(plan.predictions).get(plan.n_microbatches) if plan.predictions else None
    if plan.layout.style == "wavefront":
        lines += axes(plan)
        units = {(m, k): t for m, k, t in plan.unit_predictions or ()}
        predicted = units.get((plan.n_microbatches, plan.layout.time_chunks))
    if plan.predictions:
        options = ", ".join(f"m={m}: {t * 1e3:.1f} ms" for m, t in plan.predictions)
        lines.append(f"n_microbatches=auto chose {plan.n_microbatches} (predicted step: {options})")
    step = measurements.step_seconds if measurements is not None else None
    if predicted is not None or step is not None:
        lines.append(f"step time with m={plan.n_microbatches}: {step_times(predicted, step)}")
    return "\n".join(lines)


def cost_text(value: float, kind: str) -> str:
    """A stage cost with its unit: ``"time"`` seconds (forward + backward) as ms, ``"flops"`` as GFLOP (analytic,
    forward + backward), ``"memory"`` bytes as MiB."""
    if kind == "time":
        return f"{value * 1e3:.3g} ms"
    if kind == "flops":
        return f"{value / 1e9:.3g} GFLOP"
    return f"{value / 2**20:.3g} MiB"


def step_times(predicted: float | None, measured: float | None) -> str:
    """``"predicted 12.3 ms, measured 14.0 ms"``, leaving out what is not known."""
    known = [f"{name} {value * 1e3:.1f} ms" for name, value in (("predicted", predicted), ("measured", measured))
             if value is not None]
    return ", ".join(known)


def measured_line(plan: PipelinePlan, measurements: Measurements, after_steps: int | None) -> str:
    """One line with what was measured after ``after_steps`` training batches, beside the plan (the whole table
    with both is :func:`render`, ``MPLSTMStrategy.report``)."""
    parts = []
    if measurements.stage_seconds:
        measured = " / ".join(f"{100 * v:.1f}" for v in _shares(measurements.stage_seconds))
        planned = " / ".join(f"{100 * v:.1f}" for v in _shares(stage_summary(plan)["costs"]))
        parts.append(f"stage time shares {measured} % (planned by {plan.cost_kind}: {planned} %)")
    predicted = dict(plan.predictions).get(plan.n_microbatches) if plan.predictions else None
    if predicted is not None or measurements.step_seconds is not None:
        parts.append(f"step with m={plan.n_microbatches}: {step_times(predicted, measurements.step_seconds)}")
    return f"mp_lstm measured after {after_steps} steps: {'; '.join(parts)} (table: trainer.strategy.report)"


def axes(plan: PipelinePlan) -> list[str]:
    """A Wavefront plan's two axes: rows x time chunks, the bubble, and (after ``"auto"``) why that pair: what
    splitting the rows and splitting the time axis cost on this device, measured."""
    layout = plan.layout
    m, k, stages = layout.n_microbatches, layout.time_chunks, layout.num_stages
    units = m * k
    lines = [f"axes: rows x time chunks = {m} x {k} = {units} units; bubble (S-1)/(units+S-1) = "
             f"{(stages - 1) / (units + stages - 1):.1%} with S={stages}"]
    if not plan.unit_predictions or not plan.chunk_costs:
        return lines + [f"axis chosen by the options: n_microbatches={m}, time_chunks={k} as given "
                        "(time_chunks='auto' measures both axes on this device and takes the fastest pair)"]
    by_pair = {(a, b): t for a, b, t in plan.unit_predictions}
    chosen = by_pair[(m, k)]
    rows_only = min(((a, t) for (a, b), t in by_pair.items() if b == 1), key=lambda x: x[1], default=None)
    time_only = min(((b, t) for (a, b), t in by_pair.items() if a == 1), key=lambda x: x[1], default=None)
    others = [f"rows only (m={rows_only[0]}): {rows_only[1] * 1e3:.1f} ms" if rows_only else "",
              f"time only (k={time_only[0]}): {time_only[1] * 1e3:.1f} ms" if time_only else ""]
    lines.append(f"auto chose m={m} x k={k}: predicted {chosen * 1e3:.1f} ms per step; best "
                 f"{', '.join(o for o in others if o)}")
    costs = {rows: ChunkCost(fixed, per_step) for rows, fixed, per_step in plan.chunk_costs}
    length = plan.length
    if 1 in costs:
        whole = costs[1].seconds(length)
        row_tax = ", ".join(f"m={a}: {a * c.seconds(length) / whole:.2f}x" for a, c in sorted(costs.items()) if a > 1)
        ks = sorted({b for _, b in by_pair if b > 1})
        time_tax = ", ".join(f"k={b}: {b * costs[1].seconds(-(-length // b)) / whole:.2f}x" for b in ks[:6])
        lines.append(f"why: on this device the whole batch's stages cost {whole * 1e3:.2f} ms at length {length}; "
                     f"split into row microbatches they cost {row_tax or '-'} of that, split into time chunks "
                     f"{time_tax or '-'}")
    return lines
