"""The one place the timeline touches torch's private API: the point-to-point functions of torch's pipeline
schedules.

Every schedule of ``torch.distributed.pipelining.schedules`` issues its sends and receives through the module
functions ``_batch_p2p(ops, desc=None) -> works`` and waits for them through ``_wait_batch_p2p(works)``, looked
up as module globals at each call. Replacing the two globals while a step is recorded is how the recorder sees
when each transfer is issued and waited for; the schedules offer no public hook for it. Both functions are
private: :func:`require` checks that they are still there (they were with torch 2.13) and says so clearly when
they are not.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["TORCH_CHECKED", "P2PHooks", "UnsupportedTorchError", "require"]

#: The torch version whose private point-to-point functions these hooks were written and tested against.
TORCH_CHECKED = "2.13"
_FUNCTIONS = ("_batch_p2p", "_wait_batch_p2p")

#: ``(original _batch_p2p, ops, desc) -> works``: what runs instead of ``_batch_p2p``.
BatchHook = Callable[[Callable[..., list[Any]], list[Any], str | None], list[Any]]
#: ``(original _wait_batch_p2p, works) -> None``: what runs instead of ``_wait_batch_p2p``.
WaitHook = Callable[[Callable[[list[Any]], Any], list[Any]], None]


class UnsupportedTorchError(RuntimeError):
    """This torch lacks the private pipeline functions the timeline wraps."""


def require() -> ModuleType:
    """The module ``torch.distributed.pipelining.schedules``, once checked to have the two functions the timeline
    wraps.

    Returns:
        The schedules module.

    Raises:
        UnsupportedTorchError: a function is missing or not callable (a torch other than the one checked, 2.13,
            that renamed or removed it).
    """
    from torch.distributed.pipelining import schedules

    missing = [name for name in _FUNCTIONS if not callable(getattr(schedules, name, None))]
    if missing:
        raise UnsupportedTorchError(
            f"PipelineTimeline records sends and receives by wrapping the private functions "
            f"{', '.join(f'torch.distributed.pipelining.schedules.{n}' for n in _FUNCTIONS)} (checked with torch "
            f"{TORCH_CHECKED}); this torch ({torch.__version__}) has no {', '.join(missing)}. Remove the "
            f"PipelineTimeline callback (python train.py ~callbacks.timeline) or use torch {TORCH_CHECKED}.")
    return schedules


class P2PHooks:
    """Runs ``batch`` and ``wait`` in place of the schedules' ``_batch_p2p`` and ``_wait_batch_p2p`` between
    :meth:`install` and :meth:`remove`; each hook gets the original function as its first argument.

    Args:
        batch: replaces ``_batch_p2p``.
        wait: replaces ``_wait_batch_p2p``.
    """

    def __init__(self, batch: BatchHook, wait: WaitHook) -> None:
        self._batch, self._wait = batch, wait
        self._originals: dict[str, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._originals)

    def install(self) -> None:
        """Put the hooks in place (checks the functions exist first: :func:`require`)."""
        if self.installed:
            return
        schedules = require()
        self._originals = {name: getattr(schedules, name) for name in _FUNCTIONS}
        batch_p2p, wait_batch_p2p = self._originals["_batch_p2p"], self._originals["_wait_batch_p2p"]

        def _batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
            return self._batch(batch_p2p, p2p_ops, desc)

        def _wait_batch_p2p(work: list[Any]) -> None:
            self._wait(wait_batch_p2p, work)

        schedules._batch_p2p, schedules._wait_batch_p2p = _batch_p2p, _wait_batch_p2p

    def remove(self) -> None:
        """Put the original functions back."""
        if not self.installed:
            return
        from torch.distributed.pipelining import schedules

        for name, original in self._originals.items():
            setattr(schedules, name, original)
        self._originals = {}
