"""When to use mp_lstm: one model and global batch trained by one process, DDP, FSDP, a hand-written torch pipelining
loop and the ``mp_lstm`` strategy, side by side on this machine (docs/when_to_use.md).

The model and batch are ``benchmarks/overhead.py``'s (4 x LSTM 256, vocabulary 2,000, batch 64 x 35, SGD). Every
run starts fresh processes, skips ``--warmup`` steps, and reports tokens/s (real tokens of the global batch over the
median interval between step starts on rank 0) and the parameters each rank holds. Two processes run one thread
each; the one process runs two (the same cores). Each rank's peak resident memory (VmHWM) is the median over the
rounds. Lightning's FSDP strategy refuses a CPU, so the FSDP row is torch's
``fully_shard`` (FSDP2) in a loop of its own, as the bare pipelining row is.

The ``mp_lstm layout=auto`` row runs what the autopilot picks for this model and batch among the layouts of one and
two processes (:func:`lightning_mp_lstm.planning.autopilot.rank_layouts`, calibrated on this machine first, as
``python train.py layout=auto`` ranks). The runs go in ``--rounds`` interleaved rounds (every row once per round);
a row's step time is the median over the rounds of each run's median step.

    python benchmarks/when_to_use.py [--steps 14] [--warmup 4] [--rounds 3]   # writes benchmarks/when_to_use.json
    python docs/generated.py                                      # puts its table into docs/when_to_use.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.overhead import Setup, bare_loop, batches, model_of  # noqa: E402
from lightning_mp_lstm import MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402
from lightning_mp_lstm.models.binding import pipeline_model  # noqa: E402
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum  # noqa: E402
from lightning_mp_lstm.planning.partition import even_partition  # noqa: E402

OUT = Path(__file__).resolve().parent / "when_to_use.json"
#: (name, processes, what it is) in the order of the table.
RUNS = (
    ("one process", 1, "Lightning, `Trainer(devices=1)`, 2 threads"),
    ("DDP", 2, "Lightning, `strategy=\"ddp\"`: a whole model per process, half the batch each"),
    ("FSDP", 2, "torch `fully_shard` (FSDP2) per layer, half the batch each, own loop"),
    ("bare pipelining loop", 2, "torch `PipelineStage` + `Schedule1F1B`, 8 microbatches, own loop "
                                "(`benchmarks/overhead.py`)"),
    ("mp_lstm pp2", 2, "`Trainer(strategy=\"mp_lstm\", devices=2)`: the same pipeline, 1F1B, 8 microbatches"),
    ("mp_lstm dp2", 2, "`MPLSTMStrategy(data_parallel_size=2)`: two replicas of the whole model"),
    ("mp_lstm dp2 sharded", 2, "`MPLSTMStrategy(data_parallel_size=2, shard_replicas=True)`: FSDP2 per block, "
                               "each replica holds half the parameters, gradients and optimizer state"),
    ("mp_lstm layout=auto", 0, "the autopilot's pick among the layouts of 1 and 2 processes"),
)
AUTO = "mp_lstm layout=auto"


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())


def _held(model: torch.nn.Module) -> int:
    """Parameters this process holds (a shard's local part)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _peak_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _half(rank: int, world_size: int, steps: int, setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    share = setup.rows // world_size
    return [(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]) for x, y in batches(steps, setup)]


def _lightning(rank: int, world_size: int, steps: int, setup: Setup, strategy: Any, shard: bool) -> tuple[list, int]:
    timer, model = _StepTimer(), model_of(setup)
    data = _half(rank, world_size, steps, setup) if shard else batches(steps, setup)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[timer], use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    return [b - a for a, b in zip(timer.starts, timer.starts[1:])], _held(model)


