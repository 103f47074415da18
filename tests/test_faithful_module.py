"""A user's module is split, not replaced: AWD-LSTM (docs/examples/awd_lstm.py: embedding dropout, locked dropout,
weight drop as the original wrapper and as a parametrization, a tied decoder whose ``in_features`` is stale, AR and
TAR) and a char-rnn whose loss is summed over time train under ``mp_lstm`` exactly as their own ``training_step``
trains them on one process, on pp2, pp4, dp2 x pp2 and wavefront; every random part runs in the pipeline; what the
module's structure shows the pipeline would not reproduce is named before training (a test per case), with no guess
from the step's source, and ``verify=True`` finds each silent difference when it is put back."""

from __future__ import annotations

import re
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn

from lightning_mp_lstm import LSTMBlocks, ModelDeclarationError, MPLSTMStrategy
from lightning_mp_lstm.models.module_audit import NotReproducedWarning
from lightning_mp_lstm.strategy.random_tape import RandomTape
from lightning_mp_lstm.strategy.verify import VerificationError
from tests.helpers import (
    Gradients,
    TimeFirstStream,
    TrainLosses,
    assert_same_training,
    load_example,
    quiet_trainer,
    run_command,
    run_ranks,
)

STEPS, VOCAB = 4, 29
QUIET = dict(report_after_steps=None, timeout=60)
#: Every random part of AWD-LSTM switched off; AR and TAR on.
RATES_0 = dict(dropout=0.0, dropouth=0.0, dropouti=0.0, dropoute=0.0, wdrop=0.0)
RATES = dict(dropout=0.4, dropouth=0.3, dropouti=0.5, dropoute=0.2, wdrop=0.5)


def awd(**kwargs) -> pl.LightningModule:
    """AWD-LSTM of the docs (3 layers; embedding 6, hidden 8, tied: the decoder's in_features says 8, its weight 6)."""
    torch.manual_seed(0)
    return load_example("awd_lstm").AwdLSTM(**{"ntoken": VOCAB, "ninp": 6, "nhid": 8, "lr": 0.01, **kwargs})


class CharRNN(pl.LightningModule):
    """char-rnn as its PyTorch tutorial trains it: batch first, the loss summed over time of each step's mean over
    the batch (so a sum over the sequence, averaged over sequences)."""

    def __init__(self, reduction: str = "sequence_mean") -> None:
        super().__init__()
        self.reduction = reduction
        self.encoder = nn.Embedding(VOCAB, 6)
        self.rnn = nn.LSTM(6, 8, 2, batch_first=True)
        self.decoder = nn.Linear(8, VOCAB)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.decoder(self.rnn(self.encoder(inputs))[0])
        loss = sum(F.cross_entropy(logits[:, t], targets[:, t]) for t in range(inputs.size(1)))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", reduction=self.reduction)


def build(name: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    if name == "char_rnn":
        torch.manual_seed(0)
        return CharRNN(), TimeFirstStream(VOCAB, steps=STEPS, time_first=False)
    variant, _, rates = name.partition("/")
    return awd(weight_drop=variant, **(RATES if rates == "random" else RATES_0)), TimeFirstStream(VOCAB, steps=STEPS)


def _fit(name: str, strategy, devices: int, callbacks=()) -> dict:
    """Train ``STEPS`` batches (one epoch) and validate on two (the module's own validation_step logs val_loss)."""
    model, data = build(name)
    losses, grads = TrainLosses("train_loss"), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads, *callbacks], max_steps=STEPS, limit_val_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    val = trainer.callback_metrics.get("val_loss")
    return {"losses": losses.values, "grads": grads.steps, "warnings": [str(w.message) for w in caught],
            "val": None if val is None else float(val)}


