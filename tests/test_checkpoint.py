"""Checkpoints written under the mp_lstm strategy are layout-independent, complete and written atomically.

One 2-rank run (``_worker``) writes every checkpoint the tests below read; the single-process references
run in this process.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm import checkpoint as checkpoint_module
from lightning_mp_lstm.checkpoint import (
    AtomicCheckpointIO,
    CheckpointError,
    name_keyed_optimizer_state,
    read_checkpoint,
)
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.data.vocab import Vocabulary
from tests.helpers import VOCAB, FixedBatches, ValLosses, rel_error, run_ranks

N_EPOCHS, M_EPOCHS = 2, 1  # fit N epochs on pp=2, then resume for M more on another layout
SYNTHETIC = {"source": "synthetic", "batch_size": 8, "num_auto_buckets": 3,
             "synthetic": {"num_train": 200, "num_valid": 20, "num_test": 20, "vocab_size": 40, "max_length": 12}}


def _three_batches() -> FixedBatches:
    """Three training batches of 8 rows per epoch, two validation batches."""
    return FixedBatches((5, 9, 7))


def _model(lr: float = 0.01, vocab: int = VOCAB) -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(vocab, embedding_dim=6, hidden_size=8, num_layers=2, optimizer="adam", lr=lr)


def _trainer(strategy, devices: int, max_epochs: int = N_EPOCHS, callbacks=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )


def _pp2(**kwargs) -> MPLSTMStrategy:
    return MPLSTMStrategy(**{"n_microbatches": 2, "report_after_steps": None, "timeout": 60, **kwargs})


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _FailingWrite:
    """Replaces the checkpoint writer: writes half of the bytes, then fails like a full disk."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, checkpoint, handle):
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        handle.write(buffer.getvalue()[: buffer.tell() // 2])
        handle.flush()
        self.calls.append(handle.name)
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    warnings.filterwarnings("ignore")
    tmp_dir = Path(tmp)
    out: dict = {}

    # 1. N epochs on pp=2 (1F1B, even partition), Adam; a checkpoint at the end.
    model = _model()
    trainer = _trainer(_pp2(), 2)
    trainer.fit(model, datamodule=_three_batches())
    trainer.save_checkpoint(tmp_dir / "n.ckpt")
    optimizer = trainer.optimizers[0]
    out["params"] = _params(model)
    out["adam"] = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    out["val_loss"] = float(trainer.callback_metrics["val/loss"])
    out["global_step"] = trainer.global_step

    # 2. The same path overwritten by a save that fails half-way through writing (on rank 0, the writer).
    failing = _FailingWrite()
    original_write = checkpoint_module._serialize
    if rank == 0:
        checkpoint_module._serialize = failing
    try:
        trainer.save_checkpoint(tmp_dir / "n.ckpt")
        out["failed_save"] = None
    except OSError as err:  # every rank gets the writer's error (no rank is left waiting in a barrier)
        out["failed_save"] = str(err)
    finally:
        checkpoint_module._serialize = original_write
    out["failed_writes"] = failing.calls
    out["temp_left"] = [p for p in failing.calls if os.path.exists(p)]

    # 2b. strict_loading: a checkpoint with an extra tensor and without decoder.bias.
    lenient = torch.load(tmp_dir / "n.ckpt", weights_only=False)
    lenient["state_dict"]["extra.weight"] = torch.zeros(2)
    del lenient["state_dict"]["decoder.bias"]
    torch.save(lenient, tmp_dir / f"lenient{rank}.ckpt")
    for strict in (True, False):
        model = _model()
        model.strict_loading = strict
        trainer = _trainer(_pp2(), 2)
        try:
            trainer.validate(model, datamodule=_three_batches(), ckpt_path=tmp_dir / f"lenient{rank}.ckpt",
                             verbose=False)
            out[f"strict={strict}"] = {"params": _params(model), "initial_bias": _model().decoder.bias.detach()}
        except ValueError as err:
            out[f"strict={strict}"] = f"{type(err).__name__}: {err}"

    # 3. Resume for M more epochs on a different layout: interleaved, 4 stages of one block each.
    model = _model()
    trainer = _trainer(_pp2(stages_per_rank=2, schedule="Interleaved1F1B"), 2, max_epochs=N_EPOCHS + M_EPOCHS)
    trainer.fit(model, datamodule=_three_batches(), ckpt_path=tmp_dir / "n.ckpt")
    trainer.save_checkpoint(tmp_dir / "resumed_interleaved.ckpt")
    out["resumed_params"] = _params(model)
    out["resumed_global_step"] = trainer.global_step

    # 4. ModelCheckpoint(monitor="val/loss") with a validation loss that falls, then rises (large lr).
    model = _model(lr=0.2)
    val_losses = ValLosses()
    best = ModelCheckpoint(dirpath=tmp_dir / "best", monitor="val/loss", mode="min", save_top_k=1, filename="{epoch}")
    trainer = _trainer(_pp2(), 2, max_epochs=4, callbacks=[val_losses, best])
    trainer.fit(model, datamodule=FixedBatches((5, 9, 7), validate_on_train=True))
    trainer.strategy.barrier()
    out["best"] = {"path": best.best_model_path, "score": float(best.best_model_score), "val": val_losses.values,
                   "files": sorted(os.listdir(tmp_dir / "best"))}

    # 5. The synthetic data module's vocabulary goes into the checkpoint.
    datamodule = LMDataModule(**SYNTHETIC)
    datamodule.prepare_vocab()
    model = _model(vocab=datamodule.vocab_size)
    trainer = _trainer(_pp2(), 2, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(model, datamodule=datamodule)
    trainer.save_checkpoint(tmp_dir / "synthetic.ckpt")
    out["vocab"] = datamodule.vocab.state_dict()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("mp_lstm_ckpt")
    return run_ranks(_worker, 2, str(tmp), timeout=150), tmp


def _reference_fit(
    max_epochs: int, ckpt_path=None, lr: float = 0.01, callbacks=(), validate_on_train: bool = False
) -> tuple[pl.Trainer, LSTMLanguageModel]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = _model(lr=lr)
    trainer = _trainer("auto", 1, max_epochs=max_epochs, callbacks=callbacks)
    trainer.fit(model, datamodule=FixedBatches((5, 9, 7), validate_on_train=validate_on_train), ckpt_path=ckpt_path)
    return trainer, model


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_checkpoint_holds_the_full_model_and_name_keyed_optimizer_state(run):
    results, tmp = run
    ckpt = _load(tmp / "n.ckpt")
    full_names = list(_model().state_dict())
    assert sorted(ckpt["state_dict"]) == sorted(full_names)
    assert {"embedding.weight", "lstm.0.weight_ih_l0", "lstm.1.bias_hh_l0", "decoder.weight", "decoder.bias"} <= set(
        ckpt["state_dict"])
    # Each rank holds its own blocks only; together exactly the checkpoint's tensors.
    held = [set(r["params"]) for r in results]
    assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == set(full_names)
    assert "embedding.weight" in held[0] and "decoder.weight" in held[1]
    for r in results:
        for name, value in r["params"].items():
            assert torch.equal(ckpt["state_dict"][name], value), name
    (opt,) = ckpt["optimizer_states"]
    assert sorted(opt["state"]) == sorted(full_names)
    # Parameter order in the groups is the model's, so a plain optimizer over the full model can load it.
    assert [n for g in opt["param_groups"] for n in g["params"]] == [n for n, _ in _model().named_parameters()]
    for r in results:
        for name, state in r["adam"].items():
            assert set(opt["state"][name]) == set(state)
            for key, value in state.items():
                assert torch.equal(opt["state"][name][key], value), (name, key)
    assert int(opt["state"]["decoder.bias"]["step"]) == results[0]["global_step"] == 3 * N_EPOCHS
    assert ckpt["global_step"] == 3 * N_EPOCHS and ckpt["epoch"] == N_EPOCHS


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_checkpoint_loads_into_one_process_with_the_same_validation_loss(run):
    results, tmp = run
    model = LSTMLanguageModel.load_from_checkpoint(tmp / "n.ckpt", map_location="cpu")
    assert model.hparams.optimizer == "adam" and model.hparams.vocab_size == VOCAB
    for r in results:
        for name, value in r["params"].items():
            assert torch.equal(model.state_dict()[name], value), name
    trainer = _trainer("auto", 1)
    (metrics,) = trainer.validate(model, datamodule=_three_batches(), verbose=False)
    assert metrics["val/loss"] == pytest.approx(results[0]["val_loss"], rel=1e-6)
    assert results[0]["val_loss"] == results[1]["val_loss"]
    # And the plain torch.load route.
    plain = _model()
    plain.load_state_dict(_load(tmp / "n.ckpt")["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_resume_on_other_layouts_equals_an_uninterrupted_run(run):
    results, tmp = run
    _, uninterrupted = _reference_fit(N_EPOCHS + M_EPOCHS)
    reference = _params(uninterrupted)
    # pp=2 (1F1B, 2 stages) -> pp=2 (Interleaved1F1B, 4 stages, non-contiguous blocks per rank).
    merged = {**results[0]["resumed_params"], **results[1]["resumed_params"]}
    assert merged.keys() == reference.keys()
    assert results[0]["resumed_global_step"] == 3 * (N_EPOCHS + M_EPOCHS)
    for name, ref in reference.items():
        assert rel_error(merged[name], ref) < 1e-5, name
    # pp=2 -> one process, Lightning's default strategy.
    trainer, resumed = _reference_fit(N_EPOCHS + M_EPOCHS, ckpt_path=tmp / "n.ckpt")
    assert trainer.global_step == 3 * (N_EPOCHS + M_EPOCHS)
    for name, param in _params(resumed).items():
        assert rel_error(param, reference[name]) < 1e-5, name
    # Without the optimizer state the resumed run differs (so the comparison above is meaningful).
    ckpt = _load(tmp / "n.ckpt")
    assert ckpt["optimizer_states"][0]["state"]
    ckpt["optimizer_states"][0]["state"] = {}
    torch.save(ckpt, tmp / "no_optimizer_state.ckpt")
    _, stateless = _reference_fit(N_EPOCHS + M_EPOCHS, ckpt_path=tmp / "no_optimizer_state.ckpt")
    assert max(rel_error(p, reference[n]) for n, p in _params(stateless).items()) > 1e-3


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_checkpoint_of_an_interleaved_layout_loads_into_a_plain_optimizer(run):
    """Rank 0 holds ``embedding`` + ``lstm.1``, rank 1 ``lstm.0`` + ``decoder``: the merged groups must still
    list parameters in model order, or a plain optimizer pairs ``lstm.1``'s moments with ``lstm.0``."""
    _, tmp = run
    ckpt = _load(tmp / "resumed_interleaved.ckpt")
    (state,) = ckpt["optimizer_states"]
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert [n for g in state["param_groups"] for n in g["params"]] == names
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.load_state_dict(state)
    for name, param in model.named_parameters():
        loaded = optimizer.state[param]
        assert loaded["exp_avg"].shape == param.shape, name
        assert torch.equal(loaded["exp_avg_sq"], state["state"][name]["exp_avg_sq"]), name
        assert int(loaded["step"]) == 3 * (N_EPOCHS + M_EPOCHS)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_model_checkpoint_picks_the_same_best_checkpoint_on_every_rank(run):
    results, _ = run
    first, second = results[0]["best"], results[1]["best"]
    assert first == second
    values = first["val"]
    assert len(values) == 4
    best_epoch = min(range(len(values)), key=values.__getitem__)
    assert 0 < best_epoch < len(values) - 1  # neither the first nor the last epoch: the choice matters
    assert first["score"] == pytest.approx(values[best_epoch], rel=1e-6)
    assert Path(first["path"]).name == f"epoch={best_epoch}.ckpt" and first["files"] == [f"epoch={best_epoch}.ckpt"]
    # The same epoch a single process picks, and the file holds that epoch's full model.
    reference_values = ValLosses()
    _reference_fit(4, lr=0.2, callbacks=[reference_values], validate_on_train=True)
    assert values == pytest.approx(reference_values.values, rel=1e-4)
    ckpt = _load(first["path"])
    assert ckpt["epoch"] == best_epoch and sorted(ckpt["state_dict"]) == sorted(_model().state_dict())
    assert ckpt["callbacks"][next(k for k in ckpt["callbacks"] if k.startswith("ModelCheckpoint"))][
        "best_model_score"] == pytest.approx(values[best_epoch], rel=1e-6)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_strict_loading_is_honoured_on_every_rank(run):
    results, _ = run
    for rank, r in enumerate(results):
        # Strict (the default): the message names what is missing and what is extra; no rank loads anything.
        assert r["strict=True"].startswith("CheckpointError: the checkpoint does not fit the model: missing"), rank
        assert ("['decoder.bias']" in r["strict=True"]) == (rank == 1), rank  # the rank that holds the decoder
        assert "unexpected ['extra.weight']" in r["strict=True"], rank
        # strict_loading = False: every tensor present is loaded, decoder.bias keeps its initial value.
        lenient = r["strict=False"]
        for name, value in lenient["params"].items():
            expected = lenient["initial_bias"] if name == "decoder.bias" else r["params"][name]
            assert torch.equal(value, expected), (rank, name)


def test_a_one_process_optimizer_state_is_keyed_by_name_for_any_layout():
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randint(1, VOCAB, (2, 3)))[0].sum().backward()
    optimizer.step()
    positional = optimizer.state_dict()  # what Lightning's default strategy saves: parameters by position
    keyed = name_keyed_optimizer_state(positional, names)
    assert [n for g in keyed["param_groups"] for n in g["params"]] == names
    for i, name in enumerate(names):
        assert torch.equal(keyed["state"][name]["exp_avg"], positional["state"][i]["exp_avg"]), name
    assert name_keyed_optimizer_state(keyed, names) == keyed  # already by name: unchanged
    with pytest.raises(CheckpointError, match=r"keyed by position .* lists 11 parameters, but the model has 12"):
        name_keyed_optimizer_state(positional, [*names, "lstm.2.weight_ih_l0"])


@pytest.mark.processes
def test_data_module_vocabulary_is_in_the_checkpoint(run):
    results, tmp = run
    ckpt = _load(tmp / "synthetic.ckpt")
    assert results[0]["vocab"] == results[1]["vocab"]
    saved = ckpt[LMDataModule.__qualname__]
    assert saved == {"vocab": results[0]["vocab"]}
    vocab = Vocabulary.from_state_dict(saved["vocab"])
    assert len(vocab) == ckpt["hyper_parameters"]["vocab_size"] == ckpt["state_dict"]["embedding.weight"].shape[0]
    # A data module that would build another vocabulary takes the checkpoint's.
    other = LMDataModule(**{**SYNTHETIC, "synthetic": {**SYNTHETIC["synthetic"], "num_train": 30}})
    other.load_state_dict(saved)
    other.setup()
    assert other.vocab == vocab
    fewer = LMDataModule(**{**SYNTHETIC, "synthetic": {**SYNTHETIC["synthetic"], "num_train": 30}})
    assert fewer.prepare_vocab() != vocab


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_a_save_failing_mid_write_keeps_the_previous_checkpoint(run):
    results, tmp = run
    # Rank 0 (the writer) got the error half-way through writing; rank 1 wrote nothing but raises it too.
    assert "No space left on device" in results[0]["failed_save"] and len(results[0]["failed_writes"]) == 1
    assert results[1]["failed_save"] == results[0]["failed_save"] and results[1]["failed_writes"] == []
    # The write went to a temporary file next to the target, removed on the error.
    written = Path(results[0]["failed_writes"][0])
    assert written.parent == tmp and written.name.startswith(".n.ckpt.tmp-") and results[0]["temp_left"] == []
    ckpt = _load(tmp / "n.ckpt")  # still the complete checkpoint of step 1
    for r in results:
        for name, value in r["params"].items():
            assert torch.equal(ckpt["state_dict"][name], value), name


@pytest.mark.timeout(60)
def test_a_process_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """The project's writer (AtomicCheckpointIO), killed by SIGKILL half-way through a file."""
    path = tmp_path / "model.ckpt"
    writer = AtomicCheckpointIO()
    writer.save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}}, path)
    before = path.read_bytes()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: dies by SIGKILL after writing half of a new checkpoint to the same path
        try:
            def write_half_then_die(checkpoint, handle):
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                handle.write(buffer.getvalue()[: buffer.tell() // 2])
                handle.flush()
                os.write(write_end, handle.name.encode())
                os.kill(os.getpid(), signal.SIGKILL)

            checkpoint_module._serialize = write_half_then_die
            writer.save_checkpoint({"state_dict": {"w": torch.zeros(8192)}}, path)
        finally:
            os._exit(3)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    written_to = Path(os.read(read_end, 4096).decode())
    os.close(read_end)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert written_to.parent == tmp_path and written_to != path and written_to.is_file()
    assert path.read_bytes() == before
    assert torch.equal(read_checkpoint(path)["state_dict"]["w"], torch.arange(4096.0))
    # The next save removes the dead writer's half-written file.
    writer.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_merged_optimizer_state_lists_parameters_in_model_order():
    """V-shaped layout on 2 ranks x 2 replicas: rank 0 holds blocks 0 and 3, rank 1 blocks 1 and 2."""
    from lightning_mp_lstm.checkpoint import merge_optimizer_states

    def part(names):
        return {"state": {n: {"step": torch.tensor(1.0)} for n in names},
                "param_groups": [{"lr": 0.1, "params": list(names)}]}

    rank0 = part(["embedding.weight", "decoder.weight", "decoder.bias"])
    rank1 = part(["lstm.0.weight_ih_l0", "lstm.0.bias_hh_l0", "lstm.1.weight_ih_l0"])
    order = ["embedding.weight", "lstm.0.weight_ih_l0", "lstm.0.bias_hh_l0", "lstm.1.weight_ih_l0", "decoder.weight",
             "decoder.bias"]  # one process's named_parameters()
    merged = merge_optimizer_states([rank0, rank1, rank0, rank1], order=order)
    assert merged["param_groups"] == [{"lr": 0.1, "params": [
        "embedding.weight", "lstm.0.weight_ih_l0", "lstm.0.bias_hh_l0", "lstm.1.weight_ih_l0", "decoder.weight",
        "decoder.bias"]}]
    assert set(merged["state"]) == set(merged["param_groups"][0]["params"])
    # Without an order the process order is kept.
    assert merge_optimizer_states([rank0, rank1])["param_groups"][0]["params"][:2] == ["embedding.weight",
                                                                                      "decoder.weight"]


class _LastCheckpointSeen(pl.Callback):
    """The global step of ``last.ckpt`` in ``directory`` (``None``: no file) at the end of every training batch."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.seen = directory, []

    def on_train_batch_end(self, trainer, *args) -> None:
        path = self.directory / "last.ckpt"
        self.seen.append(read_checkpoint(path)["global_step"] if path.exists() else None)


def test_step_checkpoints_do_not_wait_for_the_monitored_metric(tmp_path):
    """``train.py``'s checkpoint callback with ``every_n_train_steps``: ``last.ckpt`` every 2 steps although the
    monitored ``val/loss`` is never logged (Lightning's ``ModelCheckpoint`` saves nothing until a validation)."""
    from lightning_mp_lstm.checkpoint import RunCheckpoint

    warnings.filterwarnings("ignore")
    seen = _LastCheckpointSeen(tmp_path)
    save = RunCheckpoint(dirpath=tmp_path, filename="best", monitor="val/loss", save_last=True, every_n_train_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[seen, save])
    trainer.fit(_model(), datamodule=FixedBatches((5, 9, 7, 5, 9, 7)))
    # Seen before the checkpoint callback runs in each batch: step 2's file from step 3 on, step 4's from step 5.
    assert seen.seen == [None, None, 2, 2, 4]
