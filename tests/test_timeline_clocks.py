"""The timeline's clocks on a GPU, checked without one (#19): fake CUDA events read a fake device clock, and a fake
NCCL whose waits return at once, as ``Work.wait()`` does on NCCL (it only makes the current stream wait).

The host queues work far ahead of the device there, so spans timed on the host clock land where the host queued
them, not where the device ran them: a send would start before the forward that produces it. Every span on a
CUDA device must be on the device clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.distributed.pipelining import schedules

from lightning_mp_lstm.timeline import COMPUTE, Recorder, Span

#: Device seconds of one forward, one backward and one transfer: far longer than the host takes to queue the
#: whole simulated step, so a span timed on the host clock cannot land where the device ran it.
FORWARD, BACKWARD, TRANSFER = 1.0, 2.0, 0.1


class FakeDevice:
    """One GPU's stream: queued work runs in order; the host only queues it and returns."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        #: Device seconds at which everything queued so far has run.
        self.queued_until = 0.0

    def run(self, seconds: float) -> None:
        self.queued_until += seconds


#: The device of the simulated rank that is running now (the fake events and NCCL read it).
CURRENT: dict[str, FakeDevice] = {}


class FakeEvent:
    """``torch.cuda.Event``: completes when the stream reaches it; times in milliseconds, like CUDA's."""

    streams: list[Any] = []

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        FakeEvent.streams.append(stream)
        self.at = CURRENT["device"].queued_until

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1e3


class FakeOp:
    """A ``P2POp``: a send or receive of the tensor ``key`` names (direction, microbatch)."""

    def __init__(self, kind: str, key: tuple[str, int]) -> None:
        self.kind, self.key = kind, key


class FakeNCCL:
    """Point-to-point transfers between the fake devices.

    A send starts on the device once the stream that issued it has run what was queued before (the forward
    that produced the tensor); a receive completes one transfer after both ends are ready. Waiting only makes
    the waiting stream wait: the host returns at once.
    """

    def __init__(self) -> None:
        self.sent_at: dict[tuple[str, int], float] = {}

    def batch_p2p(self, ops: list[FakeOp], desc: str | None = None) -> list[Any]:
        works = []
        for op in ops:
            ready = CURRENT["device"].queued_until
            if op.kind == "send":
                self.sent_at[op.key] = ready
                works.append(lambda done=ready + TRANSFER: done)
            else:
                works.append(lambda key=op.key, ready=ready: max(ready, self.sent_at[key]) + TRANSFER)
        return [_Work(done) for done in works]

    def wait_batch_p2p(self, works: list[Any]) -> None:
        for work in works:
            work.wait()


class _Work:
    def __init__(self, done: Any) -> None:
        self._done = done

    def wait(self) -> None:  # non-blocking: the current stream waits, the host goes on
        device = CURRENT["device"]
        device.queued_until = max(device.queued_until, self._done())


class Rank:
    """A simulated pipeline rank: its device, its recorder and the hooks its recorder put in place."""

    def __init__(self, index: int) -> None:
        self.device = FakeDevice(index)
        self.recorder = Recorder()
        self.batch_p2p: Any = None
        self.wait_batch_p2p: Any = None

    @contextmanager
    def running(self) -> Iterator[Rank]:
        CURRENT["device"] = self.device
        yield self

    def start(self, nccl: FakeNCCL) -> None:
        with self.running():
            self.recorder.start(self.device.device)
        # What torch's schedules would call on this rank; the next rank's recorder wraps the fakes, not these.
        self.batch_p2p, self.wait_batch_p2p = schedules._batch_p2p, schedules._wait_batch_p2p
        schedules._batch_p2p, schedules._wait_batch_p2p = nccl.batch_p2p, nccl.wait_batch_p2p

    def compute(self, kind: str, stage: int, microbatch: int, seconds: float) -> None:
        with self.running(), self.recorder.span(kind, stage, microbatch):
            self.device.run(seconds)

    def issue(self, kind: str, direction: str, stage: int, microbatch: int) -> list[Any]:
        with self.running():
            ops = self.recorder.tag([FakeOp(kind, (direction, microbatch))], kind, direction, stage, microbatch)
            return self.batch_p2p(list(ops), desc=f"{direction}_{kind}")

    def wait(self, works: list[Any]) -> None:
        with self.running():
            self.wait_batch_p2p(works)

    def stop(self, rank: int) -> tuple[float, list[Span]]:
        with self.running():
            wall, local = self.recorder.stop()
        return wall, [Span(rank, stage, kind, mb, start, end, direction, peer)
                      for kind, stage, mb, start, end, direction, peer in local]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeNCCL:
    """Fake CUDA events and stream calls, and a fake NCCL behind torch's schedules' point-to-point functions."""
    nccl = FakeNCCL()
    FakeEvent.streams = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", torch.device(device)))
    monkeypatch.setattr(schedules, "_batch_p2p", nccl.batch_p2p)
    monkeypatch.setattr(schedules, "_wait_batch_p2p", nccl.wait_batch_p2p)
    return nccl