def _worker(rank: int, world_size: int, runs: list[tuple[str, dict]]) -> list[dict]:
    return [_fit(name, MPLSTMStrategy(**QUIET, **kwargs), world_size) for name, kwargs in runs]


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """Each module trained by its own training_step, Lightning's default strategy, one process: no mp_lstm."""
    return {name: _fit(name, "auto", 1) for name in ("wrapper", "parametrize", "char_rnn")}


# 7 sequences per batch: microbatches of 4 get a padding row, which neither the module's loss nor its penalty sees.
RUNS_2 = [
    ("wrapper", dict(pipeline_parallel_size=2, n_microbatches=2)),
    ("parametrize", dict(pipeline_parallel_size=2, n_microbatches=2, schedule="GPipe")),
    ("wrapper", dict(pipeline_parallel_size=2, n_microbatches=2, schedule="Wavefront", time_chunks=3)),
    ("char_rnn", dict(pipeline_parallel_size=2, n_microbatches=2)),
]
RUNS_4 = [
    ("parametrize", dict(pipeline_parallel_size=4, n_microbatches=2, schedule="GPipe")),
    ("wrapper", dict(pipeline_parallel_size=2, data_parallel_size=2, n_microbatches=2)),
]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_awd_lstm_and_char_rnn_on_two_processes_train_as_their_own_training_step(references):
    per_rank = run_ranks(_worker, 2, RUNS_2, timeout=280)
    for index, (name, _) in enumerate(RUNS_2):
        assert_same_training([rank[index] for rank in per_rank], references[name], STEPS)
        if name != "char_rnn":  # AWD-LSTM's own validation_step (weight drop in eval mode, carried state) too
            assert references[name]["val"] is not None
            assert all(rank[index]["val"] == pytest.approx(references[name]["val"], rel=1e-5) for rank in per_rank)


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_awd_lstm_on_pp4_and_dp2_pp2_trains_as_its_own_training_step(references):
    per_rank = run_ranks(_worker, 4, RUNS_4, timeout=280)
    for index, (name, _) in enumerate(RUNS_4):
        assert_same_training([rank[index] for rank in per_rank], references[name], STEPS)


def test_the_references_are_about_something(references):
    # AR and TAR are part of the loss, the sum over time is T times the token mean: the comparisons above would fail
    # for a pipeline that dropped the penalty or averaged over tokens.
    plain = _fit("wrapper", "auto", 1)  # deterministic: the same run again gives the same curve
    assert plain["losses"] == references["wrapper"]["losses"]
    model, data = build("wrapper")
    batch = data.batches[0]
    logits, _, raw, dropped = model(batch[0])
    penalty = model.activation_penalty(raw, dropped)
    assert float(penalty["ar"]) > 1e-3 and float(penalty["tar"]) > 1e-5
    char, data = build("char_rnn")
    assert references["char_rnn"]["losses"][0][1] > 4 * references["wrapper"]["losses"][0][1]


