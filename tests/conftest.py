"""Shared fixtures. Helpers that are plain functions and classes live in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.helpers import ROOT, ptb_dir


def pytest_configure(config: pytest.Config) -> None:
    # One thread per process: in-process references and spawned ranks share 2 cores.
    torch.set_num_threads(1)


@pytest.fixture
def ptb() -> Path:
    """The PTB directory (fails, never skips, when the files are missing)."""
    return ptb_dir()


@pytest.fixture
def compose_train(tmp_path: Path) -> Callable[..., DictConfig]:
    """Compose ``conf/train.yaml`` with overrides, checkpoints under this test's ``tmp_path``."""

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="train", overrides=[f"checkpoint_dir={tmp_path}/checkpoints", *overrides])

    return _compose
