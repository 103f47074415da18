"""The recorded steps as a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_mp_lstm.timeline.record import COMPUTE, StepRecord

__all__ = ["chrome_trace"]

_THREADS = {"compute": 0, "send": 1, "recv": 2}


def chrome_trace(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The recorded steps as a Chrome trace: one process per rank, a thread for computation and one each for sends
    and receives, and a flow arrow from every send to its receive. Steps follow each other on the time axis.

    Args:
        records: the steps, in order.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, times in microseconds (``json.dumps`` it).
    """
    events: list[dict[str, Any]] = []
    offset = 0.0
    ranks = sorted({span.rank for record in records for span in record.spans})
    for rank in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for thread, tid in _THREADS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": thread}})
    for record in records:
        for span in record.spans:
            tid = _THREADS["compute"] if span.kind in COMPUTE else _THREADS[span.kind]
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
