"""Every option of every group in conf/ composes with its values and instantiates; layouts resolve through the
strategy, and conflicting groups fail before anything is launched."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hydra
import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from lightning_mp_lstm import DivergenceGuard, LayoutError, MPLSTMStrategy, PartitionError
from lightning_mp_lstm.app.training import (
    build_model,
    build_strategy,
    build_trainer,
    instantiate_callbacks,
    instantiate_loggers,
)
from lightning_mp_lstm.checkpoint import RunCheckpoint
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.timeline import PipelineTimeline

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((CONF / group).glob("*.yaml"))]
MANDATORY = {  # options whose configs hold ??? values a user must give
    ("partition", "manual"): ["partition.stages=[[embedding,lstm.0],[lstm.1,decoder]]"],
    ("data", "wikitext"): ["data.path=/nonexistent"],
    ("data", "text"): ["data.train=a", "data.valid=b", "data.test=c"],
}
VOCAB = 50
MXNET2 = [["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"], ["lstm.4", "lstm.5", "lstm.6", "lstm.7", "decoder"]]
RUN = Path(tempfile.gettempdir()) / "run"  # nothing is written there: paths are only composed and compared
CHECKPOINTS = str(RUN / "checkpoints")

#: What each option composes to: dotted keys of the composed config and their values.
EXPECTED: dict[tuple[str, str], dict[str, Any]] = {
    ("buckets", "auto"): {"buckets.lengths": "auto", "buckets.num_buckets": 5, "data.buckets": "auto",
                          "data.max_bucket_length": "auto"},
    ("buckets", "mxnet"): {"buckets.lengths": [8, 16, 24, 32, 60], "data.num_auto_buckets": None,
                           "data.max_bucket_length": None},
    ("buckets", "none"): {"buckets.lengths": None, "data.buckets": None, "data.max_bucket_length": "auto"},
    ("callbacks", "default"): {"callbacks.model_checkpoint.monitor": "val/loss",
                               "callbacks.progress_bar.refresh_rate": 10, "callbacks.timeline.steps": [2, 3],
                               "callbacks.divergence.max_loss": 100.0},
    ("callbacks", "divergence"): {"callbacks.divergence._target_": "lightning_mp_lstm.DivergenceGuard",
                                  "callbacks.divergence.patience": None, "callbacks.model_checkpoint": None},
    ("callbacks", "model_checkpoint"): {"callbacks.model_checkpoint.dirpath": CHECKPOINTS,
                                        "callbacks.model_checkpoint.save_last": True, "callbacks.progress_bar": None},
    ("callbacks", "none"): {"callbacks": {}},
    ("callbacks", "progress_bar"): {"callbacks.progress_bar._target_": "lightning.pytorch.callbacks.TQDMProgressBar",
                                    "callbacks.model_checkpoint": None},
    ("callbacks", "timeline"): {"callbacks.timeline._target_": "lightning_mp_lstm.timeline.PipelineTimeline",
                                "callbacks.timeline.directory": str(RUN),
                                "callbacks.model_checkpoint": None},
    ("data", "ptb"): {"data.source": "ptb", "data.batch_size": 20, "data.download": False, "data.seed": 0},
    ("data", "synthetic"): {"data.source": "synthetic", "data.batch_size": 32, "data.synthetic.num_train": 80000,
                            "data.synthetic.vocab_size": 1000},
    ("data", "text"): {"data.source": "text", "data.train": "a", "data.batch_size": 20},
    ("data", "wikitext"): {"data.source": "wikitext", "data.path": "/nonexistent",
                           "data.long_sentence_policy": "split"},
    ("experiment", "mxnet2"): {"model.num_layers": 8, "model.hidden_size": 400, "model.embedding_dim": 200,
                               "partition.stages": MXNET2, "strategy.partition": MXNET2,
                               "strategy.pipeline_parallel_size": "auto", "schedule.name": "1F1B"},
    ("experiment", "wt103"): {"data.source": "wikitext", "model.embedding_dim": 400, "model.hidden_size": 1024,
                              "model.num_layers": 4, "model.softmax": "adaptive", "strategy.pipeline_parallel_size": 2},
    ("experiment", "pp2_v2"): {"layout.pipeline_parallel_size": 2, "layout.stages_per_rank": 2,
                               "schedule.name": "Interleaved1F1B", "strategy.stages_per_rank": 2,
                               "strategy.schedule": "Interleaved1F1B"},
    # Its hydra.sweeper settings: tests/test_hparams_search.py (compose() leaves out the hydra node).
    ("hparams_search", "lstm_optuna"): {"optimized_metric": "val/loss", "model.optimizer.lr": 0.005},
    ("layout", "auto"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": "auto",
                         "strategy.stages_per_rank": None, "layout.processes": "auto"},
    ("layout", "dp2"): {"strategy.data_parallel_size": 2, "strategy.pipeline_parallel_size": 1},
    ("layout", "dp2_pp2"): {"strategy.data_parallel_size": 2, "strategy.pipeline_parallel_size": 2},
    ("layout", "pp2"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": 2},
    ("layout", "pp4"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": 4},
    ("layout", "single"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": 1},
    ("layout", "tp2"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": 1,
                        "strategy.tensor_parallel_size": 2},
    ("layout", "pp2_tp2"): {"strategy.data_parallel_size": 1, "strategy.pipeline_parallel_size": 2,
                            "strategy.tensor_parallel_size": 2},
    ("layout", "dp2_tp2"): {"strategy.data_parallel_size": 2, "strategy.pipeline_parallel_size": 1,
                            "strategy.tensor_parallel_size": 2},
    ("logger", "csv"): {"logger.csv.name": "logs", "logger.csv.version": "",
                        "logger.csv.save_dir": str(RUN)},
    ("logger", "tensorboard"): {"logger.tensorboard.name": "tensorboard", "logger.tensorboard.save_dir": str(RUN),
                                "logger.csv": None},
    ("model", "medium"): {"model.embedding_dim": 650, "model.hidden_size": 650, "model.num_layers": 2,
                          "model.dropout": 0.5, "model.scheduler.gamma": 0.83},
    ("model", "mxnet_ptb"): {"model.embedding_dim": 200, "model.hidden_size": 400, "model.num_layers": 8,
                             "model.init_range": 0.1},
    ("model", "small"): {"model.embedding_dim": 200, "model.hidden_size": 200,
                         "model.optimizer._target_": "torch.optim.SGD", "model.optimizer.lr": 20.0,
                         "model.scheduler._target_": "torch.optim.lr_scheduler.ExponentialLR"},
    ("model", "tiny"): {"model.embedding_dim": 128, "model.hidden_size": 128,
                        "model.optimizer._target_": "torch.optim.Adam", "model.optimizer.lr": 0.005,
                        "model.scheduler": None},
    ("paths", "default"): {"paths.output_dir": str(RUN), "paths.checkpoint_dir": CHECKPOINTS, "paths.log_dir": str(RUN),
                           "callbacks.model_checkpoint.dirpath": CHECKPOINTS},
    ("partition", "balanced"): {"strategy.partition": "balanced", "strategy.balance_by": "time",
                                "strategy.stage_speeds": None},
    **{("partition", f"balanced{n}"): {"strategy.partition": f"balanced{n}", "strategy.balance_by": "time",
                                       "strategy.stage_speeds": None} for n in range(2, 9)},
    ("partition", "even"): {"strategy.partition": "even", "strategy.balance_by": "time"},
    ("partition", "manual"): {"strategy.partition": [["embedding", "lstm.0"], ["lstm.1", "decoder"]]},
    ("partition", "per_layer"): {"strategy.partition": "per_block"},
    ("schedule", "default"): {"strategy.schedule": "1F1B", "strategy.n_microbatches": None,
                              "strategy.time_chunks": None},
    ("schedule", "wavefront"): {"strategy.schedule": "Wavefront", "strategy.n_microbatches": 1,
                                "strategy.time_chunks": "auto"},
    ("strategy", "mp_lstm"): {"strategy._target_": "lightning_mp_lstm.MPLSTMStrategy", "strategy.timeout": 300.0,
                              "strategy.report_after_steps": 5, "strategy.num_threads": "auto",
                              "strategy.checkpoint_format": "auto"},
    ("trainer", "ci"): {"trainer.max_epochs": 1, "trainer.limit_train_batches": 4, "trainer.limit_val_batches": 2,
                        "trainer.enable_progress_bar": False, "trainer.devices": None},
    ("trainer", "default"): {"trainer.devices": None, "trainer.num_nodes": 1, "trainer.gradient_clip_val": 0.25,
                             "trainer.enable_progress_bar": True, "trainer.precision": "32-true"},
}


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # ${hydra:runtime.output_dir} (paths.output_dir) exists only inside a Hydra run: name the directory here.
        return compose(config_name="train", overrides=[f"paths.output_dir={RUN}", *overrides])


def _own_values(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> values of a config file (defaults lists, ??? and interpolations left out)."""
    out: dict[str, Any] = {}
    for key in node:
        if key == "defaults" or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if isinstance(value, DictConfig):
            out.update(_own_values(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return out


def test_every_group_and_option_is_covered():
    assert set(GROUPS) == {"model", "data", "buckets", "partition", "schedule", "layout", "strategy", "callbacks",
                           "logger", "trainer", "experiment", "paths", "hparams_search"}
    assert set(EXPECTED) == set(OPTIONS)


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_with_its_values_and_instantiates(group, option):
    given = MANDATORY.get((group, option), [])
    cfg = _compose(f"{group}={option}", *given)
    # The file's own values arrive in the composed config, under its package (the group, or the root).
    path = CONF / group / f"{option}.yaml"
    root = "# @package _global_" in path.read_text()
    given_keys = {o.split("=", 1)[0] for o in given}
    for key, value in _own_values(OmegaConf.load(path), "" if root else f"{group}.").items():
        if key not in given_keys and not key.startswith("hydra."):  # compose() leaves out the hydra node
            assert OmegaConf.select(cfg, key) == value, (key, value)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    for key, value in EXPECTED[(group, option)].items():
        got = OmegaConf.select(cfg, key)
        assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value, key

    # Everything with a _target_ instantiates.
    strategy = hydra.utils.instantiate(cfg.strategy)
    assert isinstance(strategy, MPLSTMStrategy)
    model = build_model(cfg, strategy, VOCAB)
    assert model.hparams.num_layers == cfg.model.num_layers and model.hparams.vocab_size == VOCAB
    assert pipeline_model(model).block_names[-1] == "decoder"
    assert {p.device.type for p in model.parameters()} == {"meta"}  # nothing allocated yet
    callbacks = instantiate_callbacks(cfg.get("callbacks"), cfg.trainer)
    loggers = instantiate_loggers(cfg.get("logger"))
    trainer = hydra.utils.instantiate(cfg.trainer, devices=1, accelerator="cpu", callbacks=callbacks,
                                      logger=loggers or False)
    assert trainer.max_epochs == cfg.trainer.max_epochs
    assert trainer.num_devices == 1
    names = set(cfg.callbacks or {})
    checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    if "model_checkpoint" in names:
        assert [(c.dirpath, c.monitor, c.save_last) for c in checkpoints] == [(CHECKPOINTS, "val/loss", True)]
    assert (trainer.progress_bar_callback is not None) == cfg.trainer.enable_progress_bar
    if "progress_bar" in names and cfg.trainer.enable_progress_bar:
        assert isinstance(trainer.progress_bar_callback, TQDMProgressBar)
    timelines = [c for c in trainer.callbacks if isinstance(c, PipelineTimeline)]
    expected = [(RUN, {2, 3})] if "timeline" in names else []
    assert [(c.directory.resolve(), c.steps) for c in timelines] == [(d.resolve(), s) for d, s in expected]
    kinds = {"csv": CSVLogger, "tensorboard": TensorBoardLogger}
    assert [type(logger) for logger in trainer.loggers] == [kinds[name] for name in cfg.logger]
    for logger in trainer.loggers:
        assert Path(logger.log_dir).resolve() == (RUN / logger.name).resolve()


def test_ci_trainer_drops_the_progress_bar_callback():
    cfg = _compose("trainer=ci")
    callbacks = instantiate_callbacks(cfg.callbacks, cfg.trainer)
    assert [type(c) for c in callbacks] == [RunCheckpoint, PipelineTimeline, DivergenceGuard]
    assert [type(c) for c in instantiate_callbacks(cfg.callbacks)] == [RunCheckpoint, TQDMProgressBar,
                                                                        PipelineTimeline, DivergenceGuard]


def test_callbacks_and_loggers_can_be_added_or_removed_from_the_command_line():
    cfg = _compose("+callbacks.summary._target_=lightning.pytorch.callbacks.ModelSummary",
                   "+callbacks.summary.max_depth=2")
    built = instantiate_callbacks(cfg.callbacks)
    assert [type(c).__name__ for c in built] == ["RunCheckpoint", "TQDMProgressBar", "PipelineTimeline",
                                                 "DivergenceGuard", "ModelSummary"]
    cfg = _compose("~callbacks.timeline")
    assert [type(c).__name__ for c in instantiate_callbacks(cfg.callbacks)] == ["RunCheckpoint", "TQDMProgressBar",
                                                                                "DivergenceGuard"]
    cfg = _compose("~logger", "~callbacks")
    assert instantiate_loggers(cfg.get("logger")) == [] and instantiate_callbacks(cfg.get("callbacks")) == []


# ----- layouts, resolved by the strategy -------------------------------------------------------------------
def _resolve(*overrides: str) -> tuple[MPLSTMStrategy, pl.LightningModule, pl.Trainer]:
    """What train() does up to its pre-launch checks, without data: strategy, meta model, devices, Trainer."""
    cfg = _compose("trainer.accelerator=cpu", *overrides)
    strategy = build_strategy(cfg)
    model = build_model(cfg, strategy, VOCAB)
    trainer = build_trainer(cfg, strategy, model)
    batch = SimpleNamespace(batch_size=32, mean_padded_length=20.0, bucket_lengths=[20])  # as LMDataModule says
    strategy.check(model, batch)
    return strategy, model, trainer


@pytest.mark.parametrize(
    "overrides, expected, devices",
    [
        ([], (1, 2, 1), 2),  # python train.py: a 2-stage pipeline
        (["partition=balanced2"], (1, 2, 1), 2),
        (["partition=balanced4"], (1, 4, 1), 4),  # python train.py partition=balanced4: 4 stages, 4 processes
        (["partition=balanced3", "model.num_layers=4", "schedule.n_microbatches=4"], (1, 3, 1), 3),
        (["partition=balanced4", "layout=pp4"], (1, 4, 1), 4),
        (["partition=balanced4", "layout=pp2", "schedule.name=Interleaved1F1B"], (1, 2, 2), 2),
        (["partition=balanced4", "layout.data_parallel_size=2"], (2, 4, 1), 8),
        (["layout=single"], (1, 1, 1), 1),
        (["layout=dp2"], (2, 1, 1), 2),
        (["layout=pp2"], (1, 2, 1), 2),
        (["layout=pp4"], (1, 4, 1), 4),
        (["layout=dp2_pp2"], (2, 2, 1), 4),
        (["experiment=pp2_v2"], (1, 2, 2), 2),
        (["experiment=pp2_v2", "schedule.name=ZBVZeroBubble"], (1, 2, 2), 2),
        (["layout=pp2", "schedule.name=Interleaved1F1B"], (1, 2, 2), 2),  # stages per process follow the schedule
        (["layout=pp2", "schedule.name=GPipe"], (1, 2, 1), 2),
        (["layout=pp2", "schedule=wavefront"], (1, 2, 1), 2),  # one stage per process unless the layout says more
        (["layout=pp2", "schedule=wavefront", "layout.stages_per_rank=2", "schedule.time_chunks=4"], (1, 2, 2), 2),
        (["trainer.devices=2"], (1, 2, 1), 2),
        (["experiment=mxnet2"], (1, 2, 1), 2),  # the partition's two stages make two processes
        (["trainer.devices=2", "experiment=mxnet2"], (1, 2, 1), 2),
        (["experiment=mxnet2", "layout.data_parallel_size=2"], (2, 2, 1), 4),
        (["layout=pp4", "partition=balanced"], (1, 4, 1), 4),
        (["partition=balanced", "layout.processes=2"], (1, 2, 1), 2),  # without the autopilot: `processes`
        (["partition=even", "layout.processes=2"], (1, 2, 1), 2),
        (["partition=per_layer"], (1, 4, 1), 4),  # tiny: 2 LSTM layers + embedding + decoder
        (["partition=per_layer", "model.num_layers=6"], (1, 8, 1), 8),
        (["partition=manual", "partition.stages=[[embedding,lstm.0],[lstm.1,decoder]]"], (1, 2, 1), 2),
        (["trainer.devices=1", "trainer.num_nodes=2", "layout=pp2"], (1, 2, 1), 1),
        (["trainer.num_nodes=2", "layout=dp2_pp2"], (2, 2, 1), 2),  # devices count processes per node
        (["layout=tp2"], (1, 1, 1), 2),
        (["layout=pp2_tp2"], (1, 2, 1), 4),
        (["layout=dp2_tp2"], (2, 1, 1), 4),
        (["layout=pp2", "layout.tensor_parallel_size=2", "trainer.num_nodes=2"], (1, 2, 1), 2),
    ],
)
def test_layouts_resolve_through_the_strategy(overrides, expected, devices):
    strategy, model, trainer = _resolve(*overrides)
    layout = strategy.layout
    assert (layout.data_parallel_size, layout.pipeline_parallel_size, layout.stages_per_rank) == expected
    tensor = next((int(o.rsplit("=", 1)[1]) for o in overrides if "tensor_parallel_size=" in o),
                  2 if any(o.startswith("layout=") and o.endswith("tp2") for o in overrides) else 1)
    assert layout.tensor_parallel_size == tensor
    assert trainer.num_devices == devices  # processes per node
    assert layout.world_size == devices * trainer.num_nodes
    needed = strategy.processes_for(model)
    assert needed in (None, layout.world_size)


def test_processes_for_is_unknown_only_when_nothing_decides_it():
    for overrides in ([], ["partition=balanced"], ["trainer.devices=2"]):
        cfg = _compose(*overrides)
        strategy = hydra.utils.instantiate(cfg.strategy)
        assert strategy.processes_for(build_model(cfg, strategy, VOCAB)) is None


def test_experiment_choices_yield_to_the_command_line():
    cfg = _compose("experiment=pp2_v2", "layout=dp2_pp2")
    assert (cfg.layout.data_parallel_size, cfg.layout.pipeline_parallel_size, cfg.layout.stages_per_rank) == (2, 2, 2)
    cfg = _compose("experiment=mxnet2", "model=small")
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (2, 200) and cfg.partition.stages[0][0] == "embedding"
    # The experiment's own values win over a group's file, but not over a value on the command line.
    cfg = _compose("experiment=mxnet2", "partition.stages=even")
    assert cfg.partition.stages == "even" and cfg.model.num_layers == 8


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["layout=pp2", "partition=per_layer"], PartitionError,
         r"partition 'per_block' puts each of the 4 blocks on its own stage, but the layout has 2 stages"),
        (["layout=pp2", "partition=balanced4"], PartitionError,
         r"partition 'balanced4' asks for 4 pipeline stages, but the layout has 2 \(pipeline_parallel_size=2 x "
         r"stages_per_rank=1\); use partition 'balanced' to follow the layout"),
        (["partition=balanced8"], PartitionError, r"the layout has 8 pipeline stages .* but the model has 4 blocks"),
        (["layout=dp2_pp2", "trainer.devices=2"], LayoutError,
         r"the layout needs data_parallel_size=2 x pipeline_parallel_size=2 = 4 processes .*world size is 2"),
        (["experiment=pp2_v2", "schedule.name=1F1B"], LayoutError,
         r"schedule 1F1B runs one stage per rank, but stages_per_rank=2"),
        (["layout=pp2", "layout.stages_per_rank=1", "schedule.name=Interleaved1F1B"], LayoutError,
         r"multi-stage schedule and needs stages_per_rank >= 2"),
        (["trainer.devices=4", "experiment=mxnet2"], PartitionError, r"the partition has 2 stages but num_stages=4"),
        (["layout=pp2", "+schedule.time_chunks=4"], LayoutError,
         r"time_chunks=4 splits the time axis, which only schedule Wavefront does; schedule 1F1B splits the batch"),
        (["layout=pp2", "schedule=wavefront", "schedule.time_chunks=0"], LayoutError,
         r"time_chunks must be a positive integer, None or 'auto', got 0"),
        (["layout=pp2", "schedule.name=GPipe", "+schedule.time_chunks=auto"], LayoutError,
         r"time_chunks='auto' splits the time axis, which only schedule Wavefront does; schedule GPipe"),
        (["layout=pp2", "schedule=wavefront", "schedule.time_chunks=21"], LayoutError,
         r"time_chunks=21 splits every batch's time axis into 21 chunks, but the shortest bucket has 20 steps "
         r"\(buckets \[20\]\); allowed: 1 to 20, or 'auto'"),
        (["layout=pp2", "trainer.num_nodes=4"], LayoutError,
         r"the layout needs 2 processes, which cannot be spread evenly over trainer.num_nodes=4"),
    ],
)
def test_conflicts_are_clear_errors_before_any_launch(overrides, error, message):
    with pytest.raises(error, match=message):
        _resolve(*overrides)
