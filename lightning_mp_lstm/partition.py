"""Partitioning of an LSTM language model into pipeline stages.

The model is a chain of named *blocks*, in model order::

    embedding, lstm.0, lstm.1, ..., lstm.{N-1}, decoder

A pipeline *stage* is a non-empty, contiguous run of blocks, and a *partition*
is a list of stages that together cover every block exactly once, in order.
The number of stages is ``pipeline_parallel_size x stages_per_rank``.

This module provides:

* validation of user-given partitions (:func:`validate_partition`);
* the naive contiguous split (:func:`even_partition`);
* an exact min-max (bottleneck) split by dynamic programming
  (:func:`balanced_partition`, :func:`partition_blocks`);
* per-block cost models: parameter counts, memory, analytic FLOPs, measured
  time (:func:`parameter_counts`, :func:`memory_costs`, :func:`flop_costs`,
  :func:`time_costs`, :func:`profile_block_times`, :func:`costs_for`);
* a human-readable report (:func:`partition_report`) and simple pipeline
  step-time models (:func:`predicted_step_time`, :func:`predict_step_times`,
  :func:`choose_microbatches`).

Everything except :func:`profile_block_times` is pure Python and does not
touch torch.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "EMBEDDING",
    "DECODER",
    "LSTM_PREFIX",
    "COST_KINDS",
    "OPTIMIZER_STATES",
    "PartitionError",
    "ModelShape",
    "PartitionReport",
    "block_names",
    "validate_partition",
    "even_partition",
    "balanced_partition",
    "partition_blocks",
    "parameter_counts",
    "memory_costs",
    "flop_costs",
    "time_costs",
    "profile_block_times",
    "costs_for",
    "partition_report",
    "microbatch_step_time",
    "predicted_step_time",
    "predict_step_times",
    "choose_microbatches",
]

#: Name of the token-embedding block (always the first block).
EMBEDDING = "embedding"
#: Name of the output projection block (always the last block).
DECODER = "decoder"
#: Prefix of the LSTM block names: ``lstm.0`` ... ``lstm.{N-1}``.
LSTM_PREFIX = "lstm."

#: Cost kinds understood by :func:`costs_for`.
COST_KINDS = ("time", "flops", "memory")

#: Number of per-parameter optimizer state tensors, by optimizer name.
OPTIMIZER_STATES = {"adam": 2, "sgd": 0, "sgd_momentum": 1}

# FLOP constants of the analytic model (see flop_costs).
_LSTM_POINTWISE_FLOPS_PER_UNIT = 20  # biases, 3 sigmoid, 2 tanh, cell/hidden update
_BACKWARD_FACTOR = 2.0  # backward ~ 2x forward (grad wrt inputs and weights)
_SOFTMAX_XENT_FLOPS_PER_LOGIT = 6  # max, sub, exp, sum, log-sum, grad (softmax - onehot)

# Relative / absolute tolerances used when comparing floating point stage loads.
_REL_TOL = 1e-9
_ABS_TOL = 1e-12


class PartitionError(ValueError):
    """Raised for an invalid partition, invalid costs or an impossible request."""


# --------------------------------------------------------------------------- #
# Block names and partition validation
# --------------------------------------------------------------------------- #


def block_names(num_layers: int) -> list[str]:
    """Return the block names of a model with ``num_layers`` LSTM layers.

    Args:
        num_layers: Number of stacked LSTM layers (``>= 1``).

    Returns:
        ``["embedding", "lstm.0", ..., "lstm.{num_layers-1}", "decoder"]``.

    Raises:
        PartitionError: If ``num_layers`` is not a positive integer.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise PartitionError(f"num_layers must be a positive integer, got {num_layers!r}")
    return [EMBEDDING] + [f"{LSTM_PREFIX}{i}" for i in range(num_layers)] + [DECODER]


def _is_sequence_of_names(obj: object) -> bool:
    return isinstance(obj, Sequence) and not isinstance(obj, (str, bytes))


