"""A pipeline stage: a run of blocks (:class:`StageModule`), its own random stream, and the ``PipelineStage`` that
torch's schedules run (:class:`Stage`), which reports to the timeline.

A stage module holds views onto the model's blocks (parameters shared, never copied). Everything that crosses a
stage boundary is made contiguous here: gloo refuses views, and a batch-first LSTM's input gradient is one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from typing_extensions import override

from lightning_mp_lstm.models.blocks import TimeChunk
from lightning_mp_lstm.pipeline.replica_sums import ReplicaSums
from lightning_mp_lstm.pipeline.sharding import reduce_after_this_backward
from lightning_mp_lstm.timeline.recorder import RECORDER

__all__ = ["PRIVATE_API", "ContiguousGrad", "Stage", "StageModule", "StageRandomness", "hold_receive_buffers",
           "release_step"]

#: torch's private names :class:`Stage` builds on (module -> name -> the methods it overrides), checked by a test that
#: names any a new torch renamed.
PRIVATE_API: dict[str, dict[str, tuple[str, ...]]] = {
    "torch.distributed.pipelining._backward": {"stage_backward": ()},
    "torch.distributed.pipelining.stage": {"PipelineStage": ("_forward_metadata_inference",
                                                             "_backward_metadata_inference",
                                                             "backward_maybe_with_nosync")},
}


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    The gradient a stage sends upstream must be contiguous (gloo refuses views); the gradient of a
    batch-first LSTM input is a transposed view.
    """

    @staticmethod
    @override
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageRandomness:
    """The random number stream of one pipeline stage of one replica (dropout masks).

    Every process starts from the same global random state, so without this stage 1's first dropout mask
    would equal stage 0's. Each stage draws from its own stream instead, seeded from ``(seed, replica,
    stage)``: independent across stages and replicas, identical for the same seed.

    Args:
        seed: the run's seed (Lightning's ``seed_everything`` value).
        replica: data-parallel rank.
        stage: global pipeline stage index.
        device: where the stage runs (its generator is the one dropout uses there).
    """

    def __init__(self, seed: int, replica: int, stage: int, device: torch.device) -> None:
        stream_seed = int(np.random.SeedSequence([seed % 2**63, replica, stage]).generate_state(1, np.uint64)[0])
        self.device = device
        self._cpu = torch.Generator().manual_seed(stream_seed).get_state()
        self._accelerator = None
        if device.type == "cuda":
            generator = torch.Generator(device=device)
            generator.manual_seed(stream_seed)
            self._accelerator = generator.get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stage's stream inside the block; the global stream is untouched."""
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(self._cpu)
        saved_accelerator = None
        if self._accelerator is not None:
            saved_accelerator = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._accelerator, self.device)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_accelerator is not None:
                self._accelerator = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved_accelerator, self.device)


