"""The timeline on real GPUs (#19): a short fit with :class:`PipelineTimeline` on CUDA, one rank per GPU (pp2 when
two GPUs are there). Every span must be on the device clock: a send after the computation that produces it, a
receive ending no earlier than its send starts, everything within the step's wall time.

Skipped without CUDA; CI has no GPU, so there the same properties are checked with fake CUDA events and a fake
NCCL (``tests/test_timeline_clocks.py``). Run with ``pytest -m gpu`` on a machine with one or two GPUs.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.timeline import COMPUTE, PipelineTimeline, StepRecord
from tests.helpers import FixedBatches, run_ranks, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: Seconds two ranks' clocks may disagree by: each starts its step as the same (host-side) barrier releases it.
CROSS_RANK = 2e-3
#: Seconds of rounding between two events of one stream.
SAME_RANK = 1e-5
STEPS = (1, 2)


def _fit(rank: int, world_size: int, directory: str) -> list[dict]:
    warnings.filterwarnings("ignore")
    timeline = PipelineTimeline(steps=STEPS, directory=directory)
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=120, n_microbatches=2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cuda", devices=world_size, callbacks=[timeline],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         enable_checkpointing=False, max_steps=4)
    trainer.fit(tiny_model(), datamodule=FixedBatches())
    return timeline.records_as_dicts()


def check_on_one_clock(record: StepRecord) -> None:
    """Every span of ``record`` where the device put it: computation before what it sends, receives after what
    was sent, all within the step."""
    compute = {(s.stage, s.microbatch, s.kind): s for s in record.spans if s.kind in COMPUTE}
    sends = {s.flow_id: s for s in record.spans if s.kind == "send"}
    for span in record.spans:
        assert -CROSS_RANK <= span.start < span.end <= record.wall + SAME_RANK, span
    for (stage, microbatch, kind), span in compute.items():
        if kind in ("loss", "backward"):
            assert span.start >= compute[(stage, microbatch, "forward")].end - SAME_RANK, span
        if kind == "backward" and (stage, microbatch, "loss") in compute:
            assert span.start >= compute[(stage, microbatch, "loss")].end - SAME_RANK, span
    for send in sends.values():
        produced = compute[(send.stage, send.microbatch, send.direction)]  # activations: forward; grads: backward
        assert send.start >= produced.end - SAME_RANK, (send, produced)
    for receive in (s for s in record.spans if s.kind == "recv"):
        assert receive.end >= sends[receive.flow_id].start - CROSS_RANK, (receive, sends[receive.flow_id])


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.timeout(300)
def test_every_span_is_on_the_device_clock(gpus, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    per_rank = run_ranks(_fit, gpus, str(tmp_path), timeout=280)
    assert all(records == per_rank[0] for records in per_rank)  # every rank gathered every rank's spans
    records = [StepRecord.from_dict(r) for r in per_rank[0]]
    assert [r.step for r in records] == list(STEPS)
    for record in records:
        kinds = sorted((s.stage, s.kind, s.microbatch) for s in record.spans if s.kind in COMPUTE)
        assert kinds == sorted([(stage, kind, mb) for stage in range(gpus) for kind in ("forward", "backward")
                                for mb in range(2)] + [(gpus - 1, "loss", mb) for mb in range(2)])
        assert len([s for s in record.spans if s.kind == "send"]) == (4 if gpus == 2 else 0)
        check_on_one_clock(record)
    assert (tmp_path / "timeline.png").is_file() and (tmp_path / "timeline.json").is_file()