# ----- every random part runs in the pipeline ------------------------------------------------------------------------
class KeptFractions(pl.Callback):
    """The kept fraction of every Bernoulli mask the training steps draw, by kind (embedding rows, locked masks over
    sequences, recurrent weights), recorded on this process."""

    def __init__(self) -> None:
        self.kept: dict[str, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._tape = RandomTape(0, 0) if batch_idx > 0 else None  # the first batch is verify's
        if self._tape is not None:
            self._tape.__enter__()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self._tape is None:
            return
        self._tape.__exit__(None, None, None)
        for draw in self._tape.draws:
            shape = tuple(draw.values.shape)
            kind = "embedding" if shape == (VOCAB, 1) else "locked" if shape[0] == 1 else "weights"
            self.kept.setdefault(kind, []).append(float((draw.values != 0).float().mean()))


def _random_worker(rank: int, world_size: int) -> dict:
    kept = KeptFractions()
    verified = _fit("wrapper/random", MPLSTMStrategy(**QUIET, pipeline_parallel_size=2, n_microbatches=2,
                                                     verify=True), world_size, [kept])
    rates_0 = _fit("wrapper", MPLSTMStrategy(**QUIET, pipeline_parallel_size=2, n_microbatches=2), world_size)
    return {"random": verified["losses"], "rates_0": rates_0["losses"], "kept": kept.kept,
            "warnings": verified["warnings"] + rates_0["warnings"]}


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_every_random_part_of_awd_lstm_runs_in_the_pipeline():
    per_rank = run_ranks(_random_worker, 2, timeout=280)
    # verify=True replayed the module's own masks into the pipeline at the first batch and found every loss, metric
    # and gradient equal (it raises otherwise), so each random part is drawn where the module draws it.
    random, rates_0 = per_rank[0]["random"], per_rank[0]["rates_0"]
    # The logged values are the global batch's on every rank already: no "use sync_dist=True" warning to act on.
    assert not [w for rank in per_rank for w in rank["warnings"] if "sync_dist" in w]
    assert all(abs(a - b) > 1e-3 for (_, a), (_, b) in zip(random, rates_0))
    # Each kind of mask keeps about 1 - rate of its entries, as on one process: the embedding (0.2) and locked (~0.4)
    # masks on stage 0 (rank 0), the recurrent weights' (0.5) on both stages.
    kept = {kind: sum(v) / len(v) for kind, v in per_rank[0]["kept"].items()}
    assert set(kept) == {"embedding", "locked", "weights"}, kept
    assert abs(kept["embedding"] - 0.8) < 0.12 and abs(kept["weights"] - 0.5) < 0.1 and 0.35 < kept["locked"] < 0.75
    assert set(per_rank[1]["kept"]) == {"locked", "weights"}  # stage 1 holds no embedding

    one = KeptFractions()
    _fit("wrapper/random", "auto", 1, [one])
    single = {kind: sum(v) / len(v) for kind, v in one.kept.items()}
    assert abs(single["embedding"] - kept["embedding"]) < 0.15 and abs(single["weights"] - kept["weights"]) < 0.1


# ----- named before training: what the module's structure shows, never a guess from the step's source ---------------
def _check(model: pl.LightningModule, pipeline_parallel_size: int = 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MPLSTMStrategy(pipeline_parallel_size=pipeline_parallel_size).check(model)
    return [str(w.message) for w in caught if issubclass(w.category, NotReproducedWarning)]


#: AWD-LSTM declared as if it were word_language_model: no embed/after_lstm/penalty methods named.
BasicAwd = load_example("awd_lstm").AwdLSTMAsWordLM


def test_a_module_declared_in_full_is_not_warned_about():
    assert _check(awd()) == []
    assert _check(CharRNN()) == []


class KeepsItsCriterion(CharRNN):
    """Keeps its loss in a submodule, as many modules do, and declares it: cross-entropy averaged over tokens."""

    def __init__(self) -> None:
        super().__init__(reduction="token_mean")
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.decoder(self.rnn(self.encoder(inputs))[0])
        loss = self.criterion(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


def test_a_loss_kept_in_a_submodule_and_declared_is_not_warned_about():
    """Reading the step's source once named self.criterion a submodule the pipeline does not run: a false alarm."""
    assert _check(KeepsItsCriterion()) == []
    assert _check(KeepsItsCriterion(), pipeline_parallel_size=2) == []


class Undeclared(pl.LightningModule):
    """A char-rnn without configure_pipeline whose step does what no structure shows: NLL on log-probabilities,
    a dropout it draws itself, state carried across batches."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 6)
        self.rnn = nn.LSTM(6, 8, 2)
        self.decoder = nn.Linear(8, VOCAB)
        self.drop = nn.Dropout(0.2)
        self.hidden = None

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        output, hidden = self.rnn(F.dropout(self.drop(self.encoder(inputs)), 0.1), self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)
        loss = F.nll_loss(F.log_softmax(self.decoder(output), -1).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


class Wrapped(pl.LightningModule):
    """The blocks in a model of the module's own (``self.model = RNNModel(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Undeclared()


def _suggestion(model: pl.LightningModule) -> str:
    with pytest.raises(ModelDeclarationError) as caught:
        MPLSTMStrategy(pipeline_parallel_size=1).check(model)
    return str(caught.value)


def test_the_declaration_suggested_without_one_comes_from_the_structure_alone():
    message = _suggestion(Undeclared())
    assert ('    def configure_pipeline(self):\n        return LSTMBlocks(embedding="encoder", lstm="rnn", '
            'decoder="decoder", dropout="drop", time_first=True)\n') in message
    assert "from the structure of Undeclared alone, not from its training_step" in message
    assert "batch_first=False" in message and "drop an nn.Dropout" in message
    # What only the step shows is left to its author, named as a list of what to declare, never guessed.
    assert "self.hidden" not in message and "dropout()" not in message
    assert "carry_state=True)" in message and 'loss="nll")' in message and "penalty=)" in message
    assert "by default" in message and "numerically at the first training batch" in message
    assert 'embedding="model.encoder", lstm="model.rnn", decoder="model.decoder", dropout="model.drop"' \
        in _suggestion(Wrapped())


class CarriesWithoutSaying(load_example("awd_lstm").AwdLSTM):
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", embed="embed", after_lstm="after_lstm",
                          loss="lm_loss", penalty="activation_penalty", time_first=True)


class ExtraParameters(CharRNN):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


def test_parameters_outside_the_blocks_stop_the_run_before_training():
    with pytest.raises(ModelDeclarationError, match=r"ExtraParameters has parameters outside its declared blocks, "
                                                    r"which the pipeline would never train: scale"):
        MPLSTMStrategy(pipeline_parallel_size=1).check(ExtraParameters())


class TwoLstmWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.LSTM(6, 8), nn.LSTM(8, 8)


def test_weight_drop_wrappers_are_accepted_and_a_layer_holding_two_lstms_is_named():
    assert _check(awd(weight_drop="wrapper")) == [] and _check(awd(weight_drop="parametrize")) == []
    model = BasicAwd(ntoken=VOCAB, ninp=6, nhid=8)
    model.rnns[1] = TwoLstmWrapper()
    with pytest.raises(ModelDeclarationError, match=r"rnns.1 \(TwoLstmWrapper\) must be an nn.LSTM or a module "
                                                    r"wrapping exactly one .*; it holds 2"):
        MPLSTMStrategy(pipeline_parallel_size=1).check(model)


# ----- verify finds each silent difference when it is put back ------------------------------------------------------
def _verify(model: pl.LightningModule, data: pl.LightningDataModule, passing: bool = False, **kwargs) -> str | None:
    """The verification table when it fails (``None`` when the pipeline reproduces the module; with ``passing``, the
    table then), in process."""
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, verify=True, **QUIET, **kwargs)
    trainer = quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=data)
    except VerificationError as error:
        return str(error)
    finally:
        strategy.shutdown()
    return strategy.verification.table() if passing else None


