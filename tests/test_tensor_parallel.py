"""Vocabulary-parallel embedding and decoder (tensor parallel) on tp2, dp2 x tp2 and pp2 x tp2: exact against one
process, clipped by the global norm over shards, and checkpoints that load across tensor-parallel degrees.

Each layout trains with Adam (per-element state on the shards) and clipping by the global norm (which would be off
if a shard were missed or a replicated gradient counted twice); every rank's loss curve, every gradient of every
step (gathered from the shards, before clipping) and the final parameters equal one process's.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.planning.layout import LayoutError
from tests.helpers import (
    VOCAB,
    FixedBatches,
    TrainLosses,
    assert_ranks_match,
    assert_same_predictions,
    assert_split_equals_one_process,
    quiet_trainer,
    rel_error,
    replica_share,
    run_ranks,
    tiny_model,
)

STEPS = 4
#: The batches use ids below VOCAB = 37; the model's vocabulary is one larger so that two shards split it.
TP_VOCAB = VOCAB + 1
LAYOUTS = {
    "tp2": (2, dict(tensor_parallel_size=2, pipeline_parallel_size=1, n_microbatches=2)),
    "dp2_tp2": (4, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=1, n_microbatches=2)),
    "pp2_tp2": (4, dict(tensor_parallel_size=2, pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2)),
}


def _model(**kwargs: Any) -> Any:
    return tiny_model(num_layers=2, vocab=TP_VOCAB, optimizer="adam", lr=0.02, **kwargs)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class FullGradients(pl.Callback):
    """Every gradient before each optimizer step, the shards of a split one gathered (a collective on the shards)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.steps.append({n: _full(p.grad).detach().clone() for n, p in pl_module.named_parameters()
                           if p.grad is not None})


def _fit(strategy: Any, devices: int, checkpoint: str | None = None, **model_options: Any) -> dict:
    warnings.filterwarnings("ignore")
    model, losses, grads = _model(**model_options), TrainLosses(), FullGradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches())
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    validated = trainer.validate(model, datamodule=FixedBatches(), verbose=False)[0]["val/loss"]
    predictions = trainer.predict(model, datamodule=FixedBatches())
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    strategy = trainer.strategy
    replica = (strategy.data_parallel_rank, strategy.layout.data_parallel_size) if devices > 1 else (0, 1)
    return {"params": params, "losses": losses.values, "grads": grads.steps, "sharded": sharded, "local": local,
            "validated": validated, "predictions": predictions, "replica": replica}


@pytest.fixture(scope="module")
def reference() -> dict:
    return _fit("auto", 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.processes
def test_tensor_parallel_layouts_match_one_process(layout, reference, tmp_path):
    processes, kwargs = LAYOUTS[layout]
    checkpoint = str(tmp_path / "tp.ckpt")
    # The loss decodes the sharded logits 5 tokens at a time (recomputed in the backward pass, inside loss_parallel);
    # the one-process reference takes its logits whole.
    results = assert_split_equals_one_process(_fit, processes, kwargs, reference, STEPS, checkpoint,
                                              loss_chunk_tokens=5)
    for rank, r in enumerate(results):
        # the vocabulary layers this rank holds are split in two along the vocabulary
        assert r["sharded"] and set(r["sharded"]) <= {"embedding.weight", "decoder.weight", "decoder.bias"}
        for name, shape in r["local"].items():
            assert shape[0] == TP_VOCAB // 2, (rank, name, shape)
        # Evaluation and prediction (which gathers the vocabulary-sharded logits) are one process's too.
        assert r["validated"] == pytest.approx(reference["validated"], rel=1e-5), rank
        assert_same_predictions(r["predictions"], replica_share(reference["predictions"], *r["replica"]))
    # The checkpoint is one process's: full tensors under the one-process names, Adam's state too.
    saved = read_checkpoint(checkpoint)
    one_process = _model(loss_chunk_tokens=5)
    assert list(saved["state_dict"]) == list(one_process.state_dict())
    for name, value in saved["state_dict"].items():
        assert not isinstance(value, DTensor) and value.shape == one_process.state_dict()[name].shape, name
        if name in reference["params"]:
            assert rel_error(value, reference["params"][name]) < 1e-5, name
    state = saved["optimizer_states"][0]["state"]
    assert set(state) == {n for n, _ in one_process.named_parameters()}
    assert state["decoder.weight"]["exp_avg"].shape == (TP_VOCAB, 8)


def _fit_clipped_by_value(strategy: Any, devices: int, clip: float | None = 0.002) -> dict:
    warnings.filterwarnings("ignore")
    model, losses, grads = _model(), TrainLosses(), FullGradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, gradient_clip_val=clip,
                            gradient_clip_algorithm="value")
    trainer.fit(model, datamodule=FixedBatches())
    return {"params": {n: _full(p).detach().clone() for n, p in model.named_parameters()}, "losses": losses.values,
            "grads": grads.steps}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_gradients_clipped_by_value_on_tensor_parallel_shards_train_as_in_one_process():
    """Before, torch's clip_grad_value_ took the vocabulary shards (DTensor) and the LSTMs' gradients in one foreach
    kernel and the step failed: "aten._foreach_clamp_min_.Scalar got mixed torch.Tensor and DTensor"."""
    reference = _fit_clipped_by_value("auto", 1)
    unclipped = _fit_clipped_by_value("auto", 1, clip=None)
    assert rel_error(reference["params"]["decoder.weight"], unclipped["params"]["decoder.weight"]) > 0.01  # clipped
    assert_split_equals_one_process(_fit_clipped_by_value, 2, LAYOUTS["tp2"][1], reference, STEPS, timeout=150)


