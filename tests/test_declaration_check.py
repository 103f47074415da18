"""The numerical check of a declaration runs by default: on the module itself (no copy; fastai's weight-dropped LSTMs
keep non-leaf tensors as attributes), every parameter once whatever its names, only true notes about what it cannot
replay, and what the module logs under a name is what the pipeline logs under it."""

from __future__ import annotations

import copy
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_mp_lstm import LSTMBlocks, LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.strategy.verify import VerificationError
from tests.helpers import TimeFirstStream, quiet_trainer, run_command, run_ranks, tiny_model

VOCAB = 30  # even: tensor parallelism splits the vocabulary in two
QUIET = dict(report_after_steps=None, timeout=60)


class WeightDropped(nn.Module):
    """fastai's ``WeightDropout``: the raw recurrent weight is a parameter of the wrapper, and the LSTM's weight an
    attribute set from it at every forward (a non-leaf tensor at rest: ``copy.deepcopy`` refuses the module; at
    rate 0, the raw parameter itself, a second name of one parameter)."""

    def __init__(self, lstm: nn.LSTM, p: float) -> None:
        super().__init__()
        self.module, self.p = lstm, p
        raw = lstm.weight_hh_l0
        del lstm.weight_hh_l0
        self.register_parameter("weight_hh_l0_raw", nn.Parameter(raw.data))
        setattr(lstm, "weight_hh_l0", raw.clone())
        lstm.flatten_parameters = lambda: None

    def forward(self, x, state=None):
        dropped = self.weight_hh_l0_raw if self.p == 0 else F.dropout(self.weight_hh_l0_raw, self.p, self.training)
        setattr(self.module, "weight_hh_l0", dropped)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.module(x, state)


class Wrapped(pl.LightningModule):
    """A batch-first LM with weight-dropped layers, carried state, a penalty, and a ``train_loss`` that is the
    cross-entropy alone (as fastai reports it); it counts its own steps in an attribute."""

    def __init__(self, p: float = 0.0, logged: str = "cross_entropy") -> None:
        super().__init__()
        self.logged, self.steps_run = logged, 0
        self.encoder = nn.Embedding(VOCAB, 6)
        self.rnns = nn.ModuleList([WeightDropped(nn.LSTM(6, 8, batch_first=True), p),
                                   WeightDropped(nn.LSTM(8, 6, batch_first=True), p)])
        self.decoder = nn.Linear(6, VOCAB)
        self.state = None

    def forward(self, tokens, state=None):
        x, new_state = self.encoder(tokens), []
        for layer, rnn in enumerate(self.rnns):
            x, h = rnn(x, None if state is None else state[layer])
            new_state.append(h)
        return self.decoder(x), x, new_state

    def penalty(self, raw, output):
        return 0.5 * output.pow(2).mean()

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        tokens, targets = batch
        logits, last, state = self(tokens, self.state)
        self.state = [tuple(t.detach() for t in h) for h in state]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss = ce + self.penalty(last, last)
        self.log("train_loss", ce if self.logged == "cross_entropy" else 2 * ce)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", penalty="penalty", carry_state=True)


def _fit(model, strategy, devices=1, steps=2):
    trainer = quiet_trainer(strategy, devices, max_steps=steps, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=TimeFirstStream(VOCAB, steps=steps, time_first=False))
    return trainer


@pytest.mark.processes
def test_the_check_runs_by_default_on_the_module_itself_and_leaves_it_as_it_was():
    for p in (0.0, 0.5):  # at rate 0 the raw weight has a second name: one parameter, compared once
        torch.manual_seed(0)
        model = Wrapped(p)
        with pytest.raises(RuntimeError, match="deepcopy"):
            copy.deepcopy(model)  # what the check must not need
        strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
        trainer = _fit(model, strategy)
        strategy.shutdown()
        table = strategy.verification.table()
        assert strategy.verification.ok and "no gradient" not in table, table
        assert "step 1 gradients of rnns.1" in table and "DIFFERS" not in table
        assert model.steps_run == 0  # the check ran the module's own step twice, then put its attributes back
        # train_loss means the cross-entropy, as the module logs it; the objective keeps a name of its own
        assert "step 0 metric train_loss (the pipeline's declared_loss)" in table
        metrics = trainer.callback_metrics
        assert float(metrics["train_objective"]) > float(metrics["train_loss"]) > 0


