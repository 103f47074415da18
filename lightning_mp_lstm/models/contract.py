"""What the ``mp_lstm`` engine needs from a model and from its data, as ``Protocol`` s.

A LightningModule does not implement :class:`PipelineModel` itself: it declares its blocks once in
``configure_pipeline()`` (:class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`) and the library derives this view
of it. A model that is not an embedding -> LSTM stack -> decoder chain returns its own :class:`PipelineModel` from
``configure_pipeline()`` instead; :func:`check_model` names every member it lacks.

Optional members, used when present: ``prepare_batch(batch)`` (the batch's ``(inputs, targets)`` rows first) and
``restore_layout(predictions)``, ``loss_blocks`` (the blocks whose stages compute pieces of the loss; default: the
last), ``microbatch_context(index)`` (entered around every stage forward with the
microbatch's index: per-row recurrent state across batches) and ``reset_state(mode)``, ``loss_context()`` (around the
loss's forward and backward: torch's ``loss_parallel``), ``log_name`` (what the strategy logs under), and for
``tensor_parallel_size > 1`` ``parallelize_vocabulary(mesh)`` (required then), ``check_tensor_parallel(size)`` and
``tensor_parallel_blocks()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["PipelineData", "PipelineModel", "check_data", "check_model"]


@runtime_checkable
class PipelineModel(Protocol):
    """A model made of named blocks that run one after another, each mapping one tensor to one tensor."""

    @property
    def block_names(self) -> list[str]:
        """Every block's name in model order (also after pruning)."""

    def blocks(self, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
        """The blocks present on this process (optionally only ``names``), in model order."""

    def keep_blocks(self, names: Sequence[str]) -> None:
        """Delete every other block; the parameter names of the kept blocks must not change."""

    def materialize_blocks(self, names: Sequence[str], device: torch.device) -> None:
        """Give blocks built on the meta device real storage on ``device`` and their initial values.

        The values must depend only on the block's name and the model's seed, never on which other blocks
        exist, so every layout starts from the one-process model.
        """

    def build_block(self, name: str, device: torch.device) -> nn.Module:
        """A new, initialized block ``name`` on ``device``, for timing it (its values do not matter)."""

    def example_input(self, name: str, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """An input of block ``name`` for ``rows`` sequences of ``length`` steps (for profiling)."""

    def example_targets(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Targets for ``rows`` sequences of ``length`` steps (for timing the last block with its loss)."""

    def batch_weights(self, targets: torch.Tensor) -> torch.Tensor:
        """Additive counts of a replica's batch (its real rows' targets) as a 1-D tensor whose first entry is the
        number of target tokens (e.g. ``[tokens, sequences]``); the engine sums them over the replicas and hands the
        global counts to :meth:`start_batch`."""

    def start_batch(self, counts: torch.Tensor, microbatch_rows: Sequence[int], accumulation: int) -> None:
        """A batch starts: its global counts, the real (not padding) rows of each microbatch, and the batches
        accumulated per optimizer step (the pieces of the loss are divided by it too)."""

    def microbatch_loss(self, outputs: torch.Tensor, targets: torch.Tensor, microbatch: int | None = None,
                        block: nn.Module | None = None) -> torch.Tensor:
        """Microbatch ``microbatch`` 's piece of the batch loss: the pieces of every microbatch, time chunk and replica
        add up to the batch loss. ``None``: the microbatch's own loss, unscaled (for timing it). ``block``: the last
        block that gave ``outputs`` when it is a copy (:meth:`build_block`, ``probe_block``) rather than the model's
        own, for a loss that uses the block's parameters."""

    def finish_batch(self) -> dict[str, torch.Tensor]:
        """This process's pieces since :meth:`start_batch`, summed and detached: ``{"loss": ...}`` and any named terms
        of the loss; the engine sums them over the stages and replicas."""

    @property
    def term_names(self) -> list[str] | None:
        """The names :meth:`finish_batch` reports (``None``: learned from every rank at the first batch)."""

    def pad_rows(self, inputs: torch.Tensor, targets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` more rows that add nothing to the loss (to split a ragged batch into equal microbatches)."""

    def predictions(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The predict-step result of a batch from the last block's outputs."""

    def analytic_costs(self, kind: str, rows: int, length: int) -> dict[str, float]:
        """Per-block cost without measuring: ``"flops"`` for a batch of ``rows x length``, ``"memory"`` (bytes
        of parameters, gradients and optimizer state) or ``"parameters"``."""


@runtime_checkable
class PipelineData(Protocol):
    """What planning needs to know of the data: the shape of a training batch."""

    @property
    def batch_size(self) -> int | None:
        """Sequences per global training batch."""

    @property
    def mean_padded_length(self) -> float:
        """The mean length a training sequence is padded to (the bucket mix)."""

    # Optional: ``shards_data_parallel = True`` when each data-parallel replica's loaders yield its own share of
    # every global batch (LMDataModule); otherwise every replica is given the global batch and takes its rows.
    # ``bucket_lengths`` (the lengths batches are padded to) and, with it, ``eval_batch_size`` (sequences per
    # evaluation batch; ``None``: ``batch_size``) and ``dataset(split)`` (a split's ``buckets`` and
    # ``bucket_indices``: how many sequences each bucket holds) let the memory plan find the largest training and
    # evaluation batches; without ``bucket_lengths`` memory is not planned (the run says so).


def _missing(obj: Any, protocol: type) -> list[str]:
    members = [name for name in protocol.__dict__ if not name.startswith("_") and name not in ("register",)]
    return [name for name in members if not hasattr(obj, name)]


def check_model(model: Any) -> None:
    """Raise ``TypeError`` naming every member of :class:`PipelineModel` that ``model`` lacks."""
    missing = _missing(model, PipelineModel)
    if missing:
        raise TypeError(
            f"a custom pipeline model (lightning_mp_lstm.models.contract.PipelineModel) needs every member; "
            f"{type(model).__name__} lacks: {', '.join(missing)}"
        )


def check_data(datamodule: Any, why: str) -> None:
    """Raise ``TypeError`` naming what ``datamodule`` lacks of :class:`PipelineData`, and why it is needed."""
    missing = _missing(datamodule, PipelineData) if datamodule is not None else ["batch_size", "mean_padded_length"]
    if missing:
        raise TypeError(
            f"{why} needs the data's batch shape (lightning_mp_lstm.models.contract.PipelineData): "
            f"{type(datamodule).__name__} lacks {', '.join(missing)}; add them, or fix the partition and "
            "n_microbatches"
        )