def _rows(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.endswith("DIFFERS")]


@pytest.mark.processes
def test_verify_passes_for_awd_lstm_with_every_random_part_on():
    for variant in ("wrapper", "parametrize"):
        assert _verify(awd(weight_drop=variant, **RATES), TimeFirstStream(VOCAB)) is None


class NoEmbed(load_example("awd_lstm").AwdLSTM):
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", after_lstm="after_lstm",
                          loss="lm_loss", penalty="activation_penalty", time_first=True, carry_state=True)


class NoPenalty(load_example("awd_lstm").AwdLSTM):
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", embed="embed", after_lstm="after_lstm",
                          loss="lm_loss", time_first=True, carry_state=True)


class LogsMore(load_example("awd_lstm").AwdLSTM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_ppl", loss.exp())
        return loss


@pytest.mark.processes
def test_verify_names_dropped_locked_and_embedding_dropout():
    table = _verify(BasicAwd(ntoken=VOCAB, ninp=6, nhid=8, **RATES), TimeFirstStream(VOCAB))
    rows = _rows(table)
    for block in ("encoder", "rnns.0", "rnns.1", "rnns.2"):
        assert any(f"block {block}: the module's own step draws" in r and "the pipeline never draws" in r
                   for r in rows), (block, table)
    assert any(r.startswith("  step 0 loss") for r in rows)
    table = _verify(NoEmbed(ntoken=VOCAB, ninp=6, nhid=8, **RATES), TimeFirstStream(VOCAB))
    blocks = [r for r in _rows(table) if "the pipeline never draws" in r]
    assert len(blocks) == 1 and "block encoder: the module's own step draws 2 random tensor(s)" in blocks[0], table


@pytest.mark.processes
def test_verify_names_dropped_ar_tar_and_a_metric_that_vanishes():
    table = _verify(NoPenalty(ntoken=VOCAB, ninp=6, nhid=8), TimeFirstStream(VOCAB))
    rows = _rows(table)
    assert any(r.startswith("  step 0 loss") for r in rows)
    assert any("step 0 gradients of rnns.2" in r for r in rows)
    assert "note: metric 'train_ar', which training_step logs, is not logged under mp_lstm" in table
    table = _verify(LogsMore(ntoken=VOCAB, ninp=6, nhid=8), TimeFirstStream(VOCAB), passing=True)
    assert _rows(table) == [] and "note: metric 'train_ppl', which training_step logs, is not logged" in table


@pytest.mark.processes
def test_verify_names_a_sum_over_time_trained_as_a_token_mean():
    assert _verify(CharRNN(), TimeFirstStream(VOCAB, time_first=False)) is None
    rows = _rows(_verify(CharRNN(reduction="token_mean"), TimeFirstStream(VOCAB, time_first=False)))
    assert any(r.startswith("  step 0 loss") for r in rows) and any("gradients of encoder" in r for r in rows)


@pytest.mark.processes
def test_verify_names_state_carried_without_carry_state():
    rows = _rows(_verify(CarriesWithoutSaying(ntoken=VOCAB, ninp=6, nhid=8), TimeFirstStream(VOCAB)))
    assert rows and all(r.startswith("  step 1") for r in rows), rows  # the first step starts from zeros on both


@pytest.mark.processes
def test_verify_names_a_float64_loss_computed_in_float32(monkeypatch):
    def float32_loss(logits, targets, ignore_index):
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                               reduction="sum")

    model, data = CharRNN(), TimeFirstStream(VOCAB, time_first=False)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, verify=True, **QUIET)
    trainer = quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=0, precision="64-true")
    trainer.fit(model, datamodule=data)  # float64 end to end: equal to one process at 1e-10
    strategy.shutdown()
    monkeypatch.setattr("lightning_mp_lstm.models.decoded_loss.token_cross_entropy", float32_loss)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, verify=True, **QUIET)
    trainer = quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=0, precision="64-true")
    with pytest.raises(VerificationError, match=r"step 0 loss .* DIFFERS"):
        trainer.fit(CharRNN(), datamodule=data)
    strategy.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_the_verify_command_runs_on_two_processes_and_fails_on_a_difference(tmp_path):
    example = "docs/examples/awd_lstm.py"
    ok = run_command([sys.executable, "-m", "lightning_mp_lstm.app.verify", f"{example}:AwdLSTM", "--data",
                      f"{example}:RandomStream", "--devices", "2", "--accelerator", "cpu",
                      "--option", "n_microbatches=2"], timeout=110)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "the pipeline reproduces the module's training step" in ok.stdout
    assert ok.stdout.count("step 0 gradients of rnns.2") == 1  # printed once, by rank 0
    differs = run_command([sys.executable, "-m", "lightning_mp_lstm.app.verify", f"{example}:AwdLSTMAsWordLM", "--data",
                           f"{example}:RandomStream", "--devices", "1", "--accelerator", "cpu",
                           "--option", "n_microbatches=2"], timeout=110)
    assert differs.returncode == 1, differs.stdout[-3000:]
    assert "the pipeline does NOT reproduce the module's training step" in differs.stdout


