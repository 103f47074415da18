"""Pipeline stages of the LSTM language model and the per-bucket schedules that run them.

One :class:`PipelineRunner` per process. It owns this process's stage modules (views onto the blocks of
the pruned :class:`~lightning_mp_lstm.model.LSTMLanguageModel`, so parameters are shared, never copied)
and creates one ``PipelineStage`` + schedule per distinct batch shape, lazily, cached: a stage sizes its
receive buffers at its first step and cannot serve another shape afterwards (the MXNet
"one executor per bucket" idea).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from lightning_mp_lstm.layout import ParallelLayout
from lightning_mp_lstm.timeline import RECORDER

__all__ = ["PipelineRunner", "StageModule", "StageRandomness", "all_reduce_gradients", "build_pipeline", "local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a ``DTensor`` (the same storage), or ``tensor`` itself when it is a plain one."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    The gradient a stage sends upstream must be contiguous (gloo refuses views); the gradient of a
    batch-first LSTM input is a transposed view.
    """

    @staticmethod
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
        self._finite: list[torch.Tensor | None] = [None] * len(self.block_names)
        #: Set while torch's pipelining infers shapes: it runs the stage on uninitialized tensors.
        self.inferring_shapes = False
        #: The microbatch the next forward runs (set by the stage before each forward).
        self.microbatch: int | None = None
        self._microbatch_context = microbatch_context or (lambda index: nullcontext())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = _ContiguousGrad.apply(x)
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
                    finite = torch.isfinite(x.detach().sum())  # NaN and infinity survive the sum: one pass, a scalar
                    self._finite[i] = finite if self._finite[i] is None else self._finite[i] & finite
        return x.contiguous()

    def reset_finite_checks(self) -> None:
        """Forget the finite-output notes (before each training batch)."""
        self._finite = [None] * len(self.block_names)

    def first_non_finite(self) -> str | None:
        """The first of this stage's blocks whose output was not finite since the last reset, if any."""
        for name, finite in zip(self.block_names, self._finite):
            if finite is not None and not bool(finite):
                return name
        return None


@contextmanager
def _no_context() -> Iterator[None]:
    yield


def _on_cuda(randomness: StageRandomness | None) -> bool:
    return randomness is not None and randomness.device.type == "cuda"


