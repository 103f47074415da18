"""What the strategy costs over a hand-written ``torch.distributed.pipelining`` loop: the same model, global batch,
partition and schedule trained both ways in one run, rounds interleaved, and where each rank spends its time outside
the schedule.

The bare loop is what a user would write by hand, and the reference: one ``PipelineStage`` per rank holding an even
half of ``LSTMLanguageModel``'s blocks, a schedule with ``scale_grads=False`` and a loss divided by the batch's
tokens, the gradients summed over the replicas in one flat all-reduce, with ``Setup.clip`` a clip by the whole model's
gradient norm (each stage's squared norm summed over the pipeline), the model's optimizer (``Setup.optimizer``, SGD
by default; torch's fused kernel, as the model picks); nothing else (no Lightning, no checks, no logging). The
strategy runs the same in ``Trainer.fit``. Rounds alternate which of the two runs first (bare, strategy, strategy,
bare, ...), so a machine that speeds up or slows down during a round favours neither.
Layouts: ``pp2`` (2 ranks) and ``dp2_pp2`` (4 ranks, two replicas of the 2-stage pipeline, each its half of the
global batch); schedules GPipe and 1F1B.

Time outside the schedule, per rank, is the median step's wall time less the span of its schedule: for the bare loop
timed around ``schedule.step``; for the strategy from the timeline recorder (``PipelineTimeline``, a separate run:
recording costs time of its own), split into before the rank's first span and after its last.

    python benchmarks/overhead.py [--layout pp2] [--schedule 1F1B] [--steps 30] [--warmup 5] [--rounds 2]
                                  [--rows 64] [--microbatches 8]

``benchmarks/run.py`` runs :func:`compare` in its own ranks (section ``strategy_overhead``), and
``benchmarks/when_to_use.py`` runs :func:`bare_loop`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy, PipelineTimeline  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402
from lightning_mp_lstm.models.binding import pipeline_model  # noqa: E402
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum  # noqa: E402
from lightning_mp_lstm.models.optimizer_kernels import kernel_options  # noqa: E402
from lightning_mp_lstm.pipeline.stages import ContiguousGrad  # noqa: E402
from lightning_mp_lstm.planning.partition import even_partition  # noqa: E402

__all__ = ["GOAL", "LAYOUTS", "Setup", "bare_loop", "batches", "compare", "model_of", "round_orders", "start_rank",
           "strategy_fit", "summarize"]

#: Layouts compared: their number of data-parallel replicas of a 2-stage pipeline.
LAYOUTS = {"pp2": 1, "dp2_pp2": 2}

#: The goal for mp_lstm / the bare loop, tokens per second (issue 44's restatement of the earlier 0.99 against what
#: the bare loop itself reaches on the 2-core box).
GOAL = 0.97


@dataclass(frozen=True)
class Setup:
    """The model, global batch and pipeline both runs share (defaults: the numbers in docs/benchmarks.md).

    The model's fields are ``LSTMLanguageModel``'s keyword arguments, as in ``benchmarks/sizes.py``; ``optimizer``
    (``"sgd"`` or ``"adam"``, torch's fused kernel either way), ``lr`` and ``clip`` (the global gradient norm's
    bound, ``None``: no clipping) are what both runs do after the schedule.
    """

    vocab_size: int = 2000
    embedding_dim: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    rows: int = 64
    length: int = 35
    microbatches: int = 8
    schedule: str = "1F1B"
    layout: str = "pp2"
    optimizer: str = "sgd"
    lr: float = 0.1
    clip: float | None = None

    @property
    def replicas(self) -> int:
        return LAYOUTS[self.layout]

    @property
    def world_size(self) -> int:
        return 2 * self.replicas


def model_of(setup: Setup) -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(setup.vocab_size, setup.embedding_dim, setup.hidden_size, setup.num_layers,
                             optimizer=setup.optimizer, lr=setup.lr)


def optimizer_of(setup: Setup, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``setup``'s optimizer over ``parameters``, with the kernel the model itself picks."""
    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[setup.optimizer](
        parameters, lr=setup.lr, **kernel_options(parameters))


