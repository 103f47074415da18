"""Recurrent state carried across batches for a declared module (``LSTMBlocks(carry_state=True)``): each LSTM layer
block keeps the ``(h, c)`` of every microbatch of rows, apart for training and evaluation, detached (truncated
backpropagation through time over a token stream). :class:`CarriedState` is mixed into
:class:`~lightning_mp_lstm.models.language_model_blocks.LanguageModelBlocks`; the stages enter
:meth:`CarriedState.microbatch_context` around every forward."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CarriedState"]


class CarriedState:
    """The carried-state members of the pipeline contract (``microbatch_context``, ``reset_state``), over the layer
    blocks (``_layers``), the declaration (``carry_state``) and the objective (which microbatch runs, for the loss and
    penalty) of the class it is mixed into."""

    declaration: Any
    objective: Any
    _layers: dict[int, Any]
    _layer_present: Callable[[int], bool]

    @contextmanager
    def microbatch_context(self, microbatch: int | None) -> Iterator[None]:
        """Around every stage forward: with ``carry_state``, the LSTM layers read and keep microbatch
        ``microbatch`` 's state (training and evaluation apart); ``None`` (shape inference) keeps nothing."""
        self.objective.microbatch = microbatch
        if not self.declaration.carry_state or microbatch is None:
            try:
                yield
            finally:
                self.objective.microbatch = None
            return
        training = any(block.training for block in self._layers.values())
        layers = [self._layers[k] for k in self._layers if self._layer_present(k)]
        for layer in layers:
            layer.slot = ("train" if training else "eval", int(microbatch))
        try:
            yield
        finally:
            self.objective.microbatch = None
            for layer in layers:
                layer.slot = None

    def reset_state(self, mode: str) -> None:
        """Forget the carried state of ``"train"`` or ``"eval"`` (a new epoch, a new evaluation)."""
        for block in self._layers.values():
            for slot in [k for k in block.carried if k[0] == mode]:
                del block.carried[slot]

