"""Let the autopilot choose the layout of a Trainer you build: one process, replicas or a pipeline, whichever is
predicted fastest on this machine among those that fit.

Run it as a script: ``python docs/examples/auto_layout.py``. The launching process ranks the layouts and prints the
table; where the pick has two processes, Lightning's launcher starts rank 1 by re-running this script, and there
``auto_strategy`` returns the launching process's choice without timing anything.
"""

from __future__ import annotations

import lightning.pytorch as pl
from single_process import tiny_data, tiny_model  # the sibling example (docs/examples/single_process.py)

from lightning_mp_lstm.app.autopilot import auto_strategy


def main() -> None:
    data = tiny_data()
    model = tiny_model(data.vocab_size)
    strategy, devices = auto_strategy(model, data, processes=2, timeout=120)  # up to 2 processes
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=2, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    loss = float(trainer.callback_metrics["train/loss"])
    if trainer.is_global_zero:
        print(f"trained on {devices} process(es); final loss: {loss:.6f}")


if __name__ == "__main__":
    main()