def _unseeded_tp2(rank: int, world_size: int) -> dict:
    import os

    warnings.filterwarnings("ignore")
    os.environ.pop("PL_GLOBAL_SEED", None)  # inherited from a test that seeded: this script did not
    model = LSTMLanguageModel(TP_VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, lr=0.5, dropout=0.5)
    dropped: list[float] = []  # what each dropout call let through, in training
    model.dropout.register_forward_hook(lambda m, i, out: dropped.append(float(out.sum())) if m.training else None)
    strategy = MPLSTMStrategy(tensor_parallel_size=2, pipeline_parallel_size=1, n_microbatches=2, timeout=60,
                              report_after_steps=None, verify=False)
    quiet_trainer(strategy, world_size, max_steps=2).fit(model, datamodule=FixedBatches())
    return {"params": {n: _full(p).detach().clone() for n, p in model.named_parameters()}, "dropped": dropped}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_a_script_that_never_seeds_trains_one_model_on_tensor_parallel_peers():
    """Both peers compute the blocks tensor parallelism does not split (the LSTMs, their dropout included); before,
    each started from the values its own process drew (spawned as a launcher starts them, no seed_everything) and
    drew its own dropout masks, and they trained apart."""
    first, second = run_ranks(_unseeded_tp2, 2, timeout=180, start_method="spawn")
    assert set(first["params"]) == set(second["params"]) and "lstm.0.weight_ih_l0" in first["params"]
    for name, value in first["params"].items():
        assert torch.equal(value, second["params"][name]), name
    assert len(first["dropped"]) > 4 and first["dropped"] == second["dropped"]  # the same masks on both


def test_vocabulary_not_divisible_by_tensor_parallel_size_says_so():
    model = tiny_model(vocab=VOCAB)  # 37 words cannot be split in two
    strategy = MPLSTMStrategy(tensor_parallel_size=2, pipeline_parallel_size=1, report_after_steps=None)
    with pytest.raises(ValueError, match=r"vocab_size=37 is not a multiple of 2.*pad the vocabulary to 38 words"):
        strategy.check(model)
    tied = tiny_model(vocab=TP_VOCAB, embedding_dim=8, hidden_size=8, tie_weights=True)
    with pytest.raises(ValueError, match=r"does not split tied embedding and decoder weights"):
        strategy.check(tied)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2"])
def test_tensor_parallel_size_is_checked_when_the_strategy_is_built(bad):
    with pytest.raises(LayoutError, match=rf"tensor_parallel_size must be a positive integer, got {bad!r}"):
        MPLSTMStrategy(tensor_parallel_size=bad)