def _gpipe_step(nccl: FakeNCCL, microbatches: int = 2) -> tuple[list[float], list[float], list[Span]]:
    """One GPipe step of two stages on two simulated ranks, in an order consistent with the transfers.

    Returns:
        Each rank's wall time as recorded, the device time at which each rank's device ran out of work, and the
        spans.
    """
    first, last = Rank(0), Rank(1)
    first.start(nccl)
    last.start(nccl)
    sends = []
    for mb in range(microbatches):
        first.compute("forward", 0, mb, FORWARD)
        sends += first.issue("send", "forward", 0, mb)
    gradients = []
    for mb in range(microbatches):
        last.wait(last.issue("recv", "forward", 1, mb))
        last.compute("forward", 1, mb, FORWARD)
    for mb in range(microbatches):
        last.compute("backward", 1, mb, BACKWARD)
        gradients += last.issue("send", "backward", 1, mb)
    for mb in range(microbatches):
        first.wait(first.issue("recv", "backward", 0, mb))
        first.compute("backward", 0, mb, BACKWARD)
    first.wait(sends)
    last.wait(gradients)
    walls, spans = [], []
    for rank, simulated in enumerate((first, last)):
        wall, rank_spans = simulated.stop(rank)
        walls.append(wall)
        spans += rank_spans
    return walls, [first.device.queued_until, last.device.queued_until], spans


def producer_of(spans: list[Span]) -> dict[tuple[int, int, str], Span]:
    """The computation spans by ``(stage, microbatch, kind)``."""
    return {(s.stage, s.microbatch, s.kind): s for s in spans if s.kind in COMPUTE}


def test_with_non_blocking_waits_every_send_starts_after_the_computation_that_produces_it(fake_cuda):
    _, _, spans = _gpipe_step(fake_cuda)
    producer = producer_of(spans)
    sends = [s for s in spans if s.kind == "send"]
    assert len(sends) == 4
    for send in sends:
        made = producer[(send.stage, send.microbatch, send.direction)]  # forward sends activations, backward grads
        assert send.start >= made.end - 1e-9, (send, made)


def test_with_non_blocking_waits_a_receive_ends_no_earlier_than_its_send_starts(fake_cuda):
    _, _, spans = _gpipe_step(fake_cuda)
    sends = {s.flow_id: s for s in spans if s.kind == "send"}
    receives = [s for s in spans if s.kind == "recv"]
    assert len(receives) == 4 and {r.flow_id for r in receives} == set(sends)
    for receive in receives:
        assert receive.end >= sends[receive.flow_id].start + TRANSFER - 1e-9, (receive, sends[receive.flow_id])
        # The receiving stage's forward (backward) of that microbatch runs on what arrived, after it arrived.
        consumer = producer_of(spans)[(receive.stage, receive.microbatch, receive.direction)]
        assert consumer.start >= receive.end - 1e-9, (consumer, receive)


def test_on_a_gpu_every_span_and_the_wall_time_are_on_the_device_clock(fake_cuda):
    walls, device_ends, spans = _gpipe_step(fake_cuda)
    # Rank 0 ends with its second backward, at 9.4 s; rank 1 with the transfer of its last gradient, at 7.3 s.
    assert walls == pytest.approx(device_ends) and device_ends == pytest.approx([9.4, 7.3])
    for span in spans:
        assert 0 <= span.start < span.end <= walls[span.rank] + 1e-9, span
    assert FakeEvent.streams and all(stream[0] == "stream" for stream in FakeEvent.streams)


def test_events_are_recorded_on_the_recorders_device(fake_cuda):
    rank = Rank(1)
    rank.start(fake_cuda)
    rank.compute("forward", 0, 0, FORWARD)
    rank.wait(rank.issue("send", "forward", 0, 0))
    rank.stop(1)
    assert FakeEvent.streams and set(FakeEvent.streams) == {("stream", torch.device("cuda", 1))}