class BackwardOfItsOwn(CharRNN):
    def backward(self, loss, *args, **kwargs):
        (loss * 2).backward()


def test_a_backward_of_the_modules_own_is_named():
    """Lightning's backward calls the module's; under the pipeline the schedule computes the gradients."""
    (message,) = _check(BackwardOfItsOwn())
    assert re.search(r"BackwardOfItsOwn.backward \(backward, line \d+\) is not called: the pipeline runs the "
                     r"backward pass in its schedule", message), message
    assert "on_after_backward" in message


class ClipsInAHook(CharRNN):
    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.25)


def test_a_clip_by_norm_in_a_hook_is_named_where_the_model_is_split():
    """Each process would clip by its own part's norm (one process clips by the whole model's)."""
    (message,) = _check(ClipsInAHook(), pipeline_parallel_size=2)
    assert "clip_grad_norm_(...) in on_before_optimizer_step, line" in message
    assert "clips by the norm of this process's part of the model, not of the whole model" in message
    assert "Trainer(gradient_clip_val=...)" in message
    assert _check(ClipsInAHook()) == []  # one stage holds the whole model: its own norm is the model's


class LogsGradientNorms(CharRNN):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))  # as Lightning's docs show it


def test_a_gradient_norm_logged_in_a_hook_is_named_where_the_model_is_split():
    (message,) = _check(LogsGradientNorms(), pipeline_parallel_size=2)
    assert "grad_norm(...) in on_before_optimizer_step, line" in message
    assert "a total norm it gives is not the whole model's" in message
    assert _check(LogsGradientNorms()) == []  # one stage: its norms are the model's


