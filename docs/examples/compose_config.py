"""Compose the Hydra config of ``train.py`` in Python and resolve its process layout the way ``train()`` does.

``python docs/examples/compose_config.py`` prints the layout ``layout=dp2_pp2 schedule.name=GPipe`` asks for:
the strategy comes from the ``strategy`` group (its arguments interpolated from ``layout``, ``schedule`` and
``partition``), the model is built on the meta device (no memory), ``strategy.processes_for(model)`` gives the
Trainer's devices, and building the Trainer resolves the layout. Nothing is trained and no process is started.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_mp_lstm import ParallelLayout
from lightning_mp_lstm.app.training import build_model, build_strategy, build_trainer

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train_config(overrides: list[str]) -> DictConfig:
    """The config ``python train.py <overrides>`` would run with."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # ${hydra:runtime.output_dir} exists only inside a Hydra run: name the run directory here (nothing is
        # written to it).
        return compose(config_name="train", overrides=["paths.output_dir=outputs/composed", *overrides])


def main(overrides: list[str] | None = None) -> ParallelLayout:
    overrides = overrides if overrides is not None else ["layout=dp2_pp2", "schedule.name=GPipe"]
    # CPU processes, so that this runs anywhere: the layout does not depend on the device.
    cfg = compose_train_config(["trainer.accelerator=cpu", *overrides])
    strategy = build_strategy(cfg)  # MPLSTMStrategy(data_parallel_size=2, pipeline_parallel_size=2, ...)
    model = build_model(cfg, strategy, vocab_size=1000)  # on the meta device
    print(f"processes for this model: {strategy.processes_for(model)}")
    trainer = build_trainer(cfg, strategy, model)  # devices per node from processes_for; resolves the layout
    layout = strategy.layout
    print(f"schedule={layout.schedule} n_microbatches={layout.n_microbatches}")
    print(
        f"data_parallel_size={layout.data_parallel_size} pipeline_parallel_size={layout.pipeline_parallel_size} "
        f"stages_per_rank={layout.stages_per_rank} processes={layout.world_size} "
        f"(devices={trainer.num_devices} x num_nodes={trainer.num_nodes})"
    )
    return layout


if __name__ == "__main__":
    main()