@pytest.mark.processes
def test_the_module_logs_the_same_train_loss_as_on_one_process():
    torch.manual_seed(0)
    alone = _fit(Wrapped(), "auto", steps=1).callback_metrics["train_loss"]
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    split = _fit(Wrapped(), strategy, steps=1).callback_metrics["train_loss"]
    strategy.shutdown()
    assert float(split) == pytest.approx(float(alone), rel=1e-5)


class LogsAMetricObject(Wrapped):
    """Logs a torchmetrics metric object beside its loss, as Lightning documents it (``self.log(name, metric)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss(loss.detach())
        self.log("train_mean_loss", self.mean_loss)
        return loss


class OwnLanguageModel(LSTMLanguageModel):
    """The library's model as a user's subclass: its declaration is checked (the library's own class is not)."""


@pytest.mark.processes
def test_a_logged_metric_object_and_the_speed_at_a_logging_step_leave_the_check_running():
    """The check's own log took every value for a number: a metric object (the module's own, or the speed's mean the
    language model logs at a logging step, here every step) stopped the run with a TypeError before its first step."""
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    _fit(LogsAMetricObject(), strategy)
    strategy.shutdown()
    table = strategy.verification.table()
    assert strategy.verification.ok and "step 1 metric train_loss" in table, table
    # On step Lightning logs a metric's last forward: here the step's objective, which the pipeline has too.
    assert "step 1 metric train_mean_loss (the pipeline's loss)" in table, table
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    trainer = quiet_trainer(strategy, 1, max_steps=2, limit_val_batches=0, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(OwnLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2),
                    datamodule=TimeFirstStream(VOCAB, steps=2, time_first=False))
    strategy.shutdown()
    table = strategy.verification.table()
    assert strategy.verification.ok and "step 1 metric train/loss" in table, table
    assert "tokens_per_s" not in table  # the strategy logs the speed itself: no note that it would not
    assert float(trainer.callback_metrics["train/tokens_per_s_step"]) > 0


@pytest.mark.processes
def test_a_logged_name_that_means_something_else_stops_the_run():
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    torch.manual_seed(0)
    with pytest.raises(VerificationError, match=r"step 0 metric train_loss .* DIFFERS"):
        _fit(Wrapped(logged="twice"), strategy)
    strategy.shutdown()


@pytest.mark.processes
def test_verify_false_and_the_librarys_own_model_skip_it_and_a_bad_value_is_named(caplog):
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, verify=False, **QUIET)
    torch.manual_seed(0)
    _fit(Wrapped(logged="twice"), strategy)  # trains: nothing compared
    strategy.shutdown()
    assert strategy.verification is None
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    with caplog.at_level("INFO"):
        _fit(tiny_model(vocab=VOCAB), strategy, steps=1)
    strategy.shutdown()
    assert "the numerical check of the declaration is skipped: LSTMLanguageModel is this library's own model" \
        in caplog.text
    with pytest.raises(ValueError, match=r"verify must be True, False or 'auto', got 'yes'"):
        MPLSTMStrategy(verify="yes")


class _Validated(Wrapped):
    def validation_step(self, batch, batch_idx):  # the strategy runs the pipeline's own evaluation step
        return None