class LogsEpochMeans(CharRNN):
    """Logs its training loss as lightning-hydra-template does: the epoch's mean, not each step."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.decoder(self.rnn(self.encoder(inputs))[0])
        loss = sum(F.cross_entropy(logits[:, t], targets[:, t]) for t in range(inputs.size(1)))
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


class TrainMetricsByEpoch(pl.Callback):
    """``callback_metrics``' training values at the start of each epoch after the first and at the end."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def _keep(self, trainer) -> None:
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train")})

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            self._keep(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._keep(trainer)


def _epoch_means(strategy, devices: int) -> list[dict[str, float]]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, metrics = LogsEpochMeans(), TrainMetricsByEpoch()
    trainer = quiet_trainer(strategy, devices, [metrics], max_epochs=2, limit_val_batches=0)
    trainer.fit(model, datamodule=TimeFirstStream(VOCAB, steps=STEPS, time_first=False))
    return metrics.seen


def _epoch_means_worker(rank: int, world_size: int) -> list[dict[str, float]]:
    return _epoch_means(MPLSTMStrategy(**QUIET, pipeline_parallel_size=2, n_microbatches=2), world_size)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_a_loss_the_step_logs_as_an_epoch_mean_is_logged_as_one():
    """The pipeline logs the metrics it shares with the module's step with the step's on_step / on_epoch: a monitor
    of the training loss reads the epoch's mean, as in one process (it read the last step's)."""
    reference = _epoch_means("auto", 1)
    assert [sorted(seen) for seen in reference] == [["train_loss"], ["train_loss"]]
    for seen in run_ranks(_epoch_means_worker, 2, timeout=180):  # the strategy adds its speed: train_tokens_per_s_*
        assert len(seen) == 2 and all("train_loss" in epoch for epoch in seen)
        for got, expected in zip(seen, reference, strict=True):
            assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
