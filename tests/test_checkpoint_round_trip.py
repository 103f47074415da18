"""A checkpoint's round trip through the user's plain module, with Adam's state: written on pp2, resumed on one
process with Lightning's default strategy (``strategy="auto"``), which writes its own checkpoint (optimizer state
keyed by position), resumed on pp2 again. Every part continues exactly as one uninterrupted one-process run, with
untied and with tied embedding and decoder weights (on pp2 the tied weight has a copy on each rank; the file holds
its state once, under its first name).

The pieces are tested on their own elsewhere (pp2 -> one process in ``test_checkpoint.py``, one process -> pp2 in
``test_resume.py`` and ``test_tied_weights.py``); here the checkpoint goes through both, in one chain.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.checkpoint import read_checkpoint
from tests.helpers import FixedBatches, TrainLosses, assert_ranks_match, quiet_trainer, rel_error, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

EPOCH_STEPS = 3  # FixedBatches((5, 9, 7)): three batches per epoch
TIES = (False, True)


def _model(tie: bool) -> LSTMLanguageModel:
    return tiny_model(embedding_dim=8, hidden_size=8, tie_weights=tie, optimizer="adam", lr=0.01)


def _fit(strategy, devices: int, epochs: int, tie: bool, ckpt_path: str | None = None,
         save: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    model, losses = _model(tie), TrainLosses()
    trainer = quiet_trainer(strategy, devices, [losses], max_epochs=epochs, limit_val_batches=0)
    trainer.fit(model, datamodule=FixedBatches((5, 9, 7)), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    # Under every name: on pp2 a tied weight is held as embedding.weight on one rank, decoder.weight on the other.
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"params": params, "losses": losses.values, "steps": trainer.global_step}


def _pp2() -> MPLSTMStrategy:
    return MPLSTMStrategy(n_microbatches=2, report_after_steps=None, timeout=60)


def _pp2_worker(rank: int, world_size: int, directory: str, epochs: int, resume_from: str | None) -> dict:
    out = {}
    for tie in TIES:
        path = Path(directory)
        ckpt_path = str(path / f"{resume_from}-{tie}.ckpt") if resume_from else None
        out[tie] = _fit(_pp2(), 2, epochs, tie, ckpt_path=ckpt_path, save=str(path / f"pp2-{epochs}-{tie}.ckpt"))
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("round_trip")
    first = run_ranks(_pp2_worker, 2, str(tmp), 1, None, timeout=200)  # epoch 1 on pp2
    one = {tie: _fit("auto", 1, 2, tie, ckpt_path=str(tmp / f"pp2-1-{tie}.ckpt"), save=str(tmp / f"one-{tie}.ckpt"))
           for tie in TIES}  # epoch 2: one process, Lightning's default strategy
    last = run_ranks(_pp2_worker, 2, str(tmp), 3, "one", timeout=200)  # epoch 3 on pp2 again
    reference = {tie: _fit("auto", 1, 3, tie) for tie in TIES}
    return {"tmp": tmp, "first": first, "one": one, "last": last, "reference": reference}


def _continues(part: dict, reference: dict, after_step: int, until_step: int) -> None:
    expected = [(s, loss) for s, loss in reference["losses"] if after_step < s <= until_step]
    assert [s for s, _ in part["losses"]] == [s for s, _ in expected] and expected
    for (step, got), (_, want) in zip(part["losses"], expected):
        assert got == pytest.approx(want, rel=1e-5), step


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tie", TIES)
def test_pp2_to_default_strategy_to_pp2_continues_as_one_uninterrupted_run(chain, tie):
    reference = chain["reference"][tie]
    for rank in chain["first"]:
        _continues(rank[tie], reference, 0, EPOCH_STEPS)
    _continues(chain["one"][tie], reference, EPOCH_STEPS, 2 * EPOCH_STEPS)
    for rank in chain["last"]:
        _continues(rank[tie], reference, 2 * EPOCH_STEPS, 3 * EPOCH_STEPS)
        assert rank[tie]["steps"] == 3 * EPOCH_STEPS
    assert_ranks_match([rank[tie]["params"] for rank in chain["last"]], reference["params"])
    # The parts saw different optimizer states: the chain went through both kinds of checkpoint.
    by_name = read_checkpoint(chain["tmp"] / f"pp2-1-{tie}.ckpt")["optimizer_states"][0]
    by_position = read_checkpoint(chain["tmp"] / f"one-{tie}.ckpt")["optimizer_states"][0]
    assert all(isinstance(n, str) for g in by_name["param_groups"] for n in g["params"])
    assert all(isinstance(i, int) for g in by_position["param_groups"] for i in g["params"])
    assert int(by_position["state"][0]["step"]) == 2 * EPOCH_STEPS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tie", TIES)
def test_a_pp2_checkpoint_loads_strictly_into_the_plain_module_and_a_plain_optimizer(chain, tie):
    """What a user does without Lightning: ``load_state_dict(strict=True)`` on the module, and the optimizer state
    into ``torch.optim.Adam(model.parameters())``; each parameter gets its own moments (a tied weight's once)."""
    saved = read_checkpoint(chain["tmp"] / f"pp2-1-{tie}.ckpt")
    plain = _model(tie)
    plain.load_state_dict(saved["state_dict"], strict=True)
    if tie:
        assert plain.decoder.weight is plain.embedding.weight
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    optimizer.load_state_dict(saved["optimizer_states"][0])
    (state,) = saved["optimizer_states"]
    names = [n for n, _ in plain.named_parameters()]
    assert [n for g in state["param_groups"] for n in g["params"]] == names  # one name per parameter, in order
    held = {n: p for rank in chain["first"] for n, p in rank[tie]["params"].items()}
    for name, parameter in plain.named_parameters():
        assert rel_error(parameter.detach(), held[name]) == 0, name
        assert torch.equal(optimizer.state[parameter]["exp_avg"], state["state"][name]["exp_avg"]), name
        assert int(optimizer.state[parameter]["step"]) == EPOCH_STEPS
