"""The command that checks a module's declaration numerically, outside any training run::

    python -m lightning_mp_lstm.app.verify package.module:Model --data package.module:DataModule --devices 2

It builds the module and the data module (no arguments), trains one step with ``MPLSTMStrategy(verify=True)``
(:mod:`~lightning_mp_lstm.strategy.verify`: the module's own ``training_step`` on one process against the pipeline)
and prints the table; its exit status is 1 when something differs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_mp_lstm.strategy.strategy import MPLSTMStrategy
from lightning_mp_lstm.strategy.verify import VerificationError

__all__ = ["main"]


def _load(spec: str) -> Any:
    """``package.module:Name`` or ``path/to/file.py:Name``."""
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise SystemExit(f"expected package.module:Name or path/to/file.py:Name, got {spec!r}")
    if where.endswith(".py"):
        loaded = importlib.util.spec_from_file_location(f"verified_{abs(hash(where))}", where)
        if loaded is None or loaded.loader is None:
            raise SystemExit(f"cannot load {where}")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, attribute)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_mp_lstm.app.verify package.module:Model --data package.module:DataModule``: build
    both (no arguments), verify on the first training batch, print the table; exit status 1 when something differs."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mp_lstm.app.verify", description=main.__doc__)
    parser.add_argument("model", help="package.module:Class or path/file.py:Class of the LightningModule (built "
                                      "with no arguments)")
    parser.add_argument("--data", required=True, help="the LightningDataModule, the same way (no arguments)")
    parser.add_argument("--devices", type=int, default=2, help="processes (default 2: a 2-stage pipeline)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything before building the model, so every "
                                                           "process builds the same one (default 0)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an MPLSTMStrategy option (a Python literal), e.g. --option n_microbatches=2")
    args = parser.parse_args(argv)
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.option)}
    strategy = MPLSTMStrategy(verify=True, report_after_steps=None, **options)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    pl.seed_everything(args.seed, verbose=False)
    warnings.filterwarnings("ignore", ".*validation_step. but have no .val_dataloader.*")  # the check trains only
    try:
        trainer.fit(_load(args.model)(), datamodule=_load(args.data)())
    except VerificationError as error:
        if trainer.global_rank == 0:
            print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
