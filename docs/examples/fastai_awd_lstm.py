"""fastai's own ``AWD_LSTM`` (``pip install fastai``), trained as fastai's language-model learner trains it, declared
for ``mp_lstm`` as it is: its ``EmbeddingDropout``, input and hidden ``RNNDropout``, ``WeightDropout``-wrapped LSTMs
(a non-leaf weight kept as an attribute: the module cannot be deep-copied), the tied ``LinearDecoder`` with its output
dropout, AR and TAR (fastai's ``RNNRegularizer``) and the hidden state it carries across batches.

Check the declaration against the module's own ``training_step`` on two processes::

    python -m lightning_mp_lstm.app.verify docs/examples/fastai_awd_lstm.py:FastaiAwdLM \\
        --data docs/examples/fastai_awd_lstm.py:RandomBatches --devices 2

The module logs ``train_loss`` as fastai reports it, the cross-entropy without AR and TAR; the pipeline's own
``train_loss`` is what is optimized (with them), so the check finds the quantity the module means and the pipeline logs
that under ``train_loss`` (and the objective as ``train_objective``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from fastai.text.models.awdlstm import AWD_LSTM
from fastai.text.models.core import LinearDecoder
from torch.utils.data import DataLoader

from lightning_mp_lstm import LSTMBlocks

VOCAB, EMBEDDING, HIDDEN, LAYERS, ROWS, LENGTH, STEPS = 50, 8, 12, 3, 6, 10, 4


class FastaiAwdLM(pl.LightningModule):
    """fastai's ``AWD_LSTM`` and ``LinearDecoder`` with its default language-model dropouts times ``drop_mult``."""

    def __init__(self, drop_mult: float = 1.0, alpha: float = 2.0, beta: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = AWD_LSTM(VOCAB, EMBEDDING, HIDDEN, LAYERS, pad_token=1, hidden_p=0.15 * drop_mult,
                                input_p=0.25 * drop_mult, embed_p=0.02 * drop_mult, weight_p=0.2 * drop_mult)
        self.decoder = LinearDecoder(VOCAB, EMBEDDING, 0.1 * drop_mult, tie_encoder=self.encoder.encoder)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits, raw, dropped = self.decoder(self.encoder(tokens))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)  # as fastai's learner reports it: AR and TAR apart
        return loss + self.regularizer(raw, dropped)

    def regularizer(self, raw, dropped):
        """fastai's ``RNNRegularizer``: AR on the dropped output, TAR on the raw one."""
        return (self.hparams.alpha * dropped.float().pow(2).mean()
                + self.hparams.beta * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    # ----- the declaration: fastai's modules, named where they run ----------------------------------------------
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder.encoder", lstm="encoder.rnns", decoder="decoder.decoder", embed="embed",
                          after_lstm="after_lstm", penalty="regularizer", carry_state=True)

    def embed(self, tokens):
        return self.encoder.input_dp(self.encoder.encoder_dp(tokens))

    def after_lstm(self, layer, output):
        return self.encoder.hidden_dps[layer](output) if layer < LAYERS - 1 else self.decoder.output_dp(output)


class RandomBatches(pl.LightningDataModule):
    """A few batch-first batches of one random token stream, consecutive in each row (carried state means something)."""

    def train_dataloader(self) -> DataLoader:
        stream = torch.randint(0, VOCAB, (ROWS, STEPS * LENGTH + 1), generator=torch.Generator().manual_seed(0))
        batches = [(stream[:, i * LENGTH:(i + 1) * LENGTH].contiguous(),
                    stream[:, i * LENGTH + 1:(i + 1) * LENGTH + 1].contiguous()) for i in range(STEPS)]
        return DataLoader(batches, batch_size=None)
