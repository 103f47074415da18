"""A vocabulary padded to a multiple of a size (``pad_vocab_to_multiple_of``): the padding ids are never predicted
and take no probability, so the padded model is the unpadded one on the real words; tensor parallelism splits it
evenly and matches one process; its checkpoint loads into a one-process model."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.models.vocab_padding import PaddedDecoder, padded_vocab_size
from tests.helpers import (
    VOCAB,
    FixedBatches,
    TrainLosses,
    assert_ranks_match,
    lm_batches,
    quiet_trainer,
    run_ranks,
    tiny_model,
)

STEPS = 3
#: 37 words padded to 40: two shards of 20, the second holding words 20..36 and the padding ids 37..39.
MULTIPLE = 4


def test_padded_size_rounds_up_and_checks_its_multiple():
    assert [padded_vocab_size(v, 8) for v in (1, 8, 1003, 10_000)] == [8, 8, 1008, 10_000]
    assert padded_vocab_size(1003, 1) == 1003
    with pytest.raises(ValueError, match="pad_vocab_to_multiple_of must be a positive integer, got 0"):
        padded_vocab_size(10, 0)
    model = tiny_model(vocab=VOCAB, pad_vocab_to_multiple_of=8)
    assert model.embedding.num_embeddings == 40 and model.decoder.out_features == 40
    assert isinstance(model.decoder, PaddedDecoder) and model.decoder.words == VOCAB
    assert model.hparams.vocab_size == VOCAB  # the real vocabulary, which the data and generation check against
    assert type(tiny_model(vocab=40, pad_vocab_to_multiple_of=8).decoder) is torch.nn.Linear  # nothing to pad


def test_the_padded_model_is_the_unpadded_one_on_the_real_words():
    plain, padded = tiny_model(vocab=VOCAB), tiny_model(vocab=VOCAB, pad_vocab_to_multiple_of=8)
    with torch.no_grad():
        for (name, small), (_, big) in zip(plain.named_parameters(), padded.named_parameters(), strict=True):
            big.zero_()
            big[tuple(slice(0, n) for n in small.shape)] = small
            if name == "decoder.bias":
                big[VOCAB:] = 100.0  # a large bias on the padding: still never predicted
    batch = lm_batches(4, [9], seed=5)[0]
    logits, _ = padded(batch[0])
    assert torch.isneginf(logits[..., VOCAB:]).all() and torch.isfinite(logits[..., :VOCAB]).all()
    losses = [model._loss(batch, "train")[0] for model in (plain, padded)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)  # the same softmax over the real words
    for model, loss in zip((plain, padded), losses):
        model.zero_grad()
        loss.backward()
    assert padded.decoder.weight.grad[VOCAB:].abs().max() == 0 and padded.decoder.bias.grad[VOCAB:].abs().max() == 0
    torch.testing.assert_close(padded.decoder.weight.grad[:VOCAB], plain.decoder.weight.grad)
    predicted = [model.predict_step(batch, 0) for model in (plain, padded)]
    torch.testing.assert_close(predicted[1]["log_probs"], predicted[0]["log_probs"])
    assert torch.equal(predicted[1]["next_token"], predicted[0]["next_token"])
    assert int(predicted[1]["next_token"].max()) < VOCAB


def test_the_decoder_masks_its_padding_in_place_with_the_gradients_of_an_out_of_place_mask():
    torch.manual_seed(0)
    decoder = PaddedDecoder(6, 10, words=7)
    reference = torch.nn.Linear(6, 10)
    reference.load_state_dict(decoder.state_dict())
    data = torch.randn(3, 4, 6)
    inputs = [data.clone().requires_grad_() for _ in range(2)]
    upstream = torch.randn(3, 4, 10)  # nonzero on the padding too: none of it may reach the weights or inputs
    logits = decoder(inputs[0])
    expected = reference(inputs[1]).masked_fill(torch.arange(10) >= 7, float("-inf"))
    assert torch.equal(logits, expected) and torch.isneginf(logits[..., 7:]).all()
    (logits * upstream).masked_fill(logits.isinf(), 0).sum().backward()
    (expected * upstream).masked_fill(expected.isinf(), 0).sum().backward()
    for got, want in ((decoder.weight.grad, reference.weight.grad), (decoder.bias.grad, reference.bias.grad),
                      (inputs[0].grad, inputs[1].grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert decoder.weight.grad[7:].abs().max() == 0 and decoder.bias.grad[7:].abs().max() == 0


def _model() -> LSTMLanguageModel:
    return tiny_model(vocab=VOCAB, pad_vocab_to_multiple_of=MULTIPLE, optimizer="adam", lr=0.02)


def _fit(strategy: Any, devices: int, checkpoint: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    model, losses = _model(), TrainLosses()
    initial = model.decoder.bias.detach()[VOCAB:].clone()
    trainer = quiet_trainer(strategy, devices, [losses], max_steps=STEPS, gradient_clip_val=0.05)
    trainer.fit(model, datamodule=FixedBatches())
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    predictions = trainer.predict(model, datamodule=FixedBatches())
    return {"params": full, "losses": losses.values, "initial_padding_bias": initial,
            "next_token_max": max(int(p["next_token"].max()) for p in predictions),
            "validated": trainer.validate(model, datamodule=FixedBatches(), verbose=False)[0]["val/loss"]}


def _worker(rank: int, world_size: int, checkpoint: str) -> dict:
    strategy = MPLSTMStrategy(tensor_parallel_size=2, pipeline_parallel_size=1, n_microbatches=2,
                              report_after_steps=None, timeout=60)
    return _fit(strategy, world_size, checkpoint)


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_tp2_splits_a_padded_vocabulary_matches_one_process_and_its_checkpoint_loads_into_one_process(tmp_path):
    """37 words cannot be split in two; padded to 40 they are, and tp2 trains exactly as one process does (Adam,
    clipping), never predicts a padding id, leaves the padding's parameters untouched, and writes a checkpoint that
    a one-process model with the same setting loads strictly."""
    reference = _fit("auto", 1)
    checkpoint = str(tmp_path / "tp2.ckpt")
    results = run_ranks(_worker, 2, checkpoint, timeout=220)
    assert_ranks_match([r["params"] for r in results], reference["params"])
    for r in results:
        assert [s for s, _ in r["losses"]] == [s for s, _ in reference["losses"]] and len(r["losses"]) == STEPS
        assert [v for _, v in r["losses"]] == pytest.approx([v for _, v in reference["losses"]], rel=1e-5)
        assert r["validated"] == pytest.approx(reference["validated"], rel=1e-5)
        assert r["next_token_max"] < VOCAB
        # The padding's decoder columns never got a gradient: Adam left them as they started.
        torch.testing.assert_close(r["params"]["decoder.bias"][VOCAB:], r["initial_padding_bias"], rtol=0, atol=0)
    saved = read_checkpoint(checkpoint)
    one_process = _model()
    one_process.load_state_dict(saved["state_dict"], strict=True)
    assert one_process.embedding.num_embeddings == 40 and one_process.hparams.vocab_size == VOCAB
    loaded = LSTMLanguageModel(**saved["hyper_parameters"])  # what generation and load_from_checkpoint rebuild
    loaded.load_state_dict(saved["state_dict"], strict=True)
    torch.testing.assert_close(loaded.decoder.weight, reference["params"]["decoder.weight"], rtol=1e-5, atol=1e-7)
