"""AWD-LSTM (docs/examples/awd_lstm.py) on Penn Treebank as a 2-stage pipeline, next to the same module trained by its
own ``training_step`` on one process, from the same seed: the validation curves of both, drawn in one picture.

Only PTB's valid and test splits ship with this project (``data/ptb``, or ``$LIGHTNING_MP_LSTM_PTB_DIR``):
the first 90 % of ``ptb.valid.txt`` trains, its last 10 % validates; the test split is not used. The paper's recipe
at a CPU's size: embedding 200, hidden 400, three layers, tied weights, every dropout and weight drop at the paper's
PTB rates, AR 2 and TAR 1, SGD at learning rate 30 with the gradient clipped to norm 0.25; 20 sequences of 35 words.

    python docs/examples/awd_lstm_ptb.py            # both runs, then docs/_static/awd_lstm_ptb.png and the table
    python docs/examples/awd_lstm_ptb.py --layout pp2 --out DIR    # one run (what the first command starts twice)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from awd_lstm import AwdLSTM, stream_batches  # noqa: E402  (the example next to this one)

from lightning_mp_lstm import MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.base.testing import ptb_dir  # noqa: E402
from lightning_mp_lstm.data.corpus import read_sentences  # noqa: E402
from lightning_mp_lstm.data.vocab import Vocabulary  # noqa: E402

BATCH, BPTT = 20, 35
MODEL = dict(ninp=200, nhid=400, nlayers=3, dropout=0.4, dropouth=0.25, dropouti=0.4, dropoute=0.1, wdrop=0.5,
             alpha=2.0, beta=1.0, lr=30.0)
LAYOUTS = {"single": ("one process: the module's own training_step", lambda: dict(strategy="auto", devices=1)),
           "pp2": ("mp_lstm, 2-stage pipeline, 2 microbatches",
                   lambda: dict(strategy=MPLSTMStrategy(pipeline_parallel_size=2, n_microbatches=2,
                                                        report_after_steps=None), devices=2))}


class SGDAwd(AwdLSTM):
    """The paper's optimizer: plain SGD (AWD-LSTM switches to averaged SGD later; these runs stop before)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Curve(pl.Callback):
    def __init__(self) -> None:
        self.val_ppl: list[float] = []
        self.start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val_ppl.append(math.exp(float(trainer.callback_metrics["val_loss"])))


def data() -> tuple[Vocabulary, list, list]:
    sentences = read_sentences(ptb_dir(ROOT) / "ptb.valid.txt")
    cut = int(len(sentences) * 0.9)
    vocab = Vocabulary.build(sentences[:cut])
    stream = [torch.tensor([i for s in part for i in vocab.encode([*s, "<eos>"])]) for part in
              (sentences[:cut], sentences[cut:])]
    return vocab, stream_batches(stream[0], BATCH, BPTT), stream_batches(stream[1], 10, BPTT)


def run(layout: str, epochs: int, out: Path) -> None:
    vocab, train, valid = data()
    pl.seed_everything(0, verbose=False)
    model = SGDAwd(ntoken=len(vocab), **MODEL)
    curve = Curve()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, gradient_clip_val=0.25, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[curve], **LAYOUTS[layout][1]())
    trainer.fit(model, DataLoader(train, batch_size=None), DataLoader(valid, batch_size=None))
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{layout}.json").write_text(json.dumps({"val_ppl": curve.val_ppl,
                                                        "seconds": time.perf_counter() - curve.start}))


def draw(out: Path, epochs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {layout: json.loads((out / f"{layout}.json").read_text()) for layout in LAYOUTS}
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    for layout, (label, _) in LAYOUTS.items():
        values = curves[layout]["val_ppl"]
        axes.plot(range(1, len(values) + 1), values, marker="o", label=label)
    axes.set_xlabel("epoch")
    axes.set_ylabel("validation perplexity")
    axes.set_title("AWD-LSTM on PTB (90 % of ptb.valid.txt), same seed")
    axes.legend()
    figure.tight_layout()
    figure.savefig(ROOT / "docs" / "_static" / "awd_lstm_ptb.png", dpi=120)
    command = "python docs/examples/awd_lstm_ptb.py" + (f" --epochs {epochs}" if epochs != EPOCHS else "")
    rows = ["| epoch | " + " | ".join(LAYOUTS[layout][0] for layout in LAYOUTS) + " |",
            "|---:|" + "---:|" * len(LAYOUTS)]
    for epoch in range(epochs):
        rows.append(f"| {epoch + 1} | " + " | ".join(f"{curves[layout]['val_ppl'][epoch]:.1f}" for layout in LAYOUTS)
                    + " |")
    (ROOT / "docs" / "awd_lstm_ptb_results.md").write_text(
        "<!-- generated by docs/examples/awd_lstm_ptb.py: do not edit -->\n"
        f"Recorded {datetime.date.today().isoformat()} on a 2-core CPU machine with `{command}` (validation "
        "perplexity after each epoch; the two runs draw their dropout masks from different streams, so the curves "
        "are close, not equal):\n\n" + "\n".join(rows) + "\n")


EPOCHS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help="one run (default: both, then the picture)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "awd_lstm_ptb")
    args = parser.parse_args()
    if args.layout is not None:
        run(args.layout, args.epochs, args.out)
        return
    for layout in LAYOUTS:
        subprocess.run([sys.executable, __file__, "--layout", layout, "--epochs", str(args.epochs), "--out",
                        str(args.out)], check=True)
    draw(args.out, args.epochs)


if __name__ == "__main__":
    main()
