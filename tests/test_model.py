"""The LSTM language model honours the pipeline contract; its initial values depend only on the seed and block."""

from __future__ import annotations

import pytest
import torch

from lightning_mp_lstm import LSTMLanguageModel
from lightning_mp_lstm.contract import PipelineModel, check_model


def _model(**kwargs) -> LSTMLanguageModel:
    torch.manual_seed(3)
    return LSTMLanguageModel(40, **{"embedding_dim": 6, "hidden_size": 8, "num_layers": 3, **kwargs})


def test_the_model_implements_the_contract():
    model = _model()
    assert isinstance(model, PipelineModel)
    check_model(model)
    with pytest.raises(TypeError, match=r"Linear lacks: block_names, blocks, keep_blocks, materialize_blocks"):
        check_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("init_range", [0.1, None])
def test_blocks_materialized_one_by_one_equal_the_whole_model(init_range):
    whole = _model(init_range=init_range)
    for own in (["embedding", "lstm.0"], ["lstm.1"], ["lstm.2", "decoder"], ["lstm.0", "lstm.2"]):
        torch.manual_seed(3)
        with torch.device("meta"):
            part = LSTMLanguageModel(40, embedding_dim=6, hidden_size=8, num_layers=3, init_range=init_range)
        part.keep_blocks(own)
        part.materialize_blocks(own, torch.device("cpu"))
        state = part.state_dict()
        assert state and all(not t.is_meta for t in state.values())
        for name, value in state.items():
            assert torch.equal(value, whole.state_dict()[name]), (own, name)


def test_initial_values_depend_on_the_seed_and_differ_between_blocks():
    a, b = _model(), _model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    torch.manual_seed(4)
    c = LSTMLanguageModel(40, embedding_dim=6, hidden_size=8, num_layers=3)
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    assert not torch.equal(a.lstm["1"].weight_hh_l0, a.lstm["2"].weight_hh_l0)  # same shape, own stream


def test_tied_weights_survive_materialization():
    torch.manual_seed(3)
    with torch.device("meta"):
        model = LSTMLanguageModel(40, embedding_dim=8, hidden_size=8, num_layers=1, tie_weights=True)
    model.materialize_blocks(model.block_names, torch.device("cpu"))
    assert model.decoder.weight is model.embedding.weight and not model.embedding.weight.is_meta


def test_contract_helpers():
    model = _model()
    cpu = torch.device("cpu")
    assert model.example_input("embedding", 2, 5, cpu).shape == (2, 5)
    assert model.example_input("lstm.0", 2, 5, cpu).shape == (2, 5, 6)
    assert model.example_input("decoder", 2, 5, cpu).shape == (2, 5, 8)
    block = model.build_block("lstm.1", cpu)
    assert block is not model.lstm["1"] and block.weight_hh_l0.shape == model.lstm["1"].weight_hh_l0.shape
    inputs, targets = model.pad_rows(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long), 1)
    assert inputs.shape == (4, 4) and int(model.loss_weight(targets)) == 12
    logits = model(inputs)
    assert torch.equal(model.microbatch_loss(logits, targets), model.microbatch_loss(logits[:3], targets[:3]))
    assert set(model.analytic_costs("parameters", 2, 5)) == set(model.block_names)
    assert sum(model.analytic_costs("parameters", 2, 5).values()) == sum(p.numel() for p in model.parameters())
