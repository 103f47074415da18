"""An AWD-LSTM-shaped LightningModule (a ModuleList of one-layer LSTMs, tied embedding and decoder) with its
declaration, trained through the ``mp_lstm`` strategy (one process here; ``devices=2`` or more splits it).

``main()`` runs it in this process; ``python docs/examples/awd_lstm.py`` too.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp_lstm import LSTMBlocks, MPLSTMStrategy

NTOKEN, BPTT, BSZ, STEPS = 60, 10, 4, 3


class AwdLSTM(pl.LightningModule):
    def __init__(self, ntoken: int = NTOKEN, ninp: int = 12, nhid: int = 24, nlayers: int = 3):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        # The last layer is as wide as the embedding, so that the decoder can share the embedding's weight.
        self.rnns = nn.ModuleList([nn.LSTM(ninp if layer == 0 else nhid, nhid if layer != nlayers - 1 else ninp)
                                   for layer in range(nlayers)])
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight
        self.hidden = None

    def forward(self, input, hidden):
        output, new_hidden = self.encoder(input), []
        for layer, rnn in enumerate(self.rnns):
            output, h = rnn(output, None if hidden is None else hidden[layer])
            new_hidden.append(h)
        return self.decoder(output), new_hidden

    def training_step(self, batch, batch_idx):
        data, targets = batch
        logits, hidden = self(data, None if batch_idx == 0 else self.hidden)
        self.hidden = [tuple(t.detach() for t in h) for h in hidden]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", time_first=True, carry_state=True)


def main() -> float:
    torch.manual_seed(0)
    stream = torch.randint(0, NTOKEN, (BSZ * (STEPS * BPTT + 1),), generator=torch.Generator().manual_seed(0))
    data = stream.view(BSZ, -1).t().contiguous()
    loader = DataLoader([(data[i:i + BPTT], data[i + 1:i + 1 + BPTT].reshape(-1))
                         for i in range(0, STEPS * BPTT, BPTT)], batch_size=None)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(AwdLSTM(), train_dataloaders=loader)
    finally:
        strategy.shutdown()  # release this job's process group (another Trainer may follow in this process)
    return float(trainer.callback_metrics["train_loss"])


if __name__ == "__main__":
    print(f"final loss: {main():.6f}")