def _train_and_save(rank: int, world_size: int, kwargs: dict, checkpoint: str) -> None:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, **kwargs) if kwargs else "auto"
    trainer = quiet_trainer(strategy, world_size, max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(_model(), datamodule=FixedBatches())
    trainer.save_checkpoint(checkpoint)


def _resume(rank: int, world_size: int, kwargs: dict, checkpoint: str) -> dict:
    warnings.filterwarnings("ignore")
    model = _model()
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, **kwargs) if kwargs else "auto"
    trainer = quiet_trainer(strategy, world_size, max_steps=STEPS + 2, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches(), ckpt_path=checkpoint)
    return {n: _full(p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_checkpoints_round_trip_across_tensor_parallel_degrees(tmp_path):
    """A tp2 checkpoint resumes on one process and on pp2; a one-process checkpoint resumes on tp2 and on
    pp2 x tp2 (shards cut from the whole tensors, Adam's moments included): all continue like one process."""
    tp2 = dict(LAYOUTS["tp2"][1], n_microbatches=1)
    one_ckpt, tp_ckpt = str(tmp_path / "one.ckpt"), str(tmp_path / "tp2.ckpt")
    _train_and_save(0, 1, {}, one_ckpt)
    expected = _resume(0, 1, {}, one_ckpt)
    run_ranks(_train_and_save, 2, tp2, tp_ckpt, timeout=120)
    saved = read_checkpoint(tp_ckpt)
    assert saved["global_step"] == STEPS and saved["state_dict"]["decoder.weight"].shape == (TP_VOCAB, 8)
    assert_ranks_match([_resume(0, 1, {}, tp_ckpt)], expected)
    assert_ranks_match(run_ranks(_resume, 2, dict(pipeline_parallel_size=2, n_microbatches=2), tp_ckpt,
                                 timeout=120), expected)
    assert_ranks_match(run_ranks(_resume, 4, LAYOUTS["pp2_tp2"][1], one_ckpt, timeout=120), expected)


def _train_and_save_sharded(rank: int, world_size: int, kwargs: dict, checkpoint: str) -> None:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, checkpoint_format="sharded", **kwargs)
    trainer = quiet_trainer(strategy, world_size, max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(_model(), datamodule=FixedBatches())
    trainer.save_checkpoint(checkpoint)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_a_sharded_tensor_parallel_checkpoint_resumes_on_another_layout(tmp_path):
    """Every rank of pp2 x tp2 writes its own shards; pp2 (no tensor parallelism) resumes from them exactly."""
    one_ckpt, sharded = str(tmp_path / "one.ckpt"), str(tmp_path / "sharded.ckpt")
    _train_and_save(0, 1, {}, one_ckpt)
    expected = _resume(0, 1, {}, one_ckpt)
    run_ranks(_train_and_save_sharded, 4, LAYOUTS["pp2_tp2"][1], sharded, timeout=150)
    assert (tmp_path / "sharded.ckpt").is_dir()
    assert_ranks_match(run_ranks(_resume, 2, dict(pipeline_parallel_size=2, n_microbatches=2), sharded,
                                 timeout=150), expected)


def test_partition_report_shows_each_ranks_share_of_split_blocks():
    import torch as _torch

    from lightning_mp_lstm.planning.layout import ParallelLayout
    from lightning_mp_lstm.planning.plan import PlanOptions, make_plan
    from lightning_mp_lstm.planning.report import render, stage_summary

    model = tiny_model(num_layers=2, vocab=1000)
    whole = make_plan(model, ParallelLayout(pipeline_parallel_size=2, n_microbatches=2), PlanOptions(partition="even"),
                      8, 5, _torch.device("cpu"))
    split = make_plan(model, ParallelLayout(pipeline_parallel_size=2, tensor_parallel_size=2, n_microbatches=2),
                      PlanOptions(partition="even"), 8, 5, _torch.device("cpu"))
    assert split.split_blocks == ("embedding", "decoder") and whole.split_blocks == ()
    counts = dict(whole.block_parameters)
    expected = [counts["embedding"] / 2 + counts["lstm.0"], counts["lstm.1"] + counts["decoder"] / 2]
    assert stage_summary(split)["parameters"] == pytest.approx(expected)
    text = render(split)
    assert "params/rank" in text and "memory MiB/rank" in text and "(decoder split /2)" in text
    assert f"{int(expected[1]):,}" in text
