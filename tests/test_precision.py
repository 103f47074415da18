"""Precision under the pipeline: LSTM layers never run under autocast (no silent float16), float16 precisions are
refused before launch, and the numerics setting makes float32 exact."""

from __future__ import annotations

import warnings

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.models.blocks import LSTMLayerBlock
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.strategy.precision import set_numerics
from tests.helpers import FixedBatches, TrainLosses, quiet_trainer, run_ranks, tiny_model


def _fit(precision: str, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    dtypes: dict[str, set[str]] = {}

    class Record(TrainLosses):
        def on_fit_start(self, trainer, pl_module) -> None:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is None:
                return
            for stage in engine.stage_modules.values():
                for name, block in zip(stage.block_names, stage.blocks, strict=True):
                    # The decoder block hands its inputs to the loss, which runs the decoder itself: record that.
                    hooked = block.decoder if name == "decoder" else block
                    hooked.register_forward_hook(
                        lambda module, args, out, name=name: dtypes.setdefault(name, set()).add(str(out.dtype)))

    record = Record()
    timed_under_autocast = []
    timer = profile._time

    def recording(*args, **kwargs):  # planning's block timings: in the run's precision
        timed_under_autocast.append(torch.is_autocast_enabled("cpu"))
        return timer(*args, **kwargs)

    profile._time = recording
    strategy = "auto"
    if world_size > 1:
        strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, n_microbatches=2, partition="balanced")
    trainer = quiet_trainer(strategy, world_size, [record], max_steps=3, precision=precision)
    trainer.fit(tiny_model(num_layers=2, optimizer="adam", lr=0.01), datamodule=FixedBatches())
    return {"losses": [loss for _, loss in record.values], "dtypes": {k: sorted(v) for k, v in dtypes.items()},
            "timed_under_autocast": timed_under_autocast}


def _worker(rank: int, world_size: int, precision: str) -> dict:
    return _fit(precision, world_size)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_bf16_mixed_runs_the_lstms_in_float32_and_stays_close_to_float32():
    per_rank = run_ranks(_worker, 2, "bf16-mixed", timeout=180)
    seen = {**per_rank[0]["dtypes"], **per_rank[1]["dtypes"]}
    # The balanced partition timed its blocks under bf16 autocast, as they train.
    assert per_rank[0]["timed_under_autocast"] and all(per_rank[0]["timed_under_autocast"])
    # The LSTM layers and the embedding in float32 (autocast off for the LSTMs), the decoder's matmul in bfloat16.
    assert seen == {"embedding": ["torch.float32"], "lstm.0": ["torch.float32"], "lstm.1": ["torch.float32"],
                    "decoder": ["torch.bfloat16"]}, seen
    reference = _fit("32-true", 1)["losses"]
    for got, expected in zip(per_rank[0]["losses"], reference, strict=True):
        assert got == pytest.approx(expected, rel=3e-2)  # the decoder's bfloat16 logits only


def test_an_lstm_block_ignores_autocast_and_keeps_its_weights_dtype():
    block = LSTMLayerBlock(None)
    lstm = torch.nn.LSTM(4, 5, batch_first=True)
    block.set_weights(list(lstm.parameters()))
    x = torch.randn(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, lstm(x)[0])


@pytest.mark.parametrize("precision", ["16-true"])
def test_float16_precisions_are_refused_before_launch(precision):
    strategy = MPLSTMStrategy(pipeline_parallel_size=1)
    quiet_trainer(strategy, 1, precision=precision)
    with pytest.raises(ValueError, match=rf"precision='{precision}' \(float16\) is not supported: .* use "
                                         r"precision='32-true', 'bf16-mixed' \(LSTMs in float32\) or 'bf16-true'"):
        strategy.check(tiny_model())


def test_exact_numerics_turns_tf32_off_and_cudnn_deterministic():
    flags = [(torch.backends.cudnn.rnn, "fp32_precision"), (torch.backends.cudnn.conv, "fp32_precision"),
             (torch.backends.cuda.matmul, "fp32_precision"), (torch.backends.cudnn, "deterministic")]
    saved = [getattr(owner, name) for owner, name in flags]
    try:
        set_numerics("default")
        assert [getattr(owner, name) for owner, name in flags] == saved
        set_numerics("exact")
        assert [getattr(owner, name) for owner, name in flags] == ["ieee", "ieee", "ieee", True]
    finally:
        for (owner, name), value in zip(flags, saved, strict=True):
            setattr(owner, name, value)
    with pytest.raises(ValueError, match="unknown numerics 'fast'; allowed: default, exact"):
        MPLSTMStrategy(numerics="fast")
