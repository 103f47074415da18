"""Replicated gradients summed over the data-parallel replicas while the backward pass still runs (what DDP's reducer
does), for every schedule of this library.

A stage's last backward of the step (its last microbatch; the wavefront's first unit) runs inside
:meth:`ReplicaSums.posting`: as each of its parameters' gradient is accumulated for the last time, its all-reduce is
posted at once, so the sums of the last blocks travel while the earlier blocks' backward is computed (a split
backward pass, whose weight gradients torch adds itself, posts its stage's sums after its last weight pass). The step
waits for them when the schedule has returned (:meth:`ReplicaSums.finish`), before anything after the backward pass
reads a gradient. Sums are posted in one order per stage (reversed registration, roughly the order the backward
pass finishes them), the same on every replica, as DDP launches its buckets in order: a group's collectives pair up
in the order they are posted. Whatever was not posted (a parameter two stages of this process hold, accumulated
batches) is summed after the schedule, as before.

Why not DDP on each stage (torch's pipeline stages drive it): a stage's decoder may run inside the loss, outside the
stage's forward, and this library's wavefront schedule is not torch's; DDP would also need every parameter's gradient
in one backward call and wraps the module whose names the checkpoints keep. Why not a flat bucket: on gloo a flat
copy of MXNet's 16 M gradients was slower than one all-reduce per gradient, all posted at once
(:func:`~lightning_mp_lstm.pipeline.gradients.all_reduce_gradients`), and a stage holds a few large gradients.

On a GPU the order is NCCL's: a posted all-reduce waits on the stream that accumulated the gradient, and a
:meth:`~torch.distributed.Work.wait` makes the current stream wait for it (the host does not block), so the optimizer
and the clip, queued after :meth:`ReplicaSums.finish`, read the sums.

A gradient this replica did not compute in the step (an adaptive softmax's cluster that none of its targets fell in)
joins the sums as zeros, so that every replica posts the same collectives (before, the replicas posted different
ones and gloo aborted: "Received data size doesn't match expected size"); :func:`sum_the_rest` then gives back
``None`` to every gradient that no replica computed, as one process would have none.

A gradient accumulated again after its sum was posted (a block that checkpoints with ``use_reentrant=True`` runs a
backward call of its own per use of a parameter) is not lost: its sum is waited for before the new part is added, and
the new parts' own sum replaces them at :meth:`ReplicaSums.finish`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp_lstm.pipeline.gradients import all_reduce_gradients, local_tensor

__all__ = ["ReplicaSums", "sum_the_rest"]


class ReplicaSums:
    """The sums of one process's replicated gradients over its stages' replicas, posted during the backward pass.

    Args:
        group: the data-parallel group (more than one member).

    Attributes:
        overlapped: how many parameters' gradients the last step summed during its backward pass.
        filled: the ids of the parameters whose gradient this replica did not compute in the last step and that
            joined the sums as zeros (see :func:`sum_the_rest`).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.overlapped = 0
        self._handles: list[Any] = []
        self._params_of: dict[int, list[nn.Parameter]] = {}  # each stage's, in the order their sums are posted
        self._next: dict[int, int] = {}
        self._ready: set[int] = set()
        self._on = False
        self._armed: set[int] = set()
        self._posted: dict[int, tuple[nn.Parameter, Any]] = {}
        self._again: dict[int, list[torch.Tensor]] = {}
        self.filled: set[int] = set()

    def attach(self, stage_modules: dict[int, nn.Module]) -> None:
        """Hook every parameter that exactly one of ``stage_modules`` (global stage index -> module) holds, at the
        first call (a parameter two stages of this process hold gets the rest of its gradient after the first's last
        backward, and is summed after the schedule; one added later, too)."""
        if self._handles:
            return
        owners = Counter(id(p) for module in stage_modules.values() for p in module.parameters())
        for index, module in stage_modules.items():
            for p in module.parameters():
                if owners[id(p)] != 1 or not p.requires_grad:
                    continue
                self._params_of.setdefault(index, []).insert(0, p)  # the last registered is the first finished
                self._handles.append(p.register_hook(partial(self._before_accumulating, p)))
                self._handles.append(p.register_post_accumulate_grad_hook(partial(self._accumulated, index)))

    @contextmanager
    def step(self) -> Iterator[None]:
        """A training step whose gradients start at zero: :meth:`posting` posts sums inside it."""
        self._on, self._posted, self._again = True, {}, {}  # nothing left from a step that raised
        self._next, self._ready, self.filled = {}, set(), set()
        try:
            yield
        finally:
            self._on = False

    @contextmanager
    def posting(self, stage: int) -> Iterator[None]:
        """Stage ``stage``'s last backward call of the step: each of its gradients is summed once accumulated, and the
        rest when the call returns: those set without autograd's accumulation (torch's split backward adds its weight
        gradients itself) and, as zeros, those this replica did not compute (so that every replica posts the same
        sums)."""
        if not self._on:
            yield
            return
        self._armed.add(stage)
        try:
            yield
        finally:
            self._armed.discard(stage)
        for p in self._params_of.get(stage, []):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                self.filled.add(id(p))
            self._ready.add(id(p))
        self._post_in_order(stage)

    def _accumulated(self, stage: int, p: nn.Parameter) -> None:
        if stage in self._armed:
            self._ready.add(id(p))
            self._post_in_order(stage)

    def _post_in_order(self, stage: int) -> None:
        """Post the stage's ready gradients in one fixed order, the same on every replica whatever order autograd
        finished them in (the collectives of a group pair up in the order they are posted, DDP's reason to launch its
        buckets in order); a gradient not yet ready holds back those after it."""
        order, index = self._params_of.get(stage, []), self._next.get(stage, 0)
        while index < len(order) and id(order[index]) in self._ready:
            self._post(order[index])
            index += 1
        self._next[stage] = index

    def _post(self, p: nn.Parameter) -> None:
        if id(p) in self._posted or p.grad is None:
            return
        grad = local_tensor(p.grad)
        if grad.is_contiguous():  # a strided one is summed after the schedule (all_reduce needs one block)
            self._posted[id(p)] = (p, dist.all_reduce(grad, group=self.group, async_op=True))

    def _before_accumulating(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        posted = self._posted.get(id(p))
        if posted is not None:  # more of a gradient whose sum is in flight: let the sum land, keep the new part aside
            posted[1].wait()
            self._again.setdefault(id(p), []).append(local_tensor(grad).detach().clone())

    def finish(self) -> list[nn.Parameter]:
        """Wait for every sum posted in this step; return the parameters whose gradients are now summed over the
        replicas, in the order they were posted."""
        for key, (p, work) in self._posted.items():
            work.wait()
            late = self._again.pop(key, None)
            if late:  # the gradient is the parts' sum plus this replica's later parts: swap those for their sum
                local = torch.stack(late).sum(0)
                total = local.clone()
                dist.all_reduce(total, group=self.group)
                local_tensor(p.grad).add_(total.sub_(local))
        summed = [p for p, _ in self._posted.values()]
        self.overlapped = len(summed)
        self._posted, self._again = {}, {}
        return summed


def sum_the_rest(parameters: Iterable[nn.Parameter], summed: Sequence[nn.Parameter], filled: set[int],
                 group: dist.ProcessGroup, device: torch.device) -> None:
    """Sum over ``group`` the gradients of ``parameters`` not in ``summed`` (posted during the backward pass), and
    give every gradient that no replica computed back its ``None`` (one process would have none, and an optimizer
    skips such a parameter).

    A gradient this replica did not compute (an adaptive softmax's cluster that none of its targets fell in) joins
    the sums as zeros, so that every replica posts the same collectives; one more all-reduce of a flag per parameter
    finds those that no replica computed. ``filled``: the ids the backward pass filled with zeros already.
    """
    done = {id(p) for p in summed}
    rest = [p for p in parameters if p.requires_grad and id(p) not in done]
    filled = set(filled)
    for p in rest:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            filled.add(id(p))
    all_reduce_gradients(rest, group)
    every = [*summed, *rest]
    nobody = torch.tensor([id(p) in filled for p in every], dtype=torch.uint8, device=device)
    dist.all_reduce(nobody, op=dist.ReduceOp.MIN, group=group)
    for p, unused in zip(every, nobody.tolist(), strict=True):
        if unused:
            p.grad = None
