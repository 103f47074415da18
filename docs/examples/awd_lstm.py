"""AWD-LSTM (Merity, Keskar and Socher, "Regularizing and Optimizing LSTM Language Models", 2017) as a
LightningModule, written from the paper and salesforce/awd-lstm-lm's model: embedding dropout, locked (variational)
dropout on the input, between layers and on the output, weight drop (DropConnect) on the recurrent weights, tied
embedding and decoder, and activation regularization (AR, on the last layer's dropped output) plus temporal activation
regularization (TAR, on its raw output) added to the loss.

Its forward is written out of four methods, ``embed``, ``after_lstm``, ``lm_loss`` and ``activation_penalty``, and
its declaration names them, so ``mp_lstm`` runs exactly this module's computation split into stages:

.. code-block:: python

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", embed="embed",
                          after_lstm="after_lstm", loss="lm_loss", penalty="activation_penalty",
                          time_first=True, carry_state=True)

``main()`` trains it for a few steps through the strategy with ``verify=True`` (the module's own ``training_step``
against the pipeline on the first batch); ``python docs/examples/awd_lstm.py`` too.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader

from lightning_mp_lstm import LSTMBlocks, MPLSTMStrategy

NTOKEN, BPTT, BSZ, STEPS = 60, 10, 4, 3


def embedded_dropout(embed: nn.Embedding, words: torch.Tensor, dropout: float) -> torch.Tensor:
    """Embedding dropout: whole words (rows of the embedding matrix) dropped, the rest scaled, one mask per call."""
    weight = embed.weight
    if dropout:
        mask = weight.new_empty((weight.size(0), 1)).bernoulli_(1 - dropout).expand_as(weight) / (1 - dropout)
        weight = mask * weight
    return F.embedding(words, weight, embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq,
                       embed.sparse)


class LockedDropout(nn.Module):
    """Variational dropout: one mask per sequence, the same at every time step, for (T, B, H) activations."""

    def forward(self, x: torch.Tensor, dropout: float = 0.5) -> torch.Tensor:
        if not self.training or not dropout:
            return x
        mask = x.new_empty(1, x.size(1), x.size(2)).bernoulli_(1 - dropout) / (1 - dropout)
        return mask.expand_as(x) * x


class WeightDrop(nn.Module):
    """DropConnect on an LSTM's recurrent weights: the wrapper of the original code. The raw weight is the
    parameter (``weight_hh_l0_raw``); every forward sets the dropped copy as the weight the LSTM runs with."""

    def __init__(self, module: nn.LSTM, weights: list[str], dropout: float = 0.0) -> None:
        super().__init__()
        self.module, self.weights, self.dropout = module, weights, dropout
        for name in weights:
            raw = getattr(module, name)
            del module._parameters[name]
            module.register_parameter(f"{name}_raw", nn.Parameter(raw.data))
            setattr(module, name, raw.data.clone())

    def forward(self, *args):
        for name in self.weights:
            weight = F.dropout(getattr(self.module, f"{name}_raw"), p=self.dropout, training=self.training)
            # Outside training F.dropout returns the raw Parameter itself, which setattr would register as a second
            # parameter: a view of it runs the same numbers and keeps the gradient flowing to the raw weight.
            setattr(self.module, name, weight.view_as(weight))
        return self.module(*args)


class DropConnect(nn.Module):
    """The same weight drop written with ``torch.nn.utils.parametrize`` (the parameter is
    ``parametrizations.weight_hh_l0.original``)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return F.dropout(weight, p=self.dropout, training=self.training)


