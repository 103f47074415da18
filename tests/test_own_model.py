"""A user's own LSTM LightningModule, written as pytorch/examples' word_language_model and AWD-LSTM write theirs,
trains with ``strategy="mp_lstm"`` after one declaration (``configure_pipeline``) and nothing else: on pp2, pp4
(one layer per stage), dp2 x pp2 and an interleaved schedule its losses and every gradient equal the same module
trained without the strategy on one process, and its pipelined checkpoint loads into the plain module."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMBlocks, ModelDeclarationError, MPLSTMStrategy
from lightning_mp_lstm.pipeline.engine import PipelineEngine
from tests.helpers import (
    Gradients,
    TimeFirstStream,
    TrainLosses,
    assert_same_training,
    parameters_of,
    quiet_trainer,
    rel_error,
    run_ranks,
)

NTOKEN, STEPS, BPTT, BSZ = 29, 5, 6, 8


# ----- the users' modules, as they write them -------------------------------------------------------------
def repackage_hidden(h):
    """word_language_model's helper: detach the hidden state from its history."""
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


class WordLM(pl.LightningModule):
    """pytorch/examples word_language_model's RNNModel (LSTM), in a LightningModule: time-first batches, flat targets,
    log-softmax + NLL, the hidden state carried across BPTT windows."""

    def __init__(self, ntoken: int = NTOKEN, ninp: int = 6, nhid: int = 8, nlayers: int = 2, dropout: float = 0.0,
                 lr: float = 10.0) -> None:
        super().__init__()
        self.ntoken, self.lr = ntoken, lr
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)
        self.hidden = None

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def training_step(self, batch, batch_idx):
        data, targets = batch
        if batch_idx == 0:
            self.hidden = None
        output, hidden = self(data, self.hidden)
        self.hidden = repackage_hidden(hidden)
        loss = F.nll_loss(output, targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    # The declaration: the only addition for mp_lstm.
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", dropout="drop", loss="nll",
                          time_first=True, carry_state=True)


class AwdLM(pl.LightningModule):
    """AWD-LSTM's shape: a ModuleList of one-layer LSTMs (the last as wide as the embedding), tied weights,
    time-first batches, cross-entropy on logits, the hidden state carried across batches (Adam here)."""

    def __init__(self, ntoken: int = NTOKEN, ninp: int = 6, nhid: int = 8, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnns = nn.ModuleList([nn.LSTM(ninp if layer == 0 else nhid, nhid if layer != nlayers - 1 else ninp, 1)
                                   for layer in range(nlayers)])
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight
        self.hidden = None

    def forward(self, input, hidden):
        output = self.encoder(input)
        new_hidden = []
        for layer, rnn in enumerate(self.rnns):
            output, h = rnn(output, hidden[layer] if hidden is not None else None)
            new_hidden.append(h)
        return self.decoder(output), new_hidden

    def training_step(self, batch, batch_idx):
        data, targets = batch
        if batch_idx == 0:
            self.hidden = None
        logits, hidden = self(data, self.hidden)
        self.hidden = [repackage_hidden(h) for h in hidden]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder", time_first=True, carry_state=True)


MODELS = {"word_lm": WordLM, "awd": AwdLM}


def StreamData() -> TimeFirstStream:  # noqa: N802  (the data module's name in these tests)
    """word_language_model's batchify + get_batch: one token stream in BSZ columns, BPTT-long time-first windows,
    flat targets."""
    return TimeFirstStream(NTOKEN, rows=BSZ, bptt=BPTT, steps=STEPS)


# ----- runs ------------------------------------------------------------------------------------------------
def _fit(model_name: str, strategy, devices: int, save: Path | None = None) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = MODELS[model_name]()
    losses, grads = TrainLosses("train_loss"), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, limit_val_batches=0)
    trainer.fit(model, datamodule=StreamData())
    if save is not None:
        trainer.save_checkpoint(save)
    # Ownership runs one way: the strategy holds the engine, the module never does.
    holds_engine = any(isinstance(value, PipelineEngine) for value in vars(model).values())
    return {"losses": losses.values, "grads": grads.steps, "params": parameters_of(model), "holds_engine": holds_engine}


def _worker(rank: int, world_size: int, runs: list[tuple[str, dict]], directory: str) -> list[dict]:
    results = []
    for model_name, kwargs in runs:
        save = Path(directory, f"{model_name}.ckpt") if kwargs.get("pipeline_parallel_size") == 2 and world_size == 2 \
            and "stages_per_rank" not in kwargs else None
        results.append(_fit(model_name, MPLSTMStrategy(report_after_steps=None, timeout=60, **kwargs), world_size,
                            save))
    return results


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """Each module trained by Lightning's default strategy on one process: no mp_lstm anywhere."""
    return {name: _fit(name, "auto", 1) for name in MODELS}


RUNS_2 = [(name, kwargs) for name in MODELS for kwargs in (
    dict(pipeline_parallel_size=2, n_microbatches=2),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2))]
