"""Lightning's model summary under ``mp_lstm`` counts the whole model: every stage's parameters (not rank 0's), and
the FLOPs of the whole forward, LSTM layers included, equal to one process's."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.strategy.summary import CountingSummary, PipelineModelSummary, WholeModelSummary
from tests.helpers import FixedBatches, quiet_trainer, run_ranks, tiny_model

ROWS, LENGTH = 8, 9  # the example batch; the model's 37 words are padded to 40


def _model(**kwargs: Any) -> LSTMLanguageModel:
    model = tiny_model(num_layers=3, pad_vocab_to_multiple_of=8, **kwargs)
    model.example_input_array = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    return model


def _analytic_flops(layers: int = 3, embedding: int = 6, hidden: int = 8, vocab: int = 40) -> int:
    """Forward FLOPs (2 per multiply-add) of the LSTM layers' matrix products and the decoder's."""
    tokens = ROWS * LENGTH
    lstm = sum(4 * hidden * ((embedding if k == 0 else hidden) + hidden) for k in range(layers))
    return 2 * tokens * (lstm + hidden * vocab)


def test_the_summary_counts_lstm_flops_and_a_meta_model_is_counted_as_the_real_one():
    real = CountingSummary(_model(), max_depth=1)
    assert real.total_flops == _analytic_flops()  # torch's counter alone sees only the decoder's product
    assert summarize(_model(), max_depth=1).total_flops == 2 * ROWS * LENGTH * 8 * 40
    with torch.device("meta"):
        meta = _model()
    meta.example_input_array = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    whole = WholeModelSummary(meta, max_depth=1)
    assert (whole.total_parameters, whole.total_flops, whole.layer_names, whole.param_nums, whole.out_sizes) == (
        real.total_parameters, real.total_flops, real.layer_names, real.param_nums, real.out_sizes)
    assert whole.out_sizes[whole.layer_names.index("decoder")] == [ROWS, LENGTH, 40]
    assert all(p.is_meta for p in meta.parameters())  # the forward ran on a copy


def test_a_meta_model_is_counted_on_the_cpu_whatever_device_lightning_set_for_its_setup_hook():
    # Lightning's setup hook sets every submodule's device to the strategy's (cuda:0 on a GPU) while the model is
    # still on the meta device; the counting copy must not send the example input there (it did on a GPU).
    with torch.device("meta"):
        meta = _model()
    meta.example_input_array = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    for module in meta.modules():
        if isinstance(module, _DeviceDtypeModuleMixin):
            module._device = torch.device("cuda", 0)
    whole = WholeModelSummary(meta, max_depth=1)
    assert whole.total_flops == _analytic_flops()
    assert meta.device == torch.device("cuda", 0)  # the model itself is left as Lightning set it


def _fit_pp2(rank: int, world_size: int, validate_first: bool) -> dict:
    warnings.filterwarnings("ignore")
    model = _model()
    strategy = MPLSTMStrategy(pipeline_parallel_size=2, report_after_steps=None, timeout=60)
    trainer = quiet_trainer(strategy, world_size, max_steps=1, enable_model_summary=True)
    if validate_first:  # a baseline: the validation builds the pipeline, the fit prints the summary
        trainer.validate(model, datamodule=FixedBatches(), verbose=False)
    trainer.fit(model, datamodule=FixedBatches())
    kinds = [type(c).__name__ for c in trainer.callbacks if isinstance(c, ModelSummary)]
    callback = next(c for c in trainer.callbacks if isinstance(c, PipelineModelSummary))
    whole = callback.whole
    local = sum(p.numel() for p in model.parameters())
    if whole is None:
        return {"kinds": kinds, "whole": None, "local": local}
    return {"kinds": kinds, "local": local, "whole": (whole.total_parameters, whole.trainable_parameters,
                                                      whole.total_flops, whole.layer_names, whole.param_nums),
            "rows": len(whole._get_summary_data()[0][1])}


@pytest.mark.processes
@pytest.mark.parametrize("validate_first", [False, True])
def test_under_pp2_rank_0_summarizes_the_whole_model_as_one_process_does(validate_first):
    one_process = CountingSummary(_model(), max_depth=1)
    expected = (one_process.total_parameters, one_process.trainable_parameters, one_process.total_flops,
                one_process.layer_names, one_process.param_nums)
    assert expected[0] == sum(p.numel() for p in tiny_model(num_layers=3, vocab=40).parameters())
    first, second = run_ranks(_fit_pp2, 2, validate_first, timeout=120)
    assert first["kinds"] == second["kinds"] == ["PipelineModelSummary"]  # Lightning's default callback, swapped
    assert first["whole"] == expected and first["rows"] == len(expected[3])
    assert second["whole"] is None  # printed once, by global rank 0
    assert first["local"] < expected[0] and first["local"] + second["local"] == expected[0]  # each holds a part
