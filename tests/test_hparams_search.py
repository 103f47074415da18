"""A hyperparameter search with the Optuna sweeper (``hparams_search=lstm_optuna``): train.py returns the
configured metric, and the sweeper minimizes it over the trials."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers import ONE_PROCESS, ROOT, SMALL_SYNTHETIC, TINY_RUN, run_command


def _last_value(metrics_csv: Path, name: str) -> float:
    """The last value of metric ``name`` in a CSVLogger's metrics.csv."""
    with metrics_csv.open() as handle:
        values = [row[name] for row in csv.DictReader(handle) if row.get(name)]
    return float(values[-1])


def test_the_search_config_sets_up_the_optuna_sweeper():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hparams_search=lstm_optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert (sweeper.direction, sweeper.n_jobs) == ("minimize", 1)
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert cfg.optimized_metric == "val/loss"
    params = OmegaConf.to_container(sweeper.params)
    assert set(params) == {"model.optimizer.lr", "model.dropout"}
    # Every searched key exists in the composed config (a typo would make each trial fail).
    assert all(OmegaConf.select(cfg, key) is not None for key in params)


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_optuna_sweep_returns_the_best_trials_metric(tmp_path):
    """Two tiny one-process trials: each job returns its best checkpoint's val/loss, and the sweeper reports the
    lower one as the best value (printed, and in optimization_results.yaml)."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "train.py", "-m", "hparams_search=lstm_optuna", "hydra.sweeper.n_trials=2",
            *TINY_RUN, *SMALL_SYNTHETIC, ONE_PROCESS, f"hydra.sweep.dir={sweep}"]
    result = run_command(args, timeout=160)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert set(results.best_params) == {"model.optimizer.lr", "model.dropout"}
    assert f"Best value: {results.best_value}" in out
    # What each trial returned: its evaluated (best) weights' val/loss, the last one its logger wrote.
    returned = [_last_value(sweep / str(job) / "logs" / "metrics.csv", "val/loss") for job in (0, 1)]
    assert results.best_value == pytest.approx(min(returned), rel=1e-6)
    # The two trials tried different values, each on the best checkpoint it saved.
    tried = [(sweep / str(job) / ".hydra" / "overrides.yaml").read_text() for job in (0, 1)]
    assert len({re.search(r"model\.optimizer\.lr=(\S+)", text).group(1) for text in tried}) == 2
    assert out.count("evaluated weights             best.ckpt (val/loss") == 2