def batches(n: int, setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of random tokens (no padding), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, setup.vocab_size, (setup.rows, setup.length + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


class Contiguous(nn.Module):
    """A stage whose output and input gradient are contiguous: the boundary handling the library's stages do too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = ContiguousGrad.apply(x)
        return self.inner(x).contiguous()


_GROUPS: dict[int, tuple[Any, Any]] = {}


def _groups(rank: int, replicas: int) -> tuple[Any, Any]:
    """This rank's pipeline group and data-parallel group (``None`` for one replica), made once per world."""
    if replicas not in _GROUPS:
        mine: list[Any] = [None, None]
        for replica in range(replicas):  # every rank makes every group, in the same order
            group = dist.new_group([2 * replica, 2 * replica + 1])
            if rank // 2 == replica:
                mine[0] = group
        for stage in range(2):
            group = dist.new_group([2 * replica + stage for replica in range(replicas)]) if replicas > 1 else None
            if rank % 2 == stage:
                mine[1] = group
        _GROUPS[replicas] = (mine[0], mine[1])
    return _GROUPS[replicas]


def bare_loop(rank: int, steps: int, setup: Setup) -> dict[str, list[float]]:
    """The reference on ``rank`` of ``setup.world_size`` (a gloo group runs already).

    Returns:
        ``intervals``: seconds between the starts of consecutive steps (``steps`` of them); ``schedule``: seconds
        in ``schedule.step`` of the same steps; ``norms``: each step's global gradient norm before the clip (with
        ``setup.clip``; else empty).
    """
    replica, stage_index = divmod(rank, 2)
    pipeline, replicas = _groups(rank, setup.replicas)
    model = model_of(setup)
    blocks = pipeline_model(model)  # the model's blocks, as the strategy splits them
    blocks.keep_blocks(even_partition(blocks.block_names, 2)[stage_index])
    # The last stage's blocks end with the decoder's inputs (the strategy's loss decodes them): a hand-written loop
    # applies the decoder in its stage.
    stage_module = nn.Sequential(*[module for _, module in blocks.blocks()], *([model.decoder] if stage_index else []))
    stage = PipelineStage(Contiguous(stage_module), stage_index, 2, torch.device("cpu"), group=pipeline)
    divisor = torch.tensor(float(setup.rows * setup.length))
    schedule = get_schedule_class(setup.schedule)(
        stage, setup.microbatches, loss_fn=lambda out, y: token_loss_sum(out, y) / divisor, scale_grads=False)
    parameters = list(model.parameters())
    optimizer = optimizer_of(setup, parameters)
    starts, in_schedule, norms = [], [], []
    for inputs, targets in batches(steps + 1, setup):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        inputs, targets = inputs.tensor_split(setup.replicas)[replica], targets.tensor_split(setup.replicas)[replica]
        began = time.perf_counter()
        if stage_index == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, return_outputs=False)
        in_schedule.append(time.perf_counter() - began)
        if replicas is not None:  # one flat all-reduce of the replicas' gradients
            grads = [p.grad for p in parameters if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=replicas)
            for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)
        if setup.clip is not None:  # by the whole model's norm: this stage's squared norm summed over the pipeline
            grads = [p.grad for p in parameters if p.grad is not None]
            squared = torch.nn.utils.get_total_norm(grads).pow(2)
            dist.all_reduce(squared, group=pipeline)
            norms.append(squared.sqrt())
            torch.nn.utils.clip_grads_with_norm_(parameters, setup.clip, norms[-1])
        optimizer.step()
    # Same measure as for the Trainer: the interval between the starts of consecutive steps.
    return {"intervals": [b - a for a, b in zip(starts, starts[1:])], "schedule": in_schedule[:-1],
            "norms": [float(n) for n in norms]}


