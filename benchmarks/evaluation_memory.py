"""Evaluation's memory against the memory plan: every rank's measured peak beside what the plan predicted for it.

A user's module whose loss takes a microbatch's whole logits (PyTorch's word_language_model style: embedding, a
2-layer LSTM, a linear decoder, ``F.cross_entropy``), trained on ``LMDataModule``'s synthetic corpus with training
batches of 16 sentences and evaluation batches of 2,048 (``eval_batch_size``): the evaluation batch is what a process
holds most of. Each case runs ``Trainer.fit`` (3 steps, then the whole validation split), or ``validate`` or
``predict`` alone on a new Trainer, or a fit and then a predict of the same Trainer (planned again beside what the fit
still holds), in processes of its own (Lightning's launcher starts the second rank), and every rank reports its
``VmHWM`` and its row of the plan (``MPLSTMStrategy.memory``; the larger of the two calls' plans).

Goal: the plan within 15 % of every rank's measured peak (where the plan is below, a process could be refused too
late; above, a layout refused that fits).

    python benchmarks/evaluation_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (vocabulary asked of the synthetic corpus, hidden size, pipeline processes, the Trainer calls in order).
CASES = {
    "8,636 words, hidden 32, 1 process, fit + validation": (30_000, 32, 1, "fit"),
    "8,636 words, hidden 32, pp2, fit + validation": (30_000, 32, 2, "fit"),
    "8,636 words, hidden 256, pp2, fit + validation": (30_000, 256, 2, "fit"),
    "200 words, hidden 1,024, pp2, fit + validation": (200, 1024, 2, "fit"),
    "8,636 words, hidden 32, pp2, validate alone": (30_000, 32, 2, "validate"),
    "200 words, hidden 1,024, pp2, validate alone": (200, 1024, 2, "validate"),
    "8,636 words, hidden 32, pp2, predict alone": (30_000, 32, 2, "predict"),
    "8,636 words, hidden 32, pp2, fit, then predict": (30_000, 32, 2, "fit, predict"),
}
EVAL_BATCH, GOAL = 2048, 0.15


def _hwm_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))


def run_case(name: str) -> None:
    """One rank of case ``name`` (Lightning's launcher runs this again for the other rank): prints its result."""
    import warnings

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_mp_lstm import LSTMBlocks, MPLSTMStrategy
    from lightning_mp_lstm.data import LMDataModule

    warnings.filterwarnings("ignore")
    words, hidden, pp, call = CASES[name]

    class WholeLogits(pl.LightningModule):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.encoder = nn.Embedding(vocab, hidden)
            self.rnn = nn.LSTM(hidden, hidden, 2, batch_first=True)
            self.decoder = nn.Linear(hidden, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.rnn(self.encoder(tokens))[0])

        def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=0)

        def training_step(self, batch, batch_idx):
            return self.lm_loss(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.lm_loss(self(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def configure_pipeline(self):
            return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", loss="lm_loss")

    data = LMDataModule(source="synthetic", synthetic=dict(vocab_size=words, num_classes=8, num_train=2000,
                                                           num_valid=2000, num_test=2000),
                        batch_size=16, eval_batch_size=EVAL_BATCH, seed=0)
    data.setup("fit")
    torch.manual_seed(0)
    model = WholeLogits(data.vocab_size)
    strategy = MPLSTMStrategy(pipeline_parallel_size=pp, report_after_steps=None, verify=False)
    trainer = pl.Trainer(strategy=strategy, devices=pp, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, max_steps=3, val_check_interval=3,
                         num_sanity_val_steps=0)
    planned = 0.0  # the largest of the calls' plans for this rank
    for step in call.split(", "):
        if step == "fit":
            trainer.fit(model, datamodule=data)
        elif step == "validate":
            trainer.validate(model, datamodule=data, verbose=False)
        else:
            trainer.predict(model, datamodule=data, return_predictions=False)
        planned = max(planned, strategy.memory.ranks[trainer.global_rank].total / 2**20)
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "measured_mib": _hwm_mib(), "planned_mib": planned,
                                  "words": data.vocab_size}), flush=True)


def measure() -> list[dict]:
    """Every case in processes of its own: one row per rank."""
    rows = []
    for name in CASES:
        done = subprocess.run([sys.executable, __file__, "--case", name], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        # The ranks share the output: one rank's line may run into the other's.
        results = [json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", done.stdout)]
        if done.returncode != 0 or not results:
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        for result in sorted(results, key=lambda r: r["rank"]):
            ratio = result["planned_mib"] / result["measured_mib"]
            rows.append({"case": name, **result, "planned_over_measured": ratio})
            print(f"{name:<52} rank {result['rank']}: measured {result['measured_mib']:7,.0f} MiB, planned "
                  f"{result['planned_mib']:7,.0f} MiB, planned / measured {ratio:.3f}", flush=True)
    worst = max(abs(row["planned_over_measured"] - 1) for row in rows)
    print(f"goal: the plan within {GOAL:.0%} of every rank's peak: {worst:.3f} "
          f"({'met' if worst <= GOAL else 'MISSED'})")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return
    rows = measure()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
