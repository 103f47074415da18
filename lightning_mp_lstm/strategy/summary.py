"""Lightning's model summary of the whole model, when the ``mp_lstm`` strategy has split it across processes.

Lightning's ``ModelSummary`` callback summarizes global rank 0's module when fitting starts; under a pipeline that
module holds only rank 0's stages (under pp2 the synthetic model's 392 K of 522 K parameters). The strategy takes
the summary earlier, on global rank 0 before it prunes the module (:func:`install`), and swaps every
``ModelSummary`` callback for a :class:`PipelineModelSummary` that prints it. The numbers are then one process's:
every stage's parameters, and the FLOPs of the whole model's forward on ``example_input_array`` (Lightning counts
FLOPs only for a module that has one; ``train.py`` sets it to one global batch of the data's mean length), the LSTM
layers' included (torch's FLOP counter has no formula for the fused LSTM kernels; :class:`CountingSummary` adds
one).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_mp_lstm.models.shapes import fake_parameters

__all__ = ["LSTM_FLOP_FORMULAS", "CountingSummary", "PipelineModelSummary", "WholeModelSummary", "install"]

_FROZEN = ("layer_names", "layer_types", "param_nums", "training_modes", "total_training_modes", "total_parameters",
           "trainable_parameters", "in_sizes", "out_sizes", "flop_counts", "total_flops")


def _lstm_flops(input_shape: Any, *args: Any, out_shape: Any = None, weights: Any = (), **kwargs: Any) -> int:
    """Forward FLOPs of an LSTM kernel: the input and recurrent matrix products (2 per multiply-add) over every time
    step and row, from its 2-D weights' shapes (torch's counter has no formula for the fused LSTM kernels)."""
    steps_and_rows = math.prod(input_shape[:-1])
    return 2 * steps_and_rows * sum(math.prod(w) for w in weights if len(w) == 2)


def _mkldnn_lstm_layer(input_shape: Any, w_ih: Any, w_hh: Any, *args: Any, **kwargs: Any) -> int:
    return _lstm_flops(input_shape, weights=(w_ih, w_hh))


def _cudnn_lstm(input_shape: Any, weights: Any, *args: Any, **kwargs: Any) -> int:
    return _lstm_flops(input_shape, weights=weights)


#: FLOP formulas for the LSTM kernels CPU (oneDNN) and CUDA (cuDNN) forwards run.
LSTM_FLOP_FORMULAS = {torch.ops.aten.mkldnn_rnn_layer: _mkldnn_lstm_layer,
                      torch.ops.aten._cudnn_rnn: _cudnn_lstm}


class CountingSummary(Summary):
    """Lightning's model summary whose FLOP count includes LSTM layers (:data:`LSTM_FLOP_FORMULAS`)."""

    @override
    def _forward_example_input(self) -> None:
        self._flop_counter = FlopCounterMode(display=False, depth=self._max_depth + 1,
                                             custom_mapping=LSTM_FLOP_FORMULAS)
        super()._forward_example_input()


def _kept(name: str) -> property:
    """Lightning's property ``name``, answered from what was read when the summary was taken, once it was."""

    def read(self: WholeModelSummary) -> Any:
        kept = self.__dict__.get("_frozen", {})
        return kept[name] if name in kept else getattr(Summary, name).__get__(self)

    return property(read)


class WholeModelSummary(CountingSummary):
    """Lightning's summary of ``model``, read at once and kept: it no longer changes (or holds the model's layers)
    when the model is pruned afterwards.

    A model on the meta device (``train.py`` builds it there) is counted as it is; its forward on
    ``example_input_array`` (FLOPs, in and out sizes) runs on a copy whose parameters are torch's fake tensors: shapes
    only, so no process ever allocates the whole model for its summary.
    """

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        example = model.example_input_array
        meta = any(p.is_meta for p in model.parameters())
        self._frozen: dict[str, Any] = {}
        if meta:
            model.example_input_array = None  # counted here; the forward runs on a CPU copy below
        try:
            super().__init__(model, max_depth)
            frozen = {name: getattr(self, name) for name in _FROZEN}
        finally:
            model.example_input_array = example
        if meta and example is not None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            runnable = fake_parameters(copy.deepcopy(model), mode, torch.device("cpu"))
            # Lightning moves the example input to the module's device, the strategy's (its setup hook sets it).
            runnable._device = torch.device("cpu")
            runnable.example_input_array = example
            with mode:
                shapes = CountingSummary(runnable, max_depth)
                frozen.update({name: getattr(shapes, name) for name in ("in_sizes", "out_sizes", "flop_counts",
                                                                        "total_flops")})
            del runnable, shapes
        self._frozen = frozen
        self._layer_summary = OrderedDict.fromkeys(self._layer_summary)  # its layer names, not the layers

    layer_names = _kept("layer_names")
    layer_types = _kept("layer_types")
    param_nums = _kept("param_nums")
    training_modes = _kept("training_modes")
    total_training_modes = _kept("total_training_modes")
    total_parameters = _kept("total_parameters")
    trainable_parameters = _kept("trainable_parameters")
    in_sizes = _kept("in_sizes")
    out_sizes = _kept("out_sizes")
    flop_counts = _kept("flop_counts")
    total_flops = _kept("total_flops")


class PipelineModelSummary(ModelSummary):
    """A ``ModelSummary`` callback that prints a :class:`WholeModelSummary` taken before the model was split, on
    global rank 0, in the table style of the callback it replaces (plain or rich).

    Args:
        replaced: the ``ModelSummary`` callback it stands in for (its depth and table arguments are kept).
        summary: the whole model's summary (``None`` on the other ranks, which print nothing).
    """

    def __init__(self, replaced: ModelSummary, summary: WholeModelSummary | None) -> None:
        super().__init__(max_depth=replaced._max_depth, **replaced._summarize_kwargs)
        self.replaced = replaced
        self.whole = summary

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.whole is not None and trainer.is_global_zero:
            super().on_fit_start(trainer, pl_module)

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return self.whole

    def summarize(self, *args: Any, **kwargs: Any) -> None:  # the replaced callback's table (a static method there)
        type(self.replaced).summarize(*args, **kwargs)


def install(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    """Swap each ``ModelSummary`` callback of ``trainer`` for a :class:`PipelineModelSummary` of ``model`` as it is
    now (whole: call it before the strategy prunes the model); the summary is taken on global rank 0 only."""
    for index, callback in enumerate(trainer.callbacks):
        if not isinstance(callback, ModelSummary) or not callback._max_depth:
            continue
        replaced = callback.replaced if isinstance(callback, PipelineModelSummary) else callback
        whole = WholeModelSummary(model, replaced._max_depth) if trainer.is_global_zero else None
        trainer.callbacks[index] = PipelineModelSummary(replaced, whole)
