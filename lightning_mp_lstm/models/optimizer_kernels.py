"""Which of torch's optimizer implementations a model's parameters allow: the same update, computed by the fastest
kernel that accepts them.

torch picks the per-parameter loop on CPU by default. The fused kernels (one pass over every parameter, on CPU and
CUDA alike) take a step of ``LSTMLanguageModel``'s Adam from 19.8 ms to 2.1 ms on a 2.8M-parameter model on one CPU
thread, and that step follows the last stage's backward on the pipeline's critical path (docs/benchmarks.md). The
multi-tensor kernels refuse a list that mixes sharded (``DTensor``) and plain parameters, as tensor parallelism makes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["kernel_options", "make_optimizer"]

#: Devices torch's fused optimizer kernels run on.
FUSED_DEVICES = ("cpu", "cuda")


def kernel_options(params: Sequence[torch.Tensor], fused: bool = True) -> dict[str, bool]:
    """The implementation keyword for an optimizer of ``params``: ``fused=True`` when every parameter is a plain
    floating-point tensor on a device of :data:`FUSED_DEVICES` (and ``fused`` allows it); ``foreach=False`` when
    sharded and plain parameters are mixed; else nothing (torch's default)."""
    sharded = [type(p).__name__ == "DTensor" for p in params]
    if any(sharded):
        return {} if all(sharded) else {"foreach": False}
    if fused and params and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params):
        return {"fused": True}
    return {}


def make_optimizer(factory: Callable[..., torch.optim.Optimizer], params: list[torch.Tensor],
                   fused: bool = True) -> torch.optim.Optimizer:
    """``factory(params)``, with :func:`kernel_options` (``fused`` passed on) added when ``factory`` is a partial of an
    optimizer class that takes them (a Hydra ``_partial_`` config of a ``torch.optim`` class) and sets neither
    ``fused`` nor ``foreach`` itself; any other factory is called as it is."""
    if isinstance(factory, functools.partial) and not {"fused", "foreach"} & set(factory.keywords):
        try:
            accepted = inspect.signature(factory.func).parameters
        except (TypeError, ValueError):
            accepted = {}
        options: dict[str, Any] = {k: v for k, v in kernel_options(params, fused).items() if k in accepted}
        return factory(params, **options)
    return factory(params)
