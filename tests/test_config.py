"""Every file in conf/ composes, and its objects instantiate; layouts resolve to process counts."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_mp_lstm.app import _partition_option, _strategy, resolve_layout
from lightning_mp_lstm.layout import LayoutError, ParallelLayout

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((CONF / group).glob("*.yaml"))]
MANDATORY = {  # options whose configs hold ??? values a user must give
    ("partition", "manual"): ["partition.stages=[[embedding,lstm.0],[lstm.1,decoder]]"],
    ("data", "wikitext"): ["data.path=/nonexistent"],
    ("data", "text"): ["data.train=a", "data.valid=b", "data.test=c"],
}


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # ${hydra:runtime.output_dir} exists only inside a Hydra run: name the directory here.
        return compose(config_name="train", overrides=["checkpoint_dir=checkpoints", *overrides])


def test_every_group_is_covered():
    assert set(GROUPS) == {"model", "data", "buckets", "partition", "schedule", "layout", "trainer"}
    assert len(OPTIONS) >= 30


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_resolves(group, option):
    cfg = _compose(f"{group}={option}", *MANDATORY.get((group, option), []))
    # The option's own values arrive in the composed config (interpolations resolve; overrides win).
    own = OmegaConf.load(CONF / group / f"{option}.yaml")
    given = {o.split("=", 1)[0] for o in MANDATORY.get((group, option), [])}
    section = own.get(group, {}) if "# @package _global_" in (CONF / group / f"{option}.yaml").read_text() else own
    for key in section:
        if key == "defaults" or f"{group}.{key}" in given or OmegaConf.is_interpolation(section, key):
            continue
        if not OmegaConf.is_missing(section, key):
            assert cfg[group][key] == section[key], (group, option, key)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if group == "model":
        model = hydra.utils.instantiate(cfg.model, vocab_size=50)
        assert model.hparams.num_layers == cfg.model.num_layers
        assert model.block_names[-1] == "decoder"
    if group == "trainer":
        trainer = hydra.utils.instantiate(cfg.trainer, devices=1, accelerator="cpu", logger=False)
        assert trainer.max_epochs == cfg.trainer.max_epochs
    if group in ("partition", "layout", "schedule"):
        resolved = resolve_layout(cfg)
        assert resolved.devices >= 1
        _partition_option(cfg)
    if group == "schedule":
        ParallelLayout(pipeline_parallel_size=2, stages_per_rank=cfg.schedule.stages_per_rank,
                       schedule=cfg.schedule.name, n_microbatches=4)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], (1, 1, 1)),
        (["layout=single"], (1, 1, 1)),
        (["layout=dp2"], (2, 1, 1)),
        (["layout=pp2"], (1, 2, 1)),
        (["layout=pp4"], (1, 4, 1)),
        (["layout=dp2_pp2"], (2, 2, 1)),
        (["layout=pp2_v2"], (1, 2, 2)),
        (["trainer.devices=2", "partition=mxnet2", "schedule=1f1b"], (1, 2, 1)),
        (["partition=balanced4"], (1, 4, 1)),
        (["partition=per_layer"], (1, 4, 1)),  # tiny: 2 LSTM layers + embedding + decoder
        (["trainer.devices=4", "partition=mxnet2"], (2, 2, 1)),
        (["trainer.devices=1", "trainer.num_nodes=2", "layout=pp2"], (1, 2, 1)),
    ],
)
def test_layouts_resolve(overrides, expected):
    resolved = resolve_layout(_compose(*overrides))
    assert (resolved.data_parallel_size, resolved.pipeline_parallel_size, resolved.stages_per_rank) == expected


def test_mxnet2_selects_the_seed_model():
    cfg = _compose("partition=mxnet2")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.embedding_dim) == (8, 400, 200)
    assert _partition_option(cfg)[0] == ["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"]


def test_pp2_v2_runs_an_interleaved_schedule():
    cfg = _compose("layout=pp2_v2")
    assert cfg.schedule.name == "Interleaved1F1B"
    strategy = _strategy(cfg, resolve_layout(cfg))
    assert strategy.layout.num_stages == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["layout=pp2", "partition=balanced4"], r"4 stages but the layout gives pipeline_parallel_size=2"),
        (["layout=dp2_pp2", "trainer.devices=2"], r"= 2 processes but the layout needs data_parallel_size=2"),
        (["layout=pp2", "schedule=interleaved1f1b"], r"4 stages|stages_per_rank"),
    ],
)
def test_conflicts_are_clear_errors(overrides, message):
    cfg = _compose(*overrides)
    with pytest.raises(LayoutError, match=message):
        _strategy(cfg, resolve_layout(cfg))