def _fsdp(rank: int, world_size: int, steps: int, setup: Setup) -> tuple[list, int]:
    from torch.distributed.fsdp import fully_shard

    model = model_of(setup)
    for module in (model.embedding, *model.lstm, model.decoder, model):
        fully_shard(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    starts = []
    for x, y in _half(rank, world_size, steps, setup):
        starts.append(time.perf_counter())
        logits, _ = model(x)
        (token_loss_sum(logits, y) / y.numel()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [b - a for a, b in zip(starts, starts[1:])], _held(model)


def _bare(rank: int, world_size: int, steps: int, setup: Setup) -> tuple[list, int]:
    intervals = bare_loop(rank, steps - 1, setup)["intervals"]
    blocks = pipeline_model(model_of(setup))  # what bare_loop keeps on this rank: an even split of the blocks
    blocks.keep_blocks(even_partition(blocks.block_names, world_size)[rank])
    return intervals, sum(p.numel() for p in blocks.module.parameters())


def autopilot_pick(setup: Setup) -> tuple[dict[str, Any], str, int]:
    """What ``layout=auto`` trains for this model and batch: the pick's strategy options, its name and processes
    (the layouts of one and two processes ranked on this machine; the model is small, so memory is not planned)."""
    from dataclasses import replace

    from lightning_mp_lstm.app.step_cost import step_costs
    from lightning_mp_lstm.planning.autopilot import choose, rank_layouts, render_ranking
    from lightning_mp_lstm.planning.calibration import calibrate

    model, device, cores = model_of(setup), torch.device("cpu"), 2
    calibration = calibrate(model, setup.rows, setup.length, device, threads=(cores,), processes=[2])
    calibration = replace(calibration, step_costs=tuple(step_costs([2]).items()))
    ranked = rank_layouts(model, [2], setup.rows, setup.length, device, calibration, schedule=setup.schedule,
                          cores=cores)
    print(render_ranking(ranked, setup.rows * setup.length), flush=True)
    pick = choose(ranked)
    return pick.settings(), pick.name, pick.processes


def _worker(rank: int, world_size: int, name: str, steps: int,
            auto: dict[str, Any] | None = None) -> tuple[list[float], int, float]:
    intervals, held = _run(rank, world_size, name, steps, auto)
    return intervals, held, _peak_mib()


def _run(rank: int, world_size: int, name: str, steps: int,
         auto: dict[str, Any] | None = None) -> tuple[list[float], int]:
    warnings.filterwarnings("ignore")
    setup = Setup()
    torch.set_num_threads(2 if world_size == 1 else 1)
    if world_size > 1 and not dist.is_initialized() and name in ("FSDP", "bare pipelining loop"):
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if name == "one process":
        return _lightning(rank, 1, steps, setup, "auto", shard=False)
    if name == "DDP":
        return _lightning(rank, world_size, steps, setup, "ddp", shard=True)
    if name == "FSDP":
        return _fsdp(rank, world_size, steps, setup)
    if name == "bare pipelining loop":
        return _bare(rank, world_size, steps, setup)
    if name == AUTO:
        kwargs = dict(auto or {})
    elif name == "mp_lstm pp2":
        kwargs = {"schedule": setup.schedule, "n_microbatches": setup.microbatches}
    else:
        kwargs = {"data_parallel_size": 2, "pipeline_parallel_size": 1, "shard_replicas": name.endswith("sharded")}
    strategy = MPLSTMStrategy(report_after_steps=None, num_threads=2 if world_size == 1 else 1, **kwargs)
    return _lightning(rank, world_size, steps, setup, strategy, shard=False)


def measure(steps: int, warmup: int, rounds: int = 3) -> dict[str, Any]:
    """Every run of :data:`RUNS` in fresh processes, ``rounds`` times interleaved; the rows of the table."""
    setup = Setup()
    tokens = setup.rows * setup.length
    auto, pick, pick_processes = autopilot_pick(setup)
    runs = [(name, pick_processes if name == AUTO else processes,
             f"{what}: {pick}" if name == AUTO else what) for name, processes, what in RUNS]
    medians: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    held: dict[str, list[int]] = {}
    peaks: dict[str, list[list[float]]] = {name: [] for name, _, _ in runs}
    timed: dict[str, int] = {}
    for round_ in range(rounds):
        for name, processes, _ in runs:
            results = run_ranks(_worker, processes, name, steps, auto, timeout=900, start_method="forkserver")
            intervals = results[0][0][warmup:]
            medians[name].append(statistics.median(intervals))
            timed[name] = len(intervals)
            held[name] = [h for _, h, _ in results]
            peaks[name].append([peak for _, _, peak in results])
            print(f"round {round_ + 1}, {name}: {tokens / medians[name][-1]:,.0f} tokens/s", flush=True)
    rows = []
    for name, processes, what in runs:
        step_s = statistics.median(medians[name])
        rows.append({"run": name, "what": what, "processes": processes, "step_s": step_s,
                     "step_s_per_round": medians[name], "tokens_per_s": tokens / step_s,
                     "params_per_rank": held[name], "timed_steps": timed[name], "rounds": rounds,
                     "peak_mib_per_rank": [statistics.median(p) for p in zip(*peaks[name])]})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base
    import lightning

    return {"command": "python benchmarks/when_to_use.py" + (f" --steps {steps} --warmup {warmup} --rounds {rounds}"
                                                               if (steps, warmup, rounds) != (14, 4, 3) else ""),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cores": os.cpu_count(), "torch": torch.__version__, "lightning": lightning.__version__,
                        "python": platform.python_version()},
            "setup": {"model": f"{setup.num_layers} x LSTM {setup.hidden_size}, embedding {setup.embedding_dim}, "
                               f"vocabulary {setup.vocab_size:,}", "batch": f"{setup.rows} x {setup.length}"},
            "rows": rows}


def render(result: dict[str, Any]) -> str:
    """The page's table (Markdown) from a result of :func:`measure`."""
    lines = ["| run | processes x threads | tokens/s | **x one process** | s/step (each round) | parameters per rank "
             "| peak MiB per rank | what |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        threads = "1 x 2" if row["processes"] == 1 else f"{row['processes']} x 1"
        held = ", ".join(f"{p:,}" for p in row["params_per_rank"])
        rounds = ", ".join(f"{s:.3f}" for s in row.get("step_s_per_round", []))
        peaks = ", ".join(f"{p:,.0f}" for p in row.get("peak_mib_per_rank", [])) or "-"
        lines.append(f"| {row['run']} | {threads} | {row['tokens_per_s']:,.0f} | {row['ratio']:.2f} | "
                     f"{row['step_s']:.3f} ({rounds}) | {held} | {peaks} | {row['what']} |")
    m = result["machine"]
    lines.append("")
    lines.append(f"{result['setup']['model']}, global batch {result['setup']['batch']}, SGD; each run's median over "
                 f"{result['rows'][0]['timed_steps']} timed steps after warm-up, the median of "
                 f"{result['rows'][0].get('rounds', 1)} interleaved rounds per row. `{result['command']}`, "
                 f"{result['date'][:10]}, {m['cores']} CPU cores, torch {m['torch']}, Lightning {m['lightning']} "
                 "(a shared machine: compare the rows, not the absolute numbers). Generated from "
                 "`benchmarks/when_to_use.json` by `python docs/generated.py`.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a row's median over them)")
    args = parser.parse_args()
    result = measure(args.steps, args.warmup, args.rounds)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))


if __name__ == "__main__":
    main()
