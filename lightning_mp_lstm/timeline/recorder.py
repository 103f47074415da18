"""The span recorder of a process (:data:`RECORDER`): pipeline stages report their computation to it, and while a
step is recorded it hooks the schedules' sends and receives (:mod:`~lightning_mp_lstm.timeline.torch_p2p`).

Every span of a step is timed on one clock, the one of the device the process computes on
(:mod:`~lightning_mp_lstm.timeline.clocks`): the host's on CPU, timing events on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp_lstm.base.faults import object_group
from lightning_mp_lstm.timeline.clocks import Clock, HostClock, clock_for
from lightning_mp_lstm.timeline.torch_p2p import P2PHooks

__all__ = ["RECORDER", "LocalSpan", "Recorder"]

#: A span as one rank records it: ``(kind, stage, microbatch, start, end, direction, peer_stage)``, seconds since
#: the step started.
LocalSpan = tuple[str, int, int, float, float, str, "int | None"]
_Tag = tuple[str, str, int, int, int]


class Recorder:
    """Collects spans in this process while a step is being recorded (one per process: :data:`RECORDER`).

    Between :meth:`start` and :meth:`stop` the stages' :meth:`span` and :meth:`tag` calls are recorded, and so
    is every wait of the schedules' point-to-point operations; otherwise they cost one attribute check.
    """

    def __init__(self) -> None:
        #: Whether a step is being recorded.
        self.active = False
        self._clock: Clock = HostClock()
        # Marks are the clock's (floats or events), turned into seconds once the step is over.
        self._raw: list[tuple[Any, ...]] = []
        self._tags: dict[int, _Tag] = {}
        self._pending: dict[int, tuple[list[_Tag], Any]] = {}
        self._hooks = P2PHooks(self._batch_p2p, self._wait_batch_p2p)

    # ----- what the stages call ----------------------------------------------------------------------------
    @contextmanager
    def _span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        start = self._clock.mark()
        try:
            yield
        finally:
            self._raw.append((kind, stage, microbatch, start, self._clock.mark(), "", None))

    def span(self, kind: str, stage: int, microbatch: int) -> AbstractContextManager[None]:
        """A context manager recording ``kind`` work of ``stage`` on ``microbatch`` (nothing when inactive).

        Args:
            kind: one of :data:`~lightning_mp_lstm.timeline.COMPUTE`.
            stage: the stage's global index.
            microbatch: the microbatch index.
        """
        return self._span(kind, stage, microbatch) if self.active else nullcontext()

    def tag(self, ops: Sequence[Any], kind: str, direction: str, stage: int, microbatch: int) -> Sequence[Any]:
        """Remember what the point-to-point ``ops`` carry, so their wait is recorded as ``kind`` spans.

        Args:
            ops: the ``P2POp`` objects a stage made.
            kind: ``"send"`` or ``"recv"``.
            direction: ``"forward"`` (activations) or ``"backward"`` (gradients).
            stage: the stage's global index.
            microbatch: the microbatch index.

        Returns:
            ``ops``, unchanged.
        """
        if self.active:
            peer = _peer_stage(kind, direction, stage)
            for op in ops:
                self._tags[id(op)] = (kind, direction, stage, microbatch, peer)
        return ops

    def wait_received(self, works: Sequence[Any], direction: str, stage: int, microbatch: int) -> None:
        """Wait for the receives a stage posted ahead of the schedule
        (:attr:`~lightning_mp_lstm.pipeline.stages.Stage.receive_ahead`), recorded as a ``recv`` span of
        ``direction`` (``"forward"``: activations, ``"backward"``: gradients) while a step is recorded."""
        before = self._clock.mark() if self.active else None
        for work in works:
            work.wait()
        if before is not None:
            self._raw.append(("recv", stage, microbatch, before, self._clock.mark(), direction,
                              _peer_stage("recv", direction, stage)))

    # ----- what the schedules call, through the hooks ------------------------------------------------------
    def _batch_p2p(self, original: Callable[..., list[Any]], ops: list[Any], desc: str | None) -> list[Any]:
        # On a GPU this mark completes once the stream has run what was queued before the send (the computation
        # that produced the tensor), which is when the send can start; the host issues it much earlier.
        issued = self._clock.mark()
        works = original(ops, desc=desc)
        tags = [self._tags.pop(id(op)) for op in ops if id(op) in self._tags]
        for work in works:
            self._pending[id(work)] = (tags, issued)
        return works

    def _wait_batch_p2p(self, original: Callable[[list[Any]], Any], works: list[Any]) -> None:
        # One work at a time (what the original does) so that each transfer gets its own marks. On NCCL the wait
        # returns at once and only makes the current stream wait: the mark after it completes on the device when
        # the transfer is done.
        spans: dict[_Tag, list[Any]] = {}
        for work in works:
            before = self._clock.mark()
            original([work])
            after = self._clock.mark()
            tags, issued = self._pending.pop(id(work), ([], before))
            for tag in tags:
                if tag in spans:  # a batch's works carry all its tags: the span ends with the last of them
                    spans[tag][1] = after
                else:
                    # A receive waits for data from its wait's start; a send is in flight from when it was issued.
                    spans[tag] = [issued if tag[0] == "send" else before, after]
        for (kind, direction, stage, microbatch, peer), (begin, end) in spans.items():
            self._raw.append((kind, stage, microbatch, begin, end, direction, peer))

    # ----- a recorded step ---------------------------------------------------------------------------------
    def start(self, device: torch.device) -> None:
        """Begin recording a step; aligns the clock of every rank (a barrier when a process group exists).

        Args:
            device: the device this process computes on: its clock times every span of the step (timing
                events on its current stream on CUDA, the host clock on CPU;
                :func:`~lightning_mp_lstm.timeline.clocks.clock_for`).

        Raises:
            UnsupportedTorchError: torch lacks the functions the recorder wraps
                (:func:`~lightning_mp_lstm.timeline.torch_p2p.require`).
        """
        self._raw, self._tags, self._pending = [], {}, {}
        self._clock = clock_for(device)
        # Idle before the barrier: each rank's clock then starts as the barrier releases it, not after whatever
        # the device still had to finish.
        self._clock.wait_idle()
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=object_group())  # gloo: a host-side barrier, whatever the default backend
        self._clock.start()
        self._hooks.install()
        self.active = True

    def stop(self) -> tuple[float, list[LocalSpan]]:
        """End the step.

        Returns:
            The step's wall time in seconds and this rank's spans (:data:`LocalSpan`).
        """
        self.active = False
        self._hooks.remove()
        wall = self._clock.finish()
        spans: list[LocalSpan] = []
        for kind, stage, microbatch, start, end, direction, peer in self._raw:
            begin, finish = self._clock.seconds(start), self._clock.seconds(end)
            spans.append((kind, stage, microbatch, begin, max(finish, begin + 1e-6), direction, peer))
        self._raw = []
        return wall, spans

    def abort(self) -> None:
        """Stop recording without collecting anything (the step failed); torch's functions are put back."""
        self.active = False
        self._hooks.remove()
        self._raw, self._tags, self._pending = [], {}, {}


def _peer_stage(kind: str, direction: str, stage: int) -> int:
    """The stage at the other end of a ``kind`` (send, recv) of ``direction`` (forward, backward) from ``stage``."""
    return stage + 1 if (direction == "forward") == (kind == "send") else stage - 1


#: The recorder of this process; pipeline stages report to it.
RECORDER = Recorder()