class _StepStarts(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def strategy_fit(rank: int, steps: int, setup: Setup, record: tuple[int, ...] = ()) -> dict[str, Any]:
    """The same training through ``MPLSTMStrategy`` in ``Trainer.fit`` (every rank is given the global batch and
    takes its replica's rows).

    Args:
        record: global steps the timeline records (a separate run: recording costs time of its own).

    Returns:
        ``intervals`` (as :func:`bare_loop`'s) and, with ``record``, ``outside``: this rank's median seconds before
        its first span and after its last over the recorded steps.
    """
    timer = _StepStarts()
    scratch = tempfile.TemporaryDirectory()  # the timeline's picture and trace are not wanted
    timeline = PipelineTimeline(steps=record, directory=scratch.name) if record else None
    trainer = pl.Trainer(
        strategy=MPLSTMStrategy(pipeline_parallel_size=2, data_parallel_size=setup.replicas, schedule=setup.schedule,
                                n_microbatches=setup.microbatches, report_after_steps=None, num_threads=1),
        accelerator="cpu", devices=setup.world_size, max_steps=steps + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, gradient_clip_val=setup.clip,
        callbacks=[timer, *([timeline] if timeline else [])])
    with scratch:
        trainer.fit(model_of(setup), train_dataloaders=DataLoader(batches(steps + 1, setup), batch_size=None))
    out: dict[str, Any] = {"intervals": [b - a for a, b in zip(timer.starts, timer.starts[1:])]}
    if timeline is not None:
        out["outside"] = outside_schedule(timeline.records, rank)
    return out


def outside_schedule(records: list[Any], rank: int) -> dict[str, float]:
    """Median seconds of ``rank``'s recorded steps before its first span and from its last to its own end of the
    step, and its steps' wall."""
    before, after, wall = [], [], []
    for record in records:
        mine = [span for span in record.spans if span.rank == rank]
        if mine:
            end = record.rank_walls.get(rank, record.wall)
            before.append(min(span.start for span in mine))
            after.append(end - max(span.end for span in mine))
            wall.append(end)
    median = statistics.median
    return {"before": median(before), "after": median(after), "wall": median(wall)} if wall else {}


def start_rank() -> None:
    """One thread, and the default gloo group unless one runs already: what a rank of these comparisons needs."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which run goes first in each round: the bare loop in even rounds, the strategy in odd ones (ABBA), so that
    neither always runs on a machine warmed (or tired) by the other."""
    return [("bare", "strategy") if r % 2 == 0 else ("strategy", "bare") for r in range(rounds)]


def compare(rank: int, steps: int, warmup: int, setup: Setup = Setup(), rounds: int = 2) -> dict[str, Any]:
    """Both runs on this rank of ``setup.world_size``, ``rounds`` interleaved rounds of each (in the order of
    :func:`round_orders`; the first ``warmup`` steps of each run dropped), then one recorded run of the strategy for
    the time outside its schedule. Starts the default gloo group when none runs.

    Returns:
        ``bare`` and ``strategy``: step intervals (seconds), every round's; ``rounds``: each round's median interval
        of the two, ``(bare, strategy)``; ``bare_outside`` and ``strategy_outside``: this rank's median seconds
        outside the schedule (``before``/``after`` its spans for the strategy).
    """
    start_rank()
    out: dict[str, Any] = {"bare": [], "strategy": [], "rounds": [], "setup": asdict(setup), "rank": rank}
    outside: list[float] = []
    for order in round_orders(rounds):  # interleaved, so a drift of the machine falls on both alike
        medians = {}
        for run in order:
            if run == "bare":
                bare = bare_loop(rank, steps, setup)
                intervals = bare["intervals"][warmup:]
                outside += [i - s for i, s in zip(intervals, bare["schedule"][warmup:])]
            else:
                intervals = strategy_fit(rank, steps, setup)["intervals"][warmup:]
            out[run] += intervals
            medians[run] = statistics.median(intervals)
            dist.barrier()
        out["rounds"].append((medians["bare"], medians["strategy"]))
    out["bare_outside"] = statistics.median(outside)
    recorded = tuple(range(warmup + 1, min(steps, warmup + 4)))
    out["strategy_outside"] = strategy_fit(rank, steps, setup, record=recorded)["outside"]
    dist.barrier()
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of both (global tokens per step / median interval of every round's steps) and the ratio the goal
    judges: the median over rounds of each round's strategy / bare tokens per second (a round's two runs are
    neighbours in time, so a machine's drift between rounds cancels in its ratio), with every round's ratio and the
    ratio of the pooled medians beside it."""
    setup = Setup(**result["setup"])
    tokens = setup.rows * setup.length
    bare = tokens / statistics.median(result["bare"])
    strategy = tokens / statistics.median(result["strategy"])
    per_round = [b / s for b, s in result["rounds"]]
    return {"bare_tokens_per_s": bare, "strategy_tokens_per_s": strategy, "ratio": statistics.median(per_round),
            "round_ratios": per_round, "pooled_ratio": strategy / bare}


def _worker(rank: int, world_size: int, steps: int, warmup: int, setup: Setup, rounds: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    return compare(rank, steps, warmup, setup, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2")
    parser.add_argument("--schedule", choices=("GPipe", "1F1B"), default="1F1B")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=Setup.rows, help="global batch: sequences")
    parser.add_argument("--microbatches", type=int, default=Setup.microbatches, help="per replica batch")
    args = parser.parse_args()
    setup = Setup(schedule=args.schedule, layout=args.layout, rows=args.rows, microbatches=args.microbatches)
    per_rank = run_ranks(_worker, setup.world_size, args.steps, args.warmup, setup, args.rounds, timeout=1800)
    summary = summarize(per_rank[0])
    print(f"model: {setup.num_layers} x LSTM {setup.hidden_size}, vocab {setup.vocab_size}, global batch {setup.rows} "
          f"x {setup.length}, {setup.microbatches} microbatches, {setup.schedule}, {args.layout} on "
          f"{setup.world_size} CPU ranks x 1 thread; {args.rounds} interleaved rounds of {args.steps - args.warmup} "
          "timed steps each")
    print(f"bare pipelining loop : {summary['bare_tokens_per_s']:,.0f} tokens/s")
    print(f"MPLSTMStrategy fit   : {summary['strategy_tokens_per_s']:,.0f} tokens/s")
    print(f"ratio strategy/bare  : {summary['ratio']:.3f}  (goal >= {GOAL}; median over rounds of "
          f"{', '.join(f'{r:.3f}' for r in summary['round_ratios'])}; pooled {summary['pooled_ratio']:.3f})")
    for result in per_rank:
        mine = result["strategy_outside"]
        print(f"rank {result['rank']}: outside the schedule, bare {1e3 * result['bare_outside']:.1f} ms; strategy "
              f"{1e3 * (mine['before'] + mine['after']):.1f} ms ({1e3 * mine['before']:.1f} before its first span, "
              f"{1e3 * mine['after']:.1f} after its last) of a {1e3 * mine['wall']:.1f} ms recorded step")


if __name__ == "__main__":
    main()