@pytest.mark.processes
def test_a_fit_after_a_validation_of_the_same_trainer_says_the_check_is_skipped(caplog):
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    trainer = quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=1)
    data = TimeFirstStream(VOCAB, steps=1, time_first=False)
    torch.manual_seed(0)
    model = _Validated()
    with caplog.at_level("INFO"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.validate(model, datamodule=data, verbose=False)
            trainer.fit(model, datamodule=data)
        finally:
            strategy.shutdown()
    assert strategy.verification is None and model.steps_run == 0  # its own training_step never ran
    assert "the numerical check of the declaration is skipped: an earlier validate, test or predict of this " \
        "Trainer built the pipeline; fit first to check it" in caplog.text


def _skipped_when_built_on_meta(rank: int, world_size: int) -> tuple[bool, int]:
    strategy = MPLSTMStrategy(pipeline_parallel_size=2, n_microbatches=2, **QUIET)
    trainer = quiet_trainer(strategy, world_size, max_steps=1, limit_val_batches=0)
    with trainer.init_module(empty_init=True):
        torch.manual_seed(0)
        model = KernelDropout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=TimeFirstStream(VOCAB, steps=1, time_first=False))
    return strategy.verification is None, sum(p.numel() for p in model.parameters())


LAYOUTS = {"pp2": dict(pipeline_parallel_size=2), "dp2": dict(pipeline_parallel_size=1, data_parallel_size=2),
           "tp2": dict(pipeline_parallel_size=1, tensor_parallel_size=2)}


def _checked_on_two_processes(rank: int, world_size: int) -> dict[str, tuple[str | None, list[str]]]:
    out = {}
    for name, layout in LAYOUTS.items():
        torch.manual_seed(0)
        model = Wrapped(0.5)
        strategy = MPLSTMStrategy(n_microbatches=2, **layout, **QUIET)
        _fit(model, strategy, devices=world_size)
        table = strategy.verification.table() if strategy.verification is not None else None
        out[name] = (table, sorted({n.split(".")[0] for n, _ in model.named_parameters()}))
    return out


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_on_two_processes_every_layout_passes_and_each_rank_keeps_its_blocks_and_a_meta_module_skips_it():
    first, second = run_ranks(_checked_on_two_processes, 2, timeout=220)
    for name in LAYOUTS:
        assert first[name][0] is not None and "the pipeline reproduces the module's training step" in first[name][0]
    assert first["pp2"][1] == ["encoder", "rnns"] and second["pp2"][1] == ["decoder", "rnns"]  # its own blocks again
    assert first["dp2"][1] == second["dp2"][1] == ["decoder", "encoder", "rnns"]
    for skipped, _ in run_ranks(_skipped_when_built_on_meta, 2, timeout=180):
        assert skipped


