"""The name-keyed state of a model pruned to one process's blocks (``lightning_mp_lstm.checkpoint.state``), in one
process: torch's state-dict API where it serves, ours where it does not (a stateless optimizer, tied copies,
parameters missing from the checkpoint), and the sharded format's read templates."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_mp_lstm.app.generation import load_for_generation
from lightning_mp_lstm.checkpoint import (
    CheckpointError,
    load_optimizer_state,
    merge_optimizer_states,
    optimizer_state,
)
from lightning_mp_lstm.checkpoint.sharded import _empty_like
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.pipeline.tied import shared_parameter_aliases
from tests.helpers import VOCAB, tiny_model


def _tied():
    return tiny_model(embedding_dim=8, hidden_size=8, tie_weights=True)


def _pruned(model, blocks):
    pipeline_model(model).keep_blocks(blocks)
    return model


def _stepped(model, optimizer):
    model(torch.randint(1, VOCAB, (2, 3)))[0].sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_stateless_optimizer_is_keyed_by_name_without_a_step():
    """torch's get_optimizer_state_dict would first step the live optimizer (lr 0) to create its state."""
    model = tiny_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    state = optimizer_state(adam, model)
    assert state["state"] == {} and not adam.state  # the live run's Adam still starts at step 0
    assert state["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    get_optimizer_state_dict(model, adam)
    assert int(adam.state[model.decoder.bias]["step"]) == 1  # what it guards against


def test_the_tied_copy_on_a_pruned_process_is_saved_under_the_first_name_and_loads_back():
    whole = _tied()
    aliases = shared_parameter_aliases(whole)
    decoder_side = _pruned(_tied(), ["lstm.1", "decoder"])
    adam = torch.optim.Adam(decoder_side.parameters(), lr=0.01)
    for p in decoder_side.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    saved = optimizer_state(adam, decoder_side, aliases)
    assert "embedding.weight" in saved["state"] and "decoder.weight" not in saved["state"]
    embedding_side = _pruned(_tied(), ["embedding", "lstm.0"])
    other = torch.optim.Adam(embedding_side.parameters(), lr=0.01)
    for p in embedding_side.parameters():
        p.grad = torch.ones_like(p)
    other.step()
    merged = merge_optimizer_states([optimizer_state(other, embedding_side, aliases), saved],
                                    order=[n for n, _ in whole.named_parameters()])
    assert merged["param_groups"][0]["params"] == [n for n, _ in whole.named_parameters()]  # the weight once
    # Back into a fresh decoder-side optimizer: its copy (known there as decoder.weight) gets the saved state.
    fresh_side = _pruned(_tied(), ["lstm.1", "decoder"])
    fresh = torch.optim.Adam(fresh_side.parameters(), lr=0.01)
    load_optimizer_state(fresh, fresh_side, merged, aliases)
    shared = merged["state"]["embedding.weight"]
    assert torch.equal(fresh.state[fresh_side.decoder.weight]["exp_avg"], shared["exp_avg"])
    assert fresh.state[fresh_side.decoder.bias]["exp_avg"].shape == fresh_side.decoder.bias.shape


def test_loading_optimizer_state_names_parameters_the_checkpoint_lacks_and_accepts_stateless_ones():
    model = tiny_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    _stepped(model, adam)
    state = optimizer_state(adam, model)
    without = {"state": state["state"], "param_groups": [
        {**g, "params": [n for n in g["params"] if n != "decoder.bias"]} for g in state["param_groups"]]}
    with pytest.raises(CheckpointError, match=r"no entry for parameters \['decoder.bias'\]"):
        load_optimizer_state(torch.optim.Adam(model.parameters(), lr=0.01), model, without)
    never_stepped = {"state": {n: s for n, s in state["state"].items() if n != "decoder.bias"},
                     "param_groups": state["param_groups"]}  # listed, without state: starts without state
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    load_optimizer_state(fresh, model, never_stepped)
    assert not fresh.state[model.decoder.bias] and int(fresh.state[model.decoder.weight]["step"]) == 1
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state tensors at all
    load_optimizer_state(sgd, model, optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), model))
    assert not sgd.state
    # ... into an optimizer over a pruned model's parameters, with the checkpoint's hyperparameters.
    pruned = _pruned(tiny_model(), ["lstm.1", "decoder"])
    sgd = torch.optim.SGD(pruned.parameters(), lr=0.1)
    load_optimizer_state(sgd, pruned, optimizer_state(torch.optim.SGD(model.parameters(), lr=0.25), model))
    assert not sgd.state and sgd.param_groups[0]["lr"] == 0.25
    assert sgd.param_groups[0]["params"] == list(pruned.parameters())


def test_generation_names_the_file_whose_tensors_do_not_fit(tmp_path):
    from lightning_mp_lstm.data.vocab import Vocabulary

    model = tiny_model(vocab=5)
    state = dict(model.state_dict())
    state["extra.weight"] = torch.zeros(1)
    vocab = Vocabulary(["<pad>", "<unk>", "<eos>", "a", "b"]).state_dict()
    torch.save({"state_dict": state, "hyper_parameters": dict(model.hparams), "LMDataModule": {"vocab": vocab}},
               tmp_path / "extra.ckpt")
    with pytest.raises(CheckpointError, match=r"extra.ckpt does not fit the model: missing nothing, unexpected "
                                              r"\['extra.weight'\]; it is not the model its hyperparameters describe"):
        load_for_generation(tmp_path / "extra.ckpt")
    state.pop("extra.weight")
    state["decoder.bias"] = torch.zeros(7)
    torch.save({"state_dict": state, "hyper_parameters": dict(model.hparams), "LMDataModule": {"vocab": vocab}},
               tmp_path / "shape.ckpt")
    with pytest.raises(CheckpointError, match=r"shape.ckpt: decoder.bias has shape \(7,\) but the model's has shape "
                                              r"\(5,\)"):
        load_for_generation(tmp_path / "shape.ckpt")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA mesh needs a GPU"))])
def test_sharded_read_templates_keep_a_dtensor_on_its_device(one_process_group, device):
    """#19: ``empty_like(dtensor, device="cpu")`` made a DTensor with a CPU local tensor on a CUDA mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (1,))
    value = distribute_tensor(torch.ones(4, 2, device=device), mesh, [Shard(0)])
    template = _empty_like(value)
    assert isinstance(template, DTensor) and template.device_mesh == mesh and template.placements == value.placements
    assert template.to_local().device == value.to_local().device
    assert _empty_like(torch.ones(3, device=device)).device == torch.device("cpu")  # plain tensors: read onto the CPU


@pytest.mark.parametrize("saved_with", [{}, {"foreach": False}])
def test_loading_optimizer_state_keeps_this_processs_kernel_choice(saved_with):
    """A checkpoint written by a layout with sharded parameters (no fused kernels) or by an earlier version (torch's
    default loop) resumes here with the fused kernel this process chose; the training state and hyperparameters are
    the checkpoint's."""
    model = tiny_model()
    saved = torch.optim.Adam(model.parameters(), lr=0.02, **saved_with)
    _stepped(model, saved)
    state = optimizer_state(saved, model)
    fresh = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    load_optimizer_state(fresh, model, state)
    group = fresh.param_groups[0]
    assert group["fused"] is True and group["foreach"] is None and group["lr"] == 0.02
    assert int(fresh.state[model.decoder.weight]["step"]) == 1
    _stepped(model, fresh)  # the fused kernel takes the loaded state
    assert int(fresh.state[model.decoder.weight]["step"]) == 2
