"""The checkpoint hooks of Lightning's ``Strategy``, delegated to a checkpoint format: ``MPLSTMStrategy`` takes them
from :class:`CheckpointHooks`, so the strategy's own file keeps only its other plumbing."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_mp_lstm.checkpoint.formats import CheckpointFormat, check_one_step
from lightning_mp_lstm.checkpoint.state import ModelNames

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Lightning's seven checkpoint hooks, each a call into ``self._checkpoints`` (a
    :class:`~lightning_mp_lstm.checkpoint.FileFormat` or :class:`~lightning_mp_lstm.checkpoint.ShardedFormat`).

    Mixed into a Lightning ``Strategy`` that sets ``_checkpoints`` and records the whole model's names before pruning
    in ``_model_names`` (:meth:`ModelNames.of <lightning_mp_lstm.checkpoint.ModelNames.of>`): what a checkpoint holds.
    """

    _checkpoints: CheckpointFormat
    _model_names: ModelNames
    lightning_module: Any
    optimizers: Any
    checkpoint_io: Any
    is_global_zero: bool

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """One file: the full model's state dict on global rank 0 (empty elsewhere), gathered from all stages.
        Sharded: this process's own tensors (nothing is gathered)."""
        return self._checkpoints.model_state(self.lightning_module, self._model_names)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Name-keyed optimizer state: of every stage, merged on global rank 0 (one file), or this process's
        (sharded)."""
        return self._checkpoints.optimizer_state(self.lightning_module, optimizer, self._model_names)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """One file: written on global rank 0, atomically (see
        :class:`~lightning_mp_lstm.checkpoint.AtomicCheckpointIO`). Sharded: a directory every rank writes its own
        tensors to (:func:`~lightning_mp_lstm.checkpoint.save_sharded`). A failed write fails every rank, and nothing
        is written when the ranks are at different steps
        (:func:`~lightning_mp_lstm.checkpoint.formats.check_one_step`)."""
        check_one_step(checkpoint, filepath)
        self._checkpoints.save(checkpoint, filepath, self.checkpoint_io, self._model_names, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint on every rank (one file or a sharded directory, whichever format wrote it); a truncated
        or foreign file gets a message naming it."""
        return self._checkpoints.load(checkpoint_path, self.lightning_module, self.optimizers, self.checkpoint_io,
                                      weights_only, self._model_names)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint (a file or a sharded directory) on global rank 0."""
        if self.is_global_zero:
            self._checkpoints.remove(filepath, self.checkpoint_io)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model_state(self.lightning_module, checkpoint, strict, self._model_names)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizer_state(self.lightning_module, self.optimizers, checkpoint, self._model_names)
