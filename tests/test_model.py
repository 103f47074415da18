"""The LSTM language model: a plain LightningModule whose declaration gives the pipeline contract; its initial values
depend only on the seed and the block, so blocks materialized one by one equal the model built whole."""

from __future__ import annotations

import pytest
import torch

from lightning_mp_lstm import LSTMBlocks, LSTMLanguageModel
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.contract import PipelineModel, check_model


def _model(**kwargs) -> LSTMLanguageModel:
    torch.manual_seed(3)
    return LSTMLanguageModel(40, **{"embedding_dim": 6, "hidden_size": 8, "num_layers": 3, **kwargs})


def _meta_model(**kwargs) -> LSTMLanguageModel:
    torch.manual_seed(3)
    with torch.device("meta"):
        return LSTMLanguageModel(40, **{"embedding_dim": 6, "hidden_size": 8, "num_layers": 3, **kwargs})


def test_the_declaration_gives_the_contract():
    model = _model()
    assert isinstance(model.configure_pipeline(), LSTMBlocks)
    blocks = pipeline_model(model)
    assert isinstance(blocks, PipelineModel)
    check_model(blocks)
    assert blocks.block_names == ["embedding", "lstm.0", "lstm.1", "lstm.2", "decoder"]
    with pytest.raises(TypeError, match=r"Linear lacks: block_names, blocks, keep_blocks, materialize_blocks"):
        check_model(torch.nn.Linear(2, 2))


def test_the_chain_of_blocks_is_the_models_forward():
    model = _model()
    tokens = torch.randint(1, 40, (3, 7))
    x = tokens
    blocks = pipeline_model(model)
    for _, block in blocks.blocks():
        x = block(x)
    # The decoder block hands the loss its inputs (the loss decodes them a slice of tokens at a time).
    torch.testing.assert_close(x, model.features(tokens)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.decoder(x), model(tokens)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("init_range", [0.1, None])
def test_blocks_materialized_one_by_one_equal_the_whole_model(init_range):
    whole = _model(init_range=init_range).state_dict()
    for own in (["embedding", "lstm.0"], ["lstm.1"], ["lstm.2", "decoder"], ["lstm.0", "lstm.2"]):
        part = _meta_model(init_range=init_range)
        blocks = pipeline_model(part)
        blocks.keep_blocks(own)
        blocks.materialize_blocks(own, torch.device("cpu"))
        state = part.state_dict()
        assert sorted(state) == sorted(k for k in whole if any(k.startswith(f"{b}.") for b in own)), own
        for name, value in state.items():
            assert torch.equal(value, whole[name]), (own, name)


def test_initial_values_depend_on_the_seed_and_differ_between_blocks():
    a, b = _model(), _model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    torch.manual_seed(4)
    c = LSTMLanguageModel(40, embedding_dim=6, hidden_size=8, num_layers=3)
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    assert not torch.equal(a.lstm[1].weight_hh_l0, a.lstm[2].weight_hh_l0)  # same shape, own stream


def test_building_leaves_the_global_random_state_as_one_draw():
    torch.manual_seed(9)
    LSTMLanguageModel(40, embedding_dim=6, hidden_size=8, num_layers=3)
    after_model = torch.rand(1)
    torch.manual_seed(9)
    torch.randint(0, 2**62, (1,))  # the model's seed, drawn once; the blocks use their own generators
    assert torch.equal(torch.rand(1), after_model)


@pytest.mark.parametrize("own", [["embedding", "lstm.0", "decoder"], ["decoder"]])
def test_tied_weights_survive_materialization(own):
    whole = _model(embedding_dim=8, num_layers=1, tie_weights=True)
    part = _meta_model(embedding_dim=8, num_layers=1, tie_weights=True)
    blocks = pipeline_model(part)
    blocks.keep_blocks(own)
    blocks.materialize_blocks(own, torch.device("cpu"))
    assert not part.decoder.weight.is_meta
    assert torch.equal(part.decoder.weight, whole.embedding.weight)  # the copy starts as the embedding does
    assert torch.equal(part.decoder.bias, whole.decoder.bias)
    if "embedding" in own:
        assert part.decoder.weight is part.embedding.weight


def test_contract_helpers():
    model = _model()
    blocks = pipeline_model(model)
    cpu = torch.device("cpu")
    assert blocks.example_input("embedding", 2, 5, cpu).shape == (2, 5)
    assert blocks.example_input("lstm.0", 2, 5, cpu).shape == (2, 5, 6)
    assert blocks.example_input("decoder", 2, 5, cpu).shape == (2, 5, 8)
    built = blocks.build_block("lstm.1", cpu)
    original = model.lstm[1].weight_hh_l0
    assert built.weight_hh.shape == original.shape and built.weight_hh is not original
    inputs, targets = blocks.pad_rows(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long), 1)
    assert inputs.shape == (4, 4) and int(blocks.batch_weights(targets)[0]) == 12
    hidden = model.features(inputs)[0]  # what the decoder block gives the loss, which decodes it
    assert torch.equal(blocks.microbatch_loss(hidden, targets), blocks.microbatch_loss(hidden[:3], targets[:3]))
    counts = blocks.analytic_costs("parameters", 2, 5)
    assert list(counts) == blocks.block_names and sum(counts.values()) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="unknown cost kind 'time'"):
        blocks.analytic_costs("time", 2, 5)


def test_carry_state_continues_each_row_from_where_it_ended():
    model = _model(carry_state=True).eval()
    tokens = torch.randint(1, 40, (2, 10))
    whole, _ = model(tokens)
    model.on_validation_epoch_start()
    first = model.validation_step((tokens[:, :6], tokens[:, 1:7]), 0)  # keeps (h, c) of the first 6 steps
    logits, _ = model(tokens[:, 6:], model._state["eval"])
    torch.testing.assert_close(logits, whole[:, 6:], rtol=0, atol=1e-6)
    assert torch.isfinite(first)
