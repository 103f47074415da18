"""Tests for lightning_mp_lstm.models.costs: the analytic per-block costs of the LSTM language model."""

from __future__ import annotations

import pytest
import torch

from lightning_mp_lstm.models.costs import CostError, ModelShape, flop_costs, memory_costs, parameter_counts
from lightning_mp_lstm.planning.partition import even_partition, partition_blocks


def _torch_blocks(shape: ModelShape) -> dict[str, torch.nn.Module]:
    embedding = torch.nn.Embedding(shape.vocab_size, shape.embedding_dim)
    lstms = {
        f"lstm.{i}": torch.nn.LSTM(shape.lstm_input_size(i), shape.hidden_size, batch_first=True)
        for i in range(shape.num_layers)
    }
    decoder = torch.nn.Linear(shape.hidden_size, shape.vocab_size)
    if shape.tie_weights:
        decoder.weight = embedding.weight
    return {"embedding": embedding, **lstms, "decoder": decoder}


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_match_torch(tie):
    shape = ModelShape(vocab_size=37, embedding_dim=12, hidden_size=12 if tie else 9, num_layers=3, tie_weights=tie)
    modules = _torch_blocks(shape)
    counts = parameter_counts(shape)
    assert list(counts) == shape.block_names == ["embedding", "lstm.0", "lstm.1", "lstm.2", "decoder"]
    model = torch.nn.ModuleDict({k.replace(".", "_"): v for k, v in modules.items()})
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())  # shared weight once
    for name in ["embedding", "lstm.0", "lstm.1", "lstm.2"]:
        assert counts[name] == sum(p.numel() for p in modules[name].parameters())
    assert counts["decoder"] == (37 if tie else 9 * 37 + 37)  # with tied weights: the bias only


def test_model_shape_validation():
    with pytest.raises(CostError, match="embedding_dim == the last layer.s hidden size"):
        ModelShape(100, 16, 32, 2, tie_weights=True)
    with pytest.raises(CostError, match="num_layers"):
        ModelShape(100, 16, 32, 0)


def test_memory_costs():
    shape = ModelShape(vocab_size=100, embedding_dim=8, hidden_size=8, num_layers=2, tie_weights=True)
    counts = parameter_counts(shape)
    adam = memory_costs(shape)
    assert adam["embedding"] == 100 * 8 * 4 * 4  # params + grads + 2 Adam states, fp32
    assert adam["lstm.1"] == counts["lstm.1"] * 4 * 4
    assert memory_costs(shape, "sgd")["lstm.0"] == counts["lstm.0"] * 4 * 2
    assert memory_costs(shape, "sgd_momentum", bytes_per_param=2)["decoder"] == 100 * 2 * 3
    assert memory_costs(shape, replicate_tied=True)["decoder"] == (100 + 800) * 16
    with pytest.raises(CostError, match="allowed optimizers are: adam, sgd, sgd_momentum"):
        memory_costs(shape, "adagrad")


def test_flop_costs_formulas_and_bucket_mix():
    shape = ModelShape(vocab_size=1000, embedding_dim=20, hidden_size=40, num_layers=2)
    f = flop_costs(shape, batch_size=4, bucket_lengths=[10])
    tok = 40
    assert f["embedding"] == 2 * tok * 20
    assert f["lstm.0"] == 3 * tok * (8 * 40 * (20 + 40) + 20 * 40)
    assert f["lstm.1"] == 3 * tok * (8 * 40 * 80 + 20 * 40)
    assert f["decoder"] == 3 * tok * (2 * 40 * 1000 + 1000) + 6 * tok * 1000
    # Bucket mix: weighted average, uniform by default.
    assert flop_costs(shape, 4, [10, 30])["lstm.1"] == pytest.approx(flop_costs(shape, 4, [20])["lstm.1"])
    assert flop_costs(shape, 4, [10, 30], [3, 1])["decoder"] == pytest.approx(flop_costs(shape, 4, [15])["decoder"])
    with pytest.raises(CostError, match="bucket_weights"):
        flop_costs(shape, 4, [10, 30], [1])


def test_flops_balancing_moves_lstms_away_from_heavy_decoder():
    shape = ModelShape(vocab_size=10000, embedding_dim=200, hidden_size=400, num_layers=8)
    costs = flop_costs(shape, batch_size=32, bucket_lengths=[10, 20, 30, 40])
    balanced = partition_blocks(shape.block_names, costs, 2)
    even = even_partition(shape.block_names, 2)
    assert sum(n.startswith("lstm.") for n in even[-1]) == 4
    assert balanced == [["embedding"] + [f"lstm.{i}" for i in range(6)], ["lstm.6", "lstm.7", "decoder"]]
    bottleneck = max(sum(costs[n] for n in stage) for stage in balanced)
    assert bottleneck / max(sum(costs[n] for n in stage) for stage in even) < 0.85


def test_memory_and_flops_balancing_differ():
    # Large vocabulary, small LSTMs: embedding and decoder dominate memory equally, only the decoder compute.
    shape = ModelShape(vocab_size=50000, embedding_dim=256, hidden_size=256, num_layers=4)
    names = shape.block_names
    by_memory = partition_blocks(names, memory_costs(shape), 2)
    by_flops = partition_blocks(names, flop_costs(shape, 32, [35]), 2)
    assert by_memory == [["embedding", "lstm.0", "lstm.1"], ["lstm.2", "lstm.3", "decoder"]]
    assert by_flops == [["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"], ["decoder"]]
    assert partition_blocks(names, memory_costs(shape), 3) == [["embedding"], ["lstm.0", "lstm.1", "lstm.2", "lstm.3"],
                                                              ["decoder"]]
