"""Logits that never exist whole: the loss decodes slices of tokens (recomputed in the backward pass) and equals the
whole logits' loss; an adaptive softmax is a model option, exact in its perplexity and pipelined like one process.

The slices on every pipeline layout and schedule: ``tests/test_pipeline_equivalence.py`` (the engine's loss against
the plain module's whole logits, 1e-6); on the tensor-parallel layouts: ``tests/test_tensor_parallel.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMBlocks, MPLSTMStrategy
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.declaration import ModelDeclarationError
from lightning_mp_lstm.models.decoded_loss import decoded_cross_entropy, decoded_predictions, token_cross_entropy
from lightning_mp_lstm.models.lstm_language_model import adaptive_cutoffs
from tests.helpers import (
    VOCAB,
    FixedBatches,
    Gradients,
    TrainLosses,
    assert_same_predictions,
    assert_split_equals_one_process,
    lm_batches,
    parameters_of,
    quiet_trainer,
    rel_error,
    tiny_model,
)

STEPS = 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_sliced_loss_and_its_gradients_equal_the_whole_logits(dtype):
    inputs, targets = lm_batches(6, [9])[0]
    sliced, whole = tiny_model(loss_chunk_tokens=4).to(dtype), tiny_model().to(dtype)
    loss = sliced.training_step((inputs, targets), 0)
    logits = whole(inputs)[0]
    expected = token_cross_entropy(logits, targets, 0) / (targets != 0).sum()
    loss.backward()
    expected.backward()
    assert rel_error(loss.detach(), expected.detach()) < (1e-6 if dtype == torch.float32 else 1e-12)
    reference = dict(whole.named_parameters())
    for name, parameter in sliced.named_parameters():
        assert rel_error(parameter.grad, reference[name].grad) < (1e-6 if dtype == torch.float32 else 1e-12), name
    assert_same_predictions([sliced.predict_step((inputs, targets), 0)], [whole.predict_step((inputs, targets), 0)])


def test_a_slice_s_logits_are_not_kept_for_the_backward_pass():
    """What autograd keeps of the loss: the decoder's inputs and each slice's few inputs, never a slice's logits
    (recomputed in the backward pass); the whole logits keep ``tokens x vocabulary`` floats."""
    vocab, width, tokens = 5000, 16, 300
    decoder = nn.Linear(width, vocab)
    hidden = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def kept(slice_tokens: int) -> int:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            decoded_cross_entropy(hidden, decoder, targets, -100, slice_tokens)
        return sum(storages.values()) - sum(p.numel() * 4 for p in decoder.parameters())

    assert kept(tokens) >= tokens * vocab * 4  # the whole logits' log-softmax
    assert kept(50) < tokens * vocab * 4 / 20


def test_the_adaptive_softmax_s_loss_and_perplexity_are_its_exact_log_probabilities():
    model = tiny_model(vocab=VOCAB, softmax="adaptive", cutoffs=[5, 20], div_value=2.0).eval()
    inputs, targets = lm_batches(4, [7])[0]
    hidden = model.features(inputs)[0]
    with torch.no_grad():
        log_probs = model.decoder.log_prob(hidden.flatten(0, 1)).unflatten(0, targets.shape)
        assert torch.allclose(log_probs.exp().sum(-1), torch.ones(targets.shape), atol=1e-5)  # a distribution
        picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        expected = -picked[targets != 0].mean()
        loss = model.validation_step((inputs, targets), 0)
    assert rel_error(loss, expected) < 1e-6
    predicted = decoded_predictions(hidden, model.decoder, targets, 0, slice_tokens=5)
    torch.testing.assert_close(predicted["log_probs"], picked.masked_fill(targets == 0, 0.0))
    assert torch.equal(predicted["next_token"], log_probs.argmax(-1))
    torch.testing.assert_close(model(inputs)[0], log_probs)  # the module's forward: every word's log-probability


def test_adaptive_cutoffs_follow_awd_lstm_and_refuse_a_tiny_vocabulary():
    assert adaptive_cutoffs(267_735) == [2800, 20000, 76000]
    assert adaptive_cutoffs(75_001) == [2800, 20000]
    assert adaptive_cutoffs(800_000) == [4200, 35000, 180000]
    assert adaptive_cutoffs(1000) == [100, 400]
    with pytest.raises(ValueError, match="at least 10 words"):
        adaptive_cutoffs(9)


def test_an_adaptive_softmax_is_refused_where_it_cannot_serve():
    with pytest.raises(ValueError, match="tie_weights=True shares the embedding with a linear decoder"):
        tiny_model(embedding_dim=8, softmax="adaptive", tie_weights=True)
    with pytest.raises(ValueError, match="unknown softmax 'sparse'; allowed: full, adaptive, auto"):
        tiny_model(softmax="sparse")
    with pytest.raises(ValueError, match="leaves its last cluster a projection 0 wide"):
        tiny_model(softmax="adaptive", cutoffs=[5, 20])  # 8 units / 4 / 4
    wide = dict(embedding_dim=64, hidden_size=64, num_layers=1)
    assert tiny_model(vocab=75_001, softmax="auto", **wide).hparams.softmax == "adaptive"
    assert tiny_model(vocab=75_000, softmax="auto", **wide).hparams.softmax == "full"
    assert tiny_model(vocab=75_001, softmax="auto", tie_weights=True, **wide).hparams.softmax == "full"
    model = tiny_model(softmax="adaptive", cutoffs=[5, 20], div_value=2.0)
    model.lm_loss = lambda logits, targets: logits.sum()
    model.configure_pipeline = lambda: LSTMBlocks(embedding="embedding", lstm="lstm", decoder="decoder",
                                                  loss="lm_loss")
    with pytest.raises(ModelDeclarationError, match=r"'decoder' is an adaptive softmax, which computes its own loss"):
        pipeline_model(model)
    with pytest.raises(ModelDeclarationError, match="loss_chunk_tokens must be a positive integer or None, got 0"):
        LSTMBlocks(embedding="embedding", lstm="lstm", decoder="decoder", loss_chunk_tokens=0)
    strategy = MPLSTMStrategy(tensor_parallel_size=2, pipeline_parallel_size=1, report_after_steps=None)
    with pytest.raises((TypeError, ValueError), match="adaptive softmax"):
        strategy.check(tiny_model(vocab=VOCAB + 1, softmax="adaptive", cutoffs=[5, 20], div_value=2.0))


def _fit_adaptive(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    model = tiny_model(num_layers=3, softmax="adaptive", cutoffs=[5, 20], div_value=2.0, optimizer="adam", lr=0.01,
                       loss_chunk_tokens=6)
    losses, grads = TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, gradient_clip_val=0.5)
    trainer.fit(model, datamodule=FixedBatches())
    validated = trainer.validate(model, datamodule=FixedBatches(), verbose=False)[0]["val/loss"]
    return {"params": parameters_of(model), "losses": losses.values, "grads": grads.steps, "validated": validated,
            "predict": trainer.predict(model, datamodule=FixedBatches())}


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_an_adaptive_softmax_pipelined_equals_one_process():
    reference = _fit_adaptive("auto", 1)  # the module's own training_step on one process
    results = assert_split_equals_one_process(
        _fit_adaptive, 2, dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2), reference, STEPS,
        timeout=200)
    for r in results:
        assert r["validated"] == pytest.approx(reference["validated"], rel=1e-5)
        assert_same_predictions(r["predict"], reference["predict"])