class StageModule(nn.Module):
    """A contiguous run of model blocks acting as one pipeline stage.

    In training it draws dropout masks from its own :class:`StageRandomness` (when given) and notes, without
    synchronizing, whether each block's output stayed finite, so a non-finite loss can be traced to the
    first block that produced one (:meth:`first_non_finite`).

    Args:
        blocks: ``(name, module)`` pairs in model order; the modules are shared, not copied.
        randomness: this stage's random stream; ``None`` uses the global one.
        last_block: the model's last block (its output feeds the loss, which is checked itself).
        microbatch_context: the model's ``microbatch_context`` (optional in the contract): entered around each
            forward with the microbatch's index, so a model can keep per-row state (``None`` while inferring
            shapes).
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], randomness: StageRandomness | None = None,
                 last_block: str | None = None,
                 microbatch_context: Callable[[int | None], AbstractContextManager[Any]] | None = None) -> None:
        super().__init__()
        self.block_names = [name for name, _ in blocks]
        self.blocks = nn.ModuleList(module for _, module in blocks)
        self.randomness = randomness
        # The model's last block feeds the loss, which is checked itself: its (large) output is not.
        self._watched = [name != last_block for name in self.block_names]
        #: Whether this stage's output goes to another stage (not to the loss).
        self.sends_output = last_block is not None and last_block not in self.block_names
        self._finite: list[torch.Tensor | None] = [None] * len(self.block_names)  # each block's outputs, summed
        #: Set while torch's pipelining infers shapes: it runs the stage on uninitialized tensors.
        self.inferring_shapes = False
        #: The microbatch the next forward runs (set by the stage before each forward).
        self.microbatch: int | None = None
        #: The first time step of the chunk the next forward runs (wavefront pipelining; else 0).
        self.time_start = 0
        self._microbatch_context = microbatch_context or (lambda index: nullcontext())
        #: The modules :meth:`set_mode` sets (``None``: this stage and every module in it; :meth:`leave_modes_to`).
        self._mode_modules: list[nn.Module] | None = None

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = ContiguousGrad.apply(x)
        watch = self.training and torch.is_grad_enabled() and not self.inferring_shapes
        if self.inferring_shapes:
            random = torch.random.fork_rng(devices=[self.randomness.device] if _on_cuda(self.randomness) else [])
        elif self.randomness is not None and self.training:
            random = self.randomness.active()
        else:
            random = _no_context()
        with random, self._microbatch_context(None if self.inferring_shapes else self.microbatch):
            for i, block in enumerate(self.blocks):
                x = block(x)
                if watch and self._watched[i] and x.is_floating_point():
                    # NaN and infinity survive sums: one pass per output, one scalar per block, read only on failure.
                    total = x.detach().sum()
                    self._finite[i] = total if self._finite[i] is None else self._finite[i] + total
        if self.sends_output and torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
            # A stage whose parameters are all frozen still sends an output that asks for a gradient: torch's stages
            # fix from their first batch whether the next stage sends one back, so a stage the user unfreezes later
            # would get none (a leaf here takes the unused gradient).
            x = x.detach().requires_grad_(True)
        x = x.contiguous()
        # torch's split backward (the zero-bubble schedules) detaches the output a stage sends in place, which a view
        # refuses: one already contiguous (a batch-first LSTM's output of a one-row microbatch) is copied.
        return x.clone() if self.sends_output and x.requires_grad and x._is_view() else x

    @property
    def recurrent_blocks(self) -> list[nn.Module]:
        """The blocks that carry state along the time axis (those with a ``time_chunk`` slot), in order."""
        return [block for block in self.blocks if hasattr(block, "time_chunk")]

    def forward_chunk(self, x: torch.Tensor, initial: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                      index: int = 0, count: int = 1, start: int = 0
                      ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run chunk ``index`` of ``count`` of the time axis (its first step: ``start``): each recurrent block starts
        from its entry of ``initial`` (``None``: the state carried across batches, or zeros) and the final states come
        back with their autograd graph.

        Returns:
            The stage's output and one ``(h, c)`` per recurrent block (:attr:`recurrent_blocks`).
        """
        blocks = self.recurrent_blocks
        chunks = [TimeChunk(initial[j] if initial is not None else None, index, count) for j in range(len(blocks))]
        for block, chunk in zip(blocks, chunks):
            block.time_chunk = chunk
        self.time_start = start
        try:
            out = self(x)
        finally:
            self.time_start = 0
            for block in blocks:
                block.time_chunk = None
        return out, [chunk.final for chunk in chunks]

    def leave_modes_to(self, owner: nn.Module) -> None:
        """Leave the training flags of ``owner``'s modules (the user's ``LightningModule``) to whoever sets them, as
        on one process: Lightning's loops (``eval()`` for evaluation, then each module's own flag restored) and the
        user, whose module put in eval mode stays so while the rest trains. :meth:`set_mode` then sets only this
        stage's modules that ``owner`` does not hold (this wrapper, a model's adapter blocks)."""
        held = {id(module) for module in owner.modules()}
        self._mode_modules = [module for module in self.modules() if id(module) not in held]

    def set_mode(self, train: bool) -> None:
        """Training or evaluation mode for the next batch (see :meth:`leave_modes_to`)."""
        if self._mode_modules is None:
            self.train(train)
            return
        for module in self._mode_modules:
            module.training = train

    def reset_finite_checks(self) -> None:
        """Forget the finite-output notes (before each training batch)."""
        self._finite = [None] * len(self.block_names)

    def first_non_finite(self) -> str | None:
        """The first of this stage's blocks whose output was not finite since the last reset, if any."""
        for name, total in zip(self.block_names, self._finite):
            if total is not None and not bool(torch.isfinite(total)):
                return name
        return None


@contextmanager
def _no_context() -> Iterator[None]:
    yield


def _on_cuda(randomness: StageRandomness | None) -> bool:
    return randomness is not None and randomness.device.type == "cuda"