def validate_partition(
    stages: Sequence[Sequence[str]],
    block_names: Sequence[str],
    num_stages: Optional[int] = None,
) -> list[list[str]]:
    """Check that ``stages`` is a valid pipeline partition of ``block_names``.

    The checks run in this order and the first failing one raises:

    1. ``stages`` is a sequence of sequences of strings (a bare string is
       rejected, since ``"lstm.0"`` would otherwise be read as characters);
    2. every name is a known block (the message lists the valid names);
    3. no stage is empty;
    4. every block appears exactly once (the message lists duplicated and
       missing blocks);
    5. stages are contiguous and in model order;
    6. if ``num_stages`` is given, ``len(stages) == num_stages``.

    Args:
        stages: One sequence of block names per stage, e.g.
            ``[["embedding", "lstm.0"], ["lstm.1", "decoder"]]``.
        block_names: All block names in model order (see :func:`block_names`).
        num_stages: Expected number of stages
            (``pipeline_parallel_size x stages_per_rank``), or ``None`` to skip
            that check.

    Returns:
        The partition as a fresh ``list[list[str]]``.

    Raises:
        PartitionError: If any check fails.
    """
    names = list(block_names)
    valid = ", ".join(names)
    if not _is_sequence_of_names(stages):
        raise PartitionError(
            f"stages must be a list of lists of block names, got {type(stages).__name__}: {stages!r}"
        )
    if stages and all(isinstance(stage, str) for stage in stages):
        raise PartitionError(
            f"the partition is a flat list of block names {list(stages)!r}; give one list of block names per "
            f"stage, e.g. [['embedding', 'lstm.0'], ['lstm.1', 'decoder']]; valid block names are: {valid}"
        )
    result: list[list[str]] = []
    for s, stage in enumerate(stages):
        if not _is_sequence_of_names(stage):
            raise PartitionError(
                f"stage {s} must be a list of block names, got {stage!r}; "
                f"valid block names are: {valid}"
            )
        for name in stage:
            if name not in names:
                raise PartitionError(
                    f"unknown block name {name!r} in stage {s}; valid block names are: {valid}"
                )
        result.append(list(stage))

    for s, stage in enumerate(result):
        if not stage:
            raise PartitionError(f"stage {s} is empty; every stage needs at least one block")

    where: dict[str, list[int]] = {}
    for s, stage in enumerate(result):
        for name in stage:
            where.setdefault(name, []).append(s)
    duplicates = [n for n in names if len(where.get(n, ())) > 1]
    missing = [n for n in names if n not in where]
    if duplicates or missing:
        parts = []
        if duplicates:
            dup = "; ".join(
                f"{n!r} (in stages {', '.join(map(str, where[n]))})" for n in duplicates
            )
            parts.append(f"duplicated blocks: {dup}")
        if missing:
            parts.append(f"missing blocks: {', '.join(missing)}")
        raise PartitionError(
            "every block must appear exactly once; " + "; ".join(parts) + f". Valid block names are: {valid}"
        )

    flat = [name for stage in result for name in stage]
    position = 0
    for s, stage in enumerate(result):
        for name in stage:
            if name != names[position]:
                raise PartitionError(
                    f"stages must be contiguous and in model order: stage {s} has {name!r} where "
                    f"{names[position]!r} was expected (model order: {valid}; got order: {', '.join(flat)})"
                )
            position += 1

    if num_stages is not None and len(result) != num_stages:
        raise PartitionError(
            f"the partition has {len(result)} stages but num_stages={num_stages}; "
            "num_stages must equal pipeline_parallel_size x stages_per_rank"
        )
    return result


def _split_by_sizes(names: Sequence[str], sizes: Sequence[int]) -> list[list[str]]:
    stages, start = [], 0
    for size in sizes:
        stages.append(list(names[start : start + size]))
        start += size
    return stages


