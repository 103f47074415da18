"""What a run prints: informational lines from global rank 0 only and each once, Lightning's tips dropped, and the
warnings the user cannot act on filtered; the partition report's units and its one measured line."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_mp_lstm.app import console
from lightning_mp_lstm.planning import report
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.plan import PipelinePlan


def _record(message: str, level: int = logging.INFO, name: str = "lightning_mp_lstm.data") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_informational_lines_come_from_rank_zero_once_and_without_tips(monkeypatch):
    keep, once = console.RankZeroInfo(), console.OncePerProcess()
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    assert not keep.filter(_record("corpus synthetic: train=80000"))
    # The data's warnings are every rank's alike: rank 0 says them; a rank's own warnings and errors pass.
    assert not keep.filter(_record("4 of 3370 sentences are longer than the largest bucket", logging.WARNING))
    assert keep.filter(_record("lost rank 0", logging.WARNING, name="lightning_mp_lstm.base.faults"))
    assert keep.filter(_record("bad data", logging.ERROR))
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    assert keep.filter(_record("corpus synthetic: train=80000"))
    lines = ["Restoring states from best.ckpt", "Restoring states from best.ckpt", "💡 Tip: try installing x",
             "Loaded model weights"]
    assert [once.filter(_record(line)) for line in lines] == [True, False, False, True]
    assert once.filter(_record("same warning", logging.WARNING)) and not once.filter(_record("same warning",
                                                                                            logging.WARNING))
    assert once.filter(_record("an error", logging.ERROR)) and once.filter(_record("an error", logging.ERROR))


def test_quiet_filters_the_warnings_a_user_cannot_act_on_and_keeps_the_others():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ... instead.", FutureWarning)
        warnings.warn("It is recommended to use `self.log('val/loss', ..., sync_dist=True)`", UserWarning)
        warnings.warn("`ModelCheckpoint(monitor='val/loss')` could not find the monitored key in the returned "
                      "metrics: ['train/loss']", UserWarning)
        warnings.warn("The dirpath has changed from 'a/checkpoints' to 'b/checkpoints', therefore `best_model_score`, "
                      "`kth_best_model_path`, ... won't be reloaded.", UserWarning)
        warnings.warn("something the user should see", UserWarning)
    assert [str(w.message) for w in caught] == ["something the user should see"]
    handler = logging.StreamHandler()
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        console.quiet()
        console.quiet()  # idempotent: each filter once per handler
        assert sum(isinstance(f, console.RankZeroInfo) for f in handler.filters) == 1
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)


def _plan(kind: str, predictions: tuple = ()) -> PipelinePlan:
    layout = ParallelLayout.resolve(2, 1, 2, None, "1F1B", 2)
    return PipelinePlan(layout=layout, partition=(("embedding", "lstm.0"), ("lstm.1", "decoder")), cost_kind=kind,
                        block_costs=(("embedding", 0.001), ("lstm.0", 0.004), ("lstm.1", 0.004), ("decoder", 0.003)),
                        block_parameters=(("embedding", 10), ("lstm.0", 20), ("lstm.1", 20), ("decoder", 10)),
                        block_memory=(("embedding", 1.0), ("lstm.0", 2.0), ("lstm.1", 2.0), ("decoder", 1.0)),
                        microbatch_rows=16, length=25, predictions=predictions)


@pytest.mark.parametrize(("kind", "text"), [("time", "7 ms"), ("flops", "7e-12 GFLOP"), ("memory", "6.68e-09 MiB")])
def test_the_report_gives_the_bottleneck_its_unit_and_measurements_one_line(kind, text):
    plan = _plan(kind)
    rendered = report.render(plan)
    unit = "per rank" if kind == "memory" else "per microbatch of 16 x 25"
    assert f"bottleneck stage: {text} {unit} (even split: {text};" in rendered
    line = report.measured_line(plan, report.Measurements(stage_seconds=(0.01, 0.03), step_seconds=0.05), 5)
    assert line == (f"mp_lstm measured after 5 steps: stage time shares 25.0 / 75.0 % (planned by {kind}: 41.7 / "
                    "58.3 %); step with m=2: measured 50.0 ms (table: trainer.strategy.report)")
    assert "predicted -" not in report.render(plan, report.Measurements(step_seconds=0.05))
    assert report.step_times(0.04, None) == "predicted 40.0 ms"
