"""What the benchmark scripts share: the repository root, the PTB files, the model configs, quiet ranks, and paths
stored in results relative to the repository.

Light to import (no torch): ``benchmarks/run.py --render`` loads it too.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "conf" / "model"


def ptb_dir() -> Path:
    """The directory with ``ptb.valid.txt`` and ``ptb.test.txt`` (see :func:`lightning_mp_lstm.base.testing.ptb_dir`).

    Returns:
        ``$LIGHTNING_MP_LSTM_PTB_DIR`` when it is set, else the repository's ``data/ptb``.

    Raises:
        FileNotFoundError: when either file is missing there.
    """
    from lightning_mp_lstm.base.testing import ptb_dir as find

    return find(ROOT)


def ptb_paths() -> dict[str, str]:
    """``LMDataModule``'s ``train``/``valid``/``test`` paths for the benchmarks: train on ``ptb.valid.txt``,
    validate and test on ``ptb.test.txt`` (the only PTB files the benchmarks need)."""
    ptb = ptb_dir()
    return {"train": str(ptb / "ptb.valid.txt"), "valid": str(ptb / "ptb.test.txt"), "test": str(ptb / "ptb.test.txt")}


def model_config(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``conf/model/<name>.yaml`` as keyword arguments of ``LSTMLanguageModel``.

    Args:
        name: a model config of ``conf/model``.
        overrides: keyword arguments that replace the config's.

    Returns:
        The config without Hydra's ``_target_``, updated with ``overrides``.
    """
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(MODELS_DIR / f"{name}.yaml"))
    assert isinstance(config, dict)
    config.pop("_target_", None)
    # Plain values (job specs travel to the ranks and into the results): the optimizer partial as the model's
    # optimizer name and learning rate, an exponential scheduler as its per-epoch decay.
    optimizer = config.pop("optimizer", None) or {}
    if optimizer:
        config |= {"optimizer": optimizer["_target_"].rsplit(".", 1)[-1].lower(), "lr": optimizer["lr"]}
    scheduler = config.pop("scheduler", None) or {}
    if scheduler:
        config["lr_decay"] = scheduler["gamma"]
    return {**config, **overrides}


def quiet() -> None:
    """Silence warnings and Lightning's informational logging in this process (rank output would drown the
    benchmark's own lines)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_mp_lstm"):
        logging.getLogger(name).setLevel(logging.ERROR)


def stored_path(path: Path) -> str:
    """``path`` as results store it: relative to the repository when inside it, so the JSON holds in any checkout.

    Args:
        path: a file the benchmarks wrote.

    Returns:
        The repository-relative path, or the absolute one for a file outside the repository.
    """
    path = path.resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def resolve_stored(path: str) -> Path:
    """The file a path stored by :func:`stored_path` names.

    Args:
        path: a stored path.

    Returns:
        ``path`` itself when absolute, else the path under the repository root.
    """
    p = Path(path)
    return p if p.is_absolute() else ROOT / p
