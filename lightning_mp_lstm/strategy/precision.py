"""``PipelinePrecision``: Lightning's precision plugin for a schedule that runs backward inside the training step.

Lightning's automatic optimization runs ``training_step``, zeroes the gradients, then calls ``backward``. A pipeline
schedule computes the gradients during the step itself, so this plugin holds them aside while Lightning zeroes and
hands them to the parameters in :meth:`PipelinePrecision.backward` (DeepSpeed's precision plugin replaces
``backward`` the same way). Once per optimizer step it has the engine sum them over replicas and tied copies, and
it clips by the global norm of the whole model, not of one process's stage. Everything about dtypes (autocast,
module conversion) is the wrapped plugin's: the one Lightning chose from ``Trainer(precision=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["NUMERICS", "PipelinePrecision", "REFUSED_PRECISIONS", "exact_numerics", "set_numerics"]

#: ``"default"``: torch's own float32 settings (TF32 in cuDNN RNNs and convolutions on Ampere and later GPUs);
#: ``"exact"``: IEEE float32 everywhere and deterministic cuDNN kernels, so that a GPU run can be compared with one
#: process to 1e-5 (what the equivalence tests use).
NUMERICS = ("default", "exact")
#: Lightning precisions the pipeline refuses: float16 without loss scaling underflows the gradients of a loss
#: divided by the global token count, and with scaling the scaler never sees the loss the schedule backpropagates.
REFUSED_PRECISIONS = ("16-mixed", "16-true")


def set_numerics(mode: str) -> None:
    """Apply a :data:`NUMERICS` mode to this process (``"default"`` changes nothing)."""
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics {mode!r}; allowed: {', '.join(NUMERICS)}")
    if mode == "exact":
        # Only torch's new precision API (mixing it with allow_tf32 is refused by torch).
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


@contextmanager
def exact_numerics() -> Iterator[None]:
    """``"exact"`` numerics for a while, then this process's own again (TF32 rounds float32 products to about 1e-3
    relative, where a comparison of one process with a pipeline looks for 1e-5)."""
    settings = [(torch.backends.cudnn.rnn, "fp32_precision"), (torch.backends.cudnn.conv, "fp32_precision"),
                (torch.backends.cuda.matmul, "fp32_precision"), (torch.backends.cudnn, "deterministic"),
                (torch.backends.cudnn, "benchmark")]
    saved = [getattr(owner, name) for owner, name in settings]
    set_numerics("exact")
    try:
        yield
    finally:
        for (owner, name), value in zip(settings, saved, strict=True):
            setattr(owner, name, value)


def _clips_by_norm(model: Any) -> bool:
    """Whether Lightning's automatic optimization will clip ``model``'s gradients by norm after the closure."""
    if not isinstance(model, pl.LightningModule) or not model.automatic_optimization:
        return False
    trainer = model.trainer
    return (trainer.gradient_clip_val or 0) > 0 and trainer.gradient_clip_algorithm in (None,
                                                                                       GradClipAlgorithmType.NORM)


class PipelinePrecision(Precision):
    """Wraps the precision plugin Lightning chose, for the ``mp_lstm`` strategy.

    Args:
        inner: the plugin whose dtype behaviour applies (default: 32-bit).

    Attributes:
        engine: the strategy's :class:`~lightning_mp_lstm.pipeline.engine.PipelineEngine` (set in its ``setup``).
    """

    def __init__(self, inner: Precision | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else Precision()
        self.precision = self.inner.precision
        self.engine: Any = None
        self._module: nn.Module | None = None
        #: The training step's parameters and the gradients its schedule computed, until :meth:`backward`.
        self._held: list[tuple[nn.Parameter, Tensor | None]] | None = None
        #: The parameters of the last training step (listed once a step: walking the module costs a tenth of a ms).
        self._step_parameters: list[nn.Parameter] | None = None

    @property
    def scaler(self) -> Any:
        """The wrapped plugin's gradient scaler (the strategy refuses one)."""
        return getattr(self.inner, "scaler", None)

    # ----- the wrapped plugin's dtypes --------------------------------------------------------------------
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def tensor_init_context(self) -> Any:
        return self.inner.tensor_init_context()

    @override
    def module_init_context(self) -> Any:
        return self.inner.module_init_context()

    @override
    def forward_context(self) -> Any:
        return self.inner.forward_context()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        self._held = self._step_parameters = None
        self.inner.teardown()

    # ----- gradients computed inside the training step ------------------------------------------------------
    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        self._module = model
        return super().connect(model, optimizers, lr_schedulers)

    def _parameters(self) -> list[nn.Parameter]:
        assert self._module is not None, "connect() first (the strategy's setup does)"
        return list(self._module.parameters())

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """The wrapped plugin's context; the gradients the schedule adds inside it are held until :meth:`backward`
        (Lightning zeroes ``.grad`` between the training step and ``backward``)."""
        params = self._step_parameters = self._parameters()
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with self.inner.train_step_context():
                yield
        finally:
            self._held = [(p, p.grad) for p in params]
            for p, grad in zip(params, earlier, strict=True):
                p.grad = grad

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Add the gradients the schedule computed in the training step, where a plain backward would add them."""
        held, self._held = self._held or [], None
        for p, grad in held:
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)

    @override
    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Sum the gradients over replicas and tied copies once the closure computed them, before the
        ``on_before_optimizer_step`` hooks and clipping see them."""
        def closure_then_reduce() -> Any:
            result = closure()
            params = self._step_parameters
            self.engine.reduce_gradients(params if params is not None else self._parameters())
            return result

        if _clips_by_norm(model):
            self.engine.expect_clip()
        try:
            return super().optimizer_step(optimizer, model, closure_then_reduce, **kwargs)
        finally:
            self.engine.cancel_clip()  # nothing to do once the clip took the norms it expected

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip every gradient to ``[-clip_val, clip_val]``: tensor-parallel shards (``DTensor``) apart from the
        other gradients, which torch's foreach kernels refuse to take together (torch 2.13: "got mixed torch.Tensor
        and DTensor"); an element's clip does not depend on the others."""
        params = [p for p in self.main_params(optimizer) if p.grad is not None]
        for sharded in (True, False):
            group = [p for p in params if isinstance(p.grad, DTensor) == sharded]
            if group:
                torch.nn.utils.clip_grad_value_(group, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of the whole model's gradient, over every stage and shard."""
        self.engine.clip_grad_norm_(self.main_params(optimizer), clip_val)