RUNS_4 = [(name, kwargs) for name in MODELS for kwargs in (
    dict(pipeline_parallel_size=4, partition="per_block", schedule="GPipe", n_microbatches=2),  # one layer per stage
    dict(pipeline_parallel_size=2, data_parallel_size=2, n_microbatches=2))]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_own_models_on_two_processes_equal_one_plain_process(references, tmp_path):
    per_rank = run_ranks(_worker, 2, RUNS_2, str(tmp_path), timeout=280)
    for index, (name, _) in enumerate(RUNS_2):
        assert_same_training([rank[index] for rank in per_rank], references[name], STEPS)
        assert not any(rank[index]["holds_engine"] for rank in per_rank)
    # The pp2 checkpoint is the plain module's: it loads strictly and holds the one-process run's parameters.
    for name, cls in MODELS.items():
        plain = cls()
        plain.load_state_dict(torch.load(tmp_path / f"{name}.ckpt", weights_only=False)["state_dict"], strict=True)
        trained = references[name]["params"]
        for key, value in plain.named_parameters():
            assert rel_error(value, trained[key]) < 1e-5, (name, key)


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_own_models_on_four_processes_equal_one_plain_process(references, tmp_path):
    per_rank = run_ranks(_worker, 4, RUNS_4, str(tmp_path), timeout=280)
    for index, (name, _) in enumerate(RUNS_4):
        assert_same_training([rank[index] for rank in per_rank], references[name], STEPS)


def test_the_reference_trains_and_carries_its_state(references):
    # The comparison is about something: training moved every parameter, and carrying the state matters from the
    # second batch on.
    for name, reference in references.items():
        torch.manual_seed(0)
        initial = parameters_of(MODELS[name]())
        assert len(reference["losses"]) == STEPS
        assert all(rel_error(initial[k], v) > 1e-3 for k, v in reference["params"].items()), name
    torch.manual_seed(0)
    model = WordLM()
    first, second, *_ = StreamData().train_dataloader()
    model.training_step(first, 0)
    carried = F.nll_loss(model(second[0], model.hidden)[0], second[1])
    fresh = F.nll_loss(model(second[0], None)[0], second[1])
    assert abs(float(carried) - float(fresh)) > 1e-4


# ----- the way in: errors that point at the fix ---------------------------------------------------------------
class Undeclared(WordLM):
    configure_pipeline = None  # the plain module, before its author adds the declaration


def test_a_module_without_declaration_gets_one_message_with_the_fix():
    with pytest.raises(ModelDeclarationError) as caught:
        MPLSTMStrategy(pipeline_parallel_size=1).check(Undeclared())
    message = str(caught.value)
    assert "def configure_pipeline(self):" in message
    # The names and what its submodules show (time-first batches, its nn.Dropout); what only its step shows (NLL, the
    # carried hidden state) is its author's to declare, and the numerical check at the first batch holds them to it.
    assert ('return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", dropout="drop", '
            'time_first=True)\n') in message
    assert "batch_first=False" in message and "self.hidden" not in message
    assert 'loss="nll"' in message and "carry_state=True" in message and "numerically" in message
    assert "docs/bring_your_own_model.md" in message and "verify=" in message and "lacks" not in message


@pytest.mark.parametrize("declaration, error", [
    (dict(embedding="embed", lstm="rnn", decoder="decoder"),
     r"Declared has no submodule 'embed' \(declared as an nn.Embedding\); its submodules: \['drop', 'encoder'"),
    (dict(embedding="encoder", lstm="decoder", decoder="decoder"),
     r"LSTMBlocks.lstm='decoder' must be an nn.LSTM or an nn.ModuleList of one-layer LSTMs, got Linear"),
    (dict(embedding="encoder", lstm="rnn", decoder="rnn"),
     r"'rnn' must be an nn.Linear or an nn.AdaptiveLogSoftmaxWithLoss, got LSTM"),
    (dict(embedding="encoder", lstm="rnn", decoder="decoder", loss="mse"),
     r"LSTMBlocks.loss='mse': Declared has no method 'mse'; its own methods: \[.*'configure_pipeline'"),
])
def test_a_declaration_that_does_not_fit_is_named(declaration, error):
    class Declared(WordLM):
        def configure_pipeline(self):
            return LSTMBlocks(**declaration)

    with pytest.raises(ModelDeclarationError, match=error):
        MPLSTMStrategy(pipeline_parallel_size=1).check(Declared())


class BatchFirstDeclared(WordLM):
    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", dropout="drop", loss="nll")


@pytest.mark.parametrize("reshape, message", [
    (False, r"flat targets of shape \(48,\) for inputs of shape \(6, 8\): that is how time-first batches"),
    (True, r"targets are the next tokens along dimension 0, not along the declared time dimension 1: inputs of "
           r"shape \(6, 8\) are \(T, B\) = 6 steps of 8 sequences; declare LSTMBlocks\(..., time_first=True\)"),
])
def test_time_first_batches_without_the_flag_are_refused_never_trained_as_the_wrong_shape(reshape, message):
    from lightning_mp_lstm.models.binding import pipeline_model

    data, targets = next(iter(StreamData().train_dataloader()))
    blocks = pipeline_model(BatchFirstDeclared())
    with pytest.raises(ValueError, match=message):
        blocks.prepare_batch((data, targets.view(data.shape) if reshape else targets))
