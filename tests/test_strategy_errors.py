"""Bad configurations fail before the first step, with messages naming the values; never a hang."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from lightning.pytorch.tuner import Tuner

import lightning_mp_lstm  # noqa: F401
from lightning_mp_lstm import LayoutError, LSTMLanguageModel, MPLSTMStrategy, PartitionError
from tests.helpers import VOCAB, FixedBatches, run_ranks


def _trainer(strategy, devices=2, **kwargs):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_strategy_resolves_by_name():
    trainer = _trainer("mp_lstm", devices=1)
    assert isinstance(trainer.strategy, MPLSTMStrategy)


def test_world_size_mismatch_fails_when_the_trainer_is_built():
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size=2 = 2 processes .*world size is 3"):
        _trainer(MPLSTMStrategy(pipeline_parallel_size=2), devices=3)
    with pytest.raises(LayoutError, match=r"data_parallel_size=2 does not divide the world size 3"):
        _trainer(MPLSTMStrategy(data_parallel_size=2), devices=3)


def test_multi_stage_schedule_with_one_stage_per_rank_fails_at_construction():
    with pytest.raises(LayoutError, match=r"Interleaved1F1B is a multi-stage schedule and needs stages_per_rank >= 2"):
        MPLSTMStrategy(pipeline_parallel_size=2, schedule="Interleaved1F1B", stages_per_rank=1)
    with pytest.raises(LayoutError, match=r"unknown schedule 'zigzag'; allowed: GPipe, 1F1B"):
        MPLSTMStrategy(pipeline_parallel_size=2, schedule="zigzag")
    with pytest.raises(LayoutError, match=r"n_microbatches must be a positive integer, None or 'auto', got 'many'"):
        MPLSTMStrategy(pipeline_parallel_size=2, n_microbatches="many")


def _bad_setup_worker(rank: int, world_size: int) -> list[str]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cases = [
        (dict(partition=[["embedding", "lstm.0"], ["lstm.7", "decoder"]]), dict()),
        (dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2), dict(num_layers=1)),
        (dict(n_microbatches=3), dict()),
        (dict(n_microbatches=16), dict()),
        (dict(schedule="Wavefront", n_microbatches=1, time_chunks=6), dict()),  # FixedBatches: buckets [5, 9]
    ]
    messages = []
    for strategy_kwargs, model_kwargs in cases:
        model = LSTMLanguageModel(VOCAB, **{"embedding_dim": 6, "hidden_size": 8, "num_layers": 2, **model_kwargs})
        trainer = _trainer(MPLSTMStrategy(**strategy_kwargs))
        try:
            trainer.fit(model, datamodule=FixedBatches())
            messages.append("no error")
        except (LayoutError, PartitionError) as err:
            messages.append(f"{type(err).__name__}: {err}")
        assert trainer.global_step == 0
    return messages


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_bad_configurations_fail_in_setup_on_every_rank():
    results = run_ranks(_bad_setup_worker, 2, timeout=100)
    assert results[0] == results[1]
    unknown, too_many_stages, not_dividing, too_large, too_many_chunks = results[0]
    assert "PartitionError" in unknown and "'lstm.7'" in unknown and "lstm.1" in unknown and "decoder" in unknown
    assert "PartitionError" in too_many_stages and "4" in too_many_stages and "3" in too_many_stages
    assert "n_microbatches=3 must divide the per-replica batch of 8" in not_dividing and "[1, 2, 4, 8]" in not_dividing
    assert "n_microbatches=16" in too_large and "at most 8" in too_large
    assert too_many_chunks == ("LayoutError: time_chunks=6 splits every batch's time axis into 6 chunks, but the "
                               "shortest bucket has 5 steps (buckets [5, 9]); allowed: 1 to 5, or 'auto'")


def _refused_callback_worker(rank: int, world_size: int, root: str, kind: str) -> str:
    warnings.filterwarnings("ignore")
    model = LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2)
    try:
        if kind == "batch_size_finder":
            trainer = _trainer(MPLSTMStrategy(), default_root_dir=root)
            Tuner(trainer).scale_batch_size(model, datamodule=FixedBatches(), max_trials=2, steps_per_trial=1)
        else:
            callback = {"swa": lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
                        "ema": EMAWeightAveraging,
                        "pruning": lambda: ModelPruning("l1_unstructured", amount=0.3),
                        "finetuning": lambda: BackboneFinetuning(unfreeze_backbone_at_epoch=1)}[kind]()
            trainer = _trainer(MPLSTMStrategy(), default_root_dir=root, max_epochs=2, callbacks=[callback])
            trainer.fit(model, datamodule=FixedBatches())
        return "no error"
    except ValueError as err:
        assert trainer.global_step == 0
        return str(err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "start"), [
    ("batch_size_finder", "mp_lstm does not run Lightning's batch-size finder (BatchSizeFinder, which "
                          "Tuner.scale_batch_size adds)"),
    ("swa", "mp_lstm does not run Lightning's StochasticWeightAveraging: it copies the whole module before"),
    ("ema", "mp_lstm does not run Lightning's EMAWeightAveraging: it copies the whole module before"),
    ("pruning", "mp_lstm does not run Lightning's ModelPruning: it collects the layers to prune before the strategy "
                "splits the module"),
    ("finetuning", "mp_lstm does not run Lightning's BackboneFinetuning: it freezes and unfreezes the module's layers "
                   "by attribute, which a process that does not hold them lacks"),
])
@pytest.mark.processes
def test_callbacks_the_pipeline_cannot_run_are_refused_on_every_rank_before_training(tmp_path, kind, start):
    """Lightning lets a strategy that is not ``is_distributed`` run the batch-size finder (under the pipeline it
    failed after its first trial: each rank names its restoring checkpoint apart); it runs SWA and EMA on a copy of
    the whole module that it then pairs with each rank's part by position (they failed on a size mismatch at the
    first average), and pruning over layers collected before the split (global pruning ranked a rank's weights
    against stale copies of the other rank's: the embedding pruned differently from one process, no error).
    Finetuning failed on the rank without the unfrozen layer, and a resumed run lost the groups it had added."""
    messages = run_ranks(_refused_callback_worker, 2, str(tmp_path), kind, timeout=100)
    assert messages[0] == messages[1] and messages[0].startswith(start)
    assert {"batch_size_finder": "the data module's batch_size", "swa": "torch.optim.ASGD", "ema": "torch.optim.ASGD",
            "pruning": "torch.nn.utils.prune", "finetuning": "LambdaLR"}[kind] in messages[0]
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was written


def _throughput_worker(rank: int, world_size: int) -> tuple[list[str], int]:
    warnings.simplefilter("always")
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(MPLSTMStrategy(), callbacks=[monitor], max_epochs=1)
        trainer.fit(LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2), datamodule=FixedBatches())
    return [str(w.message) for w in caught if str(w.message).startswith("ThroughputMonitor")], trainer.global_step


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_the_throughput_monitor_runs_with_a_warning_that_its_numbers_count_every_stage():
    """Lightning's ``ThroughputMonitor`` multiplies a process's samples by the world size, as if every process were a
    data-parallel replica; under pp2 both processes share each batch, so its numbers are twice the run's."""
    (warned, steps), (quiet, steps_1) = run_ranks(_throughput_worker, 2, timeout=100)
    assert steps == steps_1 == 1 and quiet == []
    assert warned == ["ThroughputMonitor counts each of the 2 processes as a data-parallel replica, but 2 of them "
                      "share each batch (1 replica(s)): its samples, items and FLOPs per second are 2 times the run's. "
                      "The run's own speed is logged as train/tokens_per_s_step and train/tokens_per_s_epoch"]


class ManualOptimization(LSTMLanguageModel):
    """A module that steps its optimizer itself, in its training_step (which the pipeline does not run)."""

    def __init__(self) -> None:
        super().__init__(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def _manual_optimization_worker(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    trainer = _trainer(MPLSTMStrategy(), max_epochs=1)
    try:
        trainer.fit(ManualOptimization(), datamodule=FixedBatches())
        return f"no error, {trainer.global_step} steps"
    except ValueError as err:
        assert trainer.global_step == 0
        return str(err)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_manual_optimization_is_refused_on_every_rank_before_training():
    """Its optimizer steps in its own training_step, which the pipeline does not run: the run ended with no update
    and no error ("no error, 0 steps" on both ranks)."""
    messages = run_ranks(_manual_optimization_worker, 2, timeout=100)
    assert messages[0] == messages[1]
    assert messages[0].startswith("ManualOptimization sets automatic_optimization = False, which mp_lstm cannot "
                                  "train: the pipeline computes the gradients in its schedule")
    assert "Trainer(accumulate_grad_batches=...)" in messages[0]


class GroupsByAttribute(LSTMLanguageModel):
    """Parameter groups taken from a block's attribute: on the process without that block, it is None."""

    def __init__(self) -> None:
        super().__init__(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2)

    def configure_optimizers(self):
        rest = [p for n, p in self.named_parameters() if not n.startswith("embedding.")]
        return torch.optim.SGD([{"params": self.embedding.parameters(), "lr": 0.1}, {"params": rest}], lr=1.0)


def _groups_worker(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    trainer = _trainer(MPLSTMStrategy(timeout=30), max_epochs=1)
    try:
        trainer.fit(GroupsByAttribute(), datamodule=FixedBatches())
        return "no error"
    except (AttributeError, RuntimeError) as err:
        return str(err)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_optimizer_groups_from_a_block_another_process_holds_get_a_message_that_says_what_to_do():
    """Before, rank 1 raised a bare "'NoneType' object has no attribute 'parameters'"."""
    first, second = run_ranks(_groups_worker, 2, timeout=100)
    hint = ("GroupsByAttribute.configure_optimizers failed on global rank 1 ('NoneType' object has no attribute "
            "'parameters'): under mp_lstm it runs on each process's part of the module, where the blocks other "
            "processes hold are None. Build parameter groups by parameter name")
    assert second.startswith(hint)
    assert first.startswith("mp_lstm: rank 0 stopped because it lost a peer: rank 1") and hint in first


def _second_trainer_worker(rank: int, world_size: int, pipeline_parallel_size: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2)

    def strategy():
        return MPLSTMStrategy(pipeline_parallel_size=pipeline_parallel_size,
                              data_parallel_size=world_size // pipeline_parallel_size, n_microbatches=2, timeout=30,
                              report_after_steps=None)

    first = _trainer(strategy())
    first.fit(model, datamodule=FixedBatches())
    try:
        _trainer(strategy()).fit(model, datamodule=FixedBatches())
        second = "no error"
    except ValueError as err:
        second = str(err)
    first.fit_loop.epoch_loop.max_steps = 2  # the Trainer that split the module trains on
    first.fit(model, datamodule=FixedBatches())
    return {"second": second, "steps": first.global_step}


@pytest.mark.timeout(150)
@pytest.mark.processes
def test_a_module_a_pipeline_split_is_refused_by_a_new_trainer_on_every_rank_and_trains_on_with_its_own():
    """Before, the new Trainer's strategy looked for the blocks the first had pruned: "LSTMLanguageModel has no
    submodule 'embedding' (declared as an nn.Embedding)" on rank 1 (and 'decoder' on rank 0)."""
    results = run_ranks(_second_trainer_worker, 2, 2, timeout=130)
    for result in results:
        assert result["second"].startswith(
            "this LSTMLanguageModel was split by an earlier MPLSTMStrategy (data x pipeline x tensor = 1 x 2 x 1, "
            "1F1B): this process holds only its own stages' blocks now, so another strategy (a new Trainer) cannot "
            "run it")
        assert result["steps"] == 2
    # Data parallel alone keeps the whole module on every process: a new Trainer runs it.
    assert [r["second"] for r in run_ranks(_second_trainer_worker, 2, 1, timeout=130)] == ["no error"] * 2
