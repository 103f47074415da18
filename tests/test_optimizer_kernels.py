"""The optimizer implementation a model's parameters allow (``lightning_mp_lstm.models.optimizer_kernels``): the
same update, by torch's fused kernel where it accepts the parameters."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_mp_lstm import LSTMLanguageModel
from lightning_mp_lstm.models.optimizer_kernels import kernel_options, make_optimizer
from tests.helpers import FixedBatches, quiet_trainer, tiny_model


def _params(*shapes, device="cpu"):
    return [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes]


def test_plain_parameters_take_the_fused_kernel_and_others_what_they_allow(one_process_group):
    assert kernel_options(_params((2, 3), (4,))) == {"fused": True}
    assert kernel_options(_params((2, 3), device="meta")) == {}
    assert kernel_options([]) == {}
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    assert kernel_options([sharded, *_params((3,))]) == {"foreach": False}  # multi-tensor kernels refuse the mix
    assert kernel_options([sharded]) == {}


def test_a_partial_of_an_optimizer_class_gets_the_kernel_unless_it_chose_one():
    params = _params((2, 3))
    assert make_optimizer(functools.partial(torch.optim.Adam, lr=0.1), params).param_groups[0]["fused"] is True
    chosen = make_optimizer(functools.partial(torch.optim.Adam, lr=0.1, foreach=False), params)
    assert chosen.param_groups[0]["fused"] is None and chosen.param_groups[0]["foreach"] is False
    plain = make_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), params)  # not a partial: called as it is
    assert plain.param_groups[0]["fused"] is None


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_the_models_named_optimizers_are_fused_and_step_as_torchs_default_loop(optimizer):
    model = tiny_model(optimizer=optimizer, lr=0.05)
    reference = tiny_model(optimizer=optimizer, lr=0.05)
    fused = model.configure_optimizers()
    assert fused.param_groups[0]["fused"] is True
    # torch's default on CPU (one parameter at a time), with the model's hyperparameters
    loop = type(fused)(reference.parameters(), lr=0.05, weight_decay=fused.param_groups[0]["weight_decay"])
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    for _ in range(3):
        fused.step()
        loop.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class _ClipsItself(LSTMLanguageModel):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("clip", ["trainer", "own hook", None])
def test_one_process_under_mixed_precision_that_clips_gets_an_optimizer_lightning_can_clip(clip):
    """Lightning's mixed-precision plugin refuses to clip a fused optimizer's gradients; before, LSTMLanguageModel
    chose the fused kernel anyway and a one-process bf16-mixed run with clipping failed at its first step."""
    torch.manual_seed(0)
    model = _ClipsItself(37, embedding_dim=6, hidden_size=8, num_layers=2) if clip == "own hook" else tiny_model()
    trainer = quiet_trainer("auto", 1, max_steps=2, precision="bf16-mixed",
                            gradient_clip_val=0.5 if clip == "trainer" else None)
    trainer.fit(model, datamodule=FixedBatches())
    assert trainer.global_step == 2
    defaults = trainer.optimizers[0].defaults
    assert defaults["fused"] is (True if clip is None else None)  # the fused kernel where nothing clips
