"""Splitting a chain of named blocks into pipeline stages: validation, the even split and the exact
min-max split of given per-block costs. Pure Python: costs come from :mod:`lightning_mp_lstm.models.costs` or
:mod:`lightning_mp_lstm.planning.profile`, the choice between them from :mod:`lightning_mp_lstm.planning.plan`.

A pipeline *stage* is a non-empty, contiguous run of blocks, and a *partition* is a list of stages that
together cover every block exactly once, in model order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_mp_lstm.base.validation import check_positive_int

__all__ = [
    "PartitionError",
    "balanced_partition",
    "compact_blocks",
    "even_partition",
    "partition_blocks",
    "stage_totals",
    "validate_partition",
]

# Relative / absolute tolerances used when comparing floating point stage loads.
_REL_TOL = 1e-9
_ABS_TOL = 1e-12


class PartitionError(ValueError):
    """An invalid partition, invalid costs or an impossible request: the message names the value."""


def _is_sequence_of_names(obj: object) -> bool:
    return isinstance(obj, Sequence) and not isinstance(obj, (str, bytes))


def validate_partition(
    stages: Sequence[Sequence[str]],
    block_names: Sequence[str],
    num_stages: int | None = None,
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
        block_names: All block names in model order .
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
    check_positive_int("num_stages", num_stages, PartitionError)
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


def _check_speeds(speeds: Sequence[float] | None, num_stages: int) -> list[float]:
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
    speeds: Sequence[float] | None = None,
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


def _costs_in_order(names: Sequence[str], costs: Mapping[str, float] | Sequence[float]) -> list[float]:
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
    costs: Mapping[str, float] | Sequence[float],
    num_stages: int,
    speeds: Sequence[float] | None = None,
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


def stage_totals(partition: Sequence[Sequence[str]], costs: Mapping[str, float]) -> list[float]:
    """The sum of the block costs of every stage."""
    return [float(sum(costs[name] for name in stage)) for stage in partition]


def compact_blocks(blocks: Sequence[str]) -> str:
    """Block names for a table: ``embedding, lstm.0, lstm.1, lstm.2`` -> ``embedding, lstm.0-2`` (runs of numbered
    blocks)."""
    parts: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix = run[0][0]
            parts.append(f"{prefix}{run[0][1]}" if len(run) == 1 else f"{prefix}{run[0][1]}-{run[-1][1]}")
            run.clear()

    for name in blocks:
        prefix, _, number = name.rpartition(".")
        if number.isdigit() and prefix:
            if run and (run[-1][0] != prefix + "." or int(number) != run[-1][1] + 1):
                flush()
            run.append((prefix + ".", int(number)))
        else:
            flush()
            parts.append(name)
    flush()
    return ", ".join(parts)
