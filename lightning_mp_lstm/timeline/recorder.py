"""The span recorder of a process (:data:`RECORDER`): pipeline stages report their computation to it, and while a
step is recorded it hooks the schedules' sends and receives (:mod:`~lightning_mp_lstm.timeline.torch_p2p`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp_lstm.timeline.record import COMMUNICATION
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
        self._device: torch.device | None = None
        self._origin = 0.0
        self._reference: Any = None
        self._raw: list[tuple[Any, ...]] = []
        self._tags: dict[int, _Tag] = {}
        self._pending: dict[int, tuple[list[_Tag], float]] = {}
        self._hooks = P2PHooks(self._batch_p2p, self._wait_batch_p2p)

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

    # ----- what the stages call ----------------------------------------------------------------------------
    @contextmanager
    def _span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self._raw.append((kind, stage, microbatch, start, self._mark(), "", None))

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
            peer = stage + 1 if (direction == "forward") == (kind == "send") else stage - 1
            for op in ops:
                self._tags[id(op)] = (kind, direction, stage, microbatch, peer)
        return ops

    # ----- what the schedules call, through the hooks ------------------------------------------------------
    def _batch_p2p(self, original: Callable[..., list[Any]], ops: list[Any], desc: str | None) -> list[Any]:
        issued = time.perf_counter()
        works = original(ops, desc=desc)
        tags = [self._tags.pop(id(op)) for op in ops if id(op) in self._tags]
        for work in works:
            self._pending[id(work)] = (tags, issued)
        return works

    def _wait_batch_p2p(self, original: Callable[[list[Any]], Any], works: list[Any]) -> None:
        start = time.perf_counter()
        original(works)
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

    # ----- a recorded step ---------------------------------------------------------------------------------
    def start(self, device: torch.device) -> None:
        """Begin recording a step; aligns the clock of every rank (a barrier when a process group exists).

        Args:
            device: the device this process computes on.

        Raises:
            UnsupportedTorchError: torch lacks the functions the recorder wraps
                (:func:`~lightning_mp_lstm.timeline.torch_p2p.require`).
        """
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._device = device
        self._raw, self._tags, self._pending = [], {}, {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record()
        self._origin = time.perf_counter()
        self._hooks.install()
        self.active = True

    def stop(self) -> tuple[float, list[LocalSpan]]:
        """End the step.

        Returns:
            The step's wall time in seconds and this rank's spans (:data:`LocalSpan`).
        """
        self.active = False
        self._hooks.remove()
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        wall = time.perf_counter() - self._origin
        spans: list[LocalSpan] = []
        for kind, stage, microbatch, start, end, direction, peer in self._raw:
            if kind in COMMUNICATION:  # host clock
                begin, finish = start - self._origin, end - self._origin
            else:
                begin, finish = self._seconds(start), self._seconds(end)
            spans.append((kind, stage, microbatch, begin, max(finish, begin + 1e-6), direction, peer))
        self._raw = []
        return wall, spans

    def abort(self) -> None:
        """Stop recording without collecting anything (the step failed); torch's functions are put back."""
        self.active = False
        self._hooks.remove()
        self._raw, self._tags, self._pending = [], {}, {}


#: The recorder of this process; pipeline stages report to it.
RECORDER = Recorder()