class Stage(PipelineStage):
    """``PipelineStage`` that tells its module when it runs only to infer shapes, and may post its receives ahead.

    torch infers the shapes a stage sends from a first forward (and backward) on uninitialized tensors; that
    pass must neither draw dropout masks nor count as a non-finite output.

    Args:
        args, kwargs: ``PipelineStage``'s arguments.
        receive_ahead: when the schedule asks for a microbatch's receives, post the next microbatch's too, and wait
            for them when its forward (backward) starts. Only where the transport allows it
            (:func:`~lightning_mp_lstm.pipeline.transport.posts_receives_ahead`) and for one stage per process:
            each peer then sends this stage one kind of message, in microbatch order, which is the order the posted
            receives take them.
        replica_sums: sums the replicated gradients of the stage's last backward as they are accumulated.
    """

    def __init__(self, *args: Any, receive_ahead: bool = False, replica_sums: ReplicaSums | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receive_ahead = receive_ahead
        self.replica_sums = replica_sums
        self._posted: dict[tuple[str, int], list[Any]] = {}

    @override
    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring_shapes = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring_shapes = False

    @override
    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # The last stage computes the loss of the inferred outputs here: it is not a microbatch's piece of the loss.
        self.submod.inferring_shapes = True
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring_shapes = False

    @override
    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if not last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if isinstance(self.submod, FSDPModule):
            if backward_type != "full":
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            # Sharded replicas, the last microbatch: FSDP's own hooks reduce-scatter each block's summed gradient as
            # its backward ends (overlapped with the blocks before it) and free its gathered parameters and whole
            # gradient; torch's stage would keep them all until after the backward pass (its later reduction, or a
            # multi-stage schedule's REDUCE_GRAD action, then finds none).
            reduce_after_this_backward(self.submod, last=True)
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"]), None
        if self.replica_sums is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self.replica_sums.posting(self.stage_index):  # each gradient's sum over the replicas, once it is final
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    # The timeline (lightning_mp_lstm.timeline): spans of computation, tags on the point-to-point operations.
    @override
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self._wait_posted("forward", fwd_chunk_id)
        self.submod.microbatch = fwd_chunk_id  # a model that carries state per microbatch reads it
        with RECORDER.span("forward", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    @override
    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        self._wait_posted("backward", bwd_chunk_id)
        kind = "backward" if full_backward else "backward_input"
        with RECORDER.span(kind, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

    @override
    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with RECORDER.span("backward_weight", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    @override
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> Any:
        if self.receive_ahead:
            return self._post_ahead("forward", fwd_chunk_id, super().get_fwd_recv_ops, self.args_recv_info)
        return RECORDER.tag(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "forward", self.stage_index, fwd_chunk_id)

    @override
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> Any:
        return RECORDER.tag(super().get_fwd_send_ops(fwd_chunk_id), "send", "forward", self.stage_index, fwd_chunk_id)

    @override
    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> Any:
        if self.receive_ahead:
            return self._post_ahead("backward", bwd_chunk_id, super().get_bwd_recv_ops, self.grad_recv_info)
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        return RECORDER.tag(ops, "recv", "backward", self.stage_index, bwd_chunk_id)

    def _post_ahead(self, direction: str, chunk: int, make_ops: Callable[[int], list[Any]],
                    infos: dict[int, Any]) -> list[Any]:
        """Post the receives of ``chunk`` (unless posted already) and of the next microbatch; the schedule gets no
        operation to issue (the stage waits for its own at the microbatch's start)."""
        for index in (chunk, chunk + 1):
            if index in infos and (direction, index) not in self._posted:
                works = [dist.irecv(op.tensor, group=op.group, group_src=op.group_peer, tag=op.tag)
                         for op in make_ops(index)]
                if works:
                    self._posted[direction, index] = works
        return []

    def _wait_posted(self, direction: str, chunk: int) -> None:
        works = self._posted.pop((direction, chunk), None)
        if works:
            RECORDER.wait_received(works, direction, self.stage_index, chunk)

    @override
    def get_bwd_send_ops(self, bwd_chunk_id: int) -> Any:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        return RECORDER.tag(ops, "send", "backward", self.stage_index, bwd_chunk_id)


def release_step(schedule: Any) -> None:
    """Drop what the stages of a torch schedule keep of the step that just ran.

    torch clears a stage's per-step caches (every microbatch's outputs, kept for a backward that evaluation never
    runs, and the last stage's output chunks) only when that stage's next step starts. The engine keeps a schedule per
    batch shape, so each would hold its last batch's outputs until that shape came again: with a module whose loss
    takes whole logits, a whole evaluation batch's logits per shape (five validation buckets held 1.6 GiB after
    validation where one batch needed 0.4). This library's wavefront loop keeps nothing between steps.
    """
    for stage in _torch_stages(schedule):
        stage.fwd_cache.clear()
        stage.output_chunks.clear()


def hold_receive_buffers(schedule: Any, holding: Any) -> Any:
    """Give ``schedule``'s stages their receive buffers back and take those of ``holding`` (the schedule that held
    them until now) away; returns ``schedule``, the one that holds them now.

    torch's stage allocates a buffer for every microbatch's activations (and, training, for the gradients it
    receives) when its first step infers the shapes and keeps them for its life; the engine keeps a schedule per
    batch shape, so every shape it has run would hold its buffers (a pp2 validation over five buckets of 2,048-sentence
    batches held 106 MiB more than its largest batch needs). Only the schedule in use holds them: a schedule that runs
    again receives into new ones (a step overwrites them whole). A buffer is replaced, not resized: one torch's
    V-shaped schedules point at a stage's own output on this process is never freed from under it.
    """
    if schedule is holding:
        return schedule
    for stage in _torch_stages(holding):
        for info in _receive_infos(stage):
            info.buffer = torch.empty_like(info.buffer, device="meta").requires_grad_(info.buffer.requires_grad)
    for stage in _torch_stages(schedule):
        for info in _receive_infos(stage):
            if info.buffer.is_meta:
                info.buffer = torch.empty_like(info.buffer, device=stage.device).requires_grad_(
                    info.buffer.requires_grad)
    return schedule


def _torch_stages(schedule: Any) -> list[PipelineStage]:
    """The torch stages a schedule runs (none for this library's wavefront loop, or ``None``)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [stage for stage in stages if isinstance(stage, PipelineStage)]


def _receive_infos(stage: PipelineStage) -> Iterator[Any]:
    """The stage's receive infos that hold a buffer of their own (not a root argument's, which is the batch)."""
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            if not getattr(info, "is_root_arg", False) and isinstance(getattr(info, "buffer", None), torch.Tensor):
                yield info
