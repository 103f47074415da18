"""Lightning's hooks, schedulers (one on a logged metric too), early stopping, learning-rate finder, accumulation
schedule, the callbacks that stop a run (spike detection, timer) and predict behave under mp_lstm as in one process."""

from __future__ import annotations

import functools
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler, SpikeDetection, Timer
from lightning.pytorch.tuner import Tuner

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from tests.helpers import (
    VOCAB,
    FixedBatches,
    GlobalBatches,
    Gradients,
    TrainLosses,
    ValLosses,
    assert_same_predictions,
    assert_split_equals_one_process,
    parameters_of,
    quiet_trainer,
    rel_error,
    run_ranks,
)

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

EPOCHS, BATCHES, ACCUMULATE = 2, 4, 2
LR_FIND_LENGTHS, LR_FIND_STEPS = (5, 9, 7, 5) * 4, 16  # the suggestion skips the first 10 and the last


def _four_batches() -> FixedBatches:
    return FixedBatches((5, 9, 7, 5), seed=5)


class LearningRateKick(pl.Callback):
    """Raises every learning rate to ``lr`` after global step ``at``: the loss spikes a few steps later."""

    def __init__(self, at: int, lr: float) -> None:
        self.at, self.lr = at, lr

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.lr


class HookRecorder(pl.Callback):
    """Counts the backward / optimizer hooks and records gradients and learning rates where they fire."""

    def __init__(self) -> None:
        self.counts = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}
        self.grads_present: list[bool] = []
        self.step_grads: list[dict[str, torch.Tensor]] = []
        self.epoch_lrs: list[float] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.counts["on_before_backward"] += 1

    def on_after_backward(self, trainer, pl_module) -> None:
        self.counts["on_after_backward"] += 1
        grads = [p.grad for p in pl_module.parameters()]
        self.grads_present.append(bool(grads) and all(g is not None and g.abs().sum() > 0 for g in grads))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.counts["on_before_optimizer_step"] += 1
        self.step_grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.epoch_lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _model(**kwargs) -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, **kwargs)


def _trainer(strategy, devices: int, callbacks=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=list(callbacks), **kwargs)


