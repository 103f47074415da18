"""Peak memory per rank: one process, pp2 and pp4 on MXNet's example model with a wider hidden size; the host's RSS
on CPU, on CUDA the GPU's ``torch.cuda.max_memory_allocated``.

Every rank builds the model on the meta device (``trainer.init_module(empty_init=True)``) and materializes only
its own blocks, so a pipeline rank should hold about its share of the parameters, gradients and Adam state; the
partition is balanced by memory. Each layout runs a few training steps on PTB (train on ``ptb.valid.txt``) with one
thread per rank, then saves a checkpoint, reading the peak before and after; once with the one-file format
(gathered on rank 0) and once, in fresh processes, sharded, so what each way of saving adds shows separately. Every
rank also reports what the strategy's memory plan predicted for it (``MPLSTMStrategy.memory``, without the save).

Goals: every pp4 rank <= 0.40 x the one-process peak (issue 43; what a rank holds beyond the floor of imports and
data is printed beside it); rank 0 <= 1.15 x the largest other rank (training, without the one-file save); the
memory plan within 20 % of every rank's measured training peak.

    python benchmarks/memory.py [--hidden 1024] [--rows 8] [--steps 2] [--json results.json]

``benchmarks/run.py`` imports :func:`measure`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import ptb_paths  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402

LAYOUTS = {"1 process": 1, "pp2": 2, "pp4": 4}


def _peak_mib(device: str = "cpu") -> float:
    """This process's peak memory so far, MiB: on ``cuda`` what torch allocated on its GPU, else the host's RSS."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def rank_peaks(rank: int, world_size: int, args: dict, directory: str, fmt: str, device: str = "cpu") -> dict:
    """Train ``args["steps"]`` steps on this rank of a ``world_size``-stage pipeline on ``device`` (``cpu`` or
    ``cuda``), then save in format ``fmt`` into ``directory``: peak memory (MiB, :func:`_peak_mib`) at the floor,
    after training and after saving, and this rank's blocks."""
    warnings.filterwarnings("ignore")
    import lightning_mp_lstm  # noqa: F401
    from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
    from lightning_mp_lstm.data import LMDataModule

    data = LMDataModule(source="ptb", **ptb_paths(), buckets=[8, 16, 24, 32, 60], batch_size=args["rows"])
    data.setup("fit")
    floor = _peak_mib(device)
    strategy = MPLSTMStrategy(n_microbatches=world_size, report_after_steps=None, checkpoint_format=fmt,
                              schedule="GPipe", partition="balanced", balance_by="memory")
    trainer = pl.Trainer(strategy=strategy, accelerator=device, devices=world_size, max_steps=args["steps"],
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        model = LSTMLanguageModel(data.vocab_size, embedding_dim=200, hidden_size=args["hidden_size"], num_layers=8,
                                  optimizer="adam", lr=1e-3)
    trainer.fit(model, datamodule=data)
    training = _peak_mib(device)
    trainer.save_checkpoint(Path(directory) / f"{fmt}.ckpt")
    plan = trainer.strategy.memory
    predicted = plan.ranks[trainer.strategy.pipeline_rank].training / 2**20 if plan is not None else None
    out = {"training": training, "saving": _peak_mib(device), "params": sum(p.numel() for p in model.parameters()),
           "blocks": trainer.strategy.plan.blocks_of(trainer.strategy.pipeline_rank), "predicted": predicted}
    out["floor"] = floor
    return out


def measure(hidden: int = 1024, rows: int = 8, steps: int = 2, layouts: dict[str, int] | None = None,
            formats: tuple[str, ...] = ("file", "sharded"), timeout: float = 1200, device: str = "cpu"
            ) -> dict[str, list[dict]]:
    """Peaks of every rank of every layout (``name -> processes``, default :data:`LAYOUTS`), each checkpoint format
    in fresh processes: ``{layout: [per rank: {"floor", "training", "saving", "params", "blocks", <format>: {...}}]}``
    (the top-level numbers are the first format's)."""
    args = {"hidden_size": hidden, "rows": rows, "steps": steps}
    results = {}
    for name, world in (layouts or LAYOUTS).items():
        runs = {}
        for fmt in formats:  # the peak only ever grows: each format in fresh processes
            with tempfile.TemporaryDirectory() as directory:
                runs[fmt] = run_ranks(rank_peaks, world, args, directory, fmt, device, timeout=timeout)
        results[name] = [{**per_format[0], **dict(zip(formats, per_format))} for per_format in zip(*runs.values())]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=8, help="sentences per global batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = measure(args.hidden, args.rows, args.steps)
    single = results["1 process"][0]["file"]["training"]
    floor = results["1 process"][0]["floor"]
    print(f"peak RSS per rank (MiB), mxnet_ptb with hidden {args.hidden}, PTB batch {args.rows}, {args.steps} steps, "
          f"Adam, partition balanced by memory; floor = after imports and data")
    print("| layout | rank | blocks | parameters | floor | training | predicted | after one-file save | after sharded "
          "save | training / 1 process |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, ranks in results.items():
        for rank, r in enumerate(ranks):
            blocks = ", ".join(r["blocks"]) if len(r["blocks"]) < 4 else f"{r['blocks'][0]} .. {r['blocks'][-1]}"
            training = r["file"]["training"]
            print(f"| {name} | {rank} | {blocks} | {r['params']:,} | {r['floor']:.0f} | {training:.0f} | "
                  f"{r['predicted']:.0f} | {r['file']['saving']:.0f} | {r['sharded']['saving']:.0f} | "
                  f"{training / single:.2f} |")
    pp4 = [r["file"]["training"] for r in results["pp4"]]
    print(f"\npp4: largest rank / 1 process = {max(pp4) / single:.2f} (goal <= 0.40); beyond the floor: "
          f"{(max(pp4) - floor) / (single - floor):.2f}; rank 0 / largest other rank = {pp4[0] / max(pp4[1:]):.2f} "
          "(goal <= 1.15)")
    errors = [r["predicted"] / r["file"]["training"] - 1 for ranks in results.values() for r in ranks]
    print(f"memory plan: predicted / measured - 1 from {min(errors):+.1%} to {max(errors):+.1%} (goal within 20 %)")
    zero = results["pp4"][0]
    print(f"pp4 rank 0 over its training peak: one-file save +{zero['file']['saving'] - zero['file']['training']:.0f}"
          f" MiB (it gathers every rank's tensors), sharded save "
          f"+{zero['sharded']['saving'] - zero['sharded']['training']:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
