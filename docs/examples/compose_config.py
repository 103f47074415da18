"""Compose the Hydra config of ``train.py`` in Python and resolve the process layout.

``python docs/examples/compose_config.py`` prints the layout ``layout=dp2_pp2 schedule=gpipe`` asks for;
nothing is trained and no process is started.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_mp_lstm.app import ResolvedLayout, resolve_layout

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train_config(overrides: list[str]) -> DictConfig:
    """The config ``python train.py <overrides>`` would run with."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # return_hydra_config makes ${hydra:...} interpolations (checkpoint_dir) resolvable.
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


def main(overrides: list[str] | None = None) -> ResolvedLayout:
    cfg = compose_train_config(overrides if overrides is not None else ["layout=dp2_pp2", "schedule=gpipe"])
    resolved = resolve_layout(cfg)
    print(f"schedule={cfg.schedule.name} n_microbatches={cfg.schedule.n_microbatches}")
    print(
        f"data_parallel_size={resolved.data_parallel_size} "
        f"pipeline_parallel_size={resolved.pipeline_parallel_size} "
        f"stages_per_rank={resolved.stages_per_rank} devices={resolved.devices}"
    )
    return resolved


if __name__ == "__main__":
    main()
