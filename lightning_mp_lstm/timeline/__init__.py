"""A measured timeline of pipeline steps: where a step's time goes on every rank.

:class:`PipelineTimeline` is a Lightning callback. For a few sampled training steps it records, on every rank,
the span of each microbatch's forward and backward (input and weight parts where the schedule splits them) and
of each send and receive of the schedule. Between sampled steps a recording costs one attribute check per stage
call. After each sampled step it logs tokens/s, every stage's busy time and the measured bubble next to the
schedule's predicted one; at the end of training global rank 0 writes a picture (matplotlib PNG: stages x time)
and a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev) with real durations and send -> receive
arrows, one process row per rank.

torch's pipelining only draws a schedule's *planned* order (unit time steps); this is what happened.

One module per job:

- :mod:`~lightning_mp_lstm.timeline.record`: :class:`Span`, :class:`StepRecord`, :func:`predicted_bubble`.
- :mod:`~lightning_mp_lstm.timeline.recorder`: the per-process :data:`RECORDER` the stages report to.
- :mod:`~lightning_mp_lstm.timeline.clocks`: what spans are timed with: the host clock on CPU, device events on
  CUDA (communication included: NCCL waits return before the transfer is done).
- :mod:`~lightning_mp_lstm.timeline.torch_p2p`: the hooks on torch's private point-to-point functions.
- :mod:`~lightning_mp_lstm.timeline.trace`: :func:`chrome_trace`.
- :mod:`~lightning_mp_lstm.timeline.picture`: :func:`draw`.
- :mod:`~lightning_mp_lstm.timeline.callback`: :class:`PipelineTimeline`.
"""

from __future__ import annotations

from lightning_mp_lstm.timeline.callback import PipelineTimeline
from lightning_mp_lstm.timeline.picture import draw
from lightning_mp_lstm.timeline.record import COMMUNICATION, COMPUTE, Span, StepRecord, predicted_bubble
from lightning_mp_lstm.timeline.recorder import RECORDER, Recorder
from lightning_mp_lstm.timeline.torch_p2p import UnsupportedTorchError
from lightning_mp_lstm.timeline.trace import chrome_trace

__all__ = ["COMMUNICATION", "COMPUTE", "RECORDER", "PipelineTimeline", "Recorder", "Span", "StepRecord",
           "UnsupportedTorchError", "chrome_trace", "draw", "predicted_bubble"]
