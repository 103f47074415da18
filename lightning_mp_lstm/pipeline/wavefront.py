"""Wavefront pipelining: split the time axis, not the batch (MXNet's model-parallel LSTM execution).

Every other schedule splits a batch's rows into microbatches; on GPUs an LSTM layer's time is nearly flat in the
number of rows, so each microbatch costs almost what the whole batch does. :class:`WavefrontSchedule` keeps the rows
whole (or splits them too: rows x chunks) and cuts the time axis into ``k`` chunks: stage ``s`` runs chunk ``c`` as
soon as stage ``s - 1`` sent it, starting every LSTM layer from the state it ended chunk ``c - 1`` with: layer ``l``
at time ``t`` while layer ``l - 1`` runs ``t + 1``, the diagonal of MXNet's dependency engine and of cuDNN's
multi-layer scheduling. Backward runs the chunks in reverse on every stage; the state a chunk starts from is a leaf
that requires grad, and its gradient after chunk ``c``'s backward goes into chunk ``c - 1``'s backward with the
gradient of the stage output, so the result is exact full backpropagation through time, not a truncation.

The order is a fill-drain (GPipe-like) over ``m x k`` units: unit ``u = i * k + c`` (row microbatch ``i``, chunk
``c``) runs forward on stage ``s`` at time step ``u + s`` and backward at ``F + (U - 1 - u) + (S - 1 - s)``. Every
process walks the time steps in order; the messages produced at step ``t - 1`` travel in one batch with the receives
of step ``t``, so no process waits on a message a later step produces (deadlock-free on gloo and NCCL alike,
several stages per process included). Activations cross processes contiguous; the first message over each boundary
carries the activation's trailing shape and dtype, so receive buffers fit any chunk length.

This is this library's own point-to-point loop, not ``torch.distributed.pipelining``: torch's stages size their
buffers once (unequal chunks would need one stage per chunk length) and their backward takes no extra gradients for
a carried state; its custom-order runtime is private API. Nothing private is used here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp_lstm.pipeline.replica_sums import ReplicaSums
from lightning_mp_lstm.pipeline.sharding import reduce_after_this_backward
from lightning_mp_lstm.pipeline.stages import StageModule
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.timeline.recorder import RECORDER

__all__ = ["WavefrontSchedule", "chunk_lengths"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_META = 8  # int64 slots of a boundary's first message: dtype, number of trailing dimensions, the dimensions


def chunk_lengths(length: int, chunks: int) -> list[int]:
    """Lengths of the time chunks of a sequence of ``length`` steps: ``min(chunks, length)`` chunks, the first
    ``length % chunks`` of them one step longer (``torch.tensor_split``'s sizes)."""
    k = max(1, min(int(chunks), int(length)))
    base, extra = divmod(int(length), k)
    return [base + 1] * extra + [base] * (k - extra)


@dataclass
class _Unit:
    """What one stage keeps of one unit between its forward and its backward."""

    x: torch.Tensor | None = None  # the received input (a leaf), None on the first stage
    out: torch.Tensor | None = None  # the stage output, or the loss on the last stage
    initial: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # leaves this chunk started from
    final: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # with graph


class WavefrontSchedule:
    """Runs one batch shape through this process's stages, chunked along time (and rows).

    The interface is the one the engine uses of torch's schedules: :meth:`step` (forward and backward, gradients
    added to ``.grad``) and :meth:`eval` (forward only; the last stage returns the outputs when there is no loss).

    Args:
        stages: global stage index -> this process's :class:`~lightning_mp_lstm.pipeline.stages.StageModule`.
        layout: the layout (stage -> process; ``n_microbatches`` row splits).
        group: the pipeline's process group (ranks in it are pipeline ranks).
        device: this process's device (buffers are made there).
        rows: rows of the (padded) replica batch; ``length``: its time steps.
        time_chunks: chunks of the time axis (at most ``length`` are used).
        loss_fn: ``(outputs, targets) -> loss`` of the last stage, or ``None`` (prediction).
        replica_sums: sums the replicated gradients of each stage's last backward (its first unit) as they are
            accumulated.
    """

    def __init__(self, stages: dict[int, StageModule], layout: ParallelLayout, group: dist.ProcessGroup | None,
                 device: torch.device, rows: int, length: int, time_chunks: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 replica_sums: ReplicaSums | None = None) -> None:
        self.stages, self.layout, self.group, self.device = stages, layout, group, device
        self.replica_sums = replica_sums
        self.loss_fn = loss_fn
        self.num_stages = layout.num_stages
        self.rows = layout.n_microbatches
        self.lengths = chunk_lengths(length, time_chunks)
        self.k = len(self.lengths)
        self.units = self.rows * self.k
        self.row_sizes = [int(t.shape[0]) for t in torch.empty(rows, 0).tensor_split(self.rows)]
        self.rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
        # Trailing shape and dtype of what enters each of this process's stages from another process (first message).
        self._incoming: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._announced: set[int] = set()

    # ----- the torch-schedule interface ---------------------------------------------------------------------
    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None, losses: list | None = None,
             return_outputs: bool = False) -> Any:
        """Forward and backward of every unit; parameter gradients are added to ``.grad``."""
        return self._run(args, target, losses, backward=True, keep_outputs=return_outputs)

    def eval(self, *args: torch.Tensor, target: torch.Tensor | None = None, losses: list | None = None,
             return_outputs: bool = True) -> Any:
        """Forward only; the last stage returns the whole batch's outputs when there is no loss to compute (and
        ``return_outputs``)."""
        keep = return_outputs and (self.loss_fn is None or target is None)
        return self._run(args, target, losses, backward=False, keep_outputs=keep)

    # ----- the time steps ---------------------------------------------------------------------------------------
    def _actions(self, backward: bool) -> list[tuple[int, str, int, int]]:
        """``(time step, kind, stage, unit)`` of this process, in the order every process agrees on."""
        S, U = self.num_stages, self.units
        forward_steps = U + S - 1
        actions = [(u + s, "forward", s, u) for s in self.stages for u in range(U)]
        if backward:
            actions += [(forward_steps + (U - 1 - u) + (S - 1 - s), "backward", s, u) for s in self.stages
                        for u in range(U)]
        # Ties (several stages per process): forward in stage order, backward in reverse, on sender and receiver.
        return sorted(actions, key=lambda a: (a[0], a[1] == "backward", a[2] if a[1] == "forward" else -a[2]))

    def _run(self, args: tuple, target: torch.Tensor | None, losses: list | None, backward: bool,
             keep_outputs: bool) -> torch.Tensor | None:
        inputs = self._split(args[0]) if args else None
        targets = self._split(target) if target is not None else None
        self._saved: dict[tuple[int, int], _Unit] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}  # hand-offs between stages of this process
        outputs: list[torch.Tensor] = []
        pending: list[dist.P2POp] = []  # sends made at the previous step
        in_flight: list[Any] = []  # sends issued, waited for at the end
        actions = self._actions(backward)
        last_step = actions[-1][0] if actions else -1
        at = 0
        try:
            for t in range(last_step + 2):  # one more step sends what the last one made
                now = []
                while at < len(actions) and actions[at][0] == t:
                    now.append(actions[at])
                    at += 1
                received = self._exchange(pending, now, in_flight)
                pending = []
                for _, kind, s, u in now:
                    if kind == "forward":
                        self._forward(s, u, inputs, targets, losses, received, pending, outputs, keep_outputs,
                                      backward)
                    else:
                        self._backward(s, u, received, pending)
            for work in in_flight:
                work.wait()
        finally:
            self._saved, self._local = {}, {}
        if not keep_outputs or not outputs:
            return None
        rows = [torch.cat(outputs[i * self.k:(i + 1) * self.k], dim=1) for i in range(self.rows)]
        return torch.cat(rows, dim=0)

    def _split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The batch's units (rows first, time second), in unit order: views, nothing copied."""
        return [chunk for part in tensor.tensor_split(self.rows, dim=0) for chunk in part.split(self.lengths, dim=1)]

    def _take(self, direction: str, s: int, u: int, received: dict) -> torch.Tensor:
        key = (direction, s, u)
        return self._local.pop(key) if key in self._local else received[key]

    # ----- one stage's work -----------------------------------------------------------------------------------
    def _forward(self, s: int, u: int, inputs: list | None, targets: list | None, losses: list | None,
                 received: dict, pending: list, outputs: list, keep_outputs: bool, backward: bool) -> None:
        module, saved = self.stages[s], self._saved
        i, c = divmod(u, self.k)
        if s == 0:
            assert inputs is not None, "the first stage needs the batch's inputs"
            x = inputs[u]
        else:
            x = self._take("forward", s, u, received)
            if backward and x.is_floating_point():
                x.requires_grad_(True)
        unit = _Unit(x=x if s > 0 and backward else None)
        if c > 0:  # the state the previous chunk ended with, as a leaf: its gradient is read after this backward
            previous = saved[(s, u - 1)] if backward else saved.pop((s, u - 1))
            unit.initial = [(h.detach().requires_grad_(backward), cell.detach().requires_grad_(backward))
                            for h, cell in previous.final]
        module.microbatch = i  # the row microbatch's slot of the state carried across batches
        with RECORDER.span("forward", s, u):
            out, unit.final = module.forward_chunk(x, unit.initial, c, self.k, sum(self.lengths[:c]))
            if s == self.num_stages - 1:
                if self.loss_fn is not None and targets is not None:
                    loss = self.loss_fn(out, targets[u])
                    if losses is not None:
                        losses.append(loss.detach())
                    unit.out = loss
                if keep_outputs:
                    outputs.append(out.detach())
            else:
                unit.out = out
        if s < self.num_stages - 1:
            self._send("forward", s + 1, u, out.detach().contiguous(), pending)
        if not backward:  # only the final state is needed, by the next chunk
            unit.out, unit.x = None, None
            if c == self.k - 1:
                return
        saved[(s, u)] = unit

    def _backward(self, s: int, u: int, received: dict, pending: list) -> None:
        saved = self._saved
        unit = saved[(s, u)]
        c = u % self.k
        tensors = [unit.out]
        grads = [None if s == self.num_stages - 1 else self._take("backward", s, u, received)]
        if c < self.k - 1:  # the next chunk's backward left the gradient of the state this chunk ended with
            later = saved.pop((s, u + 1))
            for ended, started in zip(unit.final, later.initial or []):
                for tensor, leaf in zip(ended, started):
                    if leaf.grad is not None and tensor.requires_grad:  # not a stage the user froze whole
                        tensors.append(tensor)
                        grads.append(leaf.grad)
        reduce_after_this_backward(self.stages[s], last=u == 0)  # units run backward last to first
        sums = self.replica_sums.posting(s) if u == 0 and self.replica_sums is not None else nullcontext()
        with RECORDER.span("backward", s, u), sums:
            if unit.out is not None and unit.out.requires_grad:
                torch.autograd.backward(tensors, grads)
        if s > 0:
            x = unit.x
            assert x is not None
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            self._send("backward", s - 1, u, grad.contiguous(), pending)
        unit.out, unit.final, unit.x = None, [], None  # free the graph; the leaves wait for the previous chunk
        if c == 0:
            saved.pop((s, u), None)

    # ----- messages -------------------------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.layout.rank_of_stage(stage)

    def _tag(self, direction: str, stage: int) -> int:
        return {"forward": 0, "backward": 1, "meta": 2}[direction] * self.num_stages + stage

    def _send(self, direction: str, stage: int, u: int, tensor: torch.Tensor, pending: list) -> None:
        """Hand ``tensor`` to ``stage``: directly on this process, else at the next step's exchange (a boundary's
        first forward message is preceded by the activation's trailing shape and dtype)."""
        peer = self._peer(stage)
        if peer == self.rank:
            self._local[(direction, stage, u)] = tensor
            return
        if direction == "forward" and stage not in self._announced:
            self._announced.add(stage)
            tail = list(tensor.shape[2:])
            meta = torch.tensor([_DTYPES.index(tensor.dtype), len(tail), *tail] + [0] * (_META - 2 - len(tail)),
                                dtype=torch.int64, device=self.device)
            pending.append(dist.P2POp(dist.isend, meta, group=self.group, group_peer=peer,
                                      tag=self._tag("meta", stage)))
        pending.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=peer,
                                  tag=self._tag(direction, stage)))

    def _exchange(self, pending: list, now: list, in_flight: list) -> dict[tuple[str, int, int], torch.Tensor]:
        """Issue the previous step's sends with this step's receives; wait for the receives and return them (the
        sends are waited for at the end of the batch)."""
        wanted = []
        for _, kind, s, u in now:
            source = s - 1 if kind == "forward" else s + 1
            if 0 <= source < self.num_stages and self._peer(source) != self.rank:
                wanted.append((kind, s, u, self._peer(source)))
        new = {s: peer for kind, s, _, peer in wanted if kind == "forward" and s not in self._incoming}
        if new:  # a boundary's first message: the shape, which the data's buffer depends on
            metas = {s: torch.zeros(_META, dtype=torch.int64, device=self.device) for s in new}
            recvs = [dist.P2POp(dist.irecv, metas[s], group=self.group, group_peer=peer, tag=self._tag("meta", s))
                     for s, peer in new.items()]
            self._settle(dist.batch_isend_irecv(pending + recvs), len(pending), len(recvs), in_flight)
            pending = []
            for s, meta in metas.items():
                values = meta.cpu().tolist()
                self._incoming[s] = (tuple(values[2:2 + values[1]]), _DTYPES[values[0]])
        buffers = {(kind, s, u): self._buffer(kind, s, u) for kind, s, u, _ in wanted}
        recvs = [dist.P2POp(dist.irecv, buffers[(kind, s, u)], group=self.group, group_peer=peer,
                            tag=self._tag(kind, s)) for kind, s, u, peer in wanted]
        if pending or recvs:
            self._settle(dist.batch_isend_irecv(pending + recvs), len(pending), len(recvs), in_flight)
        return buffers

    @staticmethod
    def _settle(works: list, sends: int, recvs: int, in_flight: list) -> None:
        """Wait for the receives of a batch now and keep its sends for the end; a backend that coalesces the batch
        into one work (NCCL) is waited for as a whole when it holds a receive."""
        if len(works) != sends + recvs:
            if recvs:
                for work in works:
                    work.wait()
            else:
                in_flight.extend(works)
            return
        in_flight.extend(works[:sends])
        for work in works[sends:]:
            work.wait()

    def _buffer(self, direction: str, s: int, u: int) -> torch.Tensor:
        """An empty tensor for unit ``u``'s message into stage ``s``: its input (forward) or the gradient of its
        output (backward, shaped like the output it kept)."""
        if direction == "backward":
            return torch.empty_like(self._saved[(s, u)].out, memory_format=torch.contiguous_format)
        i, c = divmod(u, self.k)
        tail, dtype = self._incoming[s]
        return torch.empty((self.row_sizes[i], self.lengths[c], *tail), dtype=dtype, device=self.device)
