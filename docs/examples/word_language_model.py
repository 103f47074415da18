"""PyTorch's word_language_model (LSTM) in a LightningModule, trained as a 2-stage pipeline with one declaration.

Run it as a script: ``python docs/examples/word_language_model.py``. Lightning's launcher starts rank 1 by re-running
this script. The module is written as pytorch/examples writes ``RNNModel``: time-first batches from ``batchify``,
flat targets, log-softmax + NLL, the hidden state carried from window to window. ``configure_pipeline`` is the only
addition; the pipelined checkpoint then loads into the plain module.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp_lstm import LSTMBlocks, MPLSTMStrategy

NTOKEN, BPTT, BSZ, STEPS = 50, 7, 8, 4


class RNNModel(pl.LightningModule):
    def __init__(self, ntoken: int = NTOKEN, ninp: int = 16, nhid: int = 16, nlayers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.hidden = None

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def training_step(self, batch, batch_idx):  # used without mp_lstm; under it, the strategy runs the step
        data, targets = batch
        if batch_idx == 0:
            self.hidden = None
        output, hidden = self(data, self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)
        loss = F.nll_loss(output, targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=20.0)

    # The declaration mp_lstm needs (the only change to the module).
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", dropout="drop", loss="nll",
                          time_first=True, carry_state=True)


def batches() -> DataLoader:
    """word_language_model's ``batchify`` and ``get_batch`` over a random token stream."""
    stream = torch.randint(0, NTOKEN, (BSZ * (STEPS * BPTT + 1),), generator=torch.Generator().manual_seed(0))
    data = stream.view(BSZ, -1).t().contiguous()  # (T, B)
    return DataLoader([(data[i:i + BPTT], data[i + 1:i + 1 + BPTT].reshape(-1))
                       for i in range(0, STEPS * BPTT, BPTT)], batch_size=None)


def main() -> None:
    torch.manual_seed(0)
    model = RNNModel()
    trainer = pl.Trainer(strategy=MPLSTMStrategy(pipeline_parallel_size=2, n_microbatches=2, timeout=120),
                         accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=batches())
    directory = Path(trainer.strategy.broadcast(tempfile.mkdtemp() if trainer.is_global_zero else None))
    trainer.save_checkpoint(directory / "rnn.ckpt")  # one file, gathered on rank 0, the plain module's names
    if trainer.is_global_zero:
        plain = RNNModel()
        plain.load_state_dict(torch.load(directory / "rnn.ckpt", weights_only=False)["state_dict"], strict=True)
        shutil.rmtree(directory)
        print(f"final loss: {float(trainer.callback_metrics['train_loss']):.6f}")
        print(f"checkpoint loads into the plain RNNModel: {len(plain.state_dict())} tensors")


if __name__ == "__main__":
    main()
