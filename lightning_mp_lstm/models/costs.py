"""Analytic per-block costs of the LSTM language model: parameters, training memory and FLOPs.

Pure arithmetic on the model's shape (:class:`ModelShape`); nothing is measured here (see
:mod:`lightning_mp_lstm.planning.profile` for measured times). Block names: ``embedding``, ``lstm.0`` ...
``lstm.{N-1}``, ``decoder``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_mp_lstm.base.validation import check_positive_int, check_positive_number

__all__ = ["OPTIMIZER_STATES", "CostError", "ModelShape", "flop_costs", "memory_costs", "parameter_counts"]

#: Number of per-parameter optimizer state tensors, by optimizer name.
OPTIMIZER_STATES = {"adam": 2, "sgd": 0, "sgd_momentum": 1}

# FLOP constants of the analytic model (see flop_costs).
_LSTM_POINTWISE_FLOPS_PER_UNIT = 20  # biases, 3 sigmoid, 2 tanh, cell/hidden update
_BACKWARD_FACTOR = 2.0  # backward ~ 2x forward (grad wrt inputs and weights)
_SOFTMAX_XENT_FLOPS_PER_LOGIT = 6  # max, sub, exp, sum, log-sum, grad (softmax - onehot)

EMBEDDING, DECODER, LSTM_PREFIX = "embedding", "decoder", "lstm."


class CostError(ValueError):
    """An impossible model shape or cost request: the message names the value."""


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters that determine the size of every block.

    Attributes:
        vocab_size: Vocabulary size ``V``.
        embedding_dim: Embedding width ``E``.
        hidden_size: LSTM hidden size ``H``.
        num_layers: Number of LSTM layers ``N``.
        tie_weights: Whether the decoder weight is the embedding weight
            (requires ``E`` == the last layer's hidden size).
        layer_hidden_sizes: Hidden size of every layer when they differ
            (AWD-LSTM's last layer is as wide as the embedding); ``None``:
            ``hidden_size`` for every layer.
    """

    vocab_size: int
    embedding_dim: int
    hidden_size: int
    num_layers: int
    tie_weights: bool = False
    layer_hidden_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embedding_dim", "hidden_size", "num_layers"):
            check_positive_int(name, getattr(self, name), CostError)
        sizes = self.layer_hidden_sizes
        if sizes is not None:
            if len(sizes) != self.num_layers:
                raise CostError(f"layer_hidden_sizes must be {self.num_layers} positive integers, got {sizes!r}")
            for size in sizes:
                check_positive_int(f"layer_hidden_sizes (got {sizes!r}): each size", size, CostError)
        if self.tie_weights and self.embedding_dim != self.decoder_input_size:
            raise CostError(
                "tie_weights requires embedding_dim == the last layer's hidden size, got "
                f"embedding_dim={self.embedding_dim} and hidden_size={self.decoder_input_size}"
            )

    @property
    def block_names(self) -> list[str]:
        """Block names of this model, in order."""
        return [EMBEDDING, *(f"{LSTM_PREFIX}{i}" for i in range(self.num_layers)), DECODER]

    def lstm_hidden_size(self, layer: int) -> int:
        """Hidden width of LSTM layer ``layer``."""
        return self.layer_hidden_sizes[layer] if self.layer_hidden_sizes is not None else self.hidden_size

    def lstm_input_size(self, layer: int) -> int:
        """Input width of LSTM layer ``layer`` (``E`` for layer 0, else the previous layer's hidden size)."""
        return self.embedding_dim if layer == 0 else self.lstm_hidden_size(layer - 1)

    @property
    def decoder_input_size(self) -> int:
        """Input width of the decoder: the last layer's hidden size."""
        return self.lstm_hidden_size(self.num_layers - 1)


def parameter_counts(shape: ModelShape) -> dict[str, int]:
    """Number of trainable parameters of each block.

    * ``embedding``: ``V * E``;
    * ``lstm.i``: ``4H * (in + H) + 8H`` with ``in = E`` for layer 0 else
      ``H`` (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``);
    * ``decoder``: ``H * V + V``. With ``tie_weights`` the shared ``V x H``
      matrix is counted **once, on the embedding**, and the decoder only
      counts its own bias ``V``.

    Args:
        shape: The model shape.

    Returns:
        Mapping block name -> parameter count, in model order.
    """
    V, E = shape.vocab_size, shape.embedding_dim
    counts = {EMBEDDING: V * E}
    for layer in range(shape.num_layers):
        H = shape.lstm_hidden_size(layer)
        counts[f"{LSTM_PREFIX}{layer}"] = 4 * H * (shape.lstm_input_size(layer) + H) + 8 * H
    counts[DECODER] = V if shape.tie_weights else shape.decoder_input_size * V + V
    return counts


