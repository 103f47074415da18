"""Train a bucketed LSTM language model: ``python train.py [group=option ...] [key=value ...]``."""

import atexit
import gc

import hydra
from omegaconf import DictConfig

from lightning_mp_lstm.app.training import exit_when_stopped, metric_value, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Train; return the value of ``optimized_metric`` when a sweep sets it (``python train.py -m
    hparams_search=lstm_optuna``: ``val/loss``, which the sweeper minimizes), else ``None``. A run stopped by
    ``SIGTERM``, Ctrl-C or ``SIGHUP`` saves a checkpoint, prints how to resume and exits with 128 + the signal's
    number."""
    with exit_when_stopped():
        return metric_value(train(cfg), cfg.get("optimized_metric"))


if __name__ == "__main__":
    # Registered first, so it runs last of the exit handlers: the interpreter's final collections then skip the
    # objects torch and Lightning built, which took them over a second at every exit (each rank's, and the run's end).
    atexit.register(gc.freeze)
    main()
