"""How two replicas sum their gradients, four ways, on the same model and batches: the library's sums after the
backward pass (``pipeline.gradients.all_reduce_gradients``: every all-reduce posted at once, then waited), the
library's sums posted during the backward pass as each gradient is accumulated (``pipeline.replica_sums``, what the
engine does since the thirteenth session), torch's
``replicate`` (FSDP2-based, ``torch.distributed._composable.replicate_with_fsdp``: the sums bucketed and overlapped
with the backward pass; torchtitan applies torch's data parallelism to each stage's module) and torch's
``DistributedDataParallel``.

One process per replica, one thread each, each its half of the global batch; rounds interleaved (the order reversed
every other round) and each variant's first ``--warmup`` steps dropped. Prints each variant's median step per
round, its median over rounds of variant / sums, and how far its parameters ended from the sums' (every variant
steps the gradient of the global batch's mean loss: the sums' loss is divided by the global batch's tokens, the
others' by the replica's, which they average).

    python benchmarks/replica_sums.py [--rounds 5] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.overhead import Setup, batches, model_of, optimizer_of, start_rank  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum  # noqa: E402
from lightning_mp_lstm.pipeline.gradients import all_reduce_gradients  # noqa: E402
from lightning_mp_lstm.pipeline.replica_sums import ReplicaSums, sum_the_rest  # noqa: E402

__all__ = ["SETUP", "VARIANTS", "main", "summarize", "train_replica"]

#: The strategy-overhead model (4 x LSTM 256, vocabulary 2,000), a global batch of 32 x 35, Adam.
SETUP = Setup(rows=32, length=35, optimizer="adam", lr=0.001)
#: Each variant: how its replica's gradients are summed.
VARIANTS = ("sums", "overlapped", "replicate", "ddp")


def _wrapped(model: nn.Module, variant: str) -> nn.Module:
    if variant == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device("cpu").type, (dist.get_world_size(),))
        for block in model.modules():  # each block with parameters of its own, then the rest (torchtitan's order)
            if block is not model and any(True for _ in block.parameters(recurse=False)):
                replicate(block, mesh=mesh)
        replicate(model, mesh=mesh)
        return model
    if variant == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model


def train_replica(variant: str, steps: int, warmup: int, setup: Setup = SETUP) -> tuple[float, list[torch.Tensor]]:
    """``steps`` steps of this replica's half of each global batch; the median step after ``warmup`` (seconds) and
    the parameters at the end."""
    rank, replicas = dist.get_rank(), dist.get_world_size()
    model = model_of(setup)
    net = _wrapped(model, variant)
    optimizer = optimizer_of(setup, list(net.parameters()))
    share = setup.rows // replicas
    tokens = share * setup.length if variant in ("replicate", "ddp") else setup.rows * setup.length
    sums = ReplicaSums(dist.group.WORLD) if variant == "overlapped" else None
    if sums is not None:
        sums.attach({0: model})
    times = []
    for inputs, targets in batches(steps, setup):
        inputs, targets = (t[rank * share:(rank + 1) * share] for t in (inputs, targets))
        started = time.perf_counter()
        optimizer.zero_grad()
        logits, _ = net(inputs)
        if sums is not None:
            with sums.step(), sums.posting(0):
                (token_loss_sum(logits, targets) / tokens).backward()
            sum_the_rest(net.parameters(), sums.finish(), sums.filled, dist.group.WORLD, torch.device("cpu"))
        else:
            (token_loss_sum(logits, targets) / tokens).backward()
        if variant == "sums":
            all_reduce_gradients(net.parameters(), dist.group.WORLD)
        optimizer.step()
        times.append(time.perf_counter() - started)
    parameters = [_full(p).detach().clone() for p in model.parameters()]
    return statistics.median(times[warmup:]), parameters


def _full(parameter: torch.Tensor) -> torch.Tensor:
    full = getattr(parameter, "full_tensor", None)
    return full() if callable(full) else parameter


def _worker(rank: int, world_size: int, rounds: int, steps: int, warmup: int, setup: Setup = SETUP) -> dict[str, Any]:
    start_rank()
    medians: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    ends: dict[str, list[torch.Tensor]] = {}
    try:
        for r in range(rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                dist.barrier()
                median, ends[variant] = train_replica(variant, steps, warmup, setup)
                medians[variant].append(median)
    finally:
        dist.destroy_process_group()
    apart = {variant: max(float((a - b).abs().max()) for a, b in zip(ends[variant], ends["sums"], strict=True))
             for variant in VARIANTS}
    return {"medians": medians, "apart": apart}


def summarize(medians: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's median over rounds of its step / the sums' step of the same round."""
    return {variant: statistics.median(v / s for v, s in zip(times, medians["sums"], strict=True))
            for variant, times in medians.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    result = run_ranks(_worker, 2, args.rounds, args.steps, args.warmup, timeout=1800)[0]
    ratios = summarize(result["medians"])
    for variant, times in result["medians"].items():
        print(f"{variant:<9} step ms per round {[round(1e3 * t, 1) for t in times]}; / sums (median of rounds) "
              f"{ratios[variant]:.3f}; parameters apart from the sums' {result['apart'][variant]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