def memory_costs(
    shape: ModelShape,
    optimizer: str = "adam",
    bytes_per_param: int = 4,
    replicate_tied: bool = False,
) -> dict[str, float]:
    """Static training memory of each block in bytes: parameters + gradients + optimizer state.

    ``bytes = params * bytes_per_param * (2 + states)`` where ``states`` is the
    number of optimizer state tensors per parameter: ``adam`` 2 (first and
    second moment), ``sgd`` 0, ``sgd_momentum`` 1.

    Activations are **not** included: they depend on batch size, sequence
    length and the number of in-flight microbatches of the schedule, and per
    block they scale like the compute (see :func:`flop_costs`) rather than
    like the parameters. Balance on measured time/FLOPs for activation-heavy
    settings; this model captures the weight-dominated part (large
    vocabularies) that decides whether a stage fits on a device.

    Args:
        shape: The model shape.
        optimizer: One of ``"adam"``, ``"sgd"``, ``"sgd_momentum"``.
        bytes_per_param: Bytes per parameter/gradient/state element (4 for
            fp32).
        replicate_tied: With ``tie_weights``, also charge the shared weight
            to the decoder. Use this when embedding and decoder end up on
            different stages, each of which then holds a copy (with its
            gradient and optimizer state). Default ``False`` counts it once, on
            the embedding, consistent with :func:`parameter_counts`.

    Returns:
        Mapping block name -> bytes, in model order.

    Raises:
        CostError: On an unknown optimizer or a non-positive
            ``bytes_per_param``.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise CostError(
            f"unknown optimizer {optimizer!r}; allowed optimizers are: {', '.join(OPTIMIZER_STATES)}"
        )
    check_positive_number("bytes_per_param", bytes_per_param, CostError)
    copies = 2 + OPTIMIZER_STATES[optimizer]
    counts = parameter_counts(shape)
    if shape.tie_weights and replicate_tied:
        counts[DECODER] += shape.vocab_size * shape.decoder_input_size
    return {name: float(count * bytes_per_param * copies) for name, count in counts.items()}


def _mean_length(bucket_lengths: Sequence[int], bucket_weights: Sequence[float] | None) -> float:
    lengths = list(bucket_lengths)
    if not lengths:
        raise CostError("bucket_lengths must not be empty")
    for length in lengths:
        check_positive_number("each bucket length", length, CostError)
    if bucket_weights is None:
        weights = [1.0] * len(lengths)
    else:
        weights = [float(w) for w in bucket_weights]
        if len(weights) != len(lengths):
            raise CostError(
                f"got {len(weights)} bucket_weights for {len(lengths)} bucket_lengths; they must match"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise CostError(f"bucket_weights must be >= 0 with a positive sum, got {weights!r}")
    total = sum(weights)
    return sum(w * t for w, t in zip(weights, lengths)) / total


def flop_costs(
    shape: ModelShape,
    batch_size: int,
    bucket_lengths: Sequence[int],
    bucket_weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """Analytic forward + backward FLOPs of each block for one batch.

    A batch has ``B = batch_size`` sentences of one bucket's length ``T``.
    The result is averaged over the bucket mix: ``bucket_weights`` are the
    fractions of batches drawn from each bucket (normalized; default
    uniform). Every formula is linear in ``T``, so this equals the cost at
    the weighted mean length ``T_avg``; ``tok = B * T_avg``. One
    multiply-add counts as 2 FLOPs. Per block (forward + backward):

    * ``embedding``: ``2 * tok * E`` -- a row gather forward and a
      scatter-add of the gradient backward. Memory-bound in practice, so
      FLOPs understate its time (it is tiny either way).
    * ``lstm.i`` (``in = E`` for layer 0, else ``H``)::

          fwd = tok * (8H(in + H) + 20H)
          total = 3 * fwd                      # backward ~ 2x forward

      ``8H(in + H)`` is the four gate matmuls (``4H x (in + H)``
      multiply-adds); ``20H`` covers the two bias adds, 3 sigmoids, 2 tanh and
      the cell/hidden updates.
    * ``decoder``::

          fwd = tok * (2HV + V)               # matmul + bias
          total = 3 * fwd + 6 * tok * V        # + softmax / cross-entropy

    Args:
        shape: The model shape.
        batch_size: Sentences per batch ``B``.
        bucket_lengths: Sequence length ``T`` of each bucket.
        bucket_weights: Fraction of batches per bucket (same length as
            ``bucket_lengths``); default uniform.

    Returns:
        Mapping block name -> FLOPs per batch, in model order.

    Raises:
        CostError: On a non-positive batch size, empty/invalid buckets or
            mismatched weights.
    """
    check_positive_int("batch_size", batch_size, CostError)
    tokens = batch_size * _mean_length(bucket_lengths, bucket_weights)
    V, E = shape.vocab_size, shape.embedding_dim
    train = 1.0 + _BACKWARD_FACTOR
    costs = {EMBEDDING: 2.0 * tokens * E}
    for layer in range(shape.num_layers):
        H = shape.lstm_hidden_size(layer)
        fwd = tokens * (8.0 * H * (shape.lstm_input_size(layer) + H) + _LSTM_POINTWISE_FLOPS_PER_UNIT * H)
        costs[f"{LSTM_PREFIX}{layer}"] = train * fwd
    decoder_fwd = tokens * (2.0 * shape.decoder_input_size * V + V)
    costs[DECODER] = train * decoder_fwd + _SOFTMAX_XENT_FLOPS_PER_LOGIT * tokens * V
    return costs
