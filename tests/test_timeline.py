"""The measured timeline: spans of every stage's forward, backward, sends and receives on a tiny pp2 run, the
picture (one row per stage and rank) and the Chrome trace (positive durations, busy below wall, paired flows)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.timeline import COMPUTE, PipelineTimeline, Span, StepRecord, chrome_trace, draw
from tests.helpers import FixedBatches, quiet_trainer, run_ranks, tiny_model


class _Metrics(list):
    """A logger stand-in that keeps what the callback logs."""


def _worker(rank: int, world_size: int, directory: str, strategy_kwargs: dict) -> dict:
    warnings.filterwarnings("ignore")
    timeline = PipelineTimeline(steps=(1, 2), directory=directory if strategy_kwargs else None)
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, **strategy_kwargs)
    trainer = quiet_trainer(strategy, world_size, [timeline], max_steps=4, default_root_dir=directory)
    trainer.fit(tiny_model(), datamodule=FixedBatches())
    return {"records": timeline.records_as_dicts(), "paths": {k: str(v) for k, v in timeline.paths.items()},
            "metrics": timeline.metrics}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("timeline")
    return run_ranks(_worker, 2, str(directory), dict(n_microbatches=2), timeout=150), directory


@pytest.mark.timeout(100)
@pytest.mark.processes
def test_without_a_directory_or_logger_the_files_go_to_the_root_dir_and_every_rank_ends(tmp_path):
    # Lightning's log_dir is a collective: asked on rank 0 alone at the end of training, it hung every rank.
    per_rank = run_ranks(_worker, 2, str(tmp_path), {}, timeout=80)
    assert per_rank[0]["paths"] == {"png": str(tmp_path / "timeline.png"), "trace": str(tmp_path / "timeline.json")}
    assert (tmp_path / "timeline.png").is_file() and per_rank[1]["paths"] == {}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_every_microbatch_of_every_stage_is_recorded(pp2):
    results, _ = pp2
    assert results[0]["records"] == results[1]["records"]  # every rank gathered the same spans
    records = [StepRecord.from_dict(r) for r in results[0]["records"]]
    assert [r.step for r in records] == [1, 2]
    for record in records:
        compute = sorted((s.stage, s.kind, s.microbatch) for s in record.spans if s.kind in COMPUTE)
        # The last stage's loss is work of its own (torch's schedules compute it after the stage's forward).
        assert compute == sorted([(stage, kind, mb) for stage in (0, 1) for kind in ("forward", "backward")
                                  for mb in (0, 1)] + [(1, "loss", 0), (1, "loss", 1)])
        last = {(s.kind, s.microbatch): s for s in record.spans if s.stage == 1 and s.kind in COMPUTE}
        for mb in (0, 1):
            forward, loss, backward = last["forward", mb], last["loss", mb], last["backward", mb]
            assert forward.end <= loss.start < loss.end <= backward.start
        assert {(s.stage, s.rank) for s in record.spans if s.kind in COMPUTE} == {(0, 0), (1, 1)}
        # Activations go 0 -> 1 and gradients 1 -> 0, one transfer per microbatch each way.
        sends = sorted((s.direction, s.stage, s.microbatch) for s in record.spans if s.kind == "send")
        assert sends == [("backward", 1, 0), ("backward", 1, 1), ("forward", 0, 0), ("forward", 0, 1)]
        for span in record.spans:
            assert 0 <= span.start < span.end <= record.wall + 1e-3, span
        busy = record.busy_per_rank()
        assert set(busy) == {0, 1} and all(0 < t < record.wall for t in busy.values())
        assert 0 < record.bubble() < 1 and record.tokens > 0
        # The schedule ends before the step does (the optimizer step follows it): less idle time in its window.
        assert max(s.end for s in record.spans) == record.schedule_end < record.wall
        assert 0 < record.schedule_bubble() < record.bubble()


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_metrics_are_logged_next_to_the_predicted_bubble(pp2):
    metrics = pp2[0][0]["metrics"]
    assert metrics["timeline/bubble_predicted"] == pytest.approx(1 / 3)  # 1F1B, 2 ranks, 2 microbatches
    assert 0 < metrics["timeline/bubble_schedule"] < metrics["timeline/bubble_measured"] < 1
    assert metrics["timeline/busy_s/stage_0"] > 0 and metrics["timeline/busy_s/stage_1"] > 0
    assert metrics["timeline/tokens_per_s"] > 0
    record = pp2[0][0]["records"][-1]
    assert metrics["timeline/step_s"] == pytest.approx(record["wall"])
    end = max(span["end"] for span in record["spans"])
    assert metrics["timeline/tail"] == pytest.approx((record["wall"] - end) / record["wall"])
    assert 0 < metrics["timeline/tail"] < 1
    assert metrics["timeline/batch_elements"] == 8 * 7  # step 2: the third batch, 8 rows of length 7


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_the_chrome_trace_parses_with_positive_spans_and_paired_flows(pp2):
    results, directory = pp2
    trace = json.loads(Path(results[0]["paths"]["trace"]).read_text())
    assert Path(results[0]["paths"]["trace"]).parent == directory and results[1]["paths"] == {}  # rank 0 writes
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices and all(e["dur"] > 0 for e in slices)
    assert {e["pid"] for e in slices} == {0, 1}  # one process row per rank
    starts = sorted(e["id"] for e in trace["traceEvents"] if e["ph"] == "s")
    finishes = sorted(e["id"] for e in trace["traceEvents"] if e["ph"] == "f")
    assert starts and starts == finishes  # every send arrow ends at its receive
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_the_picture_has_one_row_per_stage(pp2, tmp_path):
    results, _ = pp2
    png = Path(results[0]["paths"]["png"])
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 500
    figure = draw(StepRecord.from_dict(results[0]["records"][-1]), tmp_path / "again.png")
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert labels == ["stage 0 (rank 0)", "stage 1 (rank 1)"]
    assert chrome_trace([StepRecord.from_dict(results[0]["records"][-1])])["traceEvents"]


@pytest.mark.timeout(100)
def test_without_pipeline_stages_the_step_is_one_span(tmp_path):
    timeline = PipelineTimeline(steps=(1,), directory=tmp_path)
    trainer = quiet_trainer("auto", 1, [timeline], max_steps=2)
    torch.set_num_threads(1)
    trainer.fit(tiny_model(), datamodule=FixedBatches())
    (record,) = timeline.records
    assert [s.kind for s in record.spans] == ["compute"] and record.bubble() == pytest.approx(0, abs=1e-6)
    assert timeline.paths["png"].is_file() and timeline.paths["trace"].is_file()


def test_with_replicas_every_rank_gets_its_own_rows(tmp_path):
    """dp2 x pp2: ranks 0, 1 are replica 0's stages 0, 1; ranks 2, 3 replica 1's. No row is drawn twice."""
    spans = [Span(rank, rank % 2, "forward", mb, 0.001 * (mb + rank % 2), 0.001 * (mb + rank % 2) + 0.0008)
             for rank in range(4) for mb in range(2)]
    record = StepRecord(step=2, wall=0.004, spans=spans, tokens=10, num_stages=2, n_microbatches=2,
                        schedule="GPipe", stage_ranks={0: 0, 1: 1})
    figure = draw(record, tmp_path / "dp.png")
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert labels == ["stage 0 (rank 0)", "stage 1 (rank 1)", "stage 0 (rank 2)", "stage 1 (rank 3)"]
    assert (tmp_path / "dp.png").stat().st_size > 0


def test_the_schedule_bubble_leaves_out_the_steps_tail(tmp_path):
    """Two ranks, 4 ms of computation each in a schedule that ends at 8 ms of a 10 ms step: 60% of the step is idle,
    50% of the schedule; the picture says both."""
    spans = [Span(0, 0, "forward", 0, 0.000, 0.002), Span(1, 1, "forward", 0, 0.002, 0.004),
             Span(1, 1, "backward", 0, 0.004, 0.006), Span(0, 0, "backward", 0, 0.006, 0.008),
             Span(1, 1, "send", 0, 0.006, 0.0065, direction="backward", peer_stage=0)]
    record = StepRecord(step=0, wall=0.010, spans=spans, tokens=4, num_stages=2, n_microbatches=1,
                        schedule="GPipe", stage_ranks={0: 0, 1: 1})
    assert record.schedule_end == pytest.approx(0.008)
    assert record.bubble() == pytest.approx(0.6) and record.schedule_bubble() == pytest.approx(0.5)
    title = draw(record, tmp_path / "tail.png").axes[0].get_title()
    assert "bubble measured 60.0% (in the schedule 50.0%), predicted 50.0%" in title


def test_a_torch_without_the_private_p2p_functions_is_named_clearly(monkeypatch):
    from torch.distributed.pipelining import schedules

    from lightning_mp_lstm.timeline import UnsupportedTorchError
    from lightning_mp_lstm.timeline.torch_p2p import TORCH_CHECKED, require

    assert require() is schedules
    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    with pytest.raises(UnsupportedTorchError, match=r"_wait_batch_p2p.*torch 2\.13") as raised:
        require()
    assert TORCH_CHECKED == "2.13" and torch.__version__ in str(raised.value)
    with pytest.raises(UnsupportedTorchError):  # the callback fails before training, not at a recorded step
        PipelineTimeline(steps=(1,)).setup(None, None, "fit")


def test_torch_schedules_get_their_functions_back_after_a_step():
    from torch.distributed.pipelining import schedules

    from lightning_mp_lstm.timeline import Recorder

    originals = (schedules._batch_p2p, schedules._wait_batch_p2p)
    recorder = Recorder()
    for end in (recorder.stop, recorder.abort):
        recorder.start(torch.device("cpu"))
        assert recorder.active and (schedules._batch_p2p, schedules._wait_batch_p2p) != originals
        end()
        assert not recorder.active and (schedules._batch_p2p, schedules._wait_batch_p2p) == originals