class AwdLSTM(pl.LightningModule):
    """AWD-LSTM. Rates: ``dropout`` (output), ``dropouth`` (between layers), ``dropouti`` (input), ``dropoute``
    (embedding), ``wdrop`` (recurrent weights); ``alpha`` (AR) and ``beta`` (TAR); ``weight_drop``: ``"wrapper"``
    (the original ``WeightDrop``) or ``"parametrize"``."""

    def __init__(self, ntoken: int = NTOKEN, ninp: int = 12, nhid: int = 24, nlayers: int = 3, dropout: float = 0.4,
                 dropouth: float = 0.3, dropouti: float = 0.65, dropoute: float = 0.1, wdrop: float = 0.5,
                 alpha: float = 2.0, beta: float = 1.0, tie_weights: bool = True, weight_drop: str = "wrapper",
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lockdrop = LockedDropout()
        self.encoder = nn.Embedding(ntoken, ninp)
        # With tied weights the last layer is as wide as the embedding (the decoder shares its matrix).
        sizes = [(ninp if k == 0 else nhid, nhid if k != nlayers - 1 or not tie_weights else ninp)
                 for k in range(nlayers)]
        self.rnns = nn.ModuleList(self._weight_dropped(nn.LSTM(i, o, 1)) for i, o in sizes)
        self.decoder = nn.Linear(nhid, ntoken)  # its in_features is stale once tied: the weight says ninp
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.hidden = None

    def _weight_dropped(self, lstm: nn.LSTM) -> nn.Module:
        if self.hparams.weight_drop == "parametrize":
            parametrize.register_parametrization(lstm, "weight_hh_l0", DropConnect(self.hparams.wdrop))
            return lstm
        return WeightDrop(lstm, ["weight_hh_l0"], self.hparams.wdrop)

    # ----- the computation, in the pieces the declaration names ---------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = embedded_dropout(self.encoder, tokens, self.hparams.dropoute if self.training else 0.0)
        return self.lockdrop(emb, self.hparams.dropouti)

    def after_lstm(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        last = layer == self.hparams.nlayers - 1
        return self.lockdrop(output, self.hparams.dropout if last else self.hparams.dropouth)

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def activation_penalty(self, raw: torch.Tensor, dropped: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"ar": self.hparams.alpha * dropped.pow(2).mean(),
                "tar": self.hparams.beta * (raw[1:] - raw[:-1]).pow(2).mean()}

    def forward(self, tokens: torch.Tensor, hidden=None):
        x, new_hidden = self.embed(tokens), []
        for layer, rnn in enumerate(self.rnns):
            raw, h = rnn(x, None if hidden is None else hidden[layer])
            new_hidden.append(h)
            x = self.after_lstm(layer, raw)
        return self.decoder(x), new_hidden, raw, x

    # ----- Lightning ----------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        data, targets = batch
        logits, hidden, raw, dropped = self(data, None if batch_idx == 0 else self.hidden)
        self.hidden = [tuple(t.detach() for t in h) for h in hidden]
        raw_loss = self.lm_loss(logits, targets)
        penalty = self.activation_penalty(raw, dropped)
        loss = raw_loss + penalty["ar"] + penalty["tar"]
        self.log("train_loss", loss, batch_size=data.size(1))
        self.log("train_ar", penalty["ar"], batch_size=data.size(1))
        self.log("train_tar", penalty["tar"], batch_size=data.size(1))
        return loss

    def validation_step(self, batch, batch_idx):
        data, targets = batch
        logits, hidden, _, _ = self(data, None if batch_idx == 0 else self.val_hidden)
        self.val_hidden = hidden
        loss = self.lm_loss(logits, targets)
        self.log("val_loss", loss, batch_size=targets.numel())  # the mean over the split's tokens
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", embed="embed",
                          after_lstm="after_lstm", loss="lm_loss", penalty="activation_penalty",
                          time_first=True, carry_state=True)


class AwdLSTMAsWordLM(AwdLSTM):
    """The same module declared as if it were word_language_model: its blocks only. The pipeline would train a
    different model (no embedding, locked or output dropout, no AR or TAR); the strategy names what it would not
    reproduce before training, and ``verify=True`` shows the difference."""

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", time_first=True, carry_state=True)


def stream_batches(tokens: torch.Tensor, batch_size: int, bptt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """word_language_model's batchify + get_batch: the stream in ``batch_size`` columns, ``bptt``-long time-first
    windows, flat targets."""
    columns = tokens[: tokens.numel() // batch_size * batch_size].view(batch_size, -1).t().contiguous()
    return [(columns[i:i + bptt], columns[i + 1:i + 1 + bptt].reshape(-1))
            for i in range(0, columns.size(0) - 1 - bptt + 1, bptt)]


class RandomStream(pl.LightningDataModule):
    """A few time-first batches of a random token stream (what ``main`` and the verify command train on)."""

    def train_dataloader(self) -> DataLoader:
        stream = torch.randint(0, NTOKEN, (BSZ * (STEPS * BPTT + 1),), generator=torch.Generator().manual_seed(0))
        return DataLoader(stream_batches(stream, BSZ, BPTT), batch_size=None)


def main() -> float:
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(AwdLSTM(), datamodule=RandomStream())
    finally:
        strategy.shutdown()  # release this job's process group (another Trainer may follow in this process)
    return float(trainer.callback_metrics["train_loss"])


if __name__ == "__main__":
    print(f"final loss: {main():.6f}")