class PerCharacter(pl.LightningModule):
    """char-rnn as its tutorial trains it: the loss summed over the sequence's characters (a mean over sequences),
    logged per character."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Embedding(VOCAB, 6), nn.Linear(8, VOCAB)
        self.rnn = nn.LSTM(6, 8, batch_first=True)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.decoder(self.rnn(self.encoder(inputs))[0])
        loss = sum(F.cross_entropy(logits[:, t], targets[:, t]) for t in range(inputs.size(1)))
        self.log("train_loss", loss / inputs.size(1))
        self.log("train_perplexity", (loss / inputs.size(1)).exp())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", reduction="sequence_mean")


@pytest.mark.processes
def test_a_loss_logged_per_character_is_logged_per_character():
    torch.manual_seed(0)
    alone = _fit(PerCharacter(), "auto", steps=1).callback_metrics
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    split = _fit(PerCharacter(), strategy, steps=1).callback_metrics
    strategy.shutdown()
    table = strategy.verification.table()
    assert "step 0 metric train_loss (the pipeline's loss_per_token)" in table, table
    assert "step 0 metric train_perplexity (the pipeline's ppl)" in table, table
    for name in ("train_loss", "train_perplexity"):
        assert float(split[name]) == pytest.approx(float(alone[name]), rel=1e-5)
    assert float(split["train_objective"]) == pytest.approx(6 * float(alone["train_loss"]), rel=1e-5)  # 6 steps


class KernelDropout(pl.LightningModule):
    """Lightning's demo LSTM: a 3-layer ``nn.LSTM`` with dropout 0.2 inside its kernel, state carried."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB)
        self.rnn = nn.LSTM(6, 6, 3, dropout=0.2, batch_first=True)
        self.hidden = None

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        output, hidden = self.rnn(self.encoder(tokens), self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)
        loss = F.cross_entropy(self.decoder(output).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", carry_state=True)


@pytest.mark.processes
def test_the_kernels_own_dropout_runs_at_rate_0_on_both_sides_and_the_note_says_so():
    torch.manual_seed(0)
    model = KernelDropout()
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    _fit(model, strategy)
    strategy.shutdown()
    table = strategy.verification.table()
    assert strategy.verification.ok, table
    assert "note: the multi-layer nn.LSTM's own dropout (0.2) is drawn inside torch's kernel" in table
    assert "both sides ran it at rate 0 here" in table
    assert model.rnn.dropout == 0.2  # put back


@pytest.mark.timeout(150)
def test_the_verify_command_passes_on_fastais_own_awd_lstm():
    pytest.importorskip("fastai")
    example = "docs/examples/fastai_awd_lstm.py"
    done = run_command([sys.executable, "-m", "lightning_mp_lstm.app.verify", f"{example}:FastaiAwdLM", "--data",
                        f"{example}:RandomBatches", "--devices", "2", "--accelerator", "cpu"], timeout=140)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "the pipeline reproduces the module's training step" in done.stdout
    assert "step 1 gradients of encoder.rnns.2" in done.stdout


def _demo(declaration: str | None) -> pl.LightningModule:
    """Lightning's own demo LSTM (``lightning.pytorch.demos.lstm``: a 2-layer ``nn.LSTM`` with dropout 0.2 in its
    kernel, ``F.log_softmax`` + ``nll_loss``, ``self.hidden`` carried across batches), small, with a declaration
    given as source."""
    from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM

    class Demo(LightningLSTM):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
            pass

        def configure_pipeline(self):
            return eval(declaration)  # noqa: S307  (the suggestion's own text)

    torch.manual_seed(0)
    model = Demo(vocab_size=VOCAB)
    model.model = SimpleLSTM(VOCAB, ninp=8, nhid=8, nlayers=2)
    return model


@pytest.mark.processes
def test_lightnings_demo_trains_declared_and_its_suggested_declaration_is_stopped():
    from lightning_mp_lstm.models.declaration import missing_declaration_message

    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    declared = ('LSTMBlocks(embedding="model.encoder", lstm="model.rnn", decoder="model.decoder", '
                'dropout="model.drop", loss="nll", carry_state=True)')
    _fit(_demo(declared), strategy)
    strategy.shutdown()
    assert strategy.verification.ok and "the multi-layer nn.LSTM's own dropout (0.2)" in strategy.verification.table()
    suggestion = missing_declaration_message(_demo(None))
    suggested = next(line.strip()[len("return "):] for line in suggestion.splitlines() if "return LSTMBlocks(" in line)
    assert "carry_state" not in suggested  # the module's structure cannot show it
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    with pytest.raises(VerificationError, match=r"step 1 loss .* DIFFERS"):  # it carries self.hidden: step 1 differs
        _fit(_demo(suggested), strategy)
    strategy.shutdown()


class TwoNames(KernelDropout):
    """Logs its loss under two names (and under a name the pipeline's log_name does not use)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/nll", loss)
        return loss


@pytest.mark.processes
def test_a_quantity_the_module_logs_under_two_names_is_logged_under_both():
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, **QUIET)
    metrics = _fit(TwoNames(), strategy, steps=1).callback_metrics
    strategy.shutdown()
    assert strategy.verification.names == {"loss": ["train/nll", "train_loss"]}
    assert float(metrics["train/nll"]) == float(metrics["train_loss"]) > 0
