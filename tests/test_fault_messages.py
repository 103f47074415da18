"""Messages that keep the cause (issue #32): a failure without a message is reported with where it was raised, a
rank that stopped answering (``SIGSTOP``) is named by its peers. (Killing rank 0 prints no C++ stack dump before
the message: ``tests/test_faults.py``; a non-finite checkpoint and an option of the wrong type are refused by name:
``tests/test_bad_inputs.py``; the divergence guard: ``tests/test_divergence.py``.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.base import faults
from tests.helpers import RELIABILITY_MESSAGES, DictStore, FixedBatches, quiet_trainer, run_ranks, tiny_model

TIMEOUT = 6.0  # the process-group timeout of the stopped-rank run, seconds


def _fail_without_a_message() -> None:
    raise RuntimeError()


def test_a_failure_without_a_message_reaches_the_other_ranks_with_where_it_was_raised(monkeypatch):
    store = DictStore()
    monkeypatch.setattr(faults.PeerDirectory, "_store", staticmethod(lambda: store))
    host = socket.gethostname()
    peers = [faults._Peer(0, host, os.getpid()), faults._Peer(1, host, os.getpid())]
    try:
        _fail_without_a_message()
    except RuntimeError as error:
        faults.PeerDirectory(peers, 1).explain(error)  # rank 1's own failure: reported
    lost = RuntimeError("[gloo] Timed out waiting 300000ms for recv operation to complete")
    faults.PeerDirectory(peers, 0).explain(lost)
    assert re.match(RELIABILITY_MESSAGES["a failure without a message"], str(lost)), str(lost)
    assert "at test_fault_messages.py:" in str(lost) and "in _fail_without_a_message" in str(lost)
    try:
        try:
            _fail_without_a_message()
        except RuntimeError as inner:
            raise SystemExit() from inner
    except SystemExit as error:
        assert re.fullmatch(r"SystemExit \(no message\) at test_fault_messages.py:\d+ in test_\w+, raised from "
                            r"RuntimeError \(no message\) at test_fault_messages.py:\d+ in _fail_without_a_message",
                            faults.describe(error)), faults.describe(error)


class _StopAt(pl.Callback):
    """Global rank 1 writes its pid to ``marker`` and stops itself (SIGSTOP) before batch 2."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2 and trainer.global_rank == 1:
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)


def _stopped_rank_worker(rank: int, world_size: int, marker: str) -> dict:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(n_microbatches=2, report_after_steps=None, timeout=TIMEOUT)
    trainer = quiet_trainer(strategy, world_size, [_StopAt(marker)], max_steps=6)
    outcome = {"error": None, "message": ""}
    try:
        trainer.fit(tiny_model(), datamodule=FixedBatches())
    except Exception as error:  # noqa: BLE001  (reported to the test)
        outcome = {"error": type(error).__name__, "message": str(error)}
    if rank == 0:  # a stopped process never ends by itself
        os.kill(int(Path(marker).read_text()), signal.SIGKILL)
    return outcome


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_a_stopped_rank_is_named_by_its_peer(tmp_path):
    results = run_ranks(_stopped_rank_worker, 2, str(tmp_path / "stopped"), timeout=100, allow_missing=True)
    assert results[1] is None  # stopped, then killed
    assert results[0]["error"] == "RuntimeError", results[0]
    assert re.match(RELIABILITY_MESSAGES["a rank stopped (SIGSTOP)"], results[0]["message"]), results[0]["message"]
