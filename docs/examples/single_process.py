"""Train a tiny LSTM language model on one CPU process with a plain Lightning ``Trainer``.

Run it with ``python docs/examples/single_process.py``; ``tests/test_docs.py`` calls :func:`main`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_mp_lstm import LSTMLanguageModel
from lightning_mp_lstm.data import LMDataModule


def tiny_data() -> LMDataModule:
    """A few bucketed batches of the embedded synthetic language (seeded: the same on every rank)."""
    data = LMDataModule(
        source="synthetic",
        synthetic=dict(vocab_size=50, num_classes=4, mean_length=8.0, max_length=16,
                       num_train=96, num_valid=48, num_test=48),
        buckets=[8, 16],  # sentence lengths in tokens, <eos> included
        batch_size=8,  # sentences per global batch
        seed=0,
    )
    data.setup("fit")  # builds the vocabulary, so the model can be sized before fitting
    return data


def tiny_model(vocab_size: int) -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(vocab_size, embedding_dim=16, hidden_size=16, num_layers=2, optimizer="adam", lr=0.01)


def main() -> float:
    """Fit for 3 steps, validate, and return the validation loss (mean cross-entropy per real token)."""
    data = tiny_data()
    model = tiny_model(data.vocab_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    (results,) = trainer.validate(model, datamodule=data, verbose=False)
    return float(results["val/loss"])


if __name__ == "__main__":
    print(f"validation loss: {main():.4f}")