def _runs(strategy, devices: int, predict_only: bool = False, root: str | None = None) -> dict:
    """Everything the tests compare; ``strategy`` is a factory (a fresh strategy per Trainer); ``root``: the
    learning-rate finder's folder (its checkpoint of the weights it restores), the same on every rank."""
    warnings.filterwarnings("ignore")
    out: dict = {}
    if not predict_only:
        # Hooks + gradient accumulation + an ExponentialLR scheduler (lr_decay) over 2 epochs.
        model = _model(optimizer="sgd", lr=0.5, lr_decay=0.5)
        hooks = HookRecorder()
        trainer = _trainer(strategy(), devices, [hooks], max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATE)
        trainer.fit(model, datamodule=_four_batches())
        out["hooks"] = {"counts": hooks.counts, "grads_present": hooks.grads_present, "lrs": hooks.epoch_lrs,
                        "step_grads": hooks.step_grads, "global_step": trainer.global_step,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        # Early stopping on a validation loss that falls, then rises (large lr).
        model = _model(optimizer="adam", lr=0.2)
        stopper, val_losses = EarlyStopping(monitor="val/loss", patience=0, mode="min"), ValLosses()
        trainer = _trainer(strategy(), devices, [stopper, val_losses], max_epochs=6)
        trainer.fit(model, datamodule=FixedBatches((5, 9, 7), validate_on_train=True))
        out["early_stopping"] = {"epoch": trainer.current_epoch, "stopped_epoch": stopper.stopped_epoch,
                                 "should_stop": trainer.should_stop, "val": val_losses.values,
                                 "global_step": trainer.global_step}
        # A scheduler that reads a logged metric: ReduceLROnPlateau on the validation loss, which rises (large lr).
        model = _model(optimizer="adam", lr=0.2, scheduler=lambda optimizer: {
            "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0),
            "monitor": "val/loss"})
        hooks = HookRecorder()
        trainer = _trainer(strategy(), devices, [hooks], max_epochs=4)
        trainer.fit(model, datamodule=FixedBatches((5, 9, 7), validate_on_train=True))
        out["plateau"] = {"lrs": hooks.epoch_lrs,
                          "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        # The learning-rate finder: an exponential sweep, then the weights it started from restored.
        model = _model(optimizer="sgd", lr=0.1)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = _trainer(strategy(), devices, default_root_dir=root)
        finder = Tuner(trainer).lr_find(model, datamodule=FixedBatches(LR_FIND_LENGTHS), num_training=LR_FIND_STEPS,
                                        min_lr=1e-3, max_lr=10.0, early_stop_threshold=None)
        out["lr_find"] = {"lrs": finder.results["lr"], "losses": finder.results["loss"],
                          "suggestion": finder.suggestion(), "lr_after": model.hparams.lr,
                          "restored": all(torch.equal(p, start[n]) for n, p in model.named_parameters())}
        # Accumulation that changes by epoch, under ASGD (the weight averaging the strategy points SWA users to: each
        # parameter's average is optimizer state, on the process that holds the parameter).
        model = _model(optimizer=functools.partial(torch.optim.ASGD, lr=0.5, t0=2))
        trainer = _trainer(strategy(), devices, [GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=EPOCHS)
        trainer.fit(model, datamodule=_four_batches())
        state = trainer.optimizers[0].state
        out["accumulation_schedule"] = {
            "global_step": trainer.global_step, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "averages": {n: state[p]["ax"].clone() for n, p in model.named_parameters()}}
        # Callbacks that stop the run: a loss spike, the clock. Each rank decides on the same global loss (the spike)
        # or takes global rank 0's decision (the timer), so every rank stops at one step.
        trainer = _trainer(strategy(), devices, [LearningRateKick(at=6, lr=200.0), SpikeDetection()], max_epochs=3,
                           default_root_dir=root)
        try:
            trainer.fit(_model(optimizer="sgd", lr=1.0), datamodule=FixedBatches())
            spike = "no spike"
        except TrainingSpikeException as error:
            spike = str(error)
        out["stopping"] = {"spike": spike, "spike_step": trainer.global_step}
        trainer = _trainer(strategy(), devices, [Timer(duration={"seconds": 1})], max_epochs=10_000)
        trainer.fit(_model(), datamodule=FixedBatches())
        out["stopping"]["timer_step"] = trainer.global_step
    # Prediction with the untrained model, of global batches (as a user's DataLoader gives them).
    trainer = _trainer(strategy(), devices)
    out["predict"] = trainer.predict(_model(), datamodule=GlobalBatches())
    return out


def _worker(rank: int, world_size: int, strategy_kwargs: dict, predict_only: bool, root: str | None = None) -> dict:
    def factory() -> MPLSTMStrategy:
        return MPLSTMStrategy(**{"report_after_steps": None, "timeout": 60, **strategy_kwargs})

    return _runs(factory, world_size, predict_only, root)


# The even split of the 2-layer model over 2 stages: the parameters each pipeline rank must hold, no others.
OWN = {0: ("embedding.", "lstm.0."), 1: ("lstm.1.", "decoder.")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    return _runs(lambda: "auto", 1, root=str(tmp_path_factory.mktemp("reference")))


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, {"schedule": "1F1B", "n_microbatches": 2}, False,
                     str(tmp_path_factory.mktemp("pp2")), timeout=150)


@pytest.mark.timeout(200)
def test_backward_and_optimizer_hooks_fire_as_in_one_process(pp2, reference):
    ref = reference["hooks"]
    batches = EPOCHS * BATCHES
    assert ref["counts"] == {"on_before_backward": batches, "on_after_backward": batches,
                             "on_before_optimizer_step": batches // ACCUMULATE}
    for rank, result in enumerate(pp2):
        hooks = result["hooks"]
        assert hooks["counts"] == ref["counts"], rank
        assert hooks["global_step"] == ref["global_step"] == batches // ACCUMULATE
        # This rank's gradients exist (and are not zero) when on_after_backward fires, every time.
        assert hooks["grads_present"] == [True] * batches, rank
        own = sorted(n for n in ref["params"] if n.startswith(OWN[rank]))
        assert sorted(hooks["params"]) == own, rank
        # At on_before_optimizer_step the gradients are the single-process (accumulated) gradients.
        for step, (got, expected) in enumerate(zip(hooks["step_grads"], ref["step_grads"])):
            assert sorted(got) == own, (rank, step)
            for name, grad in got.items():
                assert rel_error(grad, expected[name]) < 1e-5, (rank, step, name)
    merged = {**pp2[0]["hooks"]["params"], **pp2[1]["hooks"]["params"]}
    assert merged.keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        assert rel_error(merged[name], value) < 1e-5, name


@pytest.mark.timeout(200)
def test_lr_scheduler_steps_identically_on_every_rank(pp2, reference):
    expected = [0.5 * 0.5**epoch for epoch in range(EPOCHS + 1)]  # ExponentialLR(gamma=0.5), once per epoch
    assert reference["hooks"]["lrs"] == pytest.approx(expected)
    for result in pp2:
        assert result["hooks"]["lrs"] == reference["hooks"]["lrs"]


@pytest.mark.timeout(200)
def test_early_stopping_stops_every_rank_at_the_single_process_epoch(pp2, reference):
    ref = reference["early_stopping"]
    assert ref["should_stop"] and 0 < ref["stopped_epoch"] < 5  # it did stop early, not at max_epochs
    assert ref["val"][ref["stopped_epoch"]] > ref["val"][ref["stopped_epoch"] - 1]
    for result in pp2:
        got = result["early_stopping"]
        assert {k: got[k] for k in ("epoch", "stopped_epoch", "should_stop", "global_step")} == {
            k: ref[k] for k in ("epoch", "stopped_epoch", "should_stop", "global_step")}
        assert got["val"] == pytest.approx(ref["val"], rel=1e-4)


@pytest.mark.timeout(200)
def test_the_learning_rate_finder_sweeps_and_restores_as_in_one_process(pp2, reference):
    ref = reference["lr_find"]
    assert len(ref["lrs"]) == len(ref["losses"]) == LR_FIND_STEPS and ref["restored"]
    assert ref["lr_after"] == ref["suggestion"] and ref["suggestion"] is not None  # the finder set the model's lr
    assert max(ref["losses"]) > 1.01 * min(ref["losses"])  # the sweep moved the loss: the curve says something
    for rank, result in enumerate(pp2):
        got = result["lr_find"]
        assert got["lrs"] == ref["lrs"], rank
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        assert (got["suggestion"], got["lr_after"]) == (ref["suggestion"], ref["lr_after"]), rank
        assert got["restored"], rank  # every rank's own parameters back where the sweep started


@pytest.mark.timeout(200)
def test_an_accumulation_schedule_and_asgd_averages_train_as_in_one_process(pp2, reference):
    ref = reference["accumulation_schedule"]
    assert ref["global_step"] == BATCHES + BATCHES // 2  # one batch a step in the first epoch, two in the second
    assert max(rel_error(ref["averages"][n], p) for n, p in ref["params"].items()) > 1e-2  # averages, not weights
    for rank, result in enumerate(pp2):
        got = result["accumulation_schedule"]
        assert got["global_step"] == ref["global_step"], rank
        assert sorted(got["params"]) == sorted(got["averages"]) == sorted(n for n in ref["params"]
                                                                          if n.startswith(OWN[rank])), rank
        for name in got["params"]:
            assert rel_error(got["params"][name], ref["params"][name]) < 1e-5, (rank, name)
            assert rel_error(got["averages"][name], ref["averages"][name]) < 1e-5, (rank, name)


@pytest.mark.timeout(200)
def test_a_scheduler_on_the_validation_loss_lowers_the_rate_at_one_processs_epochs(pp2, reference):
    lrs = reference["plateau"]["lrs"]
    assert len(set(lrs)) > 1  # the rate was lowered at least once
    for rank, result in enumerate(pp2):
        assert result["plateau"]["lrs"] == lrs, rank
        for name, value in result["plateau"]["params"].items():
            assert name.startswith(OWN[rank])
            assert rel_error(value, reference["plateau"]["params"][name]) < 1e-5, (rank, name)


@pytest.mark.timeout(200)
def test_spike_detection_and_the_timer_stop_every_rank_at_one_step(pp2, reference):
    spike = reference["stopping"]["spike"]
    assert spike.startswith("Training spike detected in batch")
    assert [rank["stopping"]["spike"] for rank in pp2] == [spike, spike]
    assert [rank["stopping"]["spike_step"] for rank in pp2] == [reference["stopping"]["spike_step"]] * 2
    steps = [rank["stopping"]["timer_step"] for rank in pp2]
    assert steps[0] == steps[1] and 0 < steps[0] < 10_000 * len(FixedBatches().train)


@pytest.mark.timeout(200)
def test_predict_on_pp2_equals_one_process(pp2, reference):
    for result in pp2:  # every rank of the pipeline gets the predictions
        assert_same_predictions(result["predict"], reference["predict"])


@pytest.mark.timeout(200)
def test_predict_on_dp2_pp2_of_global_batches_gives_the_global_batch_on_every_rank(reference):
    results = run_ranks(_worker, 4, {"data_parallel_size": 2, "schedule": "GPipe", "n_microbatches": 2}, True,
                        timeout=150)
    for result in results:
        assert_same_predictions(result["predict"], reference["predict"])
        assert result["predict"][0]["log_probs"].shape[0] == 8  # both replicas' 4 rows


class DropoutOff(LSTMLanguageModel):
    """Puts its dropout in eval mode when training starts: the rest trains, the dropout stays off (a user's own
    choice, which Lightning keeps through its loops)."""

    def on_train_start(self) -> None:
        self.dropout.eval()


class DropoutModes(pl.Callback):
    """The dropout's training flag after every training batch, and after each validation."""

    def __init__(self) -> None:
        self.train: list[bool] = []
        self.after_validation: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.train.append(pl_module.dropout.training)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.after_validation.append(pl_module.dropout.training)


def _fit_dropout_off(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = DropoutOff(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, dropout=0.5)
    losses, grads, modes = TrainLosses(), Gradients(), DropoutModes()
    trainer = quiet_trainer(strategy, devices, [losses, grads, modes], max_steps=4, gradient_clip_val=0.5,
                            limit_val_batches=2, val_check_interval=2)
    trainer.fit(model, datamodule=FixedBatches())
    return {"params": parameters_of(model), "losses": losses.values, "grads": grads.steps, "modes": modes}


@pytest.mark.timeout(200)
def test_a_submodule_the_user_put_in_eval_mode_stays_so_in_the_pipeline_as_in_one_process():
    reference = _fit_dropout_off("auto", 1)  # the module's own training_step on one process
    assert reference["modes"].train == [False] * 4 and reference["modes"].after_validation == [False] * 2
    results = assert_split_equals_one_process(
        _fit_dropout_off, 2, dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2), reference, 4,
        timeout=150)
    for r in results:  # before, every stage put every module back in training mode at each batch
        assert r["modes"].train == [False] * 4 and r["modes"].after_validation == [False] * 2


class EmbeddingFrozen(LSTMLanguageModel):
    """Freezes its embedding when training starts (pretrained embeddings kept as they are): no gradient reaches it."""

    def on_train_start(self) -> None:
        if self.embedding is not None:  # a pipeline stage without it holds None
            self.embedding.weight.requires_grad_(False)


def _fit_embedding_frozen(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = EmbeddingFrozen(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, optimizer="adam", lr=0.01)
    losses, grads = TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=4, gradient_clip_val=0.5)
    trainer.fit(model, datamodule=FixedBatches())
    return {"params": parameters_of(model), "losses": losses.values, "grads": grads.steps}


@pytest.mark.timeout(200)
def test_a_parameter_the_user_froze_gets_no_gradient_in_the_pipeline_as_in_one_process():
    reference = _fit_embedding_frozen("auto", 1)  # the module's own training_step on one process
    assert all("embedding.weight" not in step for step in reference["grads"]) and len(reference["grads"]) == 4
    # Before, the numerical check of the declaration gave the frozen weight a gradient on its side and stopped the run.
    assert_split_equals_one_process(
        _fit_embedding_frozen, 2, dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2), reference, 4,
        timeout=150)


class HeadFirst(LSTMLanguageModel):
    """Fine-tunes its head first: every block but the decoder frozen for two steps, then all of them for two, then the
    head alone again (whole pipeline stages without a trainable parameter, then with, then without)."""

    def on_train_batch_start(self, batch, batch_idx) -> None:
        step = self.trainer.global_step
        if step in (0, 2, 4):
            for name, parameter in self.named_parameters():
                parameter.requires_grad_(step == 2 or name.startswith("decoder"))


def _fit_head_first(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = HeadFirst(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, lr=0.5)
    losses, grads = TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=6, gradient_clip_val=0.5)
    trainer.fit(model, datamodule=FixedBatches())
    return {"params": parameters_of(model), "losses": losses.values, "grads": grads.steps}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", [dict(schedule="1F1B", n_microbatches=2),
                                    dict(schedule="Wavefront", n_microbatches=2, time_chunks=2)],
                         ids=["1F1B", "wavefront"])
def test_blocks_the_user_unfreezes_and_freezes_while_training_train_as_in_one_process(layout):
    reference = _fit_head_first("auto", 1)  # the module's own training_step on one process
    trained = [sorted({name.split(".")[0] for name in step}) for step in reference["grads"]]
    assert trained == [["decoder"]] * 2 + [["decoder", "embedding", "lstm"]] * 2 + [["decoder"]] * 2
    # Before, torch's stages kept from the first batch that stage 0's output needs no gradient: after the unfreezing,
    # stage 0 waited for one that never came ("grad can be implicitly created only for scalar outputs"). The
    # wavefront, this library's loop, decides at every batch.
    assert_split_equals_one_process(_fit_head_first, 2, dict(pipeline_parallel_size=2, **layout), reference, 6,
                                    timeout=150)


class DropoutAtPrediction(LSTMLanguageModel):
    """Monte-Carlo dropout: turns its dropout on for prediction while ``monte_carlo`` (Lightning's loop puts the
    module in eval mode first)."""

    monte_carlo = True

    def on_predict_start(self) -> None:
        if self.monte_carlo:
            self.dropout.train()


class PredictModes(pl.Callback):
    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_predict_batch_end(self, trainer, pl_module, *args) -> None:
        self.modes.append(pl_module.dropout.training)


def _predict_twice(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, modes = DropoutAtPrediction(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2, dropout=0.5), PredictModes()
    trainer = quiet_trainer(strategy, devices, [modes], max_steps=1)
    trainer.fit(model, datamodule=FixedBatches())
    sampled = trainer.predict(model, datamodule=FixedBatches())
    model.monte_carlo = False
    # The plain prediction: the same random stream (a strategy that resets the seed at each call, as DDP does,
    # starts both from it), dropout off.
    plain = trainer.predict(model, datamodule=FixedBatches())
    return {"modes": modes.modes, "batches": len(sampled),
            "differ": any(not torch.equal(a["log_probs"], b["log_probs"]) for a, b in zip(sampled, plain))}


def _predict_twice_on_pp2(rank: int, world_size: int) -> dict:
    strategy = MPLSTMStrategy(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2, report_after_steps=None,
                              timeout=60)
    return _predict_twice(strategy, world_size)


@pytest.mark.timeout(200)
def test_a_dropout_the_user_turns_on_for_prediction_stays_on_in_the_pipeline_as_in_one_process():
    reference = _predict_twice("auto", 1)
    assert reference["batches"] > 0 and reference["differ"]
    assert reference["modes"] == [True] * reference["batches"] + [False] * reference["batches"]
    for result in run_ranks(_predict_twice_on_pp2, 2, timeout=150):  # before, prediction put every block in eval mode
        assert result["modes"] == reference["modes"] and result["differ"]
