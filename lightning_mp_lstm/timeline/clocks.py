"""The clocks spans are timed with: the host's on CPU, the device's (timing events) on CUDA.

A span must be timed on the clock of the place its work runs. On CPU (gloo) everything runs on the host and a
wait blocks the host until the transfer is done, so the host clock is right. On a GPU the host only queues
kernels and runs ahead of the device, and an NCCL ``Work.wait()`` only makes the current stream wait and returns
at once: host times there say when work was queued, not when it ran. So on CUDA every span, communication
included, is timed with events recorded on the device's current stream.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["EVENT_TIMED", "Clock", "EventClock", "HostClock", "clock_for"]

#: Device types timed with events. CPU events exist in torch but cannot time (``elapsed_time`` fails); only
#: CUDA's timing path is exercised here (with mocks in CI).
EVENT_TIMED = ("cuda",)


class Clock(Protocol):
    """Marks points of a step and turns them into seconds since the step started."""

    def wait_idle(self) -> None:
        """Wait until the work queued so far is done."""

    def start(self) -> None:
        """The step starts now."""

    def mark(self) -> Any:
        """A point in time (read later, by :meth:`seconds`)."""

    def finish(self) -> float:
        """The step ends now: waits until its work is done and returns its duration in seconds."""

    def seconds(self, mark: Any) -> float:
        """Seconds from the start of the step to ``mark`` (only after :meth:`finish`)."""


class HostClock:
    """The host's performance counter."""

    def __init__(self) -> None:
        self._origin = 0.0

    def wait_idle(self) -> None:
        pass  # host work is done when it returns

    def start(self) -> None:
        self._origin = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def finish(self) -> float:
        return time.perf_counter() - self._origin

    def seconds(self, mark: float) -> float:
        return mark - self._origin


class EventClock:
    """Device time: timing events recorded on the current stream of ``device``.

    An event completes when the stream reaches it, after all the work queued before it, so its time is when the
    device got there, whenever the host queued it.

    Args:
        device: the device whose streams are timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        self._reference: Any = None

    def _event(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record(self._module.current_stream(self.device))
        return event

    def wait_idle(self) -> None:
        self._module.synchronize(self.device)

    def start(self) -> None:
        # On an idle device the reference completes at once, so it lines up with the host's start (and with the
        # other ranks', released by the same barrier).
        self.wait_idle()
        self._reference = self._event()

    def mark(self) -> Any:
        return self._event()

    def finish(self) -> float:
        end = self._event()
        self._module.synchronize(self.device)
        return self.seconds(end)

    def seconds(self, mark: Any) -> float:
        return self._reference.elapsed_time(mark) / 1000.0  # milliseconds


def clock_for(device: torch.device) -> HostClock | EventClock:
    """The clock for spans of work on ``device``: events where the device times them, else the host's."""
    return EventClock(device) if device.type in EVENT_TIMED else HostClock()
