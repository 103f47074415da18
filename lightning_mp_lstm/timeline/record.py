"""What a recorded step is: its spans (:class:`Span`), the step (:class:`StepRecord`) and the bubble a schedule
would leave (:func:`predicted_bubble`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["COMMUNICATION", "COMPUTE", "Span", "StepRecord", "predicted_bubble"]

#: Span kinds that are computation (``loss``: the last stage's loss of a microbatch, which torch's schedules compute
#: after the stage's forward).
COMPUTE = ("forward", "loss", "backward", "backward_input", "backward_weight", "compute")
#: Span kinds that are point-to-point communication.
COMMUNICATION = ("send", "recv")


@dataclass(frozen=True)
class Span:
    """One recorded interval, in seconds from the start of its step (aligned across ranks).

    Attributes:
        rank: global rank that ran it.
        stage: the pipeline stage it belongs to.
        kind: one of :data:`COMPUTE` or :data:`COMMUNICATION`.
        microbatch: the microbatch index.
        start: seconds since the step started.
        end: seconds since the step started.
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
        """Identifies a transfer: a send and its receive share it (``None`` for computation)."""
        if self.kind not in COMMUNICATION or self.peer_stage is None:
            return None
        sender, receiver = (self.stage, self.peer_stage) if self.kind == "send" else (self.peer_stage, self.stage)
        return f"{self.direction}:{sender}->{receiver}:{self.microbatch}"


@dataclass
class StepRecord:
    """Every rank's spans of one training step, and what they add up to.

    Attributes:
        step: the global step (0-based).
        wall: seconds the step took (the longest rank).
        spans: every rank's spans.
        tokens: real (unpadded) tokens of the step, over all replicas.
        num_stages: pipeline stages of the model.
        n_microbatches: microbatches per step (for ``"Wavefront"``: units, row microbatches x time chunks).
        schedule: the schedule's name, as torch spells it.
        stage_ranks: the global rank of every stage in replica 0.
        rank_walls: each rank's own time from the step's start to its end (``wall`` is the longest).
    """

    step: int
    wall: float
    spans: list[Span]
    tokens: int
    num_stages: int
    n_microbatches: int
    schedule: str
    stage_ranks: dict[int, int] = field(default_factory=dict)
    rank_walls: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """The inverse of :meth:`as_dict` (and of ``dataclasses.asdict``)."""
        fields = dict(data)
        fields["spans"] = [Span(**span) for span in data["spans"]]
        fields["stage_ranks"] = {int(k): v for k, v in data.get("stage_ranks", {}).items()}
        fields["rank_walls"] = {int(k): v for k, v in data.get("rank_walls", {}).items()}
        return cls(**fields)

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data, for saving or sending between processes."""
        return {**asdict(self), "spans": [asdict(s) for s in self.spans]}

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

    @property
    def schedule_end(self) -> float:
        """Seconds from the step's start to the end of its last span, on any rank: the schedule's part of the step.
        The rest of :attr:`wall` is the step's tail (optimizer step, gradient clipping, Lightning's loop)."""
        return max((span.end for span in self.spans), default=self.wall)

    @property
    def tail(self) -> float:
        """The fraction of :attr:`wall` after :attr:`schedule_end`: what the step spends outside its schedule at
        its end."""
        return (self.wall - self.schedule_end) / self.wall if self.wall > 0 else 0.0

    def bubble(self) -> float:
        """Measured fraction of the step the ranks spent not computing (waiting, communicating, idle)."""
        return self._idle_until(self.wall)

    def schedule_bubble(self) -> float:
        """:meth:`bubble` up to :attr:`schedule_end`: what the schedule left idle, without the step's tail. This
        is the number to hold against :func:`predicted_bubble`, which knows nothing of the tail."""
        return self._idle_until(self.schedule_end)

    def _idle_until(self, end: float) -> float:
        busy = self.busy_per_rank()
        ranks = sorted({span.rank for span in self.spans}) or [0]
        return 1.0 - sum(busy.get(r, 0.0) for r in ranks) / (len(ranks) * end) if end > 0 else 0.0


def predicted_bubble(schedule: str, num_ranks: int, stages_per_rank: int, n_microbatches: int) -> float:
    """The idle fraction a schedule leaves with equal stage times and free communication.

    GPipe / 1F1B: ``(p - 1) / (m + p - 1)`` for ``p`` pipeline ranks and ``m`` microbatches; interleaved
    schedules with ``v`` stages per rank divide the fill and drain by ``v``: ``(p - 1) / (v m + p - 1)``.
    Zero-bubble schedules are reported with the interleaved formula (an upper bound).

    Args:
        schedule: the schedule's name (every schedule uses the same formula for now).
        num_ranks: pipeline-parallel ranks ``p``.
        stages_per_rank: stages per rank ``v``.
        n_microbatches: microbatches per step ``m``.

    Returns:
        The predicted bubble, a fraction in ``[0, 1)``.
    """
    p, m, v = num_ranks, n_microbatches, stages_per_rank
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)
