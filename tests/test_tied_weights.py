"""Tied embedding and decoder weights on any partition: exact against one process, saved once.

Each layout trains with Adam (state that would drift if the copies' updates differed) and clipping by the global
norm (which would be off if a copy were counted twice); every rank's loss curve, every gradient of every step
(after the owners' sum, before clipping) and the final parameters equal one process's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.pipeline.tied import shared_parameter_aliases
from tests.helpers import (
    FixedBatches,
    Gradients,
    TrainLosses,
    assert_ranks_match,
    assert_split_equals_one_process,
    quiet_trainer,
    run_ranks,
    tiny_model,
)

STEPS = 4
LAYOUTS = {
    "pp2": (2, dict(schedule="1F1B", n_microbatches=2)),
    "pp2_v2 interleaved": (2, dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2)),
    "pp4": (4, dict(schedule="GPipe", n_microbatches=2)),
    "dp2_pp2": (4, dict(data_parallel_size=2, schedule="GPipe", n_microbatches=2)),
}


def _model() -> Any:
    return tiny_model(num_layers=3, embedding_dim=8, hidden_size=8, tie_weights=True, optimizer="adam", lr=0.02)


def _fit(strategy: Any, devices: int, checkpoint: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    model, losses, grads = _model(), TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches())
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"params": params, "losses": losses.values, "grads": grads.steps}


@pytest.fixture(scope="module")
def reference() -> dict:
    return _fit("auto", 1)


def test_reference_trains_one_shared_weight(reference):
    assert len(reference["grads"]) == STEPS and len(reference["losses"]) == STEPS
    params = reference["params"]
    assert torch.equal(params["embedding.weight"], params["decoder.weight"])
    first = reference["losses"][0][1]
    assert reference["losses"][-1][1] < first  # it learns: the comparisons below compare a moving run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.processes
def test_tied_weights_on_any_layout_match_one_process(layout, reference, tmp_path):
    processes, kwargs = LAYOUTS[layout]
    checkpoint = str(tmp_path / "tied.ckpt")
    results = assert_split_equals_one_process(_fit, processes, kwargs, reference, STEPS, checkpoint)
    owners = [rank for rank, r in enumerate(results) if "decoder.weight" in r["params"]]
    assert owners and all("embedding.weight" not in results[rank]["params"] for rank in owners), \
        "the layouts under test put embedding and decoder on different processes"
    # The checkpoint is one process's: the shared weight under both module names, its optimizer state once.
    saved = read_checkpoint(checkpoint)
    one_process = _model()
    assert list(saved["state_dict"]) == list(one_process.state_dict())
    torch.testing.assert_close(saved["state_dict"]["decoder.weight"], saved["state_dict"]["embedding.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(saved["state_dict"]["embedding.weight"], reference["params"]["embedding.weight"],
                               rtol=1e-5, atol=1e-7)
    names = [n for group in saved["optimizer_states"][0]["param_groups"] for n in group["params"]]
    assert names == [n for n, _ in one_process.named_parameters()]  # "decoder.weight" is not among them
    assert set(saved["optimizer_states"][0]["state"]) == set(names)


def _resume_worker(rank: int, world_size: int, checkpoint: str) -> dict:
    warnings.filterwarnings("ignore")
    model = _model()
    trainer = quiet_trainer(MPLSTMStrategy(report_after_steps=None, timeout=60, n_microbatches=2), world_size,
                            max_steps=STEPS + 2, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches(), ckpt_path=checkpoint)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_one_process_checkpoint_resumes_on_pp2_with_the_copy_of_the_shared_state(tmp_path):
    """Adam's state of the shared weight, saved once by one process, reaches both copies on pp2."""
    warnings.filterwarnings("ignore")
    model = _model()
    trainer = quiet_trainer("auto", 1, max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches())
    checkpoint = tmp_path / "one.ckpt"
    trainer.save_checkpoint(checkpoint)
    model = _model()
    trainer = quiet_trainer("auto", 1, max_steps=STEPS + 2, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches(), ckpt_path=checkpoint)
    expected = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    assert_ranks_match(run_ranks(_resume_worker, 2, str(checkpoint), timeout=180), expected)


def test_aliases_name_every_further_name_of_a_shared_parameter():
    assert shared_parameter_aliases(_model()) == {"decoder.weight": "embedding.weight"}
    assert shared_parameter_aliases(tiny_model()) == {}


def test_a_decoder_built_on_meta_without_its_embedding_starts_from_the_embedding_values(tmp_path: Path):
    torch.manual_seed(7)
    whole = tiny_model(num_layers=1, embedding_dim=8, hidden_size=8, tie_weights=True, seed=7)
    torch.manual_seed(7)
    with torch.device("meta"):
        part = tiny_model(num_layers=1, embedding_dim=8, hidden_size=8, tie_weights=True, seed=7)
    blocks = pipeline_model(part)
    blocks.keep_blocks(["lstm.0", "decoder"])
    blocks.materialize_blocks(["lstm.0", "decoder"], torch.device("cpu"))
    assert torch.equal(part.decoder.weight, whole.embedding.weight)
    assert torch.equal(part.decoder.bias, whole.decoder.bias)