class _Stage(PipelineStage):
    """``PipelineStage`` that tells its module when it runs only to infer shapes.

    torch infers the shapes a stage sends from a first forward (and backward) on uninitialized tensors; that
    pass must neither draw dropout masks nor count as a non-finite output.
    """

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring_shapes = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring_shapes = False

    # The timeline (lightning_mp_lstm.timeline): spans of computation, tags on the point-to-point operations.
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.microbatch = fwd_chunk_id  # a model that carries state per microbatch reads it
        with RECORDER.span("forward", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        kind = "backward" if full_backward else "backward_input"
        with RECORDER.span(kind, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with RECORDER.span("backward_weight", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> Any:
        return RECORDER.tag(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "forward", self.stage_index, fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> Any:
        return RECORDER.tag(super().get_fwd_send_ops(fwd_chunk_id), "send", "forward", self.stage_index, fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> Any:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        return RECORDER.tag(ops, "recv", "backward", self.stage_index, bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> Any:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        return RECORDER.tag(ops, "send", "backward", self.stage_index, bwd_chunk_id)


class PipelineRunner:
    """Runs training, evaluation and prediction batches through this process's pipeline stages.

    Args:
        model: the model (its contract supplies the loss, padding rows and predictions).
        stage_modules: global stage index -> :class:`StageModule`, for the stages this process holds.
        layout: the validated parallel layout.
        pipeline_group: process group of this replica's pipeline (``None`` when pipeline size is 1).
        data_parallel_group: process group of the replicas of this pipeline rank (``None`` when 1 replica).
        device: device of this process.
        accumulate_grad_batches: returns the current gradient-accumulation factor; the training loss is
            divided by it like Lightning divides an automatic-optimization loss.
    """

    def __init__(
        self,
        model: Any,
        stage_modules: dict[int, StageModule],
        layout: ParallelLayout,
        pipeline_group: dist.ProcessGroup | None,
        data_parallel_group: dist.ProcessGroup | None,
        device: torch.device,
        accumulate_grad_batches: Callable[[], int] = lambda: 1,
    ) -> None:
        self.model = model
        self.stage_modules = stage_modules
        self.layout = layout
        self.pipeline_group = pipeline_group
        self.data_parallel_group = data_parallel_group
        self.device = device
        self.accumulate_grad_batches = accumulate_grad_batches
        self._schedules: dict[tuple[int, int, str], Any] = {}
        self._divisor = torch.ones((), device=device)
        #: The global loss weight (real tokens) of the last batch run.
        self.last_tokens: torch.Tensor | None = None
        last = layout.num_stages - 1
        self.has_first_stage = 0 in stage_modules
        self.has_last_stage = last in stage_modules
        # Pipeline rank that holds the last stage: the last rank, except for V-shaped schedules.
        self._last_stage_rank = 0 if layout.style == "v" else layout.pipeline_parallel_size - 1

    # ----- public ----------------------------------------------------------------------------------
    def run(self, batch: Any, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss (mean over the global batch's real tokens) and global real-token count of ``batch``.

        With ``train=True`` the backward pass runs too: gradients of this process's parameters are
        accumulated into ``.grad`` (summed, not yet reduced across data-parallel replicas).
        """
        inputs, targets = self._padded(batch)
        if train:
            for module in self.stage_modules.values():
                module.reset_finite_checks()
        n_tokens = self._all_reduce_dp(self.model.loss_weight(targets))
        self.last_tokens = n_tokens
        scale = self.accumulate_grad_batches() if train else 1
        self._divisor = (n_tokens * scale).clamp(min=1).to(torch.float32)
        losses: list[torch.Tensor] = []
        if self.layout.pipeline_parallel_size == 1:
            with self._loss_context():
                loss = self._run_local(inputs, targets, train)
        else:
            schedule = self._schedule(inputs.shape, "train" if train else "eval")
            args = (inputs,) if self.has_first_stage else ()
            target = targets if self.has_last_stage else None
            with self._loss_context():  # forward and backward of a vocabulary-parallel loss run inside it
                if train:
                    schedule.step(*args, target=target, losses=losses, return_outputs=False)
                else:
                    with torch.no_grad():
                        schedule.eval(*args, target=target, losses=losses)
            loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
            loss = self._broadcast_from_last(loss)
        loss = self._all_reduce_dp(loss) * scale
        return loss, n_tokens

    def predict(self, batch: Any) -> dict[str, torch.Tensor]:
        """Per-token target log-probabilities and next-token ids, identical on every rank.

        Every rank of the replica receives its shard's result; with several replicas the shards are
        gathered in replica order, so global rank 0 holds the whole global batch.
        """
        rows = int(batch[0].shape[0])
        inputs, targets = self._padded(batch)
        if self.layout.pipeline_parallel_size == 1:
            with torch.no_grad():
                result = self.model.predictions(self._local_forward(inputs), targets)
            log_probs, next_token = result["log_probs"], result["next_token"]
        else:
            schedule = self._schedule(inputs.shape, "predict")
            with torch.no_grad():
                logits = schedule.eval(*((inputs,) if self.has_first_stage else ()))
            if self.has_last_stage and logits is not None:
                result = self.model.predictions(logits, targets)
                log_probs, next_token = result["log_probs"], result["next_token"]
            else:
                log_probs = torch.empty(targets.shape, dtype=torch.float32, device=self.device)
                next_token = torch.empty_like(targets)
            log_probs = self._broadcast_from_last(log_probs)
            next_token = self._broadcast_from_last(next_token)
        out = {"log_probs": log_probs[:rows], "next_token": next_token[:rows], "mask": targets[:rows] != 0}
        if self.data_parallel_group is not None and self.layout.data_parallel_size > 1:
            shards: list[Any] = [None] * self.layout.data_parallel_size
            dist.all_gather_object(shards, {k: v.cpu() for k, v in out.items()}, group=self.data_parallel_group)
            out = {k: torch.cat([s[k] for s in shards]).to(self.device) for k in out}
        return out

    def non_finite_source(self) -> str:
        """Where the last training batch first produced a non-finite value (call on every rank: a collective).

        Returns:
            e.g. ``"block lstm.1 (stage 1, pipeline rank 1, replica 0)"``, or a note that every block's output
            was finite (then the loss itself overflowed).
        """
        local = []
        for index, module in sorted(self.stage_modules.items()):
            block = module.first_non_finite()
            if block is not None:
                local.append((index, block))
        found: list[Any] = [local]
        if dist.is_available() and dist.is_initialized():
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, local)
        for rank, blocks in enumerate(found):
            for stage, block in blocks:
                replica, pipeline_rank = self.layout.coordinates(rank)
                return f"block {block} (stage {stage}, pipeline rank {pipeline_rank}, replica {replica})"
        last = self.model.block_names[-1]
        return f"block {last} or the loss (every earlier block's output was finite)"

    @property
    def cached_shapes(self) -> list[tuple[int, int, str]]:
        """Keys ``(batch, length, mode)`` of the stages + schedules built so far."""
        return sorted(self._schedules)

    # ----- helpers ---------------------------------------------------------------------------------
    def _padded(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # Ragged batches get rows that add nothing to the loss, so the microbatches split evenly.
        inputs, targets = batch[0], batch[1]
        extra = -int(inputs.shape[0]) % self.layout.n_microbatches
        return self.model.pad_rows(inputs, targets, extra) if extra else (inputs, targets)

    def _loss_context(self) -> AbstractContextManager[Any]:
        # Optional in the contract: a model whose loss needs a context (torch's loss_parallel) gives it.
        make = getattr(self.model, "loss_context", None)
        return make() if make is not None else nullcontext()

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.microbatch_loss(logits, targets) / self._divisor

    def _local_forward(self, inputs: torch.Tensor, microbatch: int = 0) -> torch.Tensor:
        (module,) = self.stage_modules.values()
        module.microbatch = microbatch
        return module(inputs)

    def _run_local(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        (stage,) = self.stage_modules
        with torch.set_grad_enabled(train):
            chunks = zip(inputs.chunk(self.layout.n_microbatches), targets.chunk(self.layout.n_microbatches))
            for i, (x, y) in enumerate(chunks):
                with RECORDER.span("forward", stage, i):
                    loss = self._loss_fn(self._local_forward(x, i), y)
                if train:
                    with RECORDER.span("backward", stage, i):
                        loss.backward()
                total = total + loss.detach()
        return total

    def _schedule(self, shape: torch.Size, mode: str) -> Any:
        key = (int(shape[0]), int(shape[1]), mode)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._build_schedule(with_loss=mode != "predict")
            self._schedules[key] = schedule
        return schedule

    def _build_schedule(self, with_loss: bool) -> Any:
        layout = self.layout
        stages = [
            _Stage(module, index, layout.num_stages, self.device, group=self.pipeline_group)
            for index, module in self.stage_modules.items()
        ]
        schedule_cls = get_schedule_class(layout.schedule)
        loss_fn = self._loss_fn if with_loss else None
        target = stages[0] if layout.style == "single" else stages
        return schedule_cls(target, layout.n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def _broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.broadcast(tensor, group=self.pipeline_group, group_src=self._last_stage_rank)
        return tensor

    def _all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.data_parallel_group is None or self.layout.data_parallel_size == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.data_parallel_group)
        return tensor


def build_pipeline(
    model: Any,
    layout: ParallelLayout,
    partition: Sequence[Sequence[str]],
    pipeline_rank: int,
    pipeline_group: dist.ProcessGroup | None,
    data_parallel_group: dist.ProcessGroup | None,
    device: torch.device,
    accumulate_grad_batches: Callable[[], int] = lambda: 1,
    seed: int | None = None,
    data_parallel_rank: int = 0,
) -> PipelineRunner:
    """Prune ``model`` to the blocks of ``pipeline_rank``'s stages, give them storage, and attach a runner.

    Args:
        model: a :class:`~lightning_mp_lstm.contract.PipelineModel` (pruned in place; parameter names kept;
            blocks still on the meta device get their initial values on ``device``).
        layout: the validated layout.
        partition: block names of every stage (``layout.num_stages`` lists).
        pipeline_rank: this process's rank within its pipeline.
        pipeline_group: process group of the pipeline.
        data_parallel_group: process group of this pipeline rank's replicas.
        device: this process's device.
        accumulate_grad_batches: see :class:`PipelineRunner`.
        seed: seed of every stage's own random stream (:class:`StageRandomness`); ``None``: the global one.
        data_parallel_rank: this process's replica (replicas draw different dropout masks).

    Returns:
        The runner, also stored as ``model.pipeline``.
    """
    stage_ids = layout.stage_indices(pipeline_rank)
    own = [name for s in stage_ids for name in partition[s]]
    model.keep_blocks(own)
    model.materialize_blocks(own, device)
    model.pipeline = PipelineRunner(
        model=model,
        stage_modules={
            s: StageModule(
                model.blocks(partition[s]),
                StageRandomness(seed, data_parallel_rank, s, device) if seed is not None else None,
                last_block=model.block_names[-1],
                microbatch_context=getattr(model, "microbatch_context", None),
            )
            for s in stage_ids
        },
        layout=layout,
        pipeline_group=pipeline_group,
        data_parallel_group=data_parallel_group,
        device=device,
        accumulate_grad_batches=accumulate_grad_batches,
    )
    return model.pipeline


def all_reduce_gradients(parameters: Any, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of ``parameters`` over ``group`` in one flat all-reduce.

    Called once per optimizer step across data-parallel replicas: each replica's loss is already
    divided by the global token count, so the sum is the gradient of the global batch's mean loss. A sharded
    (tensor-parallel) gradient is reduced as its local shard: the replicas of a shard hold the same slice.
    """
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