def _check_num_stages(num_stages: int, num_blocks: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > num_blocks:
        raise PartitionError(
            f"cannot split {num_blocks} blocks into num_stages={num_stages} non-empty stages; "
            f"num_stages must be between 1 and {num_blocks}"
        )


def even_partition(block_names: Sequence[str], num_stages: int) -> list[list[str]]:
    """Split blocks into ``num_stages`` contiguous stages of near-equal block count.

    Remainder rule: with ``n`` blocks, every stage gets ``n // num_stages``
    blocks and the **first** ``n % num_stages`` stages get one extra. The
    later stages thus hold fewer blocks, which is the right direction for a
    language model whose (usually most expensive) decoder sits on the last
    stage. Example: 10 blocks (8 LSTM layers) over 2 stages gives
    ``embedding, lstm.0-3 | lstm.4-7, decoder``; over 4 stages the sizes are
    ``3, 3, 2, 2``.

    Args:
        block_names: Block names in model order.
        num_stages: Number of stages, ``1 <= num_stages <= len(block_names)``.

    Returns:
        The stages as lists of block names.

    Raises:
        PartitionError: If ``num_stages`` is not in ``[1, len(block_names)]``.
    """
    names = list(block_names)
    _check_num_stages(num_stages, len(names))
    base, extra = divmod(len(names), num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    return _split_by_sizes(names, sizes)


# --------------------------------------------------------------------------- #
# Exact bottleneck balancing
# --------------------------------------------------------------------------- #


def _check_costs(costs: Sequence[float]) -> list[float]:
    values = [float(c) for c in costs]
    if not values:
        raise PartitionError("costs must not be empty")
    for i, c in enumerate(values):
        if not math.isfinite(c) or c < 0:
            raise PartitionError(f"costs must be finite and >= 0, got costs[{i}]={c!r}")
    return values


def _check_speeds(speeds: Optional[Sequence[float]], num_stages: int) -> list[float]:
    if speeds is None:
        return [1.0] * num_stages
    values = [float(s) for s in speeds]
    if len(values) != num_stages:
        raise PartitionError(
            f"speeds must have one entry per stage: got {len(values)} speeds for num_stages={num_stages}"
        )
    for i, s in enumerate(values):
        if not math.isfinite(s) or s <= 0:
            raise PartitionError(f"speeds must be finite and > 0, got speeds[{i}]={s!r}")
    return values


def balanced_partition(
    costs: Sequence[float],
    num_stages: int,
    speeds: Optional[Sequence[float]] = None,
) -> list[int]:
    """Find the contiguous split that minimizes the bottleneck stage time.

    Stage ``s`` holding blocks ``i..j-1`` has time ``sum(costs[i:j]) / speeds[s]``;
    the result minimizes ``max_s`` of that, exactly, over all
    ``C(n-1, k-1)`` contiguous splits into ``k = num_stages`` non-empty stages.

    Algorithm (``O(n^2 k)`` time, ``O(n k)`` memory):

    1. A prefix dynamic program computes the optimal bottleneck ``T*``.
    2. Among all splits whose every stage time is ``<= T*`` (up to a relative
       tolerance of ``1e-9`` for float round-off), a suffix dynamic program
       minimizes the **sum of squared stage times**, which spreads the
       slack over the non-bottleneck stages instead of leaving e.g. one
       almost-empty stage.
    3. Remaining ties are broken by taking the **lexicographically smallest**
       size vector (the earliest stages as small as possible), so the result
       is deterministic.

    Args:
        costs: Non-negative cost of each block, in model order.
        num_stages: Number of stages ``k``, ``1 <= k <= len(costs)``.
        speeds: Optional relative speed of each stage's device (``> 0``, one
            per stage); a stage with speed 2 processes twice the cost in the
            same time. Default: all 1.

    Returns:
        Stage sizes (number of blocks per stage), summing to ``len(costs)``.
        Use :func:`partition_blocks` to get block names instead.

    Raises:
        PartitionError: On negative/non-finite costs, bad speeds or an
            impossible ``num_stages``.
    """
    values = _check_costs(costs)
    n = len(values)
    _check_num_stages(num_stages, n)
    k = num_stages
    speed = _check_speeds(speeds, k)

    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)

    def load(i: int, j: int, s: int) -> float:
        return (prefix[j] - prefix[i]) / speed[s]

    inf = math.inf
    # best[s][j]: minimal bottleneck putting blocks 0..j-1 into stages 0..s.
    best = [[inf] * (n + 1) for _ in range(k)]
    for j in range(1, n - k + 2):
        best[0][j] = load(0, j, 0)
    for s in range(1, k):
        for j in range(s + 1, n - (k - 1 - s) + 1):
            candidate = inf
            for i in range(s, j):
                value = max(best[s - 1][i], load(i, j, s))
                if value < candidate:
                    candidate = value
            best[s][j] = candidate
    bottleneck = best[k - 1][n]

    scale = prefix[n] / min(speed) if prefix[n] > 0 else 1.0
    cap = bottleneck + _REL_TOL * abs(bottleneck) + _ABS_TOL * scale

    # sq[s][i]: minimal sum of squared stage times putting blocks i..n-1 into
    # stages s..k-1, each stage time <= cap.
    sq = [[inf] * (n + 1) for _ in range(k + 1)]
    sq[k][n] = 0.0
    for s in range(k - 1, -1, -1):
        remaining = k - 1 - s
        for i in range(s, n - remaining):
            candidate = inf
            for j in range(i + 1, n - remaining + 1):
                t = load(i, j, s)
                if t > cap or sq[s + 1][j] == inf:
                    continue
                value = t * t + sq[s + 1][j]
                if value < candidate:
                    candidate = value
            sq[s][i] = candidate

    sizes: list[int] = []
    i = 0
    sq_scale = scale * scale
    for s in range(k):
        remaining = k - 1 - s
        target = sq[s][i]
        threshold = target + _REL_TOL * abs(target) + _ABS_TOL * sq_scale
        for j in range(i + 1, n - remaining + 1):
            t = load(i, j, s)
            if t > cap or sq[s + 1][j] == inf:
                continue
            if t * t + sq[s + 1][j] <= threshold:
                sizes.append(j - i)
                i = j
                break
        else:  # pragma: no cover - the DP guarantees a feasible choice
            raise AssertionError("balanced_partition reconstruction failed")
    return sizes


def _costs_in_order(names: Sequence[str], costs: Union[Mapping[str, float], Sequence[float]]) -> list[float]:
    if isinstance(costs, Mapping):
        missing = [n for n in names if n not in costs]
        unknown = [n for n in costs if n not in names]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing costs for: {', '.join(missing)}")
            if unknown:
                parts.append(f"costs for unknown blocks: {', '.join(map(str, unknown))}")
            raise PartitionError("; ".join(parts) + f"; valid block names are: {', '.join(names)}")
        return [costs[n] for n in names]
    values = list(costs)
    if len(values) != len(names):
        raise PartitionError(f"got {len(values)} costs for {len(names)} blocks ({', '.join(names)})")
    return values


def partition_blocks(
    block_names: Sequence[str],
    costs: Union[Mapping[str, float], Sequence[float]],
    num_stages: int,
    speeds: Optional[Sequence[float]] = None,
) -> list[list[str]]:
    """Balance ``block_names`` over ``num_stages`` stages with :func:`balanced_partition`.

    Args:
        block_names: Block names in model order.
        costs: Per-block cost, either a mapping ``name -> cost`` covering
            exactly ``block_names`` or a sequence aligned with ``block_names``.
        num_stages: Number of stages.
        speeds: Optional per-stage device speeds (see :func:`balanced_partition`).

    Returns:
        The stages as lists of block names.

    Raises:
        PartitionError: If the costs do not match the blocks or the split is
            impossible.
    """
    names = list(block_names)
    sizes = balanced_partition(_costs_in_order(names, costs), num_stages, speeds)
    return _split_by_sizes(names, sizes)


# --------------------------------------------------------------------------- #
# Cost models
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters that determine the size of every block.

    Attributes:
        vocab_size: Vocabulary size ``V``.
        embedding_dim: Embedding width ``E``.
        hidden_size: LSTM hidden size ``H``.
        num_layers: Number of LSTM layers ``N``.
        tie_weights: Whether the decoder weight is the embedding weight
            (requires ``E == H``).
    """

    vocab_size: int
    embedding_dim: int
    hidden_size: int
    num_layers: int
    tie_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embedding_dim", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PartitionError(f"{name} must be a positive integer, got {value!r}")
        if self.tie_weights and self.embedding_dim != self.hidden_size:
            raise PartitionError(
                "tie_weights requires embedding_dim == hidden_size, got "
                f"embedding_dim={self.embedding_dim} and hidden_size={self.hidden_size}"
            )

    @property
    def block_names(self) -> list[str]:
        """Block names of this model, in order."""
        return block_names(self.num_layers)

    def lstm_input_size(self, layer: int) -> int:
        """Input width of LSTM layer ``layer`` (``E`` for layer 0, else ``H``)."""
        return self.embedding_dim if layer == 0 else self.hidden_size


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
    V, E, H = shape.vocab_size, shape.embedding_dim, shape.hidden_size
    counts = {EMBEDDING: V * E}
    for layer in range(shape.num_layers):
        counts[f"{LSTM_PREFIX}{layer}"] = 4 * H * (shape.lstm_input_size(layer) + H) + 8 * H
    counts[DECODER] = V if shape.tie_weights else H * V + V
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
        PartitionError: On an unknown optimizer or a non-positive
            ``bytes_per_param``.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise PartitionError(
            f"unknown optimizer {optimizer!r}; allowed optimizers are: {', '.join(OPTIMIZER_STATES)}"
        )
    if isinstance(bytes_per_param, bool) or not isinstance(bytes_per_param, (int, float)) or bytes_per_param <= 0:
        raise PartitionError(f"bytes_per_param must be > 0, got {bytes_per_param!r}")
    copies = 2 + OPTIMIZER_STATES[optimizer]
    counts = parameter_counts(shape)
    if shape.tie_weights and replicate_tied:
        counts[DECODER] += shape.vocab_size * shape.hidden_size
    return {name: float(count * bytes_per_param * copies) for name, count in counts.items()}


def _mean_length(bucket_lengths: Sequence[int], bucket_weights: Optional[Sequence[float]]) -> float:
    lengths = list(bucket_lengths)
    if not lengths:
        raise PartitionError("bucket_lengths must not be empty")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, (int, float)) or not length > 0:
            raise PartitionError(f"bucket lengths must be > 0, got {length!r}")
    if bucket_weights is None:
        weights = [1.0] * len(lengths)
    else:
        weights = [float(w) for w in bucket_weights]
        if len(weights) != len(lengths):
            raise PartitionError(
                f"got {len(weights)} bucket_weights for {len(lengths)} bucket_lengths; they must match"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise PartitionError(f"bucket_weights must be >= 0 with a positive sum, got {weights!r}")
    total = sum(weights)
    return sum(w * t for w, t in zip(weights, lengths)) / total


def flop_costs(
    shape: ModelShape,
    batch_size: int,
    bucket_lengths: Sequence[int],
    bucket_weights: Optional[Sequence[float]] = None,
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
        PartitionError: On a non-positive batch size, empty/invalid buckets or
            mismatched weights.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PartitionError(f"batch_size must be a positive integer, got {batch_size!r}")
    tokens = batch_size * _mean_length(bucket_lengths, bucket_weights)
    V, E, H = shape.vocab_size, shape.embedding_dim, shape.hidden_size
    train = 1.0 + _BACKWARD_FACTOR
    costs = {EMBEDDING: 2.0 * tokens * E}
    for layer in range(shape.num_layers):
        fwd = tokens * (8.0 * H * (shape.lstm_input_size(layer) + H) + _LSTM_POINTWISE_FLOPS_PER_UNIT * H)
        costs[f"{LSTM_PREFIX}{layer}"] = train * fwd
    decoder_fwd = tokens * (2.0 * H * V + V)
    costs[DECODER] = train * decoder_fwd + _SOFTMAX_XENT_FLOPS_PER_LOGIT * tokens * V
    return costs


def time_costs(
    measured: Mapping[str, float],
    block_names: Optional[Sequence[str]] = None,
) -> dict[str, float]:
    """Use measured per-block forward + backward seconds as costs.

    Args:
        measured: Mapping block name -> seconds, e.g. from
            :func:`profile_block_times`.
        block_names: If given, ``measured`` must cover exactly these blocks,
            and the result follows their order.

    Returns:
        Mapping block name -> seconds (as floats).

    Raises:
        PartitionError: On non-finite or negative times, or blocks that do not
            match ``block_names``.
    """
    if not isinstance(measured, Mapping):
        raise PartitionError(f"measured must be a mapping block name -> seconds, got {type(measured).__name__}")
    for name, seconds in measured.items():
        value = float(seconds)
        if not math.isfinite(value) or value < 0:
            raise PartitionError(f"measured time of block {name!r} must be finite and >= 0, got {seconds!r}")
    if block_names is None:
        return {name: float(seconds) for name, seconds in measured.items()}
    names = list(block_names)
    return dict(zip(names, (float(c) for c in _costs_in_order(names, measured))))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None) if device.type != "cpu" else None
    if callable(sync):
        sync()


def _first_tensor(value: object) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def profile_block_times(
    blocks: Mapping[str, torch.nn.Module],
    example_inputs: Union[torch.Tensor, Mapping[str, torch.Tensor]],
    repeats: int = 5,
    warmup: int = 2,
    loss_block: Optional[str] = DECODER,
) -> dict[str, float]:
    """Measure forward + backward seconds of each block module in isolation.

    Each module must map one tensor to one tensor (an LSTM block returns the
    output sequence, not the state tuple). For every block, ``warmup``
    untimed iterations are followed by ``repeats`` timed ones and the median
    is returned. A timed iteration is: forward, then backward. For
    ``loss_block`` (the decoder: ``(B, T, H)`` -> ``(B, T, V)`` logits) the
    timed region also contains the cross-entropy against random targets in
    ``[1, V)`` and backward starts from that loss; for every other block
    backward is seeded with a fixed random output gradient, generated outside
    the timed region. Floating-point inputs get ``requires_grad`` so that the
    input gradient, which a pipeline stage must send upstream, is included.

    The device is the one the inputs are on (modules must already live
    there); on CUDA (and other asynchronous backends) the device is
    synchronized before starting and stopping the clock. Module train/eval
    modes are left untouched; parameter gradients are reset to ``None``
    between iterations outside the timed region.

    Args:
        blocks: Mapping block name -> module, in model order.
        example_inputs: Either a mapping block name -> input tensor, or a
            single input tensor for the first block, in which case each next
            block's input is the (detached) output of the previous one.
        repeats: Number of timed iterations (``>= 1``).
        warmup: Number of untimed warm-up iterations (``>= 0``).
        loss_block: Name of the block whose timing includes the
            cross-entropy loss, or ``None``.

    Returns:
        Mapping block name -> median seconds per forward + backward.

    Raises:
        PartitionError: On bad arguments or missing inputs.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise PartitionError(f"repeats must be a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise PartitionError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not blocks:
        raise PartitionError("blocks must not be empty")
    if isinstance(example_inputs, Mapping):
        missing = [name for name in blocks if name not in example_inputs]
        if missing:
            raise PartitionError(f"example_inputs has no input for blocks: {', '.join(missing)}")
        chained = False
    elif isinstance(example_inputs, torch.Tensor):
        chained = True
    else:
        raise PartitionError(
            "example_inputs must be a tensor or a mapping block name -> tensor, "
            f"got {type(example_inputs).__name__}"
        )

    times: dict[str, float] = {}
    current = example_inputs if chained else None
    for name, module in blocks.items():
        source = current if chained else example_inputs[name]
        if not isinstance(source, torch.Tensor):
            raise PartitionError(f"input of block {name!r} must be a tensor, got {type(source).__name__}")
        times[name], output = _time_block(module, source, repeats, warmup, name == loss_block)
        current = output
    return times


def _time_block(
    module: torch.nn.Module,
    source: torch.Tensor,
    repeats: int,
    warmup: int,
    with_loss: bool,
) -> tuple[float, torch.Tensor]:
    device = source.device
    base = source.detach()
    needs_input_grad = base.is_floating_point()
    output_grad: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None

    def make_input() -> torch.Tensor:
        x = base.clone()
        return x.requires_grad_(True) if needs_input_grad else x

    def step(x: torch.Tensor) -> torch.Tensor:
        out = _first_tensor(module(x))
        if out is None:
            raise PartitionError(f"block module {type(module).__name__} did not return a tensor")
        if with_loss:
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets)
            loss.backward()
        else:
            out.backward(output_grad)
        return out

    # Shape probe (untimed, no grad) to prepare targets / output gradient.
    with torch.no_grad():
        probe = _first_tensor(module(base))
    if probe is None:
        raise PartitionError(f"block module {type(module).__name__} did not return a tensor")
    if with_loss:
        num_classes = probe.shape[-1]
        low = 1 if num_classes > 1 else 0
        targets = torch.randint(low, num_classes, (probe[..., 0].numel(),), device=device)
    else:
        output_grad = torch.randn(probe.shape, dtype=probe.dtype, device=device)

    for _ in range(warmup):
        module.zero_grad(set_to_none=True)
        step(make_input())

    samples = []
    for _ in range(repeats):
        module.zero_grad(set_to_none=True)
        x = make_input()
        _synchronize(device)
        start = time.perf_counter()
        step(x)
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    return statistics.median(samples), probe.detach()


def costs_for(
    kind: str,
    shape: Optional[ModelShape] = None,
    *,
    batch_size: Optional[int] = None,
    bucket_lengths: Optional[Sequence[int]] = None,
    bucket_weights: Optional[Sequence[float]] = None,
    optimizer: str = "adam",
    bytes_per_param: int = 4,
    measured: Optional[Mapping[str, float]] = None,
) -> dict[str, float]:
    """Per-block costs of the given kind.

    * ``"flops"``: :func:`flop_costs` (needs ``shape``, ``batch_size``,
      ``bucket_lengths``; optional ``bucket_weights``);
    * ``"memory"``: :func:`memory_costs` (needs ``shape``; optional
      ``optimizer``, ``bytes_per_param``);
    * ``"time"``: :func:`time_costs` (needs ``measured``; if ``shape`` is
      given the measured blocks must match its block names).

    Args:
        kind: One of ``"time"``, ``"flops"``, ``"memory"``.
        shape: The model shape.
        batch_size: Sentences per batch (``"flops"``).
        bucket_lengths: Bucket sequence lengths (``"flops"``).
        bucket_weights: Fraction of batches per bucket (``"flops"``).
        optimizer: Optimizer name (``"memory"``).
        bytes_per_param: Bytes per element (``"memory"``).
        measured: Measured block seconds (``"time"``).

    Returns:
        Mapping block name -> cost.

    Raises:
        PartitionError: On an unknown kind (the message lists the allowed
            kinds) or a missing argument.
    """

    def require(**values: object) -> None:
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise PartitionError(f"cost kind {kind!r} requires the argument(s): {', '.join(missing)}")

    if kind == "flops":
        require(shape=shape, batch_size=batch_size, bucket_lengths=bucket_lengths)
        return flop_costs(shape, batch_size, bucket_lengths, bucket_weights)
    if kind == "memory":
        require(shape=shape)
        return memory_costs(shape, optimizer=optimizer, bytes_per_param=bytes_per_param)
    if kind == "time":
        require(measured=measured)
        return time_costs(measured, shape.block_names if shape is not None else None)
    raise PartitionError(f"unknown cost kind {kind!r}; allowed kinds are: {', '.join(COST_KINDS)}")


# --------------------------------------------------------------------------- #
# Pipeline step-time models
# --------------------------------------------------------------------------- #


def predicted_step_time(stage_costs: Sequence[float], num_microbatches: int) -> float:
    """Predicted time of one pipelined (GPipe / 1F1B) training step.

    ``(m + S - 1) * max(stage_costs) / m`` for ``m`` microbatches and ``S``
    stages, where ``stage_costs`` are each stage's forward + backward cost
    for the **whole** batch and a microbatch costs ``1/m`` of that (linear
    scaling, communication ignored). ``S - 1`` is the pipeline fill/drain
    bubble. Since the ``(m + S - 1)/m`` factor is shared, the step-time ratio
    of two splits with the same ``S`` and ``m`` is their bottleneck ratio.

    Args:
        stage_costs: Per-stage cost of the full batch.
        num_microbatches: Number of microbatches ``m >= 1``.

    Returns:
        The predicted step time in the units of ``stage_costs``.
    """
    costs = _check_costs(stage_costs)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PartitionError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    m, S = num_microbatches, len(costs)
    return (m + S - 1) * max(costs) / m


def microbatch_step_time(microbatch_times: Sequence[float], num_microbatches: int) -> float:
    """Step time of a GPipe / 1F1B pipeline from each process's time for one microbatch.

    ``(m - 1) * max(t) + sum(t)``: the busiest process sets the pace of the steady state, and the fill
    and drain pass every microbatch through each process once. With equal times on ``S`` processes this
    is the familiar ``(m + S - 1) * t``. Communication and the optimizer step are left out.

    Args:
        microbatch_times: Forward + backward seconds of one microbatch on each process, in order.
        num_microbatches: Number of microbatches ``m >= 1``.
    """
    times = _check_costs(microbatch_times)
    return (num_microbatches - 1) * max(times) + sum(times)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _loglog_interpolator(points: Mapping[int, float]) -> Callable[[int], float]:
    data = sorted((float(b), float(t)) for b, t in points.items())
    if not data:
        raise PartitionError("the measured stage times must not be empty")
    for b, t in data:
        if not (b > 0 and math.isfinite(t) and t > 0):
            raise PartitionError(
                f"measured stage times need microbatch sizes > 0 and times > 0, got {b!r}: {t!r}"
            )
    if len(data) == 1:
        b0, t0 = data[0]
        return lambda b: t0 * b / b0
    logs = [(math.log(b), math.log(t)) for b, t in data]

    def interpolate(b: int) -> float:
        x = math.log(b)
        # Segment containing x; the first/last segment extrapolates as a power law.
        index = 0
        while index < len(logs) - 2 and x > logs[index + 1][0]:
            index += 1
        (x0, y0), (x1, y1) = logs[index], logs[index + 1]
        return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    return interpolate


def predict_step_times(
    batch_size: int,
    num_stages: int,
    stage_time_at_microbatch_size: Union[Callable[[int], float], Mapping[int, float]],
    candidates: Optional[Sequence[int]] = None,
    at_least_num_stages: bool = False,
) -> dict[int, float]:
    """Predicted pipeline step time for each candidate number of microbatches.

    For ``m`` microbatches of ``b = batch_size / m`` sentences on ``S``
    stages, a GPipe / 1F1B schedule takes ``(m + S - 1)`` slots of the
    bottleneck stage: ``step(m) = (m + S - 1) * t(b)``, with ``t(b)`` the
    maximum stage forward + backward time for one microbatch of ``b``
    sentences. Unlike :func:`predicted_step_time` this does not assume
    ``t`` is linear in ``b``, so the per-microbatch overhead that makes many
    tiny microbatches slow is captured.

    If ``t`` is given as a mapping ``{b: seconds}`` of measurements, it is
    interpolated piecewise linearly in log-log space (exact for power laws);
    outside the measured range the nearest segment is extrapolated, and a
    single measurement is scaled linearly (``t(b) = t0 * b / b0``).

    Args:
        batch_size: Sentences per (global per-pipeline) batch.
        num_stages: Number of pipeline stages ``S``.
        stage_time_at_microbatch_size: ``t`` as a callable or a mapping.
        candidates: Numbers of microbatches to consider; each must divide
            ``batch_size``. Default: all divisors of ``batch_size``.
        at_least_num_stages: Only consider ``m >= num_stages`` (enough
            microbatches to fill the pipeline).

    Returns:
        Mapping ``m -> predicted step time``, in increasing ``m``.

    Raises:
        PartitionError: If a candidate does not divide the batch or none is
            left.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PartitionError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages must be a positive integer, got {num_stages!r}")
    divisors = _divisors(batch_size)
    if candidates is None:
        options = divisors
    else:
        options = sorted(set(candidates))
        bad = [m for m in options if m not in divisors]
        if bad:
            raise PartitionError(
                f"microbatch counts {bad} do not divide batch_size={batch_size}; "
                f"allowed values are its divisors: {divisors}"
            )
    if at_least_num_stages:
        options = [m for m in options if m >= num_stages]
    if not options:
        raise PartitionError(
            f"no candidate number of microbatches for batch_size={batch_size} and num_stages={num_stages} "
            f"(divisors of the batch: {divisors}; at_least_num_stages={at_least_num_stages})"
        )
    if isinstance(stage_time_at_microbatch_size, Mapping):
        t = _loglog_interpolator(stage_time_at_microbatch_size)
    elif callable(stage_time_at_microbatch_size):
        t = stage_time_at_microbatch_size
    else:
        raise PartitionError("stage_time_at_microbatch_size must be a callable or a mapping size -> seconds")
    return {m: microbatch_step_time([float(t(batch_size // m))] * num_stages, m) for m in options}


def choose_microbatches(
    batch_size: int,
    num_stages: int,
    stage_time_at_microbatch_size: Union[Callable[[int], float], Mapping[int, float]],
    candidates: Optional[Sequence[int]] = None,
    at_least_num_stages: bool = False,
) -> int:
    """Choose the number of microbatches minimizing the predicted step time.

    Uses the model of :func:`predict_step_times`
    (``step(m) = (m + S - 1) * t(batch_size / m)``) and returns its argmin;
    ties go to the smallest ``m`` (fewer, larger microbatches).

    Args:
        batch_size: Sentences per batch.
        num_stages: Number of pipeline stages ``S``.
        stage_time_at_microbatch_size: Bottleneck stage time per microbatch
            size, as a callable or measured mapping.
        candidates: Candidate microbatch counts (divisors of
            ``batch_size``); default all divisors.
        at_least_num_stages: Only consider ``m >= num_stages``.

    Returns:
        The chosen number of microbatches (a divisor of ``batch_size``).
    """
    predicted = predict_step_times(
        batch_size, num_stages, stage_time_at_microbatch_size, candidates, at_least_num_stages
    )
    return min(predicted, key=lambda m: (predicted[m], m))


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def _infer_block_names(names: Sequence[str]) -> list[str]:
    num_layers = sum(1 for n in names if isinstance(n, str) and n.startswith(LSTM_PREFIX))
    if num_layers < 1:
        raise PartitionError(f"costs must contain lstm.* blocks, got: {', '.join(map(str, names))}")
    expected = block_names(num_layers)
    if set(names) != set(expected) or len(names) != len(expected):
        raise PartitionError(
            f"cost blocks {', '.join(map(str, names))} do not match the model blocks {', '.join(expected)}"
        )
    return expected


def _compact(blocks: Sequence[str]) -> str:
    parts: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            suffix = f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"
            parts.append(f"{LSTM_PREFIX}{suffix}")
            run.clear()

    for name in blocks:
        if name.startswith(LSTM_PREFIX) and name[len(LSTM_PREFIX) :].isdigit():
            index = int(name[len(LSTM_PREFIX) :])
            if run and index != run[-1] + 1:
                flush()
            run.append(index)
        else:
            flush()
            parts.append(name)
    flush()
    return ", ".join(parts)


@dataclass
class PartitionReport:
    """Summary of a partition; ``str(report)`` renders a fixed-width table.

    Attributes:
        stages: Block names per stage.
        stage_costs: Sum of block costs per stage.
        stage_parameters: Parameters per stage.
        stage_memory_bytes: Memory per stage, bytes.
        measured_stage_times: Measured time per stage, if given.
        speeds: Per-stage device speeds used for the bottleneck.
        even_stages: The :func:`even_partition` with the same number of stages.
        bottleneck: ``max(stage_cost / speed)`` of this split.
        even_bottleneck: The same for the even split.
    """

    stages: list[list[str]]
    stage_costs: list[float]
    stage_parameters: list[int]
    stage_memory_bytes: list[float]
    measured_stage_times: Optional[list[float]] = None
    speeds: list[float] = field(default_factory=list)
    even_stages: list[list[str]] = field(default_factory=list)
    bottleneck: float = 0.0
    even_bottleneck: float = 0.0
    #: Microbatches per batch and the predicted / measured seconds per optimizer step, when known.
    n_microbatches: Optional[int] = None
    predicted_step_seconds: Optional[float] = None
    measured_step_seconds: Optional[float] = None
    #: Predicted step seconds for each candidate number of microbatches (``n_microbatches: auto``).
    microbatch_predictions: Optional[dict[int, float]] = None

    @property
    def cost_shares(self) -> list[float]:
        """Fraction of the total estimated cost per stage (0..1)."""
        return _shares(self.stage_costs)

    @property
    def measured_shares(self) -> Optional[list[float]]:
        """Fraction of the total measured time per stage, if measured."""
        return None if self.measured_stage_times is None else _shares(self.measured_stage_times)

    @property
    def ratio_vs_even(self) -> float:
        """Predicted step-time ratio of this split versus the even split.

        Equals ``bottleneck / even_bottleneck`` (the max-stage-cost ratio):
        with :func:`predicted_step_time` the ``(m + S - 1)/m`` factor is the
        same for both splits. Below 1 means this split is predicted faster.
        """
        if self.even_bottleneck == 0:
            return 1.0 if self.bottleneck == 0 else math.inf
        return self.bottleneck / self.even_bottleneck

    def __str__(self) -> str:
        header = ["stage", "blocks", "params", "memory MiB", "cost %"]
        if self.measured_stage_times is not None:
            header.append("measured %")
        rows = []
        measured = self.measured_shares
        for s, blocks in enumerate(self.stages):
            row = [
                str(s),
                _compact(blocks),
                f"{self.stage_parameters[s]:,}",
                f"{self.stage_memory_bytes[s] / 2**20:.1f}",
                f"{100 * self.cost_shares[s]:.1f}",
            ]
            if measured is not None:
                row.append(f"{100 * measured[s]:.1f}")
            rows.append(row)
        widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
        left = {1}

        def fmt(row: Sequence[str]) -> str:
            return "  ".join(
                cell.ljust(widths[c]) if c in left else cell.rjust(widths[c]) for c, cell in enumerate(row)
            ).rstrip()

        lines = [fmt(header), "  ".join("-" * w for w in widths)]
        lines += [fmt(r) for r in rows]
        even = " | ".join(_compact(b) for b in self.even_stages)
        lines.append(f"bottleneck cost: {self.bottleneck:.6g} (even split: {self.even_bottleneck:.6g}; {even})")
        lines.append(f"predicted step-time ratio vs even split: {self.ratio_vs_even:.3f}")
        if self.microbatch_predictions:
            options = ", ".join(f"m={m}: {t * 1e3:.1f} ms" for m, t in sorted(self.microbatch_predictions.items()))
            lines.append(f"n_microbatches=auto chose {self.n_microbatches} (predicted step: {options})")
        if self.predicted_step_seconds is not None or self.measured_step_seconds is not None:
            predicted = "-" if self.predicted_step_seconds is None else f"{self.predicted_step_seconds * 1e3:.1f} ms"
            measured = "-" if self.measured_step_seconds is None else f"{self.measured_step_seconds * 1e3:.1f} ms"
            lines.append(f"step time with m={self.n_microbatches}: predicted {predicted}, measured {measured}")
        return "\n".join(lines)


def _shares(values: Sequence[float]) -> list[float]:
    total = float(sum(values))
    if total == 0:
        return [0.0 for _ in values]
    return [v / total for v in values]


def partition_report(
    stages: Sequence[Sequence[str]],
    costs: Mapping[str, float],
    parameter_counts: Mapping[str, int],
    memory: Mapping[str, float],
    measured_stage_times: Optional[Sequence[float]] = None,
    speeds: Optional[Sequence[float]] = None,
) -> PartitionReport:
    """Summarize a partition against the even split.

    Args:
        stages: The partition (validated against the blocks of ``costs``).
        costs: Per-block cost used for balancing (any unit).
        parameter_counts: Per-block parameter counts (see
            :func:`parameter_counts`).
        memory: Per-block memory in bytes (see :func:`memory_costs`).
        measured_stage_times: Optional measured time per stage.
        speeds: Optional per-stage device speeds for the bottleneck.

    Returns:
        The report; ``str()`` it for a table.

    Raises:
        PartitionError: If the partition or the per-block mappings do not
            match the model blocks.
    """
    names = _infer_block_names(list(costs))
    checked = validate_partition(stages, names)
    block_costs = _costs_in_order(names, costs)
    params = dict(zip(names, _costs_in_order(names, parameter_counts)))
    mem = dict(zip(names, _costs_in_order(names, memory)))
    cost_of = dict(zip(names, _check_costs(block_costs)))
    speed = _check_speeds(speeds, len(checked))
    measured = None
    if measured_stage_times is not None:
        measured = _check_costs(measured_stage_times)
        if len(measured) != len(checked):
            raise PartitionError(
                f"got {len(measured)} measured stage times for {len(checked)} stages; they must match"
            )
    stage_costs = [sum(cost_of[n] for n in stage) for stage in checked]
    even = even_partition(names, len(checked))
    even_costs = [sum(cost_of[n] for n in stage) for stage in even]
    return PartitionReport(
        stages=checked,
        stage_costs=stage_costs,
        stage_parameters=[int(sum(params[n] for n in stage)) for stage in checked],
        stage_memory_bytes=[float(sum(mem[n] for n in stage)) for stage in checked],
        measured_stage_times=measured,
        speeds=speed,
        even_stages=even,
        bottleneck=max(c / v for c, v in zip(stage_costs, speed)),
        even_bottleneck=max(c / v for c, v in zip(even_costs, speed)),
    )
