"""Train the tiny model as a two-stage pipeline on two CPU processes.

Run it as a script: ``python docs/examples/pipeline_two_ranks.py``. Lightning's launcher starts rank 1
by re-running this script; both ranks build the same (seeded) data and model.
"""

from __future__ import annotations

import lightning.pytorch as pl
from single_process import tiny_data, tiny_model  # the sibling example (docs/examples/single_process.py)

from lightning_mp_lstm import MPLSTMStrategy


def main() -> None:
    data = tiny_data()
    model = tiny_model(data.vocab_size)
    strategy = MPLSTMStrategy(
        pipeline_parallel_size=2,  # stage 0: embedding, lstm.0 | stage 1: lstm.1, decoder (even split)
        schedule="1F1B",
        n_microbatches=2,  # each batch of 8 sentences runs as 2 microbatches of 4
        timeout=120,  # a crashed rank ends the run instead of hanging it
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    # Every rank sees the global loss (it is broadcast from the last stage); print it once.
    loss = float(trainer.callback_metrics["train/loss"])
    if trainer.is_global_zero:
        print(f"final loss: {loss:.6f}")


if __name__ == "__main__":
    main()
